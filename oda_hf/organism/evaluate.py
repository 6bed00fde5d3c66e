"""Score the model organism on its held-out *test* split with `oda eval`'s harness.

    python -m oda_hf.organism.evaluate --organism <dir with backbone/ and head/> --output <dir> [--n 10]

Policies: Full, StreamingLLM (always-Local), ODA at the head's threshold, and Random at ODA's
observed per-task rate with seeds 42/43/44. Every task family, prompts of 256-1024 tokens (4-16x
the window). Writes the harness's resumable JSONL, ``report.md`` and plots, and ``summary.json``
with the headline numbers, which `write_model_cards` puts into the shipped model cards (numbers in
the cards come from this file, never typed by hand).
"""

from __future__ import annotations

import argparse
import json
import os

from .corpus import TASKS, OrganismCorpus

EVAL_LENGTHS = (256, 512, 1024)
RANDOM_SEEDS = (42, 43, 44)


def organism_examples(corpus: OrganismCorpus, split: str, n: int, lengths=EVAL_LENGTHS, tasks=TASKS) -> list:
    """The first `n` examples of `split` per task and length (tasks that do not fit a length are skipped)."""
    examples = []
    for length in lengths:
        for task in tasks:
            try:
                examples += [corpus.example(task, length, split, i) for i in range(n)]
            except ValueError:  # the task does not fit this length with the window gap
                continue
    return examples


def evaluate_organism(organism: str, output: str, n: int = 10, threshold: float | None = None, lengths=EVAL_LENGTHS,
                      tasks=TASKS) -> dict:
    """`threshold` None: the head's saved routing threshold (set on dev by `calibrate`)."""
    from ..evaluation.report import summarize, write_report
    from ..evaluation.runner import evaluate, full, oda, random_matched, streaming_llm
    from ..evaluation.suites import examples_from_organism
    from .demo import load_organism

    model, tokenizer, info = load_organism(organism, threshold)
    threshold = model.oda_config.threshold
    corpus = OrganismCorpus(seed=info.get("seed", 0), window=model.oda_config.window)
    examples = examples_from_organism(organism_examples(corpus, "test", n, lengths, tasks))
    policies = [full(), streaming_llm(), oda(threshold)] + [random_matched(threshold, s) for s in RANDOM_SEEDS]
    os.makedirs(output, exist_ok=True)
    records = evaluate(model, tokenizer, examples, policies, os.path.join(output, "records.jsonl"))
    paths = write_report(records, output, primary_threshold=threshold)
    groups = summarize(records)
    summary = {"examples": len(examples), "lengths": list(lengths), "per_task_examples": n, "threshold": threshold,
               "sinks": model.oda_config.sinks, "window": model.oda_config.window}
    for name, group in groups.items():
        summary[name] = {
            "kind": group.kind, "macro_score": group.score.mean, "macro_score_std": group.score.std,
            "pooled_full_call_rate": group.pooled_rate.mean, "task_averaged_full_call_rate": group.task_averaged_rate.mean,
            "per_task": {task: group.task_score(task).mean for task in group.tasks},
        }
    with open(os.path.join(output, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    summary["report"] = paths["markdown"]
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--organism", default=None, help="organism folder (default: the shipped one)")
    parser.add_argument("--output", default="organism_eval")
    parser.add_argument("--n", type=int, default=10, help="test examples per task and length")
    parser.add_argument("--threshold", type=float, default=None,
                        help="ODA threshold (default: the head's saved one, chosen on dev by organism.calibrate)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a tiny model gains nothing from more)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    summary = evaluate_organism(args.organism, args.output, args.n, args.threshold)
    for name, values in summary.items():
        if isinstance(values, dict) and "macro_score" in values:
            print(f"{name:>24}: macro {values['macro_score']:.1f}  pooled Full-call rate "
                  f"{values['pooled_full_call_rate']:.1%}  task-averaged {values['task_averaged_full_call_rate']:.1%}")
    print(f"report: {summary['report']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
