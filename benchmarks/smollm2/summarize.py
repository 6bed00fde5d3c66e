"""One table (and plot) of SmolLM2 RULER results over lengths, from `oda eval` output folders.

    python benchmarks/smollm2/summarize.py runs/smollm2/baselines runs/smollm2/oda-test --out benchmarks/results/smollm2/ruler

reads `<folder>/<length>/results.jsonl` for every length folder present in each folder (records of several
folders for the same length are merged, e.g. baselines run without a head and ODA runs with one) and writes `<out>.md` (per task and length:
each policy group's score in percent, Random as mean over seeds, with the number of prompts; macro row; pooled
Full-call rates) and `<out>.png` (macro score against length). Partial runs are summarised as they stand; the
table says how many prompts each cell has. Matched Random records drawn at an outdated rate are left out.
"""

from __future__ import annotations

import argparse
import os

from oda_hf.evaluation.report import group_order, summarize, task_order
from oda_hf.evaluation.runner import ResultsFile, current_records


def load(*folders: str) -> dict[int, list[dict]]:
    """Records per prompt length over `folders`; one record per (prompt, policy), the first folder's."""
    runs: dict[int, dict[tuple, dict]] = {}
    versions: dict[int, dict[tuple, list[dict]]] = {}
    for folder in folders:
        for name in os.listdir(folder):
            path = os.path.join(folder, name, "results.jsonl")
            if name.isdigit() and os.path.exists(path):
                # Within a file the last record of a pair wins (a matched Random record redone at a new rate); every
                # version goes along, as `oda eval`'s report reads them (`ResultsFile.current`): a rerun over fewer
                # prompts redraws the control at their rate, and the records drawn for all of them come back.
                results = ResultsFile(path, repair=False)
                for key, record in results.records.items():
                    if key not in runs.setdefault(int(name), {}):
                        runs[int(name)][key] = record
                        versions.setdefault(int(name), {})[key] = results.versions[key]
    return {length: current_records(runs[length].values(), versions[length]) for length in sorted(runs)}


def table(runs: dict[int, list[dict]]) -> tuple[str, dict]:
    summaries = {length: summarize(records) for length, records in runs.items()}
    every = {name: group for summary in summaries.values() for name, group in summary.items()}
    groups = [g.group for g in sorted(every.values(), key=group_order)]  # columns of every length, in report order
    tasks = task_order({r["task"] for records in runs.values() for r in records})
    header = "| task | length | n | " + " | ".join(groups) + " |"
    lines = [header, "|" + "---|" * (3 + len(groups))]
    macro = {}
    for length, summary in summaries.items():
        for task in tasks:
            cells, counts = [], set()
            for group in groups:
                g = summary.get(group)
                if g is None or task not in g.tasks:
                    cells.append("-")
                    continue
                counts.add(sum(1 for r in runs[length] if r["task"] == task and r["group"] == group) // max(g.seeds, 1))
                cells.append(f"{g.task_score(task).mean:.1f}")
            lines.append(f"| {task} | {length} | {'/'.join(map(str, sorted(counts)))} | " + " | ".join(cells) + " |")
        row, rates, averaged = [], [], []
        for group in groups:
            g = summary.get(group)
            row.append("-" if g is None else f"**{g.score.mean:.1f}**")
            rates.append("-" if g is None else f"{100 * g.pooled_rate.mean:.1f}%")
            averaged.append("-" if g is None else f"{100 * g.task_averaged_rate.mean:.1f}%")
            if g is not None:
                macro.setdefault(group, {})[length] = g.score.mean
        lines.append(f"| **macro** | {length} | | " + " | ".join(row) + " |")
        lines.append(f"| pooled Full-call rate | {length} | | " + " | ".join(rates) + " |")
        lines.append(f"| task-averaged Full-call rate | {length} | | " + " | ".join(averaged) + " |")
    return "\n".join(lines) + "\n", macro


def plot(macro: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for group, points in macro.items():
        lengths = sorted(points)
        ax.plot(lengths, [points[n] for n in lengths], marker="o", label=group)
    ax.set_xlabel("prompt tokens (chat template included)")
    ax.set_ylabel("RULER macro score (%)")
    ax.set_title("SmolLM2-135M-Instruct, offline RULER test split, s=4 w=256")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="oda eval output folders holding <length>/results.jsonl")
    parser.add_argument("--out", required=True, help="output path without suffix (.md and .png are written)")
    args = parser.parse_args()
    runs = load(*args.folders)
    if not runs:
        raise SystemExit(f"No <length>/results.jsonl under {' '.join(args.folders)}.")
    text, macro = table(runs)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    plot(macro, args.out + ".png")
    print(text)


if __name__ == "__main__":
    main()
