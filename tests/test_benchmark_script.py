"""The decode benchmark runs end to end at a tiny size (numbers there mean nothing; the script is what counts)."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "decode_throughput.py")


def test_decode_benchmark_tiny_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, SCRIPT, "--tiny", "--lengths", "160", "--methods", "native-full,oda-12.5", "--window", "32",
         "--steps", "4", "--runs", "2", "--threads", "1", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "decode_tiny.json").read_text())
    assert [r["method"] for r in rows] == ["native-full", "oda-12.5"]
    oda = rows[1]
    assert len(oda["throughput"]) == 2 and all(t > 0 for t in oda["throughput"])
    assert oda["full_call_rate"] == 2 / 12  # Full on steps 1-2 of 16; 4 warm-up + 2 x 4 measured = 12 steps
    assert 0 < oda["predicted"] < 16 / 2  # the ledger itself is checked in test_cost.py
    assert (tmp_path / "decode_tiny.png").stat().st_size > 0 and "| 160 | oda-12.5 |" in (tmp_path / "decode_tiny.md").read_text()


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
