"""The decode benchmark runs end to end at a tiny size (numbers there mean nothing; the script is what counts)."""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "decode_throughput.py")


def test_decode_benchmark_tiny_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, SCRIPT, "--tiny", "--lengths", "160", "--methods",
         "native-dynamic,native-static,streamingllm,oda-12.5,engine-12.5", "--window", "32", "--steps", "4", "--runs",
         "2", "--threads", "1", "--copy-mb", "16", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "decode_tiny.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["native-dynamic", "native-static", "streamingllm", "oda-12.5", "engine-12.5"]
    assert len(result["bandwidth_bytes_per_s"]) == 2 and min(result["bandwidth_bytes_per_s"]) > 0
    oda = rows["oda-12.5"]
    assert len(oda["throughput"]) == 2 and all(t > 0 for t in oda["throughput"])  # 1 round x 2 segments
    # the schedule's Full steps (1-2 of 16) fall in the 4 warm-up steps: none of the 8 measured, timed ones recalls
    # (the rate had been the record's over all 12 steps, 2/12, beside times and limits of the measured steps alone)
    assert oda["full_call_rate"] == rows["engine-12.5"]["full_call_rate"] == 0.0
    assert 0 < oda["predicted"] < 16 / 2  # the ledgers themselves are checked in test_cost*.py
    static = rows["native-static"]
    assert static["vs_static"] == 1.0 and static["bytes_ratio"] == 1.0
    for row in rows.values():   # ms per token from the median throughput; "vs static" = static's time / the row's
        assert row["ms_per_token"] == pytest.approx(1000 / statistics.median(row["throughput"]))
        assert row["vs_static"] == pytest.approx(static["ms_per_token"] / row["ms_per_token"])
    # Always-Local reads the weights but only s + w positions: a lower limit than Full, above zero.
    assert 0 < rows["streamingllm"]["limit_ms"] < static["limit_ms"] == rows["native-dynamic"]["limit_ms"]
    assert rows["streamingllm"]["bytes_ratio"] > 1 > oda["bytes_ratio"]  # ODA's Full steps re-read the weights
    table = (tmp_path / "decode_tiny.md").read_text()
    assert "| 160 | oda-12.5 |" in table and "limit ms/token" in table
    assert (tmp_path / "decode_tiny.png").stat().st_size > 0


def test_both_benchmarks_count_a_copys_bytes_read_and_written(monkeypatch):
    """A copy of N bytes reads N and writes N: decode_throughput counted N alone, so its bandwidth was half
    engine_throughput's on the same machine and its bytes limits (bytes read / bandwidth) twice too long."""
    import torch

    for name in ("decode_throughput", "engine_throughput"):
        path = os.path.join(os.path.dirname(SCRIPT), f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        clock = iter(range(100))   # every copy takes exactly one second
        monkeypatch.setattr(script.time, "perf_counter", lambda: float(next(clock)))
        bandwidth = (script.copy_bandwidth(1, 4096) if name == "decode_throughput"
                     else script.copy_bandwidth(torch.device("cpu"), 4096))
        assert bandwidth == 2 * 4096, name


def test_decode_benchmark_rounds_alternate_the_order_after_the_stock_arm():
    """Each arm is a worker process (about 11 s on 2 cores, mostly imports), so the end-to-end test above runs one
    round; the order of several is checked here."""
    spec = importlib.util.spec_from_file_location("decode_throughput", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    jobs = script.job_order([160, 320], ["native-static", "streamingllm", "oda-12.5"], rounds=3)
    assert jobs[:6] == [(160, "native-static", 0), (160, "streamingllm", 0), (160, "oda-12.5", 0),
                        (320, "native-static", 0), (320, "streamingllm", 0), (320, "oda-12.5", 0)]
    assert jobs[6:9] == [(160, "native-static", 1), (160, "oda-12.5", 1), (160, "streamingllm", 1)]
    assert [m for length, m, r in jobs if r == 2] == [m for length, m, r in jobs if r == 0]
    assert len(jobs) == 18


def test_decode_benchmark_counts_one_warm_up_segment_at_any_runs():
    """The limit, the FLOPs ratio and the decisions behind them took the warm-up to be as long as all the measured
    segments (`--steps` x `--runs`), where it is one segment: wrong numbers with exit 0 at --steps 8 --runs 2."""
    spec = importlib.util.spec_from_file_location("decode_throughput", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.measured_and_warmup(argparse.Namespace(steps=8, runs=2)) == (16, 8)   # what main() passes on
    # schedule 2 of 16 from the warm-up's first step: measured steps 9-24 after 8 warm-up steps; Full at 17 and 18
    assert script.step_decisions("oda-12.5", 16, 8) == [False] * 8 + [True, True] + [False] * 6
    assert script.step_decisions("streamingllm", 16, 8) == [False] * 16

    class Ledger:   # records where each sum of FLOPs starts
        starts = []

        def sequence_flops(self, method, start, schedule):
            self.starts.append(start)
            return 1

    script.predicted_ratio("oda-12.5", 100, 16, 8, Ledger())
    assert Ledger.starts == [108, 108]   # after the 8 warm-up steps


def test_retry_and_window_benchmark_tiny_end_to_end(tmp_path):
    script = os.path.join(os.path.dirname(SCRIPT), "retry_and_window.py")
    done = subprocess.run(
        [sys.executable, script, "--tiny", "--device", "cpu", "--batches", "1,4", "--long-prompt", "48",
         "--short-prompt", "8", "--new-tokens", "6", "--window", "16", "--runs", "1", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "retry_and_window_tiny.json").read_text())
    assert [r["batch"] for r in results["batch_retry"]] == [1, 4]
    assert all(r["whole_ms"] > 0 and r["rows_ms"] > 0 for r in results["batch_retry"])
    short = results["short_prompt"][0]
    assert short["window_steps"] == short["routed_steps"] == 5  # the whole request stays within s + w
    assert "ODA / stock static" in (tmp_path / "retry_and_window_tiny.md").read_text()


def test_smollm2_summary_keeps_the_control_oda_evals_report_keeps(tmp_path):
    """The SmolLM2 summary reads every version of a pair as `oda eval`'s report does: after a rerun over fewer prompts
    redrew a matched Random record, the one drawn for all prompts comes back (dropped: Random 100 over 1 of 2)."""
    spec = importlib.util.spec_from_file_location(
        "summarize", os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "smollm2", "summarize.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def record(i, policy, kind, calls, score, p=None):
        return {"id": f"a/{i}", "task": "a", "policy": policy, "group": policy.split("/")[0], "kind": kind,
                "threshold": 0.0, "seed": 42 if p else None, "p": p, "score": score, "full_calls": calls,
                "routed_steps": 10, "window_steps": 0, "window_full_calls": 0, "hit_cap": False,
                "metric": "string_match_all", "answers": ["x"]}

    random = "random~oda@0/seed42"
    (tmp_path / "2048").mkdir()
    lines = [record(0, "oda@0", "oda", 2, 1.0), record(1, "oda@0", "oda", 6, 1.0),   # ODA's rate over both: 8 / 20
             record(0, random, "random", 4, 0.0, p=0.4), record(1, random, "random", 4, 1.0, p=0.4),
             record(0, random, "random", 2, 1.0, p=0.2)]   # a rerun over a/0 alone redrew it at 2 / 10
    (tmp_path / "2048" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = script.load(str(tmp_path))[2048]
    assert sorted((r["id"], r["p"]) for r in records if r["kind"] == "random") == [("a/0", 0.4), ("a/1", 0.4)]
    assert "| **macro** | 2048 | | **100.0** | **50.0** |" in script.table(script.load(str(tmp_path)))[0]


def test_vllm_equivalence_counts_steps_one_side_lacks_as_unexplained_differences():
    """The vLLM-vs-Transformers comparison compared decisions over the steps both had and scores where both had one:
    an empty or cut-short vLLM record read as 0 differing decisions and a score difference of 0.0."""
    spec = importlib.util.spec_from_file_location(
        "vllm_equivalence", os.path.join(os.path.dirname(SCRIPT), "vllm_equivalence.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hf_decisions, hf_scores = [False, True, False], [-0.5, 0.00005, -0.2]
    empty = script.compare_decisions([], [], hf_decisions, hf_scores, 0.0)
    assert (empty["decisions_differ"], empty["differ_unexplained"], empty["scores_compared"]) == (3, 3, 0)
    near = script.compare_decisions([False, False, False], [-0.5, -0.00005, -0.2], hf_decisions, hf_scores, 0.0)
    assert (near["decisions_differ"], near["differ_unexplained"], near["near_threshold"]) == (1, 0, 1)
    assert near["max_score_difference"] == 1e-4 and near["scores_compared"] == 3
    assert script.first_difference([1, 2, 3], [1, 2]) == 2 and script.first_difference([1, 2], [1, 2]) is None
    assert script.first_difference([1, 5], [1, 2, 3]) == 1
