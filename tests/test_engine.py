"""The static decode engine (oda_hf.engine): same tokens and routing as the HF path, graph bookkeeping,
state transactions, kernels, and the settings it refuses.

On CPU the engine's step runs eagerly (the same function a CUDA graph captures); ``graph_mode="emulate"``
runs the CUDA-graph bookkeeping (buckets, warm-up/capture transactions, replay) with eager re-execution.
Small buckets (8) make short requests cross bucket boundaries. GPU-only tests skip here.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oda_hf.compat import CACHE_ARG
from oda_hf import (
    OdaConfig,
    OdaForCausalLM,
    RandomPolicy,
    RecallHead,
    RecallHeadConfig,
    RoutingPolicy,
    SchedulePolicy,
)
from oda_hf.engine import (
    FastPathUnsupported,
    GraphKey,
    OdaStaticEngine,
    bucket_columns,
    bucket_index,
    fast_path_enabled,
    generate_fast,
)
from oda_hf.engine.graphs import STEP_PARTS, cuda_graph_conditionals_available
from oda_hf.kernels import commit_reference, kernels_interpreted
from tiny_models import left_padded_prompts, tiny_model

BUCKET = 8
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GRAPHS = pytest.mark.skipif(not cuda_graph_conditionals_available(),
                            reason="this torch cannot capture torch.cond as a CUDA-graph conditional node")
POLICIES = {"head": "head", "local": "local", "full": "full", "schedule": SchedulePolicy(1, 3),
            "random": RandomPolicy(0.4, seed=42)}


def make_model(family="qwen3", policy="head", sinks=2, window=4, **overrides):
    base = tiny_model(family, **overrides)
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    return OdaForCausalLM(base, head, OdaConfig(sinks=sinks, window=window, policy=policy))




GEN = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def hf_generate(model, ids, mask, **kwargs):
    out = model.generate(input_ids=ids, attention_mask=mask, **{**GEN, **kwargs})
    return out, model.routing


def engine_generate(engine, ids, mask, **kwargs):
    out = engine.generate(ids, attention_mask=mask, **{**GEN, **kwargs})
    return out, engine.routing


def assert_same(reference, got, logits_tol=1e-4):
    (ref_out, ref_routing), (out, routing) = reference, got
    assert torch.equal(ref_out.sequences, out.sequences)
    assert torch.equal(ref_routing.decisions, routing.decisions)
    assert torch.allclose(ref_routing.scores, routing.scores, atol=1e-5, equal_nan=True)
    assert torch.equal(ref_routing.finished_at, routing.finished_at)
    diff = max((a - b).abs().max().item() for a, b in zip(ref_out.logits, out.logits))
    assert diff <= logits_tol, diff


def state_copy(engine):
    return {name: t.clone() for name, t in engine.state.tensors().items()}


def assert_state_equal(before, engine):
    for name, tensor in engine.state.tensors().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0, equal_nan=True, msg=name)


# ------------------------------------------------------------------------------------------------
# Same tokens and routing as the HF path
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", list(POLICIES))
def test_engine_matches_hf_path(policy):
    model = make_model(policy=POLICIES[policy])
    ids, mask = left_padded_prompts()
    reference = hf_generate(model, ids, mask, max_new_tokens=20)
    engine = OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET)
    got = engine_generate(engine, ids, mask, max_new_tokens=20)
    assert_same(reference, got)
    # Prompt 9 + 19 routed steps: effective lengths 10..28 span buckets 2, 3 and 4.
    assert bucket_index(9 + 1, BUCKET) == 2 and bucket_index(9 + 19, BUCKET) == 4
    decisions = got[1].decisions
    if policy == "head":
        assert decisions.any() and not decisions.all()  # both branches exercised
        assert torch.equal(decisions, got[1].scores > 0)
    assert model.config._attn_implementation == "sdpa"  # restored after every step


class RowParity(RoutingPolicy):
    """A user policy with a per-row rule written once, in tensor ops: Full where step + row is even."""

    name = "parity"
    fast_path = True

    def decide(self, scores, step, batch_size, device):
        step = torch.as_tensor(step, device=device).reshape(1)
        return torch.remainder(step + torch.arange(batch_size, device=device), 2) == 0


def test_a_policy_owns_its_rule_on_both_paths():
    # The engine calls the policy's own decide (no per-type copy of the rule), so a new policy runs there too.
    model = make_model(policy=RowParity())
    ids, mask = left_padded_prompts()
    reference = hf_generate(model, ids, mask, max_new_tokens=12)
    engine = OdaStaticEngine(model, max_length=21, batch_size=2, bucket_size=BUCKET)
    got = engine_generate(engine, ids, mask, max_new_tokens=12)
    assert_same(reference, got)
    decisions = got[1].decisions
    assert torch.equal(decisions[0], ~decisions[1]) and decisions[0, 1] and not decisions[0, 0]


def test_engine_does_not_import_modeling():
    # modeling imports the engine (generate(oda_fast=True)); the engine must not import modeling back.
    code = "import sys, oda_hf.engine.engine; assert 'oda_hf.modeling' not in sys.modules, 'modeling imported'"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("policy", ["head", "schedule"])
def test_engine_matches_hf_path_families(family, policy):
    model = make_model(family, policy=POLICIES[policy])
    ids, mask = left_padded_prompts()
    reference = hf_generate(model, ids, mask, max_new_tokens=14)
    engine = OdaStaticEngine(model, max_length=23, batch_size=2, bucket_size=BUCKET)
    assert_same(reference, engine_generate(engine, ids, mask, max_new_tokens=14))


@pytest.mark.parametrize("policy,sliding_window", [(policy, 5) for policy in POLICIES] + [("head", 12), ("full", 1)])
def test_engine_matches_hf_path_gemma3(policy, sliding_window):
    """Gemma 3's window-global pattern: Local restricts the global layers, the sliding layers keep their native window
    in both passes. Window 5 slides inside the prompt; 12 holds row 0's left padding for the first steps; 1 sees
    only the current token."""
    model = make_model("gemma3", policy=POLICIES[policy], sliding_window=sliding_window)
    ids, mask = left_padded_prompts()
    reference = hf_generate(model, ids, mask, max_new_tokens=20)
    engine = OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET)
    got = engine_generate(engine, ids, mask, max_new_tokens=20)
    assert_same(reference, got)
    if policy == "head":
        assert got[1].decisions.any() and not got[1].decisions.all()


def test_engine_matches_hf_path_qwen2_with_sliding_layers():
    """Qwen2's sliding-window configuration (a window-global pattern of its own) runs the same way."""
    model = make_model("qwen2", policy="head", use_sliding_window=True, sliding_window=6,
                       layer_types=["sliding_attention", "full_attention"])
    ids, mask = left_padded_prompts()
    engine = OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET)
    assert engine.windows == (6, None)
    assert_same(hf_generate(model, ids, mask, max_new_tokens=20), engine_generate(engine, ids, mask, max_new_tokens=20))


@pytest.mark.parametrize("conditional", ["cond", "host"])
def test_gemma3_graph_bookkeeping_matches_eager_bitwise(conditional):
    """The sliding layers' window masks are step inputs of the Full branch (torch.cond operands, or tensors the
    captured parts hand on): a graph-run Gemma step equals the eager one (bitwise with split parts; torch.cond runs
    the Full branch as a dynamo-traced graph, whose float operations may be ordered differently)."""
    model = make_model("gemma3", policy="head")
    ids, mask = left_padded_prompts()
    expected = engine_generate(OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET), ids, mask,
                               max_new_tokens=20)
    graphed = OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET, graph_mode="emulate",
                              conditional=conditional)
    got = engine_generate(graphed, ids, mask, max_new_tokens=20)
    assert_same(expected, got, logits_tol=0.0 if conditional == "host" else 1e-6)
    assert got[1].decisions.any() and not got[1].decisions.all()  # both branches taken


@pytest.mark.parametrize("sinks,window", [(0, 4), (2, 1), (4, 2)])
def test_edge_geometries_and_wraparounds(sinks, window):
    model = make_model("llama", policy=RandomPolicy(0.3, seed=43), sinks=sinks, window=window)
    ids, mask = left_padded_prompts(length=7, pads=(2, 0))
    reference = hf_generate(model, ids, mask, max_new_tokens=24)
    for kernels in ("sdpa", "reference"):
        engine = OdaStaticEngine(model, max_length=31, batch_size=2, bucket_size=BUCKET, kernels=kernels)
        assert_same(reference, engine_generate(engine, ids, mask, max_new_tokens=24))


def test_sampling_matches_hf_path():
    model = make_model(policy=SchedulePolicy(2, 5))
    ids, mask = left_padded_prompts()
    sampling = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, max_new_tokens=16)
    torch.manual_seed(7)
    reference = hf_generate(model, ids, mask, **sampling)
    engine = OdaStaticEngine(model, max_length=25, batch_size=2, bucket_size=BUCKET)
    torch.manual_seed(7)
    assert_same(reference, engine_generate(engine, ids, mask, **sampling))


def test_eos_stops_rows_like_hf_path():
    model = make_model(policy="head")
    ids, mask = left_padded_prompts()
    free, _ = hf_generate(model, ids, mask, max_new_tokens=16)
    eos = int(free.sequences[0, ids.shape[1] + 3])  # row 0 emits it as its 4th token
    reference = hf_generate(model, ids, mask, max_new_tokens=16, eos_token_id=eos)
    engine = OdaStaticEngine(model, max_length=25, batch_size=2, bucket_size=BUCKET)
    got = engine_generate(engine, ids, mask, max_new_tokens=16, eos_token_id=eos)
    assert_same(reference, got)
    assert 0 <= got[1].finished_at[0] <= 3 and torch.equal(reference[1].steps_per_row, got[1].steps_per_row)


def test_load_history_then_steps_match_hf_path():
    """The benchmark's protocol: KV from a stock prefill, forced continuation, token-by-token steps."""
    model = make_model(policy=SchedulePolicy(1, 4, run_head=True))
    ids, _ = left_padded_prompts(batch=1, pads=(0,))
    with torch.no_grad():
        stock = model.base_model(input_ids=ids, use_cache=True, output_hidden_states=True)
    history = [(layer.keys, layer.values) for layer in getattr(stock, CACHE_ARG).layers]
    last_hidden = stock.hidden_states[-1][:, -1]
    continuation = torch.randint(3, 97, (12,), generator=torch.Generator().manual_seed(5))

    cache = model.new_cache(max_cache_len=ids.shape[1] + 13)
    cache.load_history(history)
    model.begin_request(cache, last_hidden)
    engine = OdaStaticEngine(model, max_length=ids.shape[1] + 13, batch_size=1, bucket_size=BUCKET)
    engine.load_history(history, last_hidden, max_steps=12)
    with torch.no_grad():
        for token in continuation:
            expected = model(input_ids=token.view(1, 1), past_key_values=cache).logits[:, -1]
            assert torch.allclose(engine.step(token.view(1)), expected, atol=1e-4)
    assert torch.equal(engine.routing.decisions, model.routing.decisions)
    assert torch.allclose(engine.routing.scores, model.routing.scores, atol=1e-5)


def test_load_history_with_left_padding_matches_prefill():
    """`load_history(..., attention_mask=)` with left-padded rows continues like `prefill(ids, mask)`: padding
    columns are neither attended nor counted (taking every loaded column as valid changed the logits by 0.47)."""
    model = make_model("llama", policy=SchedulePolicy(1, 2), sinks=2, window=3)
    ids, mask = left_padded_prompts(pads=(0, 5))  # prompts of 9 and 4 tokens
    prefilled = OdaStaticEngine(model, max_length=30, batch_size=2, bucket_size=BUCKET)
    loaded = OdaStaticEngine(model, max_length=30, batch_size=2, bucket_size=BUCKET)
    tokens = prefilled.prefill(ids, mask, max_new_tokens=13).argmax(-1)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        stock = model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                 output_hidden_states=True)
    history = [(layer.keys, layer.values) for layer in getattr(stock, CACHE_ARG).layers]
    loaded.load_history(history, stock.hidden_states[-1][:, -1], attention_mask=mask, max_steps=12)
    for _ in range(12):
        expected = prefilled.step(tokens)
        torch.testing.assert_close(loaded.step(tokens), expected, atol=1e-4, rtol=1e-4)
        tokens = expected.argmax(-1)
    assert torch.equal(loaded.routing.decisions, prefilled.routing.decisions)
    assert torch.equal(loaded.state.valid_count, prefilled.state.valid_count)


# ------------------------------------------------------------------------------------------------
# Buckets, graphs (emulated on CPU), state transactions, requests
# ------------------------------------------------------------------------------------------------
def test_bucket_keys():
    assert [bucket_index(n, 128) for n in (1, 127, 128, 129, 256, 257)] == [1, 1, 1, 2, 2, 3]
    assert bucket_columns(2, 8, 40) == 16 and bucket_columns(5, 8, 36) == 36
    model = make_model()
    engine = OdaStaticEngine(model, max_length=30, batch_size=2, bucket_size=BUCKET, graph_mode="emulate")
    assert engine.capacity == 32  # max_length rounded up to whole buckets
    ids, mask = left_padded_prompts()
    engine.prefill(ids, mask, max_new_tokens=20)
    plan = engine.graph_key().plan
    assert engine.graph_key() == GraphKey(2, plan)  # 9 committed columns: L = 10
    assert [engine.graph_key(n).bucket for n in (15, 16, 23, 24)] == [2, 3, 3, 4]


def test_emulated_graphs_match_eager_bitwise_and_reuse_buckets():
    model = make_model(policy="head")
    ids, mask = left_padded_prompts()
    eager = OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET)
    graphed = OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET, graph_mode="emulate")
    expected = engine_generate(eager, ids, mask, max_new_tokens=20)
    got = engine_generate(graphed, ids, mask, max_new_tokens=20)
    assert_same(expected, got, logits_tol=0.0)  # warm-ups and captures left no trace
    plan = graphed.graph_key().plan
    assert graphed.graphs.captures == [GraphKey(b, plan) for b in (2, 3, 4)]
    # Steps at committed lengths 9..27: L = n + 1 falls in buckets 2 (7 steps), 3 (8) and 4 (4).
    assert [graphed.graphs.replays[key] for key in graphed.graphs.captures] == [7, 8, 4]
    engine_generate(graphed, ids, mask, max_new_tokens=20)  # a second request reuses the graphs
    assert len(graphed.graphs.captures) == 3 and graphed.graphs.replays[GraphKey(2, plan)] == 14


@pytest.mark.parametrize("policy", list(POLICIES))
def test_host_split_graphs_match_eager_bitwise(policy):
    """conditional="host" (CUDA graphs on torch < 2.13): a branching step is three graphs per bucket (route, full,
    finish) with the decision read on the host between them, and the Full graph replays only on steps where a row
    recalls. Always-Full and always-Local steps do not branch: one graph each, as with conditional nodes."""
    model = make_model(policy=POLICIES[policy])
    ids, mask = left_padded_prompts()
    expected = engine_generate(OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET), ids, mask,
                               max_new_tokens=20)
    split = OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET, graph_mode="emulate",
                            conditional="host")
    got = engine_generate(split, ids, mask, max_new_tokens=20)
    assert_same(expected, got, logits_tol=0.0)
    assert_same(hf_generate(model, ids, mask, max_new_tokens=20), got)
    plan, replays = split.graph_key().plan, split.graphs.replays
    if policy in ("full", "local"):
        assert split.graphs.captures == [GraphKey(b, plan) for b in (2, 3, 4)]
        return
    assert split.graphs.captures == [GraphKey(b, plan, part) for b in (2, 3, 4) for part in STEP_PARTS]
    for part in ("route", "finish"):  # steps at committed lengths 9..27: 7, 8 and 4 per bucket
        assert [replays[GraphKey(b, plan, part)] for b in (2, 3, 4)] == [7, 8, 4]
    recalled = got[1].decisions.any(0)
    assert 0 < int(recalled.sum()) < 19  # both ways taken
    steps_per_bucket = torch.tensor([7, 8, 4]).cumsum(0).tolist()
    per_bucket = [int(part.sum()) for part in torch.tensor_split(recalled, steps_per_bucket[:-1])]
    assert [replays[GraphKey(b, plan, "full")] for b in (2, 3, 4)] == per_bucket


@pytest.mark.parametrize("conditional", ["eager", "host"])
@pytest.mark.parametrize("policy,sinks,window", [("head", 2, 4), ("full", 2, 4), ("local", 2, 1), ("head", 0, 3)])
def test_warm_up_and_capture_leave_state_bit_identical(policy, sinks, window, conditional):
    model = make_model(policy=policy, sinks=sinks, window=window)
    ids, mask = left_padded_prompts()
    engine = OdaStaticEngine(model, max_length=40, batch_size=2, bucket_size=BUCKET, graph_mode="emulate",
                             conditional=conditional)
    twin = OdaStaticEngine(model, max_length=40, batch_size=2, bucket_size=BUCKET)
    tokens = engine.prefill(ids, mask, max_new_tokens=30).argmax(-1)
    twin.prefill(ids, mask, max_new_tokens=30)
    for _ in range(3):  # some ring content and routing record first
        engine.step(tokens)
        tokens = twin.step(tokens).argmax(-1)
    engine.state.input_ids.copy_(tokens[:, None])
    before, length, steps = state_copy(engine), engine.length, engine.routed_steps
    engine._capture(GraphKey(5, engine.graph_key().plan))  # a future bucket, captured at today's length
    assert engine.capture_buckets(length + 20)  # and every bucket up to a final length
    assert_state_equal(before, engine)
    assert (engine.length, engine.routed_steps) == (length, steps)
    assert torch.equal(engine.step(tokens), twin.step(tokens))  # the history did not move


def test_reset_between_requests_forgets_the_previous_one():
    model = make_model(policy=RandomPolicy(0.5, seed=44))
    first, first_mask = left_padded_prompts(seed=11, pads=(0, 5))
    ids, mask = left_padded_prompts()
    used = OdaStaticEngine(model, max_length=40, batch_size=2, bucket_size=BUCKET, graph_mode="emulate")
    engine_generate(used, first, first_mask, max_new_tokens=30)
    fresh = OdaStaticEngine(model, max_length=40, batch_size=2, bucket_size=BUCKET, graph_mode="emulate")
    assert_same(engine_generate(fresh, ids, mask, max_new_tokens=20),
                engine_generate(used, ids, mask, max_new_tokens=20), logits_tol=0.0)
    assert_same(hf_generate(model, ids, mask, max_new_tokens=20), engine_generate(used, ids, mask, max_new_tokens=20))
    used.reset()
    assert used.length == 0 and int(used.state.cache_keys.abs().sum()) == 0


def test_a_reused_engine_forgets_the_previous_requests_padding():
    """Request 1 left-pads row 1 by 9 columns; request 2's prompt is 4 wide, so its decode tokens land in columns
    that were padding before. Always Full: they must be attended (still marked padding, they changed row 1's tokens
    from its third new one)."""
    model = make_model(policy="full", sinks=2, window=3)
    engine = OdaStaticEngine(model, max_length=40, batch_size=2, bucket_size=BUCKET)
    first, first_mask = left_padded_prompts(length=12, pads=(0, 9), seed=1)  # prompts of 12 and 3 tokens
    engine_generate(engine, first, first_mask, max_new_tokens=6)
    ids, mask = left_padded_prompts(length=4, pads=(0, 0), seed=2)
    assert_same(hf_generate(model, ids, mask, max_new_tokens=12), engine_generate(engine, ids, mask, max_new_tokens=12))


def test_a_row_stopped_by_eos_decodes_again_in_the_next_request():
    """Request 1 stops row 0 at an EOS (finished rows take Local); request 2 on the same engine has no EOS, so
    row 0 decodes (and recalls) again like the HF path's (kept as finished, it took Local on every step)."""
    model = make_model(policy=SchedulePolicy(1, 2), sinks=2, window=3)
    engine = OdaStaticEngine(model, max_length=40, batch_size=2, bucket_size=BUCKET)
    ids, mask = left_padded_prompts(pads=(0, 0), seed=4)
    free, _ = hf_generate(model, ids, mask, max_new_tokens=10)
    eos = int(free.sequences[0, ids.shape[1] + 1])  # row 0's 2nd new token
    stopped = engine_generate(engine, ids, mask, max_new_tokens=10, eos_token_id=eos)
    assert stopped[1].finished_at.tolist() == [1, -1]  # row 1 ran on
    assert_same(hf_generate(model, ids, mask, max_new_tokens=12), engine_generate(engine, ids, mask, max_new_tokens=12))


def test_torch_cond_reaches_a_control_flow_dispatch_mode():
    """`conditional="cond"`: torch.cond traces both branches with dynamo and, under a dispatch mode that
    intercepts it (as torch's CUDA-graph capture mode does, turning it into IF nodes), hands the mode
    the traced branches. This stand-in mode runs the selected one; results must match the HF path."""

    class ControlFlowMode(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls):
            return True

        def __init__(self):
            super().__init__()
            self.supports_higher_order_operators = True
            self.branches = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.higher_order.cond:
                pred, true_fn, false_fn, operands = args
                self.branches.append((type(true_fn).__name__, type(false_fn).__name__))
                with self:
                    return true_fn(*operands) if bool(pred) else false_fn(*operands)
            return func(*args, **(kwargs or {}))

    model = make_model(policy="head")
    ids, mask = left_padded_prompts()
    reference = hf_generate(model, ids, mask, max_new_tokens=12)
    engine = OdaStaticEngine(model, max_length=21, batch_size=2, bucket_size=BUCKET, graph_mode="emulate",
                             conditional="cond")
    mode = ControlFlowMode()
    run_step = engine._run_step

    def run_step_under_mode(key, force=None):
        with mode:
            run_step(key, force)

    engine._run_step = run_step_under_mode
    assert_same(reference, engine_generate(engine, ids, mask, max_new_tokens=12))
    assert mode.branches and set(mode.branches) == {("GraphModule", "GraphModule")}


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
TRITON_CPU = pytest.mark.skipif(not kernels_interpreted(), reason="needs Triton with TRITON_INTERPRET=1 before import")


@pytest.mark.parametrize("family,baseline,kernels", [
    pytest.param("qwen3", "reference", "triton", marks=TRITON_CPU),
    ("qwen3", "reference", "sdpa"),
    pytest.param("gemma3", "reference", "triton", marks=TRITON_CPU),
    ("gemma3", "reference", "sdpa")])
def test_kernel_backends_agree(family, baseline, kernels):
    """The direct-ring Triton kernels (interpreted on CPU; the Full kernel with tl.dot, its default) and the SDPA
    backend against the PyTorch reference (Gemma 3: on its global layers, beside sliding layers and the fused commit
    of every layer). The elementwise Full kernel (`full_dot=False`): test_full_dot_false_reaches_the_full_kernel."""
    model = make_model(family, policy="head")
    ids, mask = left_padded_prompts()
    runs = {}
    for backend in (baseline, kernels):
        engine = OdaStaticEngine(model, max_length=17, batch_size=2, bucket_size=BUCKET, kernels=backend)
        assert engine.kernels == backend
        if backend == "triton":
            assert engine.full.use_dot  # tl.dot unless turned off
        runs[backend] = (engine_generate(engine, ids, mask, max_new_tokens=8), state_copy(engine))
    assert_same(runs[baseline][0], runs[kernels][0], logits_tol=1e-5)
    for name, tensor in runs[baseline][1].items():
        torch.testing.assert_close(runs[kernels][1][name], tensor, atol=1e-5, rtol=1e-5, equal_nan=True, msg=name)


@TRITON_CPU
def test_full_dot_false_reaches_the_full_kernel(monkeypatch):
    """`full_dot=False` selects the elementwise Full kernel, whose numbers test_kernels.py checks against the
    reference; here, that the engine's Full pass is what passes it (both attention kernels replaced by recorders that
    return the references, so nothing is interpreted: the end-to-end interpreted run above takes about a minute)."""
    from oda_hf.engine import attention
    from oda_hf.kernels import full_attention_decode_reference, local_attention_decode_reference

    seen = []

    def full(query, keys, values, valid, position, scale, *, out, scratch, use_dot):
        seen.append(use_dot)
        return full_attention_decode_reference(query, keys, values, valid, position, scale)

    def local(*args, out, scratch):
        return local_attention_decode_reference(*args)

    monkeypatch.setattr(attention, "full_attention_decode", full)
    monkeypatch.setattr(attention, "local_attention_decode", local)
    model = make_model("qwen3", policy="full")
    ids, mask = left_padded_prompts()
    for full_dot, expected in ((False, False), (None, True)):
        seen.clear()
        engine = OdaStaticEngine(model, max_length=17, batch_size=2, bucket_size=BUCKET, kernels="triton",
                                 full_dot=full_dot)
        engine_generate(engine, ids, mask, max_new_tokens=3)
        assert seen and set(seen) == {expected}


@pytest.mark.parametrize("sinks,window", [(2, 4), (0, 3), (2, 1)])
@pytest.mark.parametrize("with_full", [True, False])
def test_state_commit_matches_kernel_reference(sinks, window, with_full):
    from oda_hf.engine.state import EngineState

    g = torch.Generator().manual_seed(0)
    state = EngineState.allocate(layers=2, batch=3, kv_heads=2, head_dim=4, head_dim_v=4, hidden=8, capacity=16,
                                 sinks=sinks, window=window, dtype=torch.float32, device=torch.device("cpu"))
    for t in (state.cache_keys, state.cache_values, state.ws_keys, state.ws_values, state.full_keys, state.full_values):
        t.copy_(torch.randn(t.shape, generator=g))
    state.cache_position.fill_(9)
    state.valid_count.copy_(torch.tensor([9, 1, 6]))
    select = torch.tensor([True, False, True])
    expected = {name: t.clone() for name, t in state.tensors().items()}
    commit_reference(expected["cache_keys"], expected["cache_values"], expected["ws_keys"], expected["ws_values"],
                     expected["ws_keys"][:, :, :, -1:].clone(), expected["ws_values"][:, :, :, -1:].clone(),
                     expected["full_keys"] if with_full else None, expected["full_values"] if with_full else None,
                     select, 9, expected["valid_count"], sinks, window, full_already_written=False)
    state.commit(select, with_full, sinks, window)
    committed = sinks + window - 1  # the current slot is scratch, overwritten by the next Local attempt
    for name in ("cache_keys", "cache_values"):
        assert torch.equal(getattr(state, name), expected[name]), name
    for name in ("ws_keys", "ws_values"):
        assert torch.equal(getattr(state, name)[:, :, :, :committed], expected[name][:, :, :, :committed]), name


@pytest.mark.parametrize("sinks,window", [(2, 4), (0, 3), (2, 1), (1, 2)])
def test_state_load_prefix_writes_each_workspace_slot_once_with_its_position(sinks, window):
    """Sinks: each row's first `sinks` valid positions; ring: its last ``window - 1`` (a prompt longer than the
    workspace, one shorter, left padding). Each (row, slot) is written once: on CUDA the order of duplicate
    ``index_put`` writes is undefined, so keeping one position too many (``window`` rather than ``window - 1``) would
    leave either position in the ring, while on the CPU the last write wins and the content alone looks right."""
    from oda_hf.engine.state import EngineState

    class IndexPutSpy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.writes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
                self.writes.append(args[1])
            return func(*args, **(kwargs or {}))

    columns = 12
    valid = torch.ones(3, columns, dtype=torch.bool)
    valid[1, :9] = False    # 3 valid positions: shorter than the workspace
    valid[2, :4] = False    # 8 valid positions after padding
    state = EngineState.allocate(layers=1, batch=3, kv_heads=1, head_dim=1, head_dim_v=1, hidden=2, capacity=16,
                                 sinks=sinks, window=window, dtype=torch.float32, device=torch.device("cpu"))
    state.cache_keys[0, :, 0, :columns, 0] = torch.arange(columns, dtype=torch.float32)  # key = its column
    state.ws_keys.fill_(-1.0)
    spy = IndexPutSpy()
    with spy:
        state.load_prefix(valid, sinks, window)
    assert len(spy.writes) == 2   # keys and values
    for indices in spy.writes:
        rows, slots = indices[1], indices[3]
        pairs = list(zip(rows.tolist(), slots.tolist()))
        assert len(pairs) == len(set(pairs)), f"a workspace slot written twice: {sorted(pairs)}"
    for row in range(3):
        kept_columns = valid[row].nonzero().flatten().tolist()
        expected = kept_columns[:sinks] + kept_columns[sinks:][-(window - 1):] if window > 1 else kept_columns[:sinks]
        got = state.ws_keys[0, row, 0, : sinks + window - 1, 0]
        assert sorted(v for v in got.tolist() if v >= 0) == sorted(expected), f"row {row}"
    assert state.valid_count.tolist() == valid.sum(dim=1).tolist() and state.cache_position.item() == columns


# ------------------------------------------------------------------------------------------------
# What the fast path refuses, the opt-in and the kill switch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,overrides", [("qwen3_5", {}), ("gemma4", {}),
                                              ("gemma3", {"attn_logit_softcapping": 50.0}),
                                              ("gemma3", {"sliding_window": 0})])
def test_models_the_engine_cannot_run_are_refused_with_a_pointer_to_the_hf_path(family, overrides):
    with pytest.raises(FastPathUnsupported, match="HF path") as refused:
        OdaStaticEngine(make_model(family, **overrides), max_length=16, batch_size=1)
    # Gemma 4's layers that reuse another's keys and values by what they do (transformers' cache calls them "dummy")
    assert "dummy" not in str(refused.value) and ("KV-sharing" in str(refused.value)) == (family == "gemma4")


def test_unsupported_settings_raise_clearly():
    model = make_model(policy="head")
    ids, mask = left_padded_prompts()
    engine = OdaStaticEngine(model, max_length=20, batch_size=2, bucket_size=BUCKET)
    for kwargs in (dict(num_beams=2), dict(no_repeat_ngram_size=2), dict(max_time=5.0),
                   dict(logits_processor=[lambda input_ids, scores: scores]), dict(streamer=object())):
        with pytest.raises(FastPathUnsupported, match="not supported by the fast path"):
            engine.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, **kwargs)
    # Each setting the engine would otherwise ignore (extra sequences, no cache, attentions or hidden states it does
    # not return, stop strings or a cache it does not use, an argument generate() does not know) is refused by name.
    for kwargs, name in ((dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
                         (dict(use_cache=False), "use_cache=False"),
                         (dict(output_attentions=True), "output_attentions"),
                         (dict(output_hidden_states=True), "output_hidden_states"),
                         (dict(stop_strings=["w5"]), "stop_strings"), (dict(token_healing=True), "token_healing"),
                         (dict(cache_implementation="static"), "cache_implementation='static'"),
                         (dict(bogus_kwarg=1), "bogus_kwarg")):
        with pytest.raises(FastPathUnsupported, match="not supported by the fast path") as refused:
            engine.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, **kwargs)
        assert name in str(refused.value), (name, str(refused.value))
    with pytest.raises(ValueError, match="batch_size=2"):
        engine.generate(ids[:1], max_new_tokens=4, pad_token_id=0)
    right_padded = mask.flip(1)
    with pytest.raises(ValueError, match="left padding"):
        engine.generate(ids, attention_mask=right_padded, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="capacity"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0)
    with pytest.raises(ValueError, match="full_dot selects a variant of the Triton Full kernel"):
        OdaStaticEngine(model, max_length=20, batch_size=2, bucket_size=BUCKET, kernels="sdpa", full_dot=True)
    with pytest.raises(TypeError, match="full_dot must be None"):
        OdaStaticEngine(model, max_length=20, batch_size=2, bucket_size=BUCKET, full_dot="yes")
    engine.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(RuntimeError, match="started for 3 routed steps"):  # the request's planned steps are done
        engine.step(ids[:, -1])

    class EveryOther(RoutingPolicy):
        def decide(self, scores, step, batch_size, device):
            return torch.full((batch_size,), step % 2 == 0, device=device)

    model.set_routing(policy=EveryOther())
    with pytest.raises(FastPathUnsupported, match="EveryOther"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)

    class FirstKFull(RoutingPolicy):
        """A device counter reset per request: the engine ran its rule on in-window steps too and never reset it
        (measured: decisions [0]*7 where the HF path made [1, 1, 1, 0, 0, 0, 0], and a second request differed)."""
        fast_path = True

        def __init__(self):
            self.calls = torch.zeros(1, dtype=torch.long)

        def reset(self):
            self.calls.zero_()

        def decide(self, scores, step, batch_size, device):
            self.calls += 1
            return (self.calls <= 3).repeat(batch_size)

    model.set_routing(policy=FirstKFull())
    with pytest.raises(FastPathUnsupported, match="keeps per-request state .it defines reset."):
        engine.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)


def test_generate_fast_and_the_kill_switch(monkeypatch):
    model = make_model(policy=SchedulePolicy(1, 2))
    ids, mask = left_padded_prompts()
    reference = hf_generate(model, ids, mask, max_new_tokens=10)
    got = generate_fast(model, ids, attention_mask=mask, max_new_tokens=10, **GEN)
    assert_same(reference, (got, model.routing))
    engine = model.__dict__["_oda_static_engine"]
    generate_fast(model, ids, attention_mask=mask, max_new_tokens=6, **GEN)
    assert model.__dict__["_oda_static_engine"] is engine  # reused while it fits
    assert fast_path_enabled()
    monkeypatch.setenv("ODA_DISABLE_FAST_PATH", "1")
    assert not fast_path_enabled()
    with pytest.raises(FastPathUnsupported, match="ODA_DISABLE_FAST_PATH"):
        OdaStaticEngine(model, max_length=16, batch_size=1)


def test_model_generate_oda_fast(monkeypatch):
    model = make_model(policy="head")
    ids, mask = left_padded_prompts()
    reference = hf_generate(model, ids, mask, max_new_tokens=10)
    fast = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, oda_fast=True, **GEN)
    assert_same(reference, (fast, model.routing))
    monkeypatch.setenv("ODA_DISABLE_FAST_PATH", "1")  # falls back to the HF path: same results
    fallback = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, oda_fast=True, **GEN)
    assert_same(reference, (fallback, model.routing), logits_tol=0.0)
    monkeypatch.delenv("ODA_DISABLE_FAST_PATH")
    with pytest.raises(FastPathUnsupported, match="beam"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2, oda_fast=True)


def test_model_generate_oda_fast_default_length():
    """Without max_new_tokens or max_length, generate()'s default length (20) counts new tokens after the prompt on
    both paths (counted from the start, the fast path would return 11 new tokens here)."""
    model = make_model(policy="head")
    ids, mask = left_padded_prompts()
    reference = hf_generate(model, ids, mask)
    fast = model.generate(input_ids=ids, attention_mask=mask, oda_fast=True, **GEN)
    assert reference[0].sequences.shape == fast.sequences.shape == (2, ids.shape[1] + 20)
    assert_same(reference, (fast, model.routing))


def run_engine_benchmark(tmp_path, *arguments) -> list[dict]:
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "engine_throughput.py")
    done = subprocess.run(
        [sys.executable, script, *arguments, "--lengths", "96", "--steps", "4", "--runs", "2", "--threads", "1",
         "--output", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(tmp_path.glob("engine_*.json")).read_text())


def test_benchmark_script_tiny(tmp_path):
    rows = run_engine_benchmark(tmp_path, "--tiny", "--methods", "native-full,native-static,engine-12.5",
                                "--window", "32", "--bucket-size", "16")
    assert [r["method"] for r in rows] == ["native-full", "native-static", "engine-12.5"]
    # the schedule's 2 Full steps of 16 fall in the 4 warm-up steps: none of the 8 measured (and timed) ones recalls
    # (the rate had been the record's over all 12 steps, 2/12, beside times of the measured steps alone)
    assert rows[2]["full_call_rate"] == 0.0 and all(t > 0 for t in rows[2]["throughput"])
    assert all(r["bytes_limit_ms"] > 0 for r in rows)
    # one bandwidth for every row (the best measured), not each worker's own
    best = max(r["bandwidth_bytes_per_s"] for r in rows)
    assert all(r["bytes_limit_ms"] == pytest.approx(1000 * r["step_bytes"] / best) for r in rows)
    fastest_stock = max(r["median"] for r in rows[:2])
    assert rows[2]["vs_best_stock"] == pytest.approx(rows[2]["median"] / fastest_stock)


def test_benchmark_defaults_run_stocks_static_cache_beside_the_engine():
    """"vs best stock" divides by the fastest stock arm that ran: the CPU default ran stock's dynamic cache alone, the
    slowest stock choice at long context (a 12.3x "vs best stock" where stock static is several times faster)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from engine_throughput import DEFAULT_METHODS, HYBRID_METHODS

    for methods in (*DEFAULT_METHODS.values(), *HYBRID_METHODS.values()):
        assert "native-static" in methods.split(","), methods


def test_benchmark_bytes_limit_counts_passes_and_kv():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from engine_throughput import step_bytes

    model = tiny_model("llama")  # fp32, untied output matrix
    config = model.config
    output = model.lm_head.weight.numel() * 4
    decoder = sum(p.numel() for p in model.model.parameters()) * 4 - model.model.embed_tokens.weight.numel() * 4
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert step_bytes(model, 1000, 4, 60, 1.0, runs_local=False) == decoder + output + kv * 1000
    assert step_bytes(model, 1000, 4, 60, 0.0, runs_local=True) == decoder + output + kv * 64
    assert step_bytes(model, 1000, 4, 60, 0.25, runs_local=True) == 1.25 * decoder + output + kv * (64 + 250)
    assert step_bytes(model, 1000, 4, 60, 0.25, runs_local=True, batch=3) == \
        1.25 * decoder + output + 3 * kv * (64 + 250)  # weights once per pass, every row's KV
    hybrid = tiny_model("gemma3", sliding_window=100)  # layers: sliding, global, sliding, global; tied output
    output = hybrid.lm_head.weight.numel() * 4
    decoder = sum(p.numel() for p in hybrid.model.parameters()) * 4 - output
    kv_layer = 2 * hybrid.config.num_key_value_heads * hybrid.config.head_dim * 4
    assert step_bytes(hybrid, 1000, 4, 60, 1.0, runs_local=False) == decoder + output + kv_layer * (2 * 100 + 2 * 1000)
    assert step_bytes(hybrid, 1000, 4, 60, 0.25, runs_local=True) == pytest.approx(
        1.25 * decoder + output + kv_layer * (2 * 1.25 * 100 + 2 * (64 + 250)))  # a sliding layer reads W per pass


def test_benchmark_script_batch_and_independent_rows(tmp_path):
    """--batch decodes several rows; with rows recalling independently (engine-random-*) the Full pass runs on
    every step where any row recalls, which the table reports beside the per-row rate."""
    rows = run_engine_benchmark(tmp_path, "--tiny", "--batch", "3", "--methods",
                                "native-full,engine-full,engine-12.5,engine-random-25", "--window", "16",
                                "--bucket-size", "16")
    assert [r["batch"] for r in rows] == [3] * 4 and rows[0]["method"] == "native-full"
    schedule, independent = rows[2], rows[3]
    assert schedule["full_call_rate"] == schedule["full_pass_rate"] == 0.0  # (its Full steps: in the warm-up)
    assert independent["full_pass_rate"] >= independent["full_call_rate"] > 0
    assert next(tmp_path.glob("engine_*.md")).name == "engine_tiny_cpu_b3.md"
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "engine_throughput.py")
    done = subprocess.run([sys.executable, script, "--tiny", "--batch", "2", "--methods", "native-full,hf-oda-local"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "the hf-oda-* arms drive one row" in done.stderr


def test_benchmark_script_hybrid_runs_the_engine_and_the_hf_path(tmp_path):
    """A window-global hybrid (Gemma 3 shapes) runs on the engine beside the HF path."""
    rows = run_engine_benchmark(tmp_path, "--model", "tiny-hybrid", "--methods", "native-full,hf-oda-local,engine-12.5",
                                "--window", "16", "--bucket-size", "16")
    assert [r["method"] for r in rows] == ["native-full", "hf-oda-local", "engine-12.5"]
    assert rows[1]["full_call_rate"] == 0.0 and rows[2]["full_call_rate"] == 0.0   # (Full only in the warm-up)


# ------------------------------------------------------------------------------------------------
# GPU (skipped here: no GPU in this project)
# ------------------------------------------------------------------------------------------------
@GPU
@pytest.mark.parametrize("graph_mode,conditional,full_dot", [pytest.param("cuda", "cond", None, marks=GRAPHS),
                                                             ("cuda", "host", None), ("cuda", "host", False),
                                                             ("eager", "eager", None)])
@pytest.mark.parametrize("policy", ["head", "schedule", "full", "local"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_cuda_graph_engine_matches_hf_path(policy, graph_mode, conditional, full_dot, family):
    model = make_model(family, policy=POLICIES[policy]).cuda()
    ids, mask = (t.cuda() for t in left_padded_prompts())
    reference = hf_generate(model, ids, mask, max_new_tokens=20)
    engine = OdaStaticEngine(model, max_length=29, batch_size=2, bucket_size=BUCKET, graph_mode=graph_mode,
                             conditional=conditional, full_dot=full_dot)
    assert engine.graph_mode == graph_mode and engine.kernels == "triton"
    got = engine_generate(engine, ids, mask, max_new_tokens=20)
    assert_same(reference, got, logits_tol=1e-3)
    if graph_mode == "cuda":
        split = conditional == "host" and policy in ("head", "schedule")  # the policies whose steps branch
        graphs_per_bucket = len(STEP_PARTS) if split else 1
        assert len(engine.graphs) == 3 * graphs_per_bucket
        steps = [n for key, n in engine.graphs.replays.items() if key.part in ("step", "route")]
        assert sum(steps) == 19


def test_graph_mode_without_conditional_nodes(monkeypatch):
    """A torch without CUDA-graph conditional nodes (2.11): graphs still, with the branch read on the host;
    asking for torch.cond there is refused by name, and a Python if inside a captured graph is refused."""
    from oda_hf.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "cuda_graph_conditionals_available", lambda: False)
    engine = OdaStaticEngine.__new__(OdaStaticEngine)  # only the mode checks: no CUDA model to build here
    engine.device, engine.model = torch.device("cuda"), make_model(policy="head")
    engine.graph_mode = engine._resolve_graph_mode("auto")
    assert engine.graph_mode == "cuda" and engine._resolve_conditional("auto") == "host"
    with pytest.raises(FastPathUnsupported, match="conditional node.*conditional='host'"):
        engine._resolve_conditional("cond")
    with pytest.raises(ValueError, match="Python if"):
        engine._resolve_conditional("eager")
    monkeypatch.setattr(engine_module, "cuda_graph_conditionals_available", lambda: True)
    assert engine._resolve_conditional("auto") == "cond"
    engine.graph_mode = "eager"
    assert engine._resolve_conditional("auto") == "eager"


@GPU
@pytest.mark.parametrize("conditional", [pytest.param("cond", marks=GRAPHS), "host"])
def test_cuda_graph_capture_leaves_state_bit_identical(conditional):
    model = make_model(policy="head").cuda()
    ids, mask = (t.cuda() for t in left_padded_prompts())
    engine = OdaStaticEngine(model, max_length=40, batch_size=2, bucket_size=BUCKET, conditional=conditional)
    tokens = engine.prefill(ids, mask, max_new_tokens=30).argmax(-1)
    engine.state.input_ids.copy_(tokens[:, None])
    before = state_copy(engine)
    assert engine.capture_buckets(engine.length + 20)
    torch.cuda.synchronize()
    assert_state_equal(before, engine)
