"""Batch economics of the cost model (oda_hf.cost.BatchCostModel): closed-form expectations against
brute-force enumeration of every decision pattern, reduction to the per-step ledger at batch 1, the
ordering of the two Full modes, continuous batching, and `oda flops --batch`."""

import argparse
import itertools
import math

import pytest

from oda_hf.cli_common import UsageError

from oda_hf.cost import (
    HARDWARE,
    BatchCostModel,
    CostLedger,
    Hardware,
    ModelShape,
    add_cli,
    batch_table,
    head_param_count,
)
from tiny_models import _config

# A tiny accelerator whose ridge point sits inside the small cases, so both roofline sides are exercised.
TINY_HW = Hardware("tiny", peak_flops=2.0e6, bandwidth=1.0e5)


def _tiny_model(family="llama", hardware=TINY_HW, overhead=0.0):
    shape = ModelShape.from_config(_config(family))
    return BatchCostModel(CostLedger(shape, head_param_count(shape.hidden_size, 8), sinks=2, window=4),
                          hardware, pass_overhead_s=overhead)


def _enumerate(model, lengths, rate, mode):
    """Expectation by summing every one of the 2^B decision patterns, weighted by its probability."""
    flops = nbytes = seconds = 0.0
    for pattern in itertools.product((False, True), repeat=len(lengths)):
        k = sum(pattern)
        p = rate ** k * (1 - rate) ** (len(lengths) - k)
        cost = model.oda_step_pattern(lengths, pattern, mode)
        flops, nbytes, seconds = flops + p * cost.flops, nbytes + p * cost.bytes, seconds + p * cost.seconds
    return flops, nbytes, seconds


# --- closed form == enumeration ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
@pytest.mark.parametrize("mode", ["whole", "rows", "masked"])
@pytest.mark.parametrize("lengths", [[9], [3, 9], [9, 9, 9], [1, 5, 7, 40], [6, 7, 30, 2, 100]])
@pytest.mark.parametrize("rate", [0.0, 0.125, 0.5, 0.9, 1.0])
def test_expectation_equals_enumeration_of_all_patterns(family, mode, lengths, rate):
    model = _tiny_model(family, overhead=1e-4)
    expected = model.oda_step_expected(lengths, rate, mode)
    flops, nbytes, seconds = _enumerate(model, lengths, rate, mode)
    assert expected.flops == pytest.approx(flops, rel=1e-12)
    assert expected.bytes == pytest.approx(nbytes, rel=1e-12)
    assert expected.seconds == pytest.approx(seconds, rel=1e-12)


def test_pattern_flops_follow_the_per_step_ledger():
    """FLOPs of a pattern from the ledger's own StepCosts, written out independently of the model."""
    model = _tiny_model("gemma3")
    ledger = model.ledger
    lengths = [3, 8, 50]
    for pattern in itertools.product((False, True), repeat=3):
        steps = [ledger.step_costs(n) for n in lengths]
        rows = sum(s.oda(a) for s, a in zip(steps, pattern))
        local = sum(s.backbone + s.attention_local + s.head + s.output for s in steps)
        whole = local + any(pattern) * sum(s.backbone + s.attention_full for s in steps)
        masked = local + sum(any(pattern) * s.backbone + a * s.attention_full for s, a in zip(steps, pattern))
        assert model.oda_step_pattern(lengths, pattern, "rows").flops == rows
        assert model.oda_step_pattern(lengths, pattern, "whole").flops == whole
        assert model.oda_step_pattern(lengths, pattern, "masked").flops == masked
    assert model.full_step(lengths).flops == sum(s.full for s in (ledger.step_costs(n) for n in lengths))


def test_a_batched_pass_reads_weights_not_the_recurrent_state_updates():
    """Gated DeltaNet's state update (3 nv dk dv multiply-adds a token) is on each row's state: not weight bytes."""
    model = _tiny_model("qwen3_5")
    config = _config("qwen3_5")
    config = getattr(config, "get_text_config", lambda: config)()
    kinds = config.layer_types
    state = 3 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    linear_layers = kinds.count("linear_attention")
    assert linear_layers >= 1 and state > 0
    shape = model.ledger.shape
    assert shape.weight_macs == shape.backbone_flops // 2 - linear_layers * state
    assert model.full_step([10]).bytes == (shape.weight_macs * 2 + model.kv_bytes_read(10, local=False)
                                           + shape.hidden_size * shape.vocab_size * 2)


def test_pattern_bytes_count_weights_once_per_pass_and_kv_per_row():
    model = _tiny_model("llama")  # 2 layers, all global: Hkv 2, head_dim 8; s + w = 6
    shape, ledger = model.ledger.shape, model.ledger
    kv_per_position = 2 * 2 * 8 * 2 * 2  # K and V x Hkv x hd x 2 bytes x 2 layers
    assert model.kv_bytes_read(50, local=False) == 50 * kv_per_position
    assert model.kv_bytes_read(50, local=True) == 6 * kv_per_position
    assert model.kv_bytes_read(4, local=True) == 4 * kv_per_position
    weights = shape.backbone_flops // 2 * 2
    head, output = ledger.head_params * 4, shape.hidden_size * shape.vocab_size * 2
    lengths = [10, 20, 30]
    local_kv = sum(model.kv_bytes_read(n, True) for n in lengths)
    assert model.full_step(lengths).bytes == weights + sum(n * kv_per_position for n in lengths) + output
    # One recalling row: "rows" reads the weights again but only that row's history; "whole" reads every history.
    one = [False, True, False]
    assert model.oda_step_pattern(lengths, one, "rows").bytes == 2 * weights + local_kv + 20 * kv_per_position + head + output
    assert model.oda_step_pattern(lengths, one, "whole").bytes == (2 * weights + local_kv + 60 * kv_per_position
                                                                   + head + output)
    assert model.oda_step_pattern(lengths, one, "masked").bytes == model.oda_step_pattern(lengths, one, "rows").bytes
    # StreamingLLM: the weights once, every row's Local history, the output projection, no head.
    assert model.local_step(lengths).bytes == weights + local_kv + output
    assert model.local_step(lengths).flops == sum(s.backbone + s.attention_local + s.output
                                                  for s in (ledger.step_costs(n) for n in lengths))


# --- reductions and orderings ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [100, 2052, 40_000, 516_788])
def test_batch_one_reduces_to_the_per_step_ledger(n):
    model = BatchCostModel(CostLedger.qwen3_1_7b())
    step = model.ledger.step_costs(n)
    assert model.full_step([n]).flops == step.full
    for recall in (False, True):
        for mode in ("whole", "rows", "masked"):
            assert model.oda_step_pattern([n], [recall], mode).flops == step.oda(recall)
    for rate in (0.0, 0.125, 0.5, 1.0):
        # The modes coincide at batch 1, and the FLOPs are the paper's T_ODA(n, rho) in FLOPs.
        whole = model.oda_step_expected([n], rate, "whole")
        for mode in ("rows", "masked"):
            other = model.oda_step_expected([n], rate, mode)
            assert (whole.flops, whole.bytes) == pytest.approx((other.flops, other.bytes), rel=1e-12)
            assert whole.seconds == pytest.approx(other.seconds, rel=1e-12)
        _, t_oda = model.ledger.speed_model(n, rate)
        assert whole.flops == pytest.approx(t_oda, rel=1e-12)


def test_rows_never_costs_more_than_whole():
    model = BatchCostModel(CostLedger.qwen3_1_7b())
    for lengths in ([32_768] * 8, [1000, 50_000, 4000, 200_000], [2052] * 3, [128_000] * 64):
        for rate in (0.0, 0.05, 0.125, 0.25, 0.5, 0.9, 1.0):
            whole, rows = model.oda_step_expected(lengths, rate, "whole"), model.oda_step_expected(lengths, rate, "rows")
            assert rows.flops <= whole.flops * (1 + 1e-12)
            assert rows.bytes <= whole.bytes * (1 + 1e-12)
            assert rows.seconds <= whole.seconds * (1 + 1e-12)
            if rate in (0.0, 1.0) or len(lengths) == 1:
                assert rows.seconds == pytest.approx(whole.seconds, rel=1e-12)
            # masked reads what rows reads; it runs every row's projections, which costs FLOPs but, at
            # these batch sizes (weight-bandwidth bound), no time.
            masked = model.oda_step_expected(lengths, rate, "masked")
            assert masked.bytes == pytest.approx(rows.bytes, rel=1e-12)
            assert rows.flops * (1 - 1e-12) <= masked.flops <= whole.flops * (1 + 1e-12)
            assert masked.seconds == pytest.approx(rows.seconds, rel=1e-12)
    # The strict gap in the brief's case: many rows, a few recalls.
    assert model.speedup([32_768] * 16, 0.125, "rows") > 2 * model.speedup([32_768] * 16, 0.125, "whole")


def test_monotonicity():
    model = BatchCostModel(CostLedger.qwen3_1_7b())
    rates = [0.0, 0.125, 0.25, 0.5, 1.0]
    for mode in ("whole", "rows"):
        for lengths in ([32_768] * 8, [3000, 90_000]):
            costs = [model.oda_step_expected(lengths, r, mode) for r in rates]
            for lower, higher in zip(costs, costs[1:]):  # more recalls never cost less
                assert lower.flops < higher.flops and lower.bytes < higher.bytes and lower.seconds < higher.seconds
        # Longer histories cost more, and beyond s + w ODA's advantage at a fixed rate grows with them.
        speedups = [model.speedup([n] * 4, 0.125, mode) for n in (4096, 32_768, 131_072, 524_288)]
        assert speedups == sorted(speedups)
    # Whole-batch Full runs almost every step for large batches (P(any) = 1 - 0.875^64 > 0.9998), so its
    # speedup sinks below 1 toward Full / (Full + Local pass + head), once weight reads are amortized.
    whole = [model.speedup([32_768] * b, 0.125, "whole") for b in (2, 4, 8, 16, 32, 64)]
    assert whole[:4] == sorted(whole[:4], reverse=True) and whole[-1] < 1.0
    full = model.full_step([32_768] * 64).seconds
    always = model.oda_step_expected([32_768] * 64, 1.0, "whole").seconds
    assert whole[-1] == pytest.approx(full / always, rel=1e-3)
    # Per-row Full amortizes the Local pass's weight read: its speedup rises with B toward the KV-bound limit.
    rows = [model.speedup([32_768] * b, 0.125, "rows") for b in (1, 2, 4, 8, 16, 32, 64)]
    assert rows == sorted(rows)
    limit = model.kv_bytes_read(32_768, False) / (model.kv_bytes_read(32_768, True)
                                                  + 0.125 * model.kv_bytes_read(32_768, False))
    assert rows[-1] < limit


def test_continuous_batching_with_equal_lengths_equals_the_fixed_length_table():
    model = BatchCostModel(CostLedger.qwen3_1_7b(), "a100-sxm-80gb")
    fixed = batch_table(model, [4], [0.25], [32_768])
    continuous = batch_table(model, [], [0.25], [32_768] * 4)
    assert [(r.batch, r.mode, r.full, r.oda) for r in fixed] == [(r.batch, r.mode, r.full, r.oda) for r in continuous]
    # Mixed lengths: costs add per row on the attention side and share the weight read.
    mixed = model.oda_step_expected([4096, 131_072], 0.25, "rows")
    singles = [model.oda_step_expected([n], 0.25, "rows") for n in (4096, 131_072)]
    assert mixed.flops == pytest.approx(sum(s.flops for s in singles), rel=1e-12)
    assert mixed.bytes < sum(s.bytes for s in singles)


def test_roofline_sides():
    hw = Hardware("x", peak_flops=100.0, bandwidth=10.0)
    assert hw.seconds(1000.0, 5.0) == 10.0 and hw.seconds(10.0, 50.0) == 5.0
    model = BatchCostModel(CostLedger.qwen3_1_7b())
    # Decode at small batch is weight-bandwidth bound: the linear phase of B = 1 and B = 8 take the same time.
    assert model._linear(1).seconds == model._linear(8).seconds == pytest.approx(
        model.ledger.shape.backbone_flops // 2 * 2 / HARDWARE["h100-sxm"].bandwidth)
    assert model._linear(4096).seconds > model._linear(8).seconds  # past the ridge point it is compute bound


def test_bad_inputs_are_refused():
    model = _tiny_model()
    with pytest.raises(ValueError, match="mode"):
        model.oda_step_expected([5], 0.1, "partial")
    with pytest.raises(ValueError, match="mode"):
        model.oda_step_pattern([5], [True], "both")
    with pytest.raises(ValueError, match="rate"):
        model.oda_step_expected([5], 1.5, "rows")
    with pytest.raises(ValueError, match="one decision per row"):
        model.oda_step_pattern([5, 6], [True], "rows")
    with pytest.raises(ValueError, match="history lengths"):
        model.full_step([])
    with pytest.raises(ValueError, match="history lengths"):
        model.full_step([0, 5])
    with pytest.raises(ValueError, match="Unknown hardware"):
        BatchCostModel(model.ledger, "tpu")


# --- `oda flops --batch` -----------------------------------------------------------------------------


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="oda")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["flops", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_cli_batch_economics(capsys):
    out = _run(["--batch", "1,8", "--rate", "0.25", "--history", "32768"], capsys)
    model = BatchCostModel(CostLedger.qwen3_1_7b())
    assert "NVIDIA H100 SXM" in out
    for batch in (1, 8):
        for mode in ("whole", "rows", "masked"):
            speedup = model.speedup([32_768] * batch, 0.25, mode)
            assert f"| 32,768 | {batch} | 0.25 | {mode} |" in out
            assert f"| {speedup:.3f} |" in out
    assert "| 516,788 |" not in out  # the paper's sequence table is not printed in batch mode


def test_cli_continuous_batching_and_mode(capsys):
    out = _run(["--histories", "4096,131072", "--rate", "0.125", "--mode", "rows", "--hardware", "a100-sxm-80gb"],
               capsys)
    model = BatchCostModel(CostLedger.qwen3_1_7b(), "a100-sxm-80gb")
    speedup = model.speedup([4096, 131_072], 0.125, "rows")
    assert "| 67,584 | 2 | 0.125 | rows |" in out and f"| {speedup:.3f} |" in out
    assert "| whole |" not in out and "NVIDIA A100" in out


def test_cli_batch_rejects_bad_combinations(capsys):
    with pytest.raises(UsageError, match="--batch needs --history"):
        _run(["--batch", "4"], capsys)
    with pytest.raises(UsageError, match="either --histories"):
        _run(["--batch", "4", "--history", "100", "--histories", "5,6"], capsys)
    with pytest.raises(UsageError, match="probabilities"):
        _run(["--batch", "4", "--history", "100", "--rate", "2"], capsys)
    with pytest.raises(UsageError, match=">= 1"):
        _run(["--batch", "0", "--history", "100"], capsys)


def test_closed_form_any_row_probability():
    model = BatchCostModel(CostLedger.qwen3_1_7b())
    rows = batch_table(model, [1, 8, 64], [0.125], [32_768], modes=("whole",))
    assert [r.p_any for r in rows] == pytest.approx([1 - 0.875 ** b for b in (1, 8, 64)])
    full_pass = model.full_step([32_768] * 8).flops - 8 * model.ledger.shape.output_flops
    oda = model.oda_step_expected([32_768] * 8, 0.125, "whole").flops
    no_recall = model.oda_step_expected([32_768] * 8, 0.0, "whole").flops
    assert oda - no_recall == pytest.approx((1 - 0.875 ** 8) * full_pass, rel=1e-12)
    assert math.isclose(rows[1].speedup, model.speedup([32_768] * 8, 0.125, "whole"))


# --- the benchmark script ----------------------------------------------------------------------------


def _benchmark_module():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "batch_economics.py")
    spec = importlib.util.spec_from_file_location("batch_economics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_latency_model_fitted_on_full_predicts_the_papers_oda_speedups():
    """Two constants fitted to the paper's five batch-1 Full throughputs predict its fifteen ODA ones."""
    model, rows = _benchmark_module().calibrate_on_paper()
    assert len(rows) == 15
    assert 1.0e12 < model.hardware.bandwidth < HARDWARE["a100-sxm-80gb"].bandwidth  # below the datasheet
    assert 0 < model.pass_overhead_s < 5e-3
    for row in rows:
        assert row["calibrated"] == pytest.approx(row["paper_measured"], rel=0.06)
        assert row["roofline"] > row["paper_measured"]


def test_benchmark_script_writes_plot_and_tables(tmp_path):
    import json

    assert _benchmark_module().main(["--max-batch", "4", "--histories", "8192", "--rates", "0.25",
                                     "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "batch_economics.json").read_text())
    model = BatchCostModel(CostLedger.qwen3_1_7b())
    assert data["batches"] == [1, 2, 3, 4]
    assert data["speedup"]["roofline"]["8192"]["0.25"]["rows"][3] == pytest.approx(
        model.speedup([8192] * 4, 0.25, "rows"))
    assert (tmp_path / "batch_economics.png").stat().st_size > 10_000
    assert "| 8,192 | 4 | 0.25 | rows |" in (tmp_path / "batch_economics.md").read_text()
