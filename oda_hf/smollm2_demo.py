"""`oda demo --model smollm2`: the real pretrained SmolLM2-135M-Instruct answering held-out RULER prompts.

Fetches the model on first use (`oda fetch smollm2`), builds a few *test*-split prompts with the offline RULER
generator (King James prose of Matthew-Acts, never used for training), and answers each with Full, StreamingLLM
(s=4, w=256) and ODA through the evaluation runner (one Full prefill per prompt shared by the three methods).
Prints the answers, each method's score and ODA's Full-call rate, and writes one ODA routing trajectory (tokens
coloured Local / Full) to HTML and PNG.
"""

from __future__ import annotations

import os
import time

#: (task, prompt tokens): 2K prompts are 8x the window; prefill dominates the demo's time. The tasks were fixed
#: before the head was evaluated (not picked from its results).
DEMO_LENGTH = 2048
DEMO_PROMPTS = (("niah_single_2", DEMO_LENGTH), ("niah_multikey_1", DEMO_LENGTH), ("vt", DEMO_LENGTH))
METHODS = (("Full", "full"), ("StreamingLLM", "streamingllm"))


def run_smollm2_demo(head: str, output: str = "oda_demo", prompts=DEMO_PROMPTS, threshold: float | None = None,
                     say=print) -> dict:
    """Answer `prompts` with Full, StreamingLLM and ODA on SmolLM2; returns scores, ODA's rate and file paths."""
    from transformers import AutoTokenizer

    from .evaluation import runner, trajectory
    from .evaluation.ruler_synth import generate_suite
    from .known_models import fetch_smollm2
    from .modeling import OdaForCausalLM

    start = time.perf_counter()
    base = fetch_smollm2(say=lambda message: say(f"[oda demo] {message}"))
    model = OdaForCausalLM.from_pretrained(base, head=head, policy="head").eval()
    if threshold is not None:
        model.set_routing(threshold=threshold)
    tokenizer = AutoTokenizer.from_pretrained(base)
    config = model.oda_config
    examples = []
    for task, length in prompts:
        examples += generate_suite(tokenizer, [task], [length], split="test", n=1, haystack="kjv",
                                   max_position_embeddings=model.config.max_position_embeddings)
    say(f"ODA demo: SmolLM2-135M-Instruct (s={config.sinks}, w={config.window}, threshold={config.threshold:g}), "
        f"{len(examples)} held-out RULER test prompts of ~{prompts[0][1]} tokens\n")
    os.makedirs(output, exist_ok=True)
    policies = [runner.full(), runner.streaming_llm(), runner.oda(config.threshold)]
    # Records are reused on a rerun with the same head; another head (or base) gets its own file.
    key = runner.head_fingerprint(model.recall_head)[:12]
    records = runner.evaluate(model, tokenizer, examples, policies,
                              os.path.join(output, f"smollm2_records-{key}.jsonl"), chat_template=True, progress=True)
    names = dict(METHODS) | {"ODA": policies[-1].name}
    by_key = {(r["id"], r["policy"]): r for r in records}
    for example in examples:
        say(f"[{example.task}, {example.meta['tokens']} prompt tokens] reference: {' | '.join(example.answers)}")
        for label, name in names.items():
            record = by_key[(example.id, name)]
            calls, steps = runner.decided_counts(record)
            rate = f"  (Full calls {calls}/{steps})" if label == "ODA" else ""
            say(f"  {label:>12} [{100 * record['score']:5.1f}] {record['output'].strip()[:100]}{rate}")
        say("")
    means = {label: 100 * sum(by_key[(e.id, name)]["score"] for e in examples) / len(examples)
             for label, name in names.items()}
    oda_records = [by_key[(e.id, names["ODA"])] for e in examples]
    counts = [runner.decided_counts(r) for r in oda_records]  # past the window: where a decision is made
    calls, steps = sum(c for c, _ in counts), sum(n for _, n in counts)
    rate = calls / steps if steps else float("nan")
    say("score (RULER string match, mean over prompts): " + ", ".join(f"{k} {v:.1f}" for k, v in means.items())
        + f" | ODA Full-call rate {rate:.1%} ({calls}/{steps} steps past the window)")
    shown = max(oda_records, key=lambda r: (r["full_calls"] > 0, r["score"]))
    paths = {"html": os.path.join(output, "trajectory.html"), "png": os.path.join(output, "trajectory.png")}
    trajectory.render_record(shown, tokenizer, html_path=paths["html"], png_path=paths["png"])
    for kind, path in paths.items():
        say(f"routing trajectory ({kind}): {path}")
    say(f"done in {time.perf_counter() - start:.1f} s")
    return {"scores": means, "full_call_rate": rate, "files": paths}
