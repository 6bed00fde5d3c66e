"""A Full-call budget that holds, against a calibrated threshold and Random, on the same held-out prompts.

    python benchmarks/smollm2/budget_table.py runs/smollm2/budget-test/2048 \\
        benchmarks/results/smollm2/baselines/2048 benchmarks/results/smollm2/oda-test/2048 \\
        benchmarks/results/smollm2/calibrate-rate25/test_records.jsonl --out benchmarks/results/smollm2/budget.md

reads `results.jsonl` of each folder (or a JSONL file of records), keeps the budget run's prompts (those its last
run reported, as its manifest records them; else every prompt of its folder), and writes one table: per policy group
the macro score, the pooled Full-call rate over decided steps, and the highest rate of any single request (what a
budget must bound).
"""

from __future__ import annotations

import argparse
import math
import os

from oda_hf.evaluation.report import summarize
from oda_hf.evaluation.runner import ResultsFile, read_last_run


def records_of(path: str) -> list[dict]:
    file = os.path.join(path, "results.jsonl") if os.path.isdir(path) else path
    return ResultsFile(file, repair=False).current()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", help="the budget run first, then folders or JSONL files of records")
    parser.add_argument("--groups", nargs="+", default=None, help="policy groups to show (default: all)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    last = read_last_run(os.path.join(args.sources[0], "manifest.json")) if os.path.isdir(args.sources[0]) else None
    prompts = {r["id"] for r in records_of(args.sources[0])} if last is None else set(last["examples"])
    records, seen = [], set()
    for source in args.sources:  # one record per (prompt, policy): the first source's (e.g. Random seed 42 twice)
        for record in records_of(source):
            key = (record["id"], record["policy"])
            if record["id"] in prompts and key not in seen:
                seen.add(key)
                records.append(record)
    groups = summarize(records)
    # which of each task's prompts (`oda ruler` puts prompt i's needle at depth i / (n - 1)): a subset says so
    indices = sorted({int(rid.rsplit("/", 1)[-1]) for rid in prompts if rid.rsplit("/", 1)[-1].isdigit()})
    lines = [f"Held-out RULER test prompts at 2,048 tokens: {len(prompts)} prompts ({len(prompts) // 11} per task, "
             f"11 tasks; suite indices {', '.join(map(str, indices))}), SmolLM2-135M-Instruct with its shipped head, "
             "s = 4, w = 256, greedy. Rates count the decided steps (past sinks + window); Random: mean over its "
             "seeds.", "",
             "| policy | prompts | macro score | pooled Full-call rate | highest request rate |",
             "|---|---:|---:|---:|---:|"]
    for name, group in groups.items():
        if args.groups and name not in args.groups:
            continue
        highest = group.max_request_rate
        lines.append(f"| {name} | {group.examples // group.seeds} | {group.score.mean:.1f} | "
                     f"{100 * group.pooled_rate.mean:.1f}% | "
                     f"{'-' if math.isnan(highest) else f'{100 * highest:.1f}%'} |")
    text = "\n".join(lines) + "\n"
    from oda_hf.files import write_text

    write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
