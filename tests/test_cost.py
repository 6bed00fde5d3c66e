"""The analytical cost model (oda_hf.cost) against the paper's FLOPs table, brute-force counts on tiny
models, the additive speed model, and the `oda flops` command."""

import argparse
import json

import pytest
import torch
import transformers
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from oda_hf.compat import CACHE_ARG, cache_kwargs
from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig, SchedulePolicy
from oda_hf.cli_common import UsageError
from oda_hf.cost import (
    PAPER_INPUT_LENGTHS,
    CostLedger,
    ModelShape,
    add_cli,
    format_flops_table,
    head_param_count,
    head_params_from_config,
    run_cli,
    schedule_first_k,
)
from tiny_models import FAMILIES, _config, tiny_model

# Paper, Appendix "Runtime protocol and complete results", Table tab:decode-throughput-full:
# "FLOPs saved (%)" for Local and ODA at 12.5 / 25 / 50 % Full calls (Full is 0.00 by definition).
PAPER_FLOPS_SAVED = {
    4139: ("13.19", "1.17", "-9.60", "-31.15"),
    15918: ("45.73", "33.53", "22.11", "-0.73"),
    31400: ("63.64", "51.34", "39.57", "16.01"),
    63852: ("78.51", "66.13", "54.06", "29.91"),
    128852: ("88.19", "75.75", "63.49", "38.96"),
    261696: ("93.85", "81.38", "69.00", "44.25"),
    516788: ("96.80", "84.31", "71.88", "47.01"),
}


@pytest.fixture(scope="module")
def paper_rows():
    return CostLedger.qwen3_1_7b().flops_table()


# --- the paper's numbers -----------------------------------------------------------------------------


def test_qwen3_1_7b_terms_follow_the_spec_formulas():
    shape = ModelShape.qwen3_1_7b()
    layers, d, hq, hkv, hd, ffn, vocab = 28, 2048, 16, 8, 128, 6144, 151936
    assert shape.backbone_flops == 2 * layers * (d * hq * hd + 2 * d * hkv * hd + hq * hd * d + 3 * d * ffn)
    assert shape.attention_flops(1000) == 2 * 2 * 1000 * hd * hq * layers
    assert shape.attention_flops(5000, 4 + 2048) == 2 * 2 * 2052 * hd * hq * layers
    assert shape.output_flops == 2 * d * vocab
    assert shape.global_layers == tuple(range(28))
    assert head_param_count(2048) == head_param_count(2048, 1024) == 28_325_889
    assert CostLedger.qwen3_1_7b().head_flops == 2 * 28_325_889


def test_paper_flops_table_every_cell(paper_rows):
    assert [r.input_tokens for r in paper_rows[::5]] == list(PAPER_INPUT_LENGTHS)
    for i, input_tokens in enumerate(PAPER_INPUT_LENGTHS):
        rows = paper_rows[5 * i: 5 * i + 5]
        assert [(r.method, r.full_pct) for r in rows] == [
            ("Full", 100.0), ("Local", 0.0), ("ODA", 12.5), ("ODA", 25.0), ("ODA", 50.0)]
        assert f"{rows[0].saved_pct:.2f}" == "0.00" and rows[0].ratio == 1.0
        assert tuple(f"{r.saved_pct:.2f}" for r in rows[1:]) == PAPER_FLOPS_SAVED[input_tokens]


def test_paper_ratio_at_516788(paper_rows):
    row = next(r for r in paper_rows if r.input_tokens == 516788 and r.full_pct == 12.5)
    assert f"{row.saved_pct:.2f}" == "84.31"
    assert f"{row.ratio:.3f}" == "6.375"
    assert abs(row.ratio - 6.375) < 1e-4


def test_schedule_and_sequence_ledger():
    schedule = schedule_first_k(2, 16, 1008)
    assert sum(schedule) == 126 and schedule[:3] == [True, True, False] and schedule[16:18] == [True, True]
    assert [sum(schedule_first_k(k, 16, 1008)) for k in (4, 8)] == [252, 504]
    with pytest.raises(ValueError):
        schedule_first_k(17, 16, 10)

    ledger = CostLedger.qwen3_1_7b()
    shape, input_len = ledger.shape, 3000
    b, o, r = shape.backbone_flops, shape.output_flops, ledger.head_flops
    a = shape.attention_flops
    steps = range(1, 1009)
    assert ledger.sequence_flops("full", input_len, 1008) == sum(b + a(input_len + t) + o for t in steps)
    assert ledger.sequence_flops("local", input_len, schedule) == sum(
        b + a(min(input_len + t, 2052)) + o for t in steps)
    assert ledger.sequence_flops("oda", input_len, schedule) == sum(
        (1 + at) * b + a(min(input_len + t, 2052)) + at * a(input_len + t) + r + o
        for t, at in zip(steps, schedule))
    # ODA with every step recalled costs Full plus the Local attempts and the head.
    assert ledger.sequence_flops("oda", input_len, [True] * 5) == ledger.sequence_flops("full", input_len, 5) + sum(
        b + a(min(input_len + t, 2052)) + r for t in range(1, 6))
    with pytest.raises(ValueError):
        ledger.sequence_flops("sparse", input_len, 5)

    rows = ledger.flops_table([input_len])
    assert rows[0].flops == ledger.sequence_flops("full", input_len, 1008)
    assert rows[2].flops == ledger.sequence_flops("oda", input_len, schedule)


# --- the recall head ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden, width", [(32, 8), (48, None), (64, 24)])
def test_head_param_count_matches_the_module(hidden, width):
    config = RecallHeadConfig(hidden_size=hidden, head_width=width)
    head = RecallHead(config)
    assert head_param_count(hidden, width) == sum(p.numel() for p in head.parameters())
    expected = head_param_count(hidden, width)
    assert head_params_from_config(config) == head_params_from_config(config.to_dict()) == expected


def test_head_params_from_a_saved_head(tmp_path):
    RecallHeadConfig(hidden_size=32, head_width=8).save_pretrained(tmp_path)
    expected = head_param_count(32, 8)
    assert head_params_from_config(tmp_path) == head_params_from_config(tmp_path / "config.json") == expected


# --- brute force on tiny models ----------------------------------------------------------------------


def _tiny(family):
    if family == "gemma4_moe":  # Gemma4 with every optional block the count knows about
        return tiny_model("gemma4", attn_implementation="eager", enable_moe_block=True, num_experts=4,
                          top_k_experts=2, moe_intermediate_size=12, use_double_wide_mlp=True, attention_k_eq_v=True)
    return tiny_model(family, attn_implementation="eager")


def _gated_deltanet_macs(model) -> int:
    """Per-token conv and recurrent-update multiply-adds read off the instantiated DeltaNet modules."""
    total = 0
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            total += module.conv1d.weight.numel()  # depthwise conv: kernel taps per channel
            total += 3 * module.num_v_heads * module.head_k_dim * module.head_v_dim  # S^T k, k delta^T, S^T q
    return total


def _ungated(model_type):
    """Families with a two-matrix MLP (found by an audit: counted as gated, 1.33x the backbone's FLOPs)."""
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=512)
    config = {"gpt_neox": lambda: transformers.GPTNeoXConfig(**common, rotary_pct=0.5),
              "starcoder2": lambda: transformers.Starcoder2Config(**common, num_key_value_heads=2,
                                                                  sliding_window=None)}[model_type]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", FAMILIES + ["gemma4_moe", "gpt_neox", "starcoder2"])
def test_step_costs_match_brute_force_count(family):
    """One decode token: every nn.Linear (hooks), MoE experts (hook), eager attention products (bmm)."""
    model = _ungated(family) if family in ("gpt_neox", "starcoder2") else _tiny(family)
    shape = ModelShape.from_config(model.config)
    prompt = 12  # longer than the tiny sliding window (5), so sliding layers are clamped
    backbone, output = [], []

    def linear_hook(module, inputs, _):
        macs = module.in_features * module.out_features * inputs[0].shape[:-1].numel()
        (output if module is model.lm_head else backbone).append(macs)

    def experts_hook(module, inputs, _):
        routed = inputs[1].numel()  # tokens x top_k
        backbone.append(routed * (module.gate_up_proj[0].numel() + module.down_proj[0].numel()))

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(linear_hook)
        elif type(module).__name__ == "Gemma4TextExperts":
            module.register_forward_hook(experts_hook)
    with torch.no_grad():
        past = getattr(model(torch.randint(1, 97, (1, prompt)), use_cache=True), CACHE_ARG)
        backbone.clear(), output.clear()
        with FlopCounterMode(display=False) as counter:
            model(torch.tensor([[5]]), **cache_kwargs(past), use_cache=True)
    attention = counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0)

    assert shape.backbone_flops == 2 * (sum(backbone) + _gated_deltanet_macs(model))
    assert shape.output_flops == 2 * sum(output)
    assert shape.attention_flops(prompt + 1) == attention


def _matmul_flops(counter) -> int:
    counts = counter.get_flop_counts()["Global"]
    return sum(counts.get(op, 0) for op in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm))


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4", "qwen3_5"])
def test_oda_sequence_matches_counted_generation(family):
    """A scheduled ODA generation through OdaForCausalLM costs exactly the ledger's F_ODA.

    The prompt is longer than s + w: before the workspace fills, the eager Local kernel also
    multiplies masked empty slots, which the paper's count (rightly) leaves out.
    """
    base = _tiny(family)
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    sinks, window, prompt, new_tokens = 2, 4, 9, 7
    ids = torch.randint(3, 97, (1, prompt))

    def generate_flops(max_new_tokens):
        model = OdaForCausalLM(base, head, OdaConfig(sinks=sinks, window=window,
                                                     policy=SchedulePolicy(1, 3, run_head=True)))
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return _matmul_flops(counter), model.routing.decisions[0].tolist()

    prefill, _ = generate_flops(1)
    total, decisions = generate_flops(new_tokens)
    schedule = schedule_first_k(1, 3, new_tokens - 1)
    assert decisions == schedule

    d, m = base.config.hidden_size, 8
    ledger = CostLedger(ModelShape.from_config(base.config), head_param_count(d, m), sinks, window)
    # R counts every head parameter; the matmuls alone leave out the norm scales and the biases.
    head_matmuls = 2 * (3 * d * m + 9 * m * m + 2 * 3 * (2 * m) * m + m)
    passes = len(schedule) + sum(schedule)  # one Local pass per step plus one Full pass per recall
    expected = (ledger.sequence_flops("oda", prompt, schedule) - len(schedule) * (ledger.head_flops - head_matmuls)
                - passes * 2 * _gated_deltanet_macs(base))  # conv and state updates are not matmuls here
    assert total - prefill == expected


# --- hybrids -----------------------------------------------------------------------------------------


def test_qwen3_5_counts_only_full_attention_layers_in_attention():
    config = _config("qwen3_5")  # linear, full, linear, full; 4 query heads of dim 8
    shape = ModelShape.from_config(config)
    assert shape.global_layers == (1, 3)
    assert [layer.kind for layer in shape.layers] == ["linear_attention", "full_attention"] * 2
    per_position = 2 * 2 * 8 * 4 * 2  # two global layers
    assert shape.global_attention_flops_per_position == per_position
    for n in (3, 6, 100, 10_000):
        assert shape.attention_flops(n) == per_position * n
        assert shape.attention_flops(n, 6) == per_position * min(n, 6)
    # Gated DeltaNet layers cost the same at every history length, and more than a plain MLP.
    linear, full = shape.layers[0], shape.layers[1]
    assert linear.attention_flops(10_000) == 0 and linear.macs > 3 * 32 * 48
    # The full-attention q_proj also emits the output gate: q is d x 2*Hq*hd.
    assert full.macs == 32 * (2 * 4 * 8) + 2 * 32 * 2 * 8 + 4 * 8 * 32 + 3 * 32 * 48


def test_qwen3_5_multimodal_wrapper_and_config_files(tmp_path):
    text = _config("qwen3_5")
    wrapped = transformers.Qwen3_5Config(text_config=text.to_dict())
    text.save_pretrained(tmp_path)
    for source in (wrapped, tmp_path, tmp_path / "config.json", json.loads((tmp_path / "config.json").read_text())):
        assert ModelShape.from_config(source).layers == ModelShape.from_config(text).layers


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemma_sliding_layers_read_their_window_in_both_branches(family):
    shape = ModelShape.from_config(_config(family))  # sliding_window 5; sliding, full, sliding, full
    assert shape.global_layers == (1, 3)
    per_layer = 2 * 2 * 8 * 4
    for n in (3, 5, 6, 50, 5000):
        sliding = 2 * per_layer * min(n, 5)
        assert shape.attention_flops(n) == sliding + 2 * per_layer * n
        assert shape.attention_flops(n, 6) == sliding + 2 * per_layer * min(n, 6)
    # Gemma4's KV-shared consumers are "dummy" cache layers that still attend like their declared kind.
    if family == "gemma4":
        assert [layer.cache_type for layer in shape.layers] == ["sliding_attention", "full_attention", "dummy", "dummy"]
        assert [layer.kind for layer in shape.layers] == ["sliding_attention", "full_attention"] * 2


def test_hybrid_ledger_saves_only_on_global_layers():
    shape = ModelShape.from_config(_config("gemma3"))
    ledger = CostLedger(shape, head_param_count(32, 8), sinks=2, window=4)
    for n in (4, 6, 7, 500):
        step = ledger.step_costs(n)
        assert step.attention_full - step.attention_local == 2 * 2 * 2 * 8 * 4 * max(0, n - 6)


def test_unmodeled_moe_is_refused():
    config = transformers.Qwen3MoeConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                         moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelShape.from_config(config)


# --- the additive speed model ------------------------------------------------------------------------


@pytest.mark.parametrize("d_full, d_oda", [(0.0, 0.0), (1e8, 3e8), (2e8, 0.0)])
@pytest.mark.parametrize("n", [2052, 4000, 16_000, 128_000, 516_788])
def test_break_even_rate_separates_faster_from_slower(n, d_full, d_oda):
    ledger = CostLedger.qwen3_1_7b()
    bound = ledger.break_even_rate(n, d_full, d_oda)
    step = ledger.step_costs(n)
    h = step.head + d_oda - d_full
    assert bound == pytest.approx((step.attention_full - step.attention_local - h)
                                  / (step.backbone + step.attention_full), rel=1e-12)
    for rho in (0.0, 0.05, 0.125, 0.25, 0.5, 0.9, bound - 1e-6, bound + 1e-6):
        t_full, t_oda = ledger.speed_model(n, rho, d_full, d_oda)
        assert (t_oda < t_full) == (rho < bound)
    t_full, _ = ledger.speed_model(n, 0.3, d_full, d_oda)
    assert t_full == step.backbone + step.attention_full + step.output + d_full


def test_break_even_length_matches_the_closed_form():
    ledger = CostLedger.qwen3_1_7b()
    b, r, ell = ledger.shape.backbone_flops, ledger.head_flops, ledger.local_range
    a = ledger.shape.global_attention_flops_per_position
    for rho in (0.125, 0.25, 0.5):
        threshold = (rho * b + a * ell + r) / ((1 - rho) * a)  # paper: n > [rho B + a l + H] / [(1 - rho) a]
        n = ledger.break_even_length(rho)
        assert n == int(threshold) + 1 and n > ell
        assert ledger.break_even_rate(n) > rho > ledger.break_even_rate(n - 1)
    assert ledger.break_even_length(1.0) is None  # always recalling never pays
    # Overheads larger than the head make even the shortest history pay.
    assert ledger.break_even_length(0.0, d_full=2.0 * r) == 1


# --- `oda flops` -------------------------------------------------------------------------------------


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="oda")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["flops", *argv])
    assert args.func is run_cli
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_cli_default_prints_the_paper_table(capsys, paper_rows):
    out = _run([], capsys)
    assert "28,325,889 head params" in out and "attention = 229,376 * n (28 of 28 layers)" in out
    assert "Local range s + w = 4 + 2048" in out
    assert "| 516,788 | ODA | 12.5 | 84.31 | 6.375 |" in out
    for input_tokens, saved in PAPER_FLOPS_SAVED.items():
        for method, share, cell in zip(("Local", "ODA", "ODA", "ODA"), ("0.0", "12.5", "25.0", "50.0"), saved):
            assert f"| {input_tokens:,} | {method} | {share} | {cell} |" in out
    assert format_flops_table(paper_rows) in out


def test_cli_with_configs_and_options(tmp_path, capsys):
    _config("qwen3_5").save_pretrained(tmp_path / "base")
    head_config = tmp_path / "head.json"
    head_config.write_text(json.dumps({"hidden_size": 32, "head_width": 8, "sinks": 2, "window": 4}))
    out = _run(["--config", str(tmp_path / "base" / "config.json"), "--head-config", str(head_config),
                "--input-lengths", "10,100", "--continuation", "9", "--period", "4", "--full-steps", "1,2",
                "--format", "plain"], capsys)
    assert "(2 of 4 layers)" in out and f"({head_param_count(32, 8):,} head params)" in out
    assert "Local range s + w = 2 + 4; 8 routed steps" in out
    body = [line.split() for line in out.splitlines() if line.strip().startswith(("10 ", "100 "))]
    assert [(row[0], row[1], row[2]) for row in body] == [
        (n, method, share) for n in ("10", "100")
        for method, share in (("Full", "100.0"), ("Local", "0.0"), ("ODA", "25.0"), ("ODA", "50.0"))]
    # Flags override the head's Local set.
    out = _run(["--config", str(tmp_path / "base"), "--head-config", str(head_config), "--sinks", "1",
                "--input-lengths", "50"], capsys)
    assert "Local range s + w = 1 + 4" in out


def test_cli_rejects_bad_schedules_and_mismatched_heads(tmp_path, capsys):
    with pytest.raises(UsageError, match="--full-steps 20 is outside"):
        _run(["--full-steps", "20"], capsys)
    with pytest.raises(SystemExit):  # argparse refuses it: exit 2, one line naming the flag
        _run(["--continuation", "1"], capsys)
    assert "argument --continuation: must be an integer >= 2" in capsys.readouterr().err
    head_config = tmp_path / "head.json"
    head_config.write_text(json.dumps({"hidden_size": 32}))
    with pytest.raises(UsageError, match="the head reads hidden size 32"):
        _run(["--head-config", str(head_config)], capsys)


def test_a_config_file_missing_sizes_is_named_and_a_malformed_one_is_one_error(tmp_path, caplog):
    """Found by an audit: a config file without intermediate_size was counted with Llama's default 11008 (FLOPs 5.6x
    too high), silently; a string where a number belongs raised a raw strict-dataclass traceback."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "vocab_size": 97}))
    with caplog.at_level("WARNING"):
        ModelShape.from_config(str(path))
    assert "gives no intermediate_size" in caplog.text
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": "128",
                                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 97}))
    with pytest.raises(ValueError, match="does not make a llama config"):
        ModelShape.from_config(str(path))


def test_a_model_config_given_as_head_config_is_refused(tmp_path, capsys):
    """Found by an audit: a model's config.json given to --head-config was read, its hidden size matched, and the
    default head width and geometry were counted, exit 0."""
    model_config = tmp_path / "config.json"
    model_config.write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    with pytest.raises(UsageError, match="is not a recall head's config .*'llama'"):
        _run(["--head-config", str(model_config)], capsys)


def test_a_chunked_layer_reads_its_chunk_so_far():
    """At history length n, a chunked-attention layer (Llama 4) reads the positions of the current chunk up to the
    token: a whole chunk at its last position, one at a chunk's first (a mutation audit's `n % span` passed)."""
    from oda_hf.cost import LayerShape

    layer = LayerShape(index=0, cache_type="chunked_attention", kind="chunked_attention", macs=0, query_heads=1,
                       head_dim=8, span=4, kv_heads=1)
    assert [layer.positions_read(n) for n in range(1, 10)] == [1, 2, 3, 4, 1, 2, 3, 4, 1]


# --- bytes and batch-table numbers, written out by hand (mutation audit of oda_hf/cost.py) -----------------------


def _hand_model(layers, macs=100, **bytes_kw):
    """A BatchCostModel over hand-made layers: d 4, vocab 10, head 5 params (R = 10), s + w = 2 + 4 = 6."""
    from oda_hf.cost import BatchCostModel, Hardware, LayerShape

    shape = ModelShape("hand", 4, 10, tuple(LayerShape(i, kind, kind, macs if i == 0 else 0, *rest)
                                            for i, (kind, *rest) in enumerate(layers)))
    return BatchCostModel(CostLedger(shape, 5, sinks=2, window=4), Hardware("hw", 1e12, 1e12), **bytes_kw)


def test_kv_and_output_bytes_use_their_own_dtype_sizes():
    """KV bytes are priced at kv_bytes and weights/output at weight_bytes (an FP8 KV cache halves only the KV)."""
    model = _hand_model([("full_attention", 4, 8, None, 2)], weight_bytes=2, kv_bytes=1)  # Hq 4, hd 8, Hkv 2
    kv_per_position = 2 * 2 * 8 * 1  # K and V x Hkv x hd x 1 byte x 1 layer
    assert model.kv_bytes_read(10, local=False) == 10 * kv_per_position == 320
    weights, output = 100 * 2, 4 * 10 * 2  # 100 multiply-adds of weights; d x vocab, both at 2 bytes
    assert model.full_step([10]).bytes == weights + 320 + output == 600


def test_kv_bytes_of_sliding_chunked_and_linear_layers_are_their_own_reads():
    """Sliding layers read min(n, window), chunked (n - 1) % chunk + 1, linear none, in both branches."""
    model = _hand_model([("full_attention", 4, 8, None, 2), ("sliding_attention", 4, 8, 5, 2),
                         ("chunked_attention", 4, 8, 4, 2), ("linear_attention",)])
    per_position = 2 * 2 * 8 * 2  # K and V x Hkv 2 x hd 8 x 2 bytes, one layer
    assert model.kv_bytes_read(50, local=False) == per_position * (50 + 5 + 2) == 3648  # chunk: 49 % 4 + 1 = 2
    assert model.kv_bytes_read(50, local=True) == per_position * (6 + 5 + 2) == 832
    assert model.kv_bytes_read(3, local=False) == per_position * (3 + 3 + 3) == 576


def _model_for(config):
    from oda_hf.cost import BatchCostModel

    shape = ModelShape.from_config(config)
    return BatchCostModel(CostLedger(shape, head_param_count(shape.hidden_size, 8), sinks=2, window=4))


def test_gemma4_kv_shared_layers_read_their_source_kv_heads():
    """Gemma4's KV-shared (dummy) layers read K/V of Hkv heads, not Hq: 4 layers x Hkv 2 x hd 8, window 5."""
    model = _model_for(_config("gemma4"))
    per_position = 2 * 2 * 8 * 2  # K and V x Hkv x hd x 2 bytes, one layer
    assert model.kv_bytes_read(50, local=False) == per_position * (5 + 50 + 5 + 50) == 7040
    assert model.kv_bytes_read(50, local=True) == per_position * (5 + 6 + 5 + 6) == 1408


def test_batch_row_flops_ratio_is_full_over_oda():
    """BatchRow.flops_ratio is Full FLOPs / ODA FLOPs: B 200, A(n) 128 n, l 6, R 10, O 80; rate 0 at n = 50."""
    from oda_hf.cost import batch_table

    model = _hand_model([("full_attention", 4, 8, None, 2)])
    (row,) = batch_table(model, [1], [0.0], [50], ["whole"])
    assert row.full.flops == 200 + 128 * 50 + 80 == 6680
    assert row.oda.flops == 200 + 128 * 6 + 10 + 80 == 1058
    assert row.flops_ratio == pytest.approx(6680 / 1058, rel=1e-12)


def test_batch_table_columns_hold_full_and_oda_values():
    """The markdown batch table prints Full GB from Full's bytes, ODA GB from ODA's, and Full/ODA FLOPs."""
    from oda_hf.cost import batch_table, format_batch_table

    model = _hand_model([("full_attention", 4, 8, None, 2)], macs=10**9)  # weights 2e9 bytes per pass
    out = format_batch_table(batch_table(model, [1], [1.0], [50], ["whole"]))
    cells = [c.strip() for c in out.splitlines()[2].strip("|").split("|")]
    full_flops, oda_flops = 2 * 10**9 + 128 * 50 + 80, 2 * (2 * 10**9) + 128 * 6 + 10 + 80 + 128 * 50
    assert cells[7:9] == ["2.00", "4.00"]  # Full reads the weights once, ODA (Local + Full pass) twice
    assert cells[10] == f"{full_flops / oda_flops:.3f}" == "0.500"


def test_cli_pass_overhead_is_microseconds_per_pass(capsys):
    """--pass-overhead-us 1000 adds 1 ms per backbone pass: Full (one pass) and ODA at rate 1 whole (two passes)."""
    def times(overhead):
        out = _run(["--histories", "100", "--rate", "1", "--mode", "whole", "--pass-overhead-us", overhead], capsys)
        cells = [c.strip() for c in out.strip().splitlines()[-1].strip("|").split("|")]
        return float(cells[5]), float(cells[6])  # Full ms, ODA ms

    (full0, oda0), (full1, oda1) = times("0"), times("1000")
    assert full1 - full0 == pytest.approx(1.0, abs=2e-3)
    assert oda1 - oda0 == pytest.approx(2.0, abs=2e-3)


def test_rows_mode_expectation_for_a_batch_over_1000_rows():
    """Rows mode over 1,200 rows (log-space binomial): E[recalling rows] = 1200 x 0.5 linear passes' FLOPs."""
    model = _hand_model([("full_attention", 4, 8, None, 2)])  # B 200, A(n) 128 n, l 6, R 10, O 80
    expected = 1200 * (200 + 128 * 6 + 10 + 80) + 0.5 * 1200 * 128 * 10 + 0.5 * 1200 * 200
    assert model.oda_step_expected([10] * 1200, 0.5, "rows").flops == pytest.approx(expected, rel=1e-9)
