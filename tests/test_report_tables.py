"""Report tables and cards on hand-made records: every cell checked against numbers worked out by hand (Random's
mean ± sample std over seeds, rates past sinks + window, pooled vs task-averaged columns, each threshold's own
Random, the default threshold) and the cards' fields (the organism's score table and summary, a head's card)."""

from __future__ import annotations

import json
import types

import pytest

from oda_hf.evaluation import report
from oda_hf.organism.ship import score_table


def rec(task, policy, calls, steps, score, kind, group=None, threshold=None, seed=None, window=0, window_calls=0, i=0):
    return {"id": f"{task}/{i}", "task": task, "policy": policy, "group": group or policy, "kind": kind,
            "threshold": threshold, "seed": seed, "score": score, "full_calls": calls, "routed_steps": steps,
            "window_steps": window, "window_full_calls": window_calls, "hit_cap": False, "metric": "string_match_all"}


def rnd(task, thr, seed, calls, steps, score, window=0):
    return rec(task, f"random~oda@{thr:g}/seed{seed}", calls, steps, score, "random", group=f"random~oda@{thr:g}",
               threshold=thr, seed=seed, window=window)


def oda(task, thr, calls, steps, score, window=0, i=0):
    return rec(task, f"oda@{thr:g}", calls, steps, score, "oda", threshold=thr, window=window, i=i)


def row(table, first_cell):
    return next(line for line in table.splitlines() if line.startswith(f"| {first_cell} |"))


def test_main_table_per_task_cells_of_random_are_mean_and_sample_std_over_every_seed():
    """A task's Random cell is the mean ± sample std over every seed, score and rate; the header counts seeds."""
    records = [oda("a", 0.0, 4, 10, 1.0), rnd("a", 0.0, 42, 2, 10, 1.0), rnd("a", 0.0, 43, 6, 10, 0.0)]
    table = report.main_table(report.summarize(records))
    # seed 42: 100 at 20%, seed 43: 0 at 60% -> 50 ± 70.71 (40 ± 28.28%)
    assert row(table, "a").endswith("| 50.00 ± 70.71 (40.00 ± 28.28%) |")
    assert table.splitlines()[0] == "| Task | ODA (θ=0) | Random (matched to ODA θ=0, 2 seeds) |"


def test_main_table_per_task_rate_is_over_the_steps_past_the_window():
    """The rate beside a task's score counts only the steps past sinks + window."""
    records = [oda("a", 0.0, 3, 10, 1.0, window=4)]
    assert row(report.main_table(report.summarize(records)), "a") == "| a | 100.00 (50.00%) |"


def test_sweep_rows_pair_each_threshold_with_its_own_random_and_main_table_only_the_primary():
    """Each sweep row pairs a threshold with its own Random; the main table holds the primary threshold's only."""
    records = [oda("a", 0.0, 8, 10, 1.0), oda("a", 0.5, 2, 10, 0.5),
               rnd("a", 0.0, 42, 8, 10, 1.0), rnd("a", 0.5, 42, 2, 10, 0.0)]
    groups = report.summarize(records)
    sweep = report.sweep_table(groups).splitlines()
    assert sweep[2] == "| 0 | 100.00 | 80.00% | 80.00% | 100.00 | 80.00% | 80.00% |"
    assert sweep[3] == "| 0.5 | 50.00 | 20.00% | 20.00% | 0.00 | 20.00% | 20.00% |"
    header = report.main_table(groups).splitlines()[0]
    assert header == "| Task | ODA (θ=0) | Random (matched to ODA θ=0) |"


def test_routing_table_columns_hold_what_their_headers_name():
    """The routing table's pooled, task-avg and paper-rate columns hold what their headers name."""
    # task a: 9 calls past the window over 10 decided (+2 in window); task b: 0 over 90 (+8 in window)
    records = [oda("a", 0.0, 9, 12, 1.0, window=2), oda("b", 0.0, 0, 98, 0.5, window=8)]
    table = report.routing_table(report.summarize(records))
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    cells = [c.strip() for c in row(table, "ODA (θ=0)").strip("|").split("|")]
    got = dict(zip(header, cells))
    assert got["Full-call rate (pooled)"] == "9.00%"        # 9 / 100
    assert got["Full-call rate (task-avg)"] == "45.00%"     # (0.9 + 0) / 2
    assert got["Paper rate (pooled)"] == "8.18%"            # 9 / 110
    assert got["Routed steps"] == "110" and got["In window"] == "10" and got["Full calls"] == "9"
    assert got["Highest request rate"] == "90.0%"


def test_highest_request_rate_of_a_random_group_is_the_highest_over_its_seeds():
    """A Random group's highest request rate is the highest over its seeds."""
    records = [rnd("a", 0.0, 42, 2, 10, 1.0), rnd("a", 0.0, 43, 6, 10, 0.0)]
    assert report.summarize(records)["random~oda@0"].max_request_rate == pytest.approx(0.6)


def test_default_primary_threshold_is_zero_when_run_else_the_lowest():
    """The main table's default threshold is 0 when it ran, else the lowest."""
    zero_first = [oda("a", 0.0, 8, 10, 1.0), oda("a", 0.5, 2, 10, 0.5), oda("a", 1.0, 1, 10, 0.0)]
    assert report.main_table(report.summarize(zero_first)).splitlines()[0] == "| Task | ODA (θ=0) |"
    no_zero = [oda("a", 0.7, 8, 10, 1.0), oda("a", 0.3, 2, 10, 0.5)]
    assert report.main_table(report.summarize(no_zero)).splitlines()[0] == "| Task | ODA (θ=0.3) |"


def test_score_table_columns_hold_what_their_headers_name():
    """The organism card's score table: pooled and task-averaged columns hold what their headers name."""
    summary = {"threshold": 0.5, "oda@0.5": {"kind": "oda", "macro_score": 80.0, "macro_score_std": None,
                                            "pooled_full_call_rate": 0.09, "task_averaged_full_call_rate": 0.45},
               "random~oda@0.5": {"kind": "random", "macro_score": 60.0, "macro_score_std": 2.5,
                                  "pooled_full_call_rate": 0.1, "task_averaged_full_call_rate": 0.4}}
    lines = score_table(summary).splitlines()
    assert lines[0] == "| method | macro score | pooled Full-call rate | task-averaged rate |"
    assert lines[2] == "| ODA (threshold 0.5) | 80.0 | 9.0% | 45.0% |"
    assert lines[3] == "| Random at ODA's per-task rate (seeds 42/43/44) | 60.0 ± 2.5 | 10.0% | 40.0% |"


def _rec(task, policy, kind, calls, steps, score, seed=None, threshold=0.0, i=0):
    group = policy.split("/")[0]
    return {"id": f"{task}/{i}", "task": task, "policy": policy, "group": group, "kind": kind,
            "threshold": threshold if kind in ("oda", "random") else None, "seed": seed, "score": score,
            "full_calls": calls, "routed_steps": steps, "window_steps": 0, "window_full_calls": 0, "hit_cap": False,
            "metric": "string_match_all"}


def test_organism_summary_holds_each_groups_own_numbers(tmp_path, monkeypatch):
    """summary.json (the organism card's source) holds each group's own rates, per-task scores and seed std."""
    from oda_hf.evaluation import runner
    from oda_hf.organism import demo, evaluate

    config = types.SimpleNamespace(threshold=0.0, sinks=4, window=64)
    monkeypatch.setattr(demo, "load_organism", lambda *a, **k: (types.SimpleNamespace(oda_config=config), None, {}))
    records = [_rec("a", "full", "full", 10, 10, 1.0), _rec("b", "full", "full", 90, 90, 1.0),
               _rec("a", "oda@0", "oda", 9, 10, 1.0), _rec("b", "oda@0", "oda", 0, 90, 0.5)]
    for seed, (calls, score) in {42: (9, 1.0), 43: (5, 0.0), 44: (1, 0.5)}.items():
        records += [_rec("a", f"random~oda@0/seed{seed}", "random", calls, 10, score, seed),
                    _rec("b", f"random~oda@0/seed{seed}", "random", 0, 90, 0.5, seed)]
    monkeypatch.setattr(runner, "evaluate", lambda *a, **k: records)
    monkeypatch.setattr(report, "write_report", lambda *a, **k: {"markdown": "report.md"})
    evaluate.evaluate_organism("unused", str(tmp_path), n=1, lengths=(256,), tasks=("niah_single_1",))
    saved = json.loads((tmp_path / "summary.json").read_text())
    oda = saved["oda@0"]
    assert oda["pooled_full_call_rate"] == pytest.approx(9 / 100)
    assert oda["task_averaged_full_call_rate"] == pytest.approx(0.45)
    assert oda["per_task"] == {"a": 100.0, "b": 50.0} and oda["macro_score_std"] is None
    random = saved["random~oda@0"]
    assert random["macro_score"] == pytest.approx(50.0)           # seeds: 75, 25, 50
    assert random["macro_score_std"] == pytest.approx(25.0)       # sample std of 75, 25, 50


def test_head_card_table_rows_hold_their_config_fields(tmp_path):
    """A saved head's card lists its own sinks / window, lambda / tau_hist, hidden size and head width."""
    from oda_hf import RecallHead, RecallHeadConfig

    head = RecallHead(RecallHeadConfig(hidden_size=32, head_width=8, sinks=2, window=4, oda_lambda=0.25, tau_hist=0.001,
                                       base_vocab_size=97))
    head.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "| trained with sinks / window | 2 / 4 |" in card
    assert "| lambda / tau_hist | 0.25 / 0.001 |" in card
    assert "| base hidden size / vocab | 32 / 97 |" in card and "| head width / input variant | 8 / " in card
    assert "(2 sink positions plus a recent window of\n4 tokens)" in card
