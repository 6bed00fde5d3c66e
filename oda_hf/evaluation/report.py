"""Aggregation, Markdown tables and plots of generation-evaluation records.

Scores are reported in percent: a task's score is the mean of its examples' scores, and a policy's
average is the unweighted mean over tasks (macro). Full-call rates (ODA_SPEC section 6), with
``F_d`` Full decisions and ``N_d`` routed steps past the window summed over the examples of task d
(steps whose history is within sinks + window are not decided: Local and Full read the same positions):

* pooled:        ``sum_d F_d / sum_d N_d``  (weights tasks by their routed steps);
* task-averaged: ``mean_d F_d / N_d``       (weights tasks equally; tasks with N_d = 0 are left out);
* paper (pooled): Full decisions over every routed step, in-window steps included (they count as Local,
  except for the always-Full control). Records written before window steps were set apart have no
  ``window_steps`` and count every step as decided.

Random runs with several seeds form one group. As in the paper, every statistic is first computed
within a seed (its task-averaged score, task-averaged and pooled rates, per-task values) and the
group reports their mean and sample standard deviation across seeds; counts are never pooled across
seeds.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .metrics import CHINESE_METRICS, LONGBENCH_TASKS, RULER_TASKS, zh_segmentation

KIND_ORDER = {"full": 0, "local": 1, "oda": 2, "random": 3, "schedule": 4, "budget": 5}


@dataclass
class TaskStats:
    """One policy (one seed) on one task."""

    examples: int = 0
    score_sum: float = 0.0
    full_calls: int = 0
    routed_steps: int = 0  # every step after the prefill (the paper's routed steps)
    window_steps: int = 0  # of those, steps within sinks + window (not decided)
    window_full_calls: int = 0  # Full calls on them (only the always-Full control makes them)
    cap_hits: int = 0

    @property
    def score(self) -> float:
        """Mean example score in percent."""
        return 100.0 * self.score_sum / self.examples if self.examples else float("nan")

    @property
    def rate(self) -> float:
        """Full-call rate over the steps past the window."""
        steps = self.routed_steps - self.window_steps
        return (self.full_calls - self.window_full_calls) / steps if steps else float("nan")

    @property
    def paper_rate(self) -> float:
        """The paper's Full-call rate: over every routed step."""
        return self.full_calls / self.routed_steps if self.routed_steps else float("nan")


@dataclass
class PolicyStats:
    """One policy (one seed) over the suite."""

    name: str
    tasks: dict[str, TaskStats] = field(default_factory=dict)
    #: The highest Full-call rate of one request (steps past the window); what a budget policy guarantees.
    max_request_rate: float = float("nan")

    def add(self, record: dict) -> None:
        steps = record["routed_steps"] - record.get("window_steps", 0)
        if steps:
            rate = (record["full_calls"] - record.get("window_full_calls", 0)) / steps
            self.max_request_rate = rate if math.isnan(self.max_request_rate) else max(self.max_request_rate, rate)
        stats = self.tasks.setdefault(record["task"], TaskStats())
        stats.examples += 1
        stats.score_sum += record["score"]
        stats.full_calls += record["full_calls"]
        stats.routed_steps += record["routed_steps"]
        stats.window_steps += record.get("window_steps", 0)  # older records: no window steps were set apart
        stats.window_full_calls += record.get("window_full_calls", 0)
        stats.cap_hits += bool(record["hit_cap"])

    @property
    def score(self) -> float:
        """Task-averaged (macro) score in percent."""
        return _mean(t.score for t in self.tasks.values())

    @property
    def full_calls(self) -> int:
        return sum(t.full_calls for t in self.tasks.values())

    @property
    def routed_steps(self) -> int:
        return sum(t.routed_steps for t in self.tasks.values())

    @property
    def window_steps(self) -> int:
        return sum(t.window_steps for t in self.tasks.values())

    @property
    def pooled_rate(self) -> float:
        """Pooled Full-call rate over the steps past the window."""
        steps = self.routed_steps - self.window_steps
        window_calls = sum(t.window_full_calls for t in self.tasks.values())
        return (self.full_calls - window_calls) / steps if steps else float("nan")

    @property
    def paper_pooled_rate(self) -> float:
        """The paper's pooled rate: Full calls over every routed step."""
        return self.full_calls / self.routed_steps if self.routed_steps else float("nan")

    @property
    def task_averaged_rate(self) -> float:
        return _mean(t.rate for t in self.tasks.values())

    @property
    def cap_hits(self) -> int:
        return sum(t.cap_hits for t in self.tasks.values())

    @property
    def examples(self) -> int:
        return sum(t.examples for t in self.tasks.values())


@dataclass
class Estimate:
    """Mean and sample standard deviation across seeds (std is None for a single run)."""

    mean: float
    std: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> "Estimate":
        values = [v for v in values if not math.isnan(v)]
        if not values:
            return cls(float("nan"))
        return cls(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None)


@dataclass
class GroupSummary:
    """A policy group: one deterministic policy, or the seeds of one Random control."""

    group: str
    kind: str
    threshold: float | None
    runs: list[PolicyStats]

    @property
    def seeds(self) -> int:
        return len(self.runs)

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(t for run in self.runs for t in run.tasks))

    def task_score(self, task: str) -> Estimate:
        return Estimate.of([run.tasks[task].score for run in self.runs if task in run.tasks])

    def task_rate(self, task: str) -> Estimate:
        return Estimate.of([run.tasks[task].rate for run in self.runs if task in run.tasks])

    @property
    def score(self) -> Estimate:
        return Estimate.of([run.score for run in self.runs])

    @property
    def pooled_rate(self) -> Estimate:
        return Estimate.of([run.pooled_rate for run in self.runs])

    @property
    def task_averaged_rate(self) -> Estimate:
        return Estimate.of([run.task_averaged_rate for run in self.runs])

    @property
    def paper_pooled_rate(self) -> Estimate:
        return Estimate.of([run.paper_pooled_rate for run in self.runs])

    @property
    def window_steps(self) -> int:
        return sum(run.window_steps for run in self.runs)

    @property
    def cap_hits(self) -> int:
        return sum(run.cap_hits for run in self.runs)

    @property
    def examples(self) -> int:
        return sum(run.examples for run in self.runs)

    @property
    def routed_steps(self) -> int:
        return sum(run.routed_steps for run in self.runs)

    @property
    def full_calls(self) -> int:
        return sum(run.full_calls for run in self.runs)

    @property
    def max_request_rate(self) -> float:
        rates = [run.max_request_rate for run in self.runs if not math.isnan(run.max_request_rate)]
        return max(rates) if rates else float("nan")


def summarize(records: Iterable[dict]) -> dict[str, GroupSummary]:
    """Group records by policy group (seeds together), ordered Full, StreamingLLM, ODA, Random, schedules."""
    runs: dict[str, PolicyStats] = {}
    meta: dict[str, tuple[str, str, float | None]] = {}
    for record in records:
        runs.setdefault(record["policy"], PolicyStats(record["policy"])).add(record)
        meta[record["policy"]] = (record["group"], record["kind"], record.get("threshold"))
    groups: dict[str, GroupSummary] = {}
    for name, stats in runs.items():
        group, kind, threshold = meta[name]
        if group not in groups:
            groups[group] = GroupSummary(group, kind, threshold, [])
        groups[group].runs.append(stats)
    return {g.group: g for g in sorted(groups.values(), key=group_order)}


def group_order(group: GroupSummary) -> tuple:
    """Sort key of report columns: Full, StreamingLLM, ODA by threshold, Random, schedules."""
    return KIND_ORDER.get(group.kind, 9), group.threshold if group.threshold is not None else 0.0, group.group


def task_order(tasks: Iterable[str]) -> list[str]:
    """Paper order for LongBench and RULER tasks, then any other task alphabetically."""
    tasks = set(tasks)
    known = [t for t in LONGBENCH_TASKS + RULER_TASKS if t in tasks]
    return known + sorted(tasks - set(known))


# -- Markdown ----------------------------------------------------------------------------------------


def _cell(text) -> str:
    """`text` as one Markdown table cell: a ``|`` would split the cell and a line break end the row."""
    text = str(text).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


def _pct(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.2f}%"


def _num(estimate: Estimate, scale: float = 1.0, suffix: str = "") -> str:
    if math.isnan(estimate.mean):
        return "n/a"
    text = f"{scale * estimate.mean:.2f}"
    if estimate.std is not None:
        text += f" ± {scale * estimate.std:.2f}"
    return text + suffix


def _routed(kind: str) -> bool:
    return kind not in ("full", "local")  # Full/StreamingLLM rates are 100% / 0% by construction


def _title(summary: GroupSummary) -> str:
    titles = {"full": "Full", "streamingllm": "StreamingLLM"}
    if summary.group in titles:
        return titles[summary.group]
    if summary.kind == "oda":
        return f"ODA (θ={summary.threshold:g})"
    if summary.kind == "random":
        base = summary.group.replace("random~oda@", "Random (matched to ODA θ=").replace("random@p", "Random (p=")
        seeds = f", {summary.seeds} seeds" if summary.seeds > 1 else ""
        return f"{base}{seeds})"
    if summary.kind == "budget":
        return summary.group.replace("budget@p", "Budget (rate <= ").replace("(oda@", ", head θ=")
    return summary.group.replace("schedule:", "Schedule ")


def main_table(groups: dict[str, GroupSummary], primary_threshold: float | None = None) -> str:
    """The paper's layout: tasks + Avg as rows; Full, StreamingLLM, ODA (rate beside), controls.

    With several ODA thresholds only `primary_threshold` (default 0 if run, else the first one)
    and its matched Random control appear; the sweep table shows the rest.
    """
    thresholds = [g.threshold for g in groups.values() if g.kind == "oda"] or \
        [g.threshold for g in groups.values() if g.group.startswith("random~")]
    if primary_threshold is None and thresholds:
        primary_threshold = 0.0 if 0.0 in thresholds else thresholds[0]
    elif primary_threshold is not None and primary_threshold not in thresholds:
        # Not a silent table without ODA: name what was run.
        run = ", ".join(f"{t:g}" for t in sorted(set(thresholds))) or "none"
        raise ValueError(f"primary threshold {primary_threshold:g} was not run (ODA thresholds in the records: {run}); "
                         "give one of them (--primary-threshold).")
    columns = [g for g in groups.values()
               if g.kind in ("full", "local", "schedule", "budget")
               or (g.kind == "oda" and g.threshold == primary_threshold)
               or (g.kind == "random" and (g.threshold == primary_threshold or not g.group.startswith("random~")))]
    tasks = task_order(t for g in columns for t in g.tasks)
    header = "| Task | " + " | ".join(_title(g) for g in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 1)]
    for task in tasks:
        cells = []
        for g in columns:
            score = _num(g.task_score(task))
            cells.append(f"{score} ({_num(g.task_rate(task), 100, '%')})" if _routed(g.kind) else score)
        lines.append(f"| {_cell(task)} | " + " | ".join(cells) + " |")
    cells = []
    for g in columns:
        score = f"**{_num(g.score)}**"
        if _routed(g.kind):
            score += f" (task-avg {_num(g.task_averaged_rate, 100, '%')}; pooled {_num(g.pooled_rate, 100, '%')})"
        cells.append(score)
    lines.append("| **Avg** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(groups: dict[str, GroupSummary]) -> str:
    """Paper Table (learned vs random access): per ODA threshold, ODA and its matched Random."""
    lines = ["| Threshold | ODA score | ODA Full (task-avg) | ODA Full (pooled) | Random score | "
             "Random Full (task-avg) | Random Full (pooled) |", "|---|---|---|---|---|---|---|"]
    for g in groups.values():
        if g.kind != "oda":
            continue
        random = groups.get(f"random~oda@{g.threshold:g}")
        row = [f"{g.threshold:g}", _num(g.score), _num(g.task_averaged_rate, 100, "%"), _num(g.pooled_rate, 100, "%")]
        row += ([_num(random.score), _num(random.task_averaged_rate, 100, "%"), _num(random.pooled_rate, 100, "%")]
                if random else ["-", "-", "-"])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def routing_table(groups: dict[str, GroupSummary]) -> str:
    """Per policy group: generations, routed steps, Full calls, both rates, output-cap hits."""
    lines = ["| Policy | Runs | Generations | Routed steps | In window | Full calls | Full-call rate (pooled) | "
             "Full-call rate (task-avg) | Highest request rate | Paper rate (pooled) | Output-cap hits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in groups.values():
        highest = "n/a" if math.isnan(g.max_request_rate) else f"{100 * g.max_request_rate:.1f}%"
        lines.append(f"| {_title(g)} | {g.seeds} | {g.examples} | {g.routed_steps} | {g.window_steps} | {g.full_calls} "
                     f"| {_num(g.pooled_rate, 100, '%')} | {_num(g.task_averaged_rate, 100, '%')} | {highest} | "
                     f"{_num(g.paper_pooled_rate, 100, '%')} | {g.cap_hits}/{g.examples} |")
    return "\n".join(lines)


def coverage_note(records: Sequence[dict]) -> str | None:
    """A warning when the policies (each Random seed apart) were not all run on the same examples: their averages
    would then be over different prompts or tasks (an interrupted run, a rerun over fewer prompts or other tasks into
    the folder, a merge), and a column's lead could be the prompts' doing. None when they were."""
    from collections import Counter

    examples: dict[str, set] = {}
    for record in records:
        examples.setdefault(record["policy"], set()).add((record["task"], record["id"]))
    every = set().union(*examples.values()) if examples else set()
    short = {policy: every - seen for policy, seen in examples.items() if seen != every}
    if not short:
        return None
    totals = Counter(task for task, _ in every)
    lines = ["**Warning: the policies were not all run on the same examples**, so the averages below are over "
             "different prompts (or tasks); compare them on the shared ones, or finish the run (rerun `oda eval` with "
             "the same command). Missing:"]
    for policy in sorted(short):
        missing = Counter(task for task, _ in short[policy])
        lines.append(f"- {_cell(policy)}: " + ", ".join(f"{_cell(task)} {missing[task]} of {totals[task]}"
                                                         for task in task_order(missing)))
    return "\n".join(lines)


def markdown_report(records: Sequence[dict], primary_threshold: float | None = None, title: str = "ODA evaluation") -> str:
    groups = summarize(records)
    if not groups:
        raise ValueError("No records to report.")
    metrics = sorted({(r["task"], r["metric"]) for r in records})
    parts = [f"# {title}", "",
             "Scores in percent (task mean of example scores; Avg = unweighted mean over tasks). Rates beside a "
             "score are that task's Full-call rate F_d/N_d over the routed steps past sinks + window. Avg rates: "
             "task-avg = mean_d F_d/N_d, pooled = sum F_d / sum N_d; the paper's rate counts every routed step. "
             "Random entries: mean ± sample std across seeds.", ""]
    note = coverage_note(records)
    if note:
        parts += [note, ""]
    parts += ["## Quality", "", main_table(groups, primary_threshold), ""]
    odas = sum(g.kind == "oda" for g in groups.values())
    if odas > 1 or (odas and any(g.group.startswith("random~") for g in groups.values())):
        parts += ["## ODA threshold sweep and the matched Random control", "", sweep_table(groups), ""]
    parts += ["## Routing", "", routing_table(groups), "", "## Metrics", ""]
    parts += [f"- {_cell(task)}: {metric}" for task, metric in sorted(dict(metrics).items())]
    if any(metric in CHINESE_METRICS for _, metric in metrics):
        parts.append(f"- Chinese word segmentation: {zh_segmentation()}"
                     + (" (LongBench's)" if zh_segmentation() == "jieba"
                        else " (character-level fallback: jieba not installed; differs from LongBench)"))
    return "\n".join(parts) + "\n"


# -- plots -------------------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("Plots need matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, groups: dict[str, GroupSummary], task: str | None) -> None:
    """Quality (y) against Full-call rate in percent (x) on one axis: all tasks when task is None."""
    def point(g):
        if task is None:
            return g.task_averaged_rate, g.score
        return g.task_rate(task), g.task_score(task)

    odas = sorted((point(g) + (g.threshold,) for g in groups.values() if g.kind == "oda"),
                  key=lambda p: p[0].mean)
    if odas:
        ax.plot([100 * r.mean for r, _, _ in odas], [s.mean for _, s, _ in odas], "o-", color="#d6336c", label="ODA")
        for r, s, threshold in odas:
            if threshold == 0:
                ax.plot(100 * r.mean, s.mean, "o", markersize=13, markerfacecolor="none", color="#d6336c")
    randoms = [point(g) for g in groups.values() if g.kind == "random"]
    if randoms:
        ax.errorbar([100 * r.mean for r, _ in randoms], [s.mean for _, s in randoms],
                    xerr=[100 * (r.std or 0) for r, _ in randoms], yerr=[s.std or 0 for _, s in randoms],
                    fmt="s", color="#1c7ed6", capsize=3, label="Random")
    for g in groups.values():
        rate, score = point(g)
        if g.kind == "full":
            ax.axhline(score.mean, color="black", linestyle="--", linewidth=1, label="Full")
        elif g.kind == "local":
            ax.axhline(score.mean, color="gray", linestyle=":", linewidth=1, label="StreamingLLM")
        elif g.kind == "schedule":
            ax.plot(100 * rate.mean, score.mean, "^", color="#2b8a3e", label=_title(g))


def plot_quality_vs_rate(records: Sequence[dict], path: str | os.PathLike) -> None:
    """Paper Figure 4b: task-averaged score against task-averaged Full-call rate."""
    plt = _pyplot()
    groups = summarize(records)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    _draw(ax, groups, None)
    ax.set_xlabel("Full-call rate, task-averaged (%)")
    ax.set_ylabel("Score (task average)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def save_figure(fig, path: str | os.PathLike, dpi: int) -> None:
    """`fig.savefig` through `files.atomic_path`: a killed run leaves no half-written image (the format is given
    explicitly, the temporary name has no image extension)."""
    from ..files import atomic_path

    with atomic_path(path) as temporary:
        fig.savefig(temporary, dpi=dpi, format=os.path.splitext(os.fspath(path))[1].lstrip(".") or "png")


def plot_per_task(records: Sequence[dict], path: str | os.PathLike) -> None:
    """One panel per task (paper Figure 'learned and random access across individual tasks')."""
    plt = _pyplot()
    groups = summarize(records)
    tasks = task_order(t for g in groups.values() for t in g.tasks)
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        _draw(ax, groups, task)
        ax.set_title(task, fontsize=10, parse_math=False)  # a task name is text, never mathtext
        ax.set_xlabel("Full-call rate (%)", fontsize=8)
        ax.set_ylabel("Score", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def write_report(records: Sequence[dict], out_dir: str | os.PathLike, primary_threshold: float | None = None,
                 plots: bool = True) -> dict[str, str]:
    """Write ``report.md`` (and ``quality_vs_rate.png``, ``per_task.png``) into `out_dir`."""
    from ..files import write_text

    os.makedirs(out_dir, exist_ok=True)
    paths = {"markdown": os.path.join(out_dir, "report.md")}
    write_text(paths["markdown"], markdown_report(records, primary_threshold))
    if plots:
        paths["quality_vs_rate"] = os.path.join(out_dir, "quality_vs_rate.png")
        paths["per_task"] = os.path.join(out_dir, "per_task.png")
        plot_quality_vs_rate(records, paths["quality_vs_rate"])
        plot_per_task(records, paths["per_task"])
    return paths


def _mean(values: Iterable[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


__all__ = [
    "Estimate", "GroupSummary", "PolicyStats", "TaskStats", "main_table", "markdown_report", "plot_per_task",
    "plot_quality_vs_rate", "routing_table", "summarize", "sweep_table", "task_order", "write_report",
]
