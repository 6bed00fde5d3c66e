"""oda_hf.kernels: Triton kernels against their PyTorch references, and the references against a
brute-force dense softmax over explicit logical positions.

Without a GPU the Triton kernels run through Triton's CPU interpreter, which is chosen when a jit
function is *defined*: both Triton's own library (``tl.sum``, ``tl.max``..., defined when triton is
first imported) and our kernels must be defined with ``TRITON_INTERPRET=1``. It is therefore set
below (on machines without a GPU), before this module imports triton or the kernels; it stays set for the session. If another
test module already imported triton (transformers does), the interpreter cannot be switched on in
this process any more: the Triton tests then skip here and `test_triton_tests_in_fresh_process`
reruns this file in a fresh interpreter with the variable set from the start. (A
``tests/conftest.py`` that sets the variable avoids that second process.)

The interpreter is ~100x slower than torch, so shapes are tiny and the number of launched programs
is kept small. The GPU test runs the compiled kernels in a subprocess without the variable.
"""
from __future__ import annotations

import os

import torch

# Must precede any import of triton / oda_hf.kernels. Not on a GPU machine: the variable holds for the whole
# pytest process, and the engine tests that follow must run the compiled kernels on CUDA tensors there (the
# interpreter cannot read them); this file's CPU tests then run in a fresh process (test_triton_tests_in_fresh_process).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"


def _import_kernels():
    """`oda_hf.kernels`, from the installed package or, failing that, from the source tree."""
    try:
        import oda_hf.kernels as kernels
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "oda_hf.kernels", KERNELS_DIR / "__init__.py", submodule_search_locations=[str(KERNELS_DIR)])
        kernels = importlib.util.module_from_spec(spec)
        sys.modules["oda_hf.kernels"] = kernels
        spec.loader.exec_module(kernels)
    return kernels


K = _import_kernels()
INTERPRETED = K.kernels_interpreted()  # the Triton kernels can run on CPU tensors in this process

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")
triton_cpu = pytest.mark.skipif(
    not INTERPRETED,
    reason="triton missing, or imported before TRITON_INTERPRET=1 (then run by test_triton_tests_in_fresh_process)")
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


# ------------------------------------------------------------------------------------------------
# Test data: an explicit logical history per row, and the workspace it produces
# ------------------------------------------------------------------------------------------------
def _slot_of(p: int, s: int, w: int) -> int | None:
    """0-based valid position -> workspace slot (written out independently of the package)."""
    if p < s:
        return p
    return None if w == 1 else s + (p - s) % (w - 1)


def make_case(counts, q_heads, kv_heads, head_dim, s, w, dtype, seed=0, spare_slots=1):
    """Random RoPE'd keys/values for logical positions 0..count (the last one is the current token).

    The workspace is filled with NaN and then written position by position, so ring slots get
    overwritten exactly as a decode would; slots a query must not read stay NaN (or hold stale
    positions), which any leak turns into a failure. Returns a dict of tensors and the history.
    """
    g = torch.Generator().manual_seed(seed)
    batch = len(counts)
    keys = [torch.randn(kv_heads, c + 1, head_dim, generator=g) for c in counts]
    values = [torch.randn(kv_heads, c + 1, head_dim, generator=g) for c in counts]
    ws_k = torch.full((batch, kv_heads, s + w - 1 + spare_slots, head_dim), float("nan"))
    ws_v = ws_k.clone()
    for b, c in enumerate(counts):
        for p in range(c):
            slot = _slot_of(p, s, w)
            if slot is not None:
                ws_k[b, :, slot], ws_v[b, :, slot] = keys[b][:, p], values[b][:, p]
    cast = lambda t: t.to(dtype)  # noqa: E731
    return dict(
        q=cast(torch.randn(batch, q_heads, 1, head_dim, generator=g)),
        ws_keys=cast(ws_k), ws_values=cast(ws_v),
        cur_k=cast(torch.stack([k[:, -1:] for k in keys])), cur_v=cast(torch.stack([v[:, -1:] for v in values])),
        valid_count=torch.tensor(counts, dtype=torch.long),
        history=([cast(k) for k in keys], [cast(v) for v in values]),
    )


def dense_local_attention(q, keys, values, counts, s, w, scale):
    """Brute force in float64: attend densely over the visible 1-based positions of S_L(t), t = count + 1."""
    out = []
    group = q.shape[1] // keys[0].shape[0]
    for b, c in enumerate(counts):
        t = c + 1
        visible = sorted(set(range(1, min(s, t) + 1)) | set(range(max(1, t - w + 1), t + 1)))
        idx = torch.tensor(visible) - 1
        k = keys[b][:, idx].double().repeat_interleave(group, dim=0)  # [Hq, n, D]
        v = values[b][:, idx].double().repeat_interleave(group, dim=0)
        probs = torch.softmax((q[b].double() @ k.transpose(-1, -2)) * scale, dim=-1)  # [Hq, 1, n]
        out.append(probs @ v)
    return torch.stack(out)


def run_reference(case, s, w, scale):
    return K.local_attention_decode_reference(case["q"], case["ws_keys"], case["ws_values"], case["cur_k"],
                                              case["cur_v"], case["valid_count"], s, w, scale)


def run_kernel(case, s, w, scale, **kwargs):
    return K.local_attention_decode(case["q"], case["ws_keys"], case["ws_values"], case["cur_k"],
                                    case["cur_v"], case["valid_count"], s, w, scale, **kwargs)


# (name, counts per row, s, w, q_heads, kv_heads, head_dim). Counts are committed positions, so the
# current token is position count + 1: count = w - 1 gives t = w, count = s + w gives the first t
# at which Local and Full differ.
LOCAL_CASES = [
    ("window_exact_and_plus_one", [5, 6, 8, 9], 3, 6, 4, 2, 16),
    ("many_wraparounds", [2 + 7 * 5 + 3, 2 + 5 * 5], 2, 6, 2, 2, 24),
    ("sinks_not_full", [0, 1, 3], 4, 5, 4, 1, 16),
    ("no_sinks", [0, 1, 4, 40], 0, 5, 8, 1, 16),
    ("window_one", [0, 1, 2, 30], 2, 1, 4, 4, 24),
    ("window_one_no_sinks", [0, 7], 0, 1, 2, 1, 16),
    ("multi_block", [0, 17, 31, 32, 33, 200], 3, 30, 8, 1, 24),
    ("more_than_32_blocks", [700, 300], 4, 600, 2, 1, 8),  # 38 blocks of 16: the combine merges them 32 at a time
]
LOCAL_IDS = [c[0] for c in LOCAL_CASES]


# ------------------------------------------------------------------------------------------------
# The reference against brute force (no Triton)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,counts,s,w,hq,hkv,d", LOCAL_CASES, ids=LOCAL_IDS)
def test_reference_matches_dense_logical_positions(name, counts, s, w, hq, hkv, d):
    case = make_case(counts, hq, hkv, d, s, w, torch.float32, seed=1)
    scale = d ** -0.5
    expected = dense_local_attention(case["q"], *case["history"], counts, s, w, scale)
    got = run_reference(case, s, w, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_equals_full_attention_while_sets_coincide():
    """Through t = s + w, S_L(t) = {1..t}: Local must equal plain causal attention."""
    s, w = 2, 4
    counts = list(range(s + w))  # t = 1 .. s + w
    case = make_case(counts, 2, 1, 16, s, w, torch.float32, seed=2)
    got = run_reference(case, s, w, 0.25)
    keys, values = case["history"]
    for b in range(len(counts)):
        full = torch.softmax(case["q"][b] @ keys[b].transpose(-1, -2) * 0.25, dim=-1) @ values[b]
        torch.testing.assert_close(got[b], full, atol=1e-6, rtol=1e-5)


def test_layout_matches_oda_global_layer():
    """Visibility and slot mapping agree with the cache the HF path uses (oda_hf.cache)."""
    cache = pytest.importorskip("oda_hf.cache")
    for s, w in [(4, 6), (0, 5), (3, 2), (2, 1)]:
        # a history long enough for the counts below: the workspace is the full s + w
        layer = cache.OdaGlobalLayer(sinks=s, window=w, max_cache_len=3 * (s + w) + 1)
        layer.lazy_initialization(torch.zeros(5, 1, 1, 8), torch.zeros(5, 1, 1, 8))
        layer.valid_count = torch.tensor([0, 1, s + 1, s + w, 3 * (s + w) + 1])
        visible = layer.local_visibility()
        torch.testing.assert_close(K.local_visible_slots(layer.valid_count, s, w), visible[:, : s + w - 1])
        assert visible[:, -1].all()  # the current slot
        positions = torch.arange(60)
        ours = K.workspace_slot(positions, s, w)
        if w > 1:
            torch.testing.assert_close(ours, layer._workspace_slots(positions))
        else:  # no ring: positions >= s have no slot (the cache writes the unread current slot)
            assert (ours[positions >= s] == -1).all() and torch.equal(ours[:s], positions[:s])


def test_shape_validation():
    case = make_case([3, 4], 4, 2, 16, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        K.local_attention_decode_reference(case["q"][:, :3], case["ws_keys"], case["ws_values"], case["cur_k"],
                                           case["cur_v"], case["valid_count"], 2, 4, 1.0)
    with pytest.raises(ValueError, match="slots"):
        K.local_attention_decode_reference(case["q"], case["ws_keys"][:, :, :4], case["ws_values"][:, :, :4],
                                           case["cur_k"], case["cur_v"], case["valid_count"], 2, 4, 1.0)
    with pytest.raises(ValueError, match="valid_count"):
        K.local_attention_decode_reference(case["q"], case["ws_keys"], case["ws_values"], case["cur_k"],
                                           case["cur_v"], case["valid_count"].float(), 2, 4, 1.0)


def test_missing_triton_and_wrong_device_are_clear_errors(monkeypatch):
    triton_mod = sys.modules["oda_hf.kernels._triton"]
    monkeypatch.setattr(triton_mod, "HAS_TRITON", False)
    case = make_case([1], 2, 1, 16, 2, 4, torch.float32)
    with pytest.raises(RuntimeError, match="needs Triton"):
        run_kernel(case, 2, 4, 1.0)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        triton_mod.check_devices(object(), "kernel", torch.zeros(1))  # a compiled (non-interpreted) kernel


def test_package_imports_without_triton():
    """With triton unimportable the references work and the kernels raise a clear error."""
    script = textwrap.dedent(f"""
        import importlib.util, sys, torch
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        spec = importlib.util.spec_from_file_location(
            "oda_hf.kernels", {str(KERNELS_DIR / "__init__.py")!r}, submodule_search_locations=[{str(KERNELS_DIR)!r}])
        K = importlib.util.module_from_spec(spec); sys.modules["oda_hf.kernels"] = K; spec.loader.exec_module(K)
        assert not K.HAS_TRITON and not K.kernels_interpreted()
        q = torch.randn(1, 2, 1, 8); ws = torch.randn(1, 1, 6, 8); cur = torch.randn(1, 1, 1, 8)
        count = torch.tensor([3])
        K.local_attention_decode_reference(q, ws, ws, cur, cur, count, 2, 4, 1.0)
        try:
            K.local_attention_decode(q, ws, ws, cur, cur, count, 2, 4, 1.0)
        except RuntimeError as e:
            assert "needs Triton" in str(e); print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# ------------------------------------------------------------------------------------------------
# Local attention kernel against the reference (interpreter)
# ------------------------------------------------------------------------------------------------
@triton_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,counts,s,w,hq,hkv,d", LOCAL_CASES, ids=LOCAL_IDS)
def test_local_kernel_matches_reference(name, counts, s, w, hq, hkv, d, dtype):
    case = make_case(counts, hq, hkv, d, s, w, dtype, seed=3)
    scale = 0.3  # not head_dim ** -0.5: the scale is a real parameter
    got = run_kernel(case, s, w, scale)
    want = run_reference(case, s, w, scale)
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    if dtype == torch.float32:  # and, independently, the brute-force logical attention
        dense = dense_local_attention(case["q"], *case["history"], counts, s, w, scale)
        torch.testing.assert_close(got.double(), dense, atol=2e-5, rtol=1e-4)


@triton_cpu
def test_local_kernel_strided_inputs_and_reused_buffers():
    """Non-contiguous q / workspace views (as an engine's stacked buffers give) and reused scratch/out.

    The second call has shorter rows than the first, so stale partials from the first call in the
    reused scratch would show up if empty blocks were not rewritten.
    """
    s, w, hq, hkv, d = 2, 20, 4, 2, 16
    long_case = make_case([40, 25], hq, hkv, d, s, w, torch.float32, seed=4)
    short_case = make_case([3, 0], hq, hkv, d, s, w, torch.float32, seed=5)
    scratch = K.allocate_local_scratch(2, hq, d, s, w, "cpu")
    assert scratch.num_blocks == K.num_local_blocks(s, w) == 2
    out_storage = torch.empty(2, 1, hq, d)
    out = out_storage.transpose(1, 2)  # [B, Hq, 1, D] view with non-standard strides
    for case in (long_case, short_case):
        stacked = torch.stack([torch.zeros_like(case["ws_keys"]), case["ws_keys"]])  # [L, B, H, S, D]
        case = dict(case, ws_keys=stacked[1], q=case["q"].transpose(1, 2).contiguous().transpose(1, 2))
        got = run_kernel(case, s, w, 0.25, out=out, scratch=scratch)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got, run_reference(case, s, w, 0.25), **TOL[torch.float32])


def logit_metrics(reference: torch.Tensor, candidate: torch.Tensor):
    """Per-vector cosine and KL(p_ref || p_cand), and the top-1 agreement rate, in float64."""
    reference, candidate = reference.double(), candidate.double()
    cosine = torch.nn.functional.cosine_similarity(reference, candidate, dim=-1)
    log_p, log_q = reference.log_softmax(-1), candidate.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    top1 = (reference.argmax(-1) == candidate.argmax(-1)).double().mean().item()
    return cosine, kl, top1


@triton_cpu
def test_paper_logit_checks_bf16_kernel_vs_fp32_reference():
    """Paper App. B.8 kernel checks on logits: cosine >= 0.999, KL <= 0.005, top-1 agreement >= 0.99.

    bf16 kernel (bf16 q/k/v, bf16 output) against the fp32 reference on the fp32 originals. Each
    of 64 decode rows goes through 32 random output projections to a 64-token vocabulary, giving
    2,048 logit vectors: the top-1 rate is then measured on enough vectors that a near-tie or two
    (bf16 input rounding alone flips ~0.4% of random near-ties) cannot decide the test.
    """
    s, w, hq, hkv, d, vocab, projections = 4, 12, 2, 1, 16, 64, 32
    g = torch.Generator().manual_seed(6)
    counts = torch.randint(0, 60, (64,), generator=g).tolist()
    case32 = make_case(counts, hq, hkv, d, s, w, torch.float32, seed=7)
    case16 = {k: v.to(torch.bfloat16) if k not in ("valid_count", "history") and v.is_floating_point() else v
              for k, v in case32.items()}
    scale = d ** -0.5
    reference = run_reference(case32, s, w, scale).flatten(1)  # fp32 inputs, fp32 math
    kernel = run_kernel(case16, s, w, scale).float().flatten(1)  # bf16 inputs and output
    same_inputs = run_reference(case16, s, w, scale).float().flatten(1)  # reference on the bf16 inputs
    weights = torch.randn(projections, hq * d, vocab, generator=g) * 2.0 / (hq * d) ** 0.5
    to_logits = lambda out: torch.einsum("bh,phv->pbv", out, weights).reshape(-1, vocab)  # noqa: E731

    cosine, kl, top1 = logit_metrics(to_logits(reference), to_logits(kernel))
    print(f"bf16 kernel vs fp32 reference: min cosine {cosine.min():.6f}, max KL {kl.max():.2e}, "
          f"top-1 agreement {top1:.4f} over {cosine.numel()} logit vectors")
    assert cosine.min() >= 0.999, cosine.min()
    assert kl.max() <= 0.005, kl.max()
    assert top1 >= 0.99, top1
    # The kernel's own error (same bf16 inputs) is far below the bf16 input rounding.
    cosine, kl, top1 = logit_metrics(to_logits(same_inputs), to_logits(kernel))
    assert cosine.min() >= 0.99999 and kl.max() <= 1e-5 and top1 >= 0.999, (cosine.min(), kl.max(), top1)


if K.HAS_TRITON:
    import triton
    import triton.language as tl

    from oda_hf.kernels._triton import cast_for_store

    @triton.jit
    def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok)
        tl.store(out_ptr + offs, cast_for_store(x, out_ptr.dtype.element_ty), mask=ok)


@triton_cpu
def test_bf16_stores_round_to_nearest_even_like_torch():
    """The kernels round fp32 -> bf16 like torch / the GPU (the interpreter's own cast truncates)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(9)) * torch.logspace(-20, 20, 4096)
    x[:4] = torch.tensor([0x7FFFFFFF, 0x7F800001, 0x7F7FFFFF, 1], dtype=torch.int32).view(torch.float32)
    out = torch.empty(4096, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, 4096, BLOCK=4096)
    expected = x.to(torch.bfloat16)
    assert out[:2].isnan().all() and torch.equal(out[2:], expected[2:])


# ------------------------------------------------------------------------------------------------
# Fused commit
# ------------------------------------------------------------------------------------------------
def make_commit_case(layers, counts, heads, dk, dv, s, w, capacity, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    batch = len(counts)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return dict(
        cache_keys=rnd(layers, batch, heads, capacity, dk), cache_values=rnd(layers, batch, heads, capacity, dv),
        ws_keys=rnd(layers, batch, heads, s + w, dk), ws_values=rnd(layers, batch, heads, s + w, dv),
        full_keys=rnd(layers, batch, heads, 1, dk), full_values=rnd(layers, batch, heads, 1, dv),
        valid_count=torch.tensor(counts),
        select_full=torch.rand(batch, generator=g) < 0.5,
    )


COMMIT_CASES = [  # (counts, s, w)
    ([0, 3, 4, 5, 11, 40], 4, 5),  # sink slots, first ring slot, wrap-arounds
    ([0, 1, 9], 0, 4),  # no sinks
    ([0, 1, 2, 7], 2, 1),  # window 1: no ring
]


@triton_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts,s,w", COMMIT_CASES, ids=["ring", "no_sinks", "window_one"])
@pytest.mark.parametrize("mode", ["full_written", "write_all", "local_only", "lists"])
def test_fused_commit_matches_reference(counts, s, w, dtype, mode):
    layers, heads, dk, dv, capacity, n = 3, 3, 24, 16, 9, 6
    case = make_commit_case(layers, counts, heads, dk, dv, s, w, capacity, dtype, seed=len(counts) + s + w)
    case["select_full"][:2] = torch.tensor([True, False])  # both kinds of rows, whatever the seed

    def commit(fn, bufs):
        # Local candidates as a zero-copy view of the workspace's current slot (the documented layout).
        local_k, local_v = bufs["ws_keys"][:, :, :, -1:], bufs["ws_values"][:, :, :, -1:]
        full_k, full_v, select = case["full_keys"], case["full_values"], case["select_full"]
        if mode == "local_only":
            full_k = full_v = select = None
        if mode == "lists":
            local_k, local_v, full_k, full_v = (list(t.unbind(0)) for t in (local_k, local_v, full_k, full_v))
        fn(bufs["cache_keys"], bufs["cache_values"], bufs["ws_keys"], bufs["ws_values"], local_k, local_v,
           full_k, full_v, select, torch.tensor(n), case["valid_count"], s, w,
           full_already_written=(mode != "write_all"))

    names = ("cache_keys", "cache_values", "ws_keys", "ws_values")
    before = {k: case[k].clone() for k in names}
    kernel_bufs = {k: case[k].clone() for k in names}
    reference_bufs = {k: case[k].clone() for k in names}
    commit(K.fused_commit, kernel_bufs)
    commit(K.commit_reference, reference_bufs)
    for k in names:
        assert torch.equal(kernel_bufs[k], reference_bufs[k]), k

    # The semantics themselves, spelled out per row.
    for b, c in enumerate(counts):
        take_full = mode != "local_only" and bool(case["select_full"][b])
        for cache, ws, cand in (("cache_keys", "ws_keys", "full_keys"), ("cache_values", "ws_values", "full_values")):
            local = before[ws][:, b, :, -1]
            selected = case[cand][:, b, :, 0] if take_full else local
            expect_cache = before[cache].clone()
            if not (take_full and mode != "write_all"):
                expect_cache[:, b, :, n] = selected
            assert torch.equal(kernel_bufs[cache][:, b], expect_cache[:, b])
            expect_ws = before[ws][:, b].clone()
            slot = _slot_of(c, s, w)
            if slot is not None:
                expect_ws[:, :, slot] = selected
            assert torch.equal(kernel_bufs[ws][:, b], expect_ws)


@triton_cpu
def test_decode_loop_commit_and_local_attention_agree_with_logical_history():
    """Several routed steps over 2 stacked layers with left-padded rows and ring wrap-arounds.

    Each step: Local candidate into the workspace's current slot, Local attention (kernel) checked
    against dense attention over the row's logical history, native Full writes column n for every
    row, random routing, one fused commit for both layers, then n and valid_count advance on the
    device. Finally both history views must equal what the logical history implies.
    """
    layers, batch, hq, hkv, d, s, w = 2, 3, 2, 1, 16, 2, 4
    prompt_valid = [5, 2, 0]  # left padding: the prompt is 5 columns wide
    prompt, steps, scale = 5, 7, 0.35
    g = torch.Generator().manual_seed(8)
    capacity = prompt + steps
    cache_k = torch.zeros(layers, batch, hkv, capacity, d)
    cache_v = torch.zeros(layers, batch, hkv, capacity, d)
    ws_k = torch.full((layers, batch, hkv, s + w, d), float("nan"))
    ws_v = ws_k.clone()
    history = [[([], []) for _ in range(batch)] for _ in range(layers)]  # valid K/V rows per (layer, row)
    for layer in range(layers):  # prefill
        for b, valid in enumerate(prompt_valid):
            for p in range(valid):
                col = prompt - valid + p
                k, v = torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
                cache_k[layer, b, :, col], cache_v[layer, b, :, col] = k, v
                history[layer][b][0].append(k), history[layer][b][1].append(v)
                slot = _slot_of(p, s, w)
                if slot is not None:
                    ws_k[layer, b, :, slot], ws_v[layer, b, :, slot] = k, v
    n = torch.tensor(prompt)
    valid_count = torch.tensor(prompt_valid)
    full_k = torch.empty(layers, batch, hkv, 1, d)
    full_v = torch.empty_like(full_k)
    for _ in range(steps):
        counts = valid_count.tolist()
        for layer in range(layers):
            local_k, local_v = torch.randn(batch, hkv, 1, d, generator=g), torch.randn(batch, hkv, 1, d, generator=g)
            ws_k[layer, :, :, -1:], ws_v[layer, :, :, -1:] = local_k, local_v
            q = torch.randn(batch, hq, 1, d, generator=g)
            out = K.local_attention_decode(q, ws_k[layer], ws_v[layer], ws_k[layer, :, :, -1:],
                                           ws_v[layer, :, :, -1:], valid_count, s, w, scale)
            keys = [torch.stack(history[layer][b][0] + [local_k[b, :, 0]], dim=1) for b in range(batch)]
            values = [torch.stack(history[layer][b][1] + [local_v[b, :, 0]], dim=1) for b in range(batch)]
            dense = dense_local_attention(q, keys, values, counts, s, w, scale)
            torch.testing.assert_close(out.double(), dense, atol=2e-5, rtol=1e-4)
            full_k[layer] = torch.randn(batch, hkv, 1, d, generator=g)
            full_v[layer] = torch.randn(batch, hkv, 1, d, generator=g)
            cache_k[layer, :, :, int(n)], cache_v[layer, :, :, int(n)] = full_k[layer, :, :, 0], full_v[layer, :, :, 0]
        select_full = torch.rand(batch, generator=g) < 0.5
        K.fused_commit(cache_k, cache_v, ws_k, ws_v, ws_k[:, :, :, -1:], ws_v[:, :, :, -1:], full_k, full_v,
                       select_full, n, valid_count, s, w, full_already_written=True)
        for layer in range(layers):
            for b in range(batch):
                use_full = bool(select_full[b])
                k = full_k[layer, b, :, 0] if use_full else ws_k[layer, b, :, -1]
                v = full_v[layer, b, :, 0] if use_full else ws_v[layer, b, :, -1]
                history[layer][b][0].append(k.clone()), history[layer][b][1].append(v.clone())
        valid_count += 1
        n += 1
    for layer in range(layers):
        for b, valid in enumerate(prompt_valid):
            keys, values = torch.stack(history[layer][b][0], 1), torch.stack(history[layer][b][1], 1)
            count = keys.shape[1]
            assert count == valid + steps == int(valid_count[b])
            assert torch.equal(cache_k[layer, b, :, capacity - count:], keys)
            assert torch.equal(cache_v[layer, b, :, capacity - count:], values)
            visible = K.local_visible_slots(valid_count, s, w)[b]
            for slot in visible.nonzero().flatten().tolist():  # every readable slot holds its position
                p = slot if slot < s else next(p for p in range(count - 1, -1, -1) if _slot_of(p, s, w) == slot)
                assert torch.equal(ws_k[layer, b, :, slot], keys[:, p])
                assert torch.equal(ws_v[layer, b, :, slot], values[:, p])


# ------------------------------------------------------------------------------------------------
# Full attention (split-K) over a static cache
# ------------------------------------------------------------------------------------------------
def make_full_case(columns, capacity, position, pads, q_heads, kv_heads, head_dim, dtype, seed=0):
    """A cache of `capacity` columns whose columns after `position` and padding columns hold NaN."""
    g = torch.Generator().manual_seed(seed)
    batch = len(pads)
    q = torch.randn(batch, q_heads, 1, head_dim, generator=g).to(dtype)
    cache_k, cache_v = (torch.randn(batch, kv_heads, capacity, head_dim, generator=g).to(dtype) for _ in range(2))
    valid = torch.ones(batch, capacity, dtype=torch.bool)
    for row, pad in enumerate(pads):
        valid[row, :pad] = False
    for cache in (cache_k, cache_v):
        cache[:, :, position + 1:] = float("nan")  # unwritten: must never be read
        cache.masked_fill_(~valid[:, None, :, None], float("nan"))
    return q, cache_k[:, :, :columns], cache_v[:, :, :columns], valid, torch.tensor([position])


def dense_full_attention(q, keys, values, valid, position, scale):
    """Softmax over the explicitly listed visible columns of each row (independent of the reference)."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        cols = [c for c in range(keys.shape[2]) if c <= int(position) and bool(valid[b, c])]
        for h in range(q.shape[1]):
            k, v = keys[b, h // group, cols].float(), values[b, h // group, cols].float()
            out[b, h, 0] = torch.softmax(q[b, h, 0].float() @ k.T * scale, dim=-1) @ v
    return out


FULL_CASES = {  # columns, capacity, position, left pads per row, hq, hkv, d
    "one split, GQA 4": (48, 64, 40, (0, 5), 8, 2, 16),
    "several splits, MHA": (600, 640, 555, (0, 300), 2, 2, 8),
    "position at the last column": (64, 64, 63, (3,), 7, 1, 24),
    "position on a split boundary": (520, 520, 256, (0,), 4, 2, 16),
    "current token alone in the last split": (257, 264, 256, (0, 100), 4, 2, 8),
    "current token alone in the third split": (513, 513, 512, (0, 300), 2, 1, 8),
}


@pytest.mark.parametrize("name", list(FULL_CASES))
def test_full_reference_matches_dense(name):
    columns, capacity, position, pads, hq, hkv, d = FULL_CASES[name]
    q, keys, values, valid, pos = make_full_case(columns, capacity, position, pads, hq, hkv, d, torch.float32)
    got = K.full_attention_decode_reference(q, keys, values, valid, pos, d ** -0.5)
    torch.testing.assert_close(got.float(), dense_full_attention(q, keys, values, valid, pos, d ** -0.5),
                               **TOL[torch.float32])


@triton_cpu
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FULL_CASES))
def test_full_kernel_matches_reference(name, dtype, use_dot):
    if use_dot and dtype == torch.bfloat16:  # (the GPU script checks it compiled)
        pytest.skip("Triton's CPU interpreter computes bf16 tl.dot wrongly")
    columns, capacity, position, pads, hq, hkv, d = FULL_CASES[name]
    q, keys, values, valid, pos = make_full_case(columns, capacity, position, pads, hq, hkv, d, dtype, seed=3)
    scratch = K.allocate_full_scratch(len(pads), hq, d, capacity, "cpu")  # sized for the capacity, reused
    out = torch.empty(len(pads), hq, 1, d, dtype=dtype)
    got = K.full_attention_decode(q, keys, values, valid, pos, d ** -0.5, out=out, scratch=scratch, use_dot=use_dot)
    assert got is out
    want = K.full_attention_decode_reference(q, keys, values, valid, pos, d ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert K.num_full_splits(columns) == -(-columns // K.SPLIT_POSITIONS)


@triton_cpu
def test_full_kernel_compile_constants_do_not_follow_the_length(monkeypatch):
    """The static engine runs the Full branch under torch.cond, compiled once for every length bucket: a Triton
    constexpr derived from the bucket's column count (the combine's BLOCK_B was next_power_of_2(splits)) made dynamo
    specialise on it, one retrace per 256 columns toward its recompile limit (an audit's CPU repro)."""
    import oda_hf.kernels.full_attention as full

    launches = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **constants):
                launches.append(constants)
                return self.kernel[grid](*args, **constants)
            return launch

    monkeypatch.setattr(full, "_local_combine_kernel", Recording(full._local_combine_kernel))
    for columns in (40, 700):   # 1 and 3 splits
        q, keys, values, valid, pos = make_full_case(columns, columns, columns - 1, [0, 2], 4, 2, 16,
                                                     torch.float32, seed=1)
        K.full_attention_decode(q, keys, values, valid, pos, 0.25, use_dot=False)
    assert len(launches) == 2 and launches[0] == launches[1]


def test_full_kernel_shape_errors():
    q, keys, values, valid, pos = make_full_case(48, 64, 40, (0,), 8, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        K.full_attention_decode_reference(q[:, :7], keys, values, valid, pos, 0.25)
    with pytest.raises(ValueError, match="column_valid"):
        K.full_attention_decode_reference(q, keys, values, valid[:, :10], pos, 0.25)
    with pytest.raises(ValueError, match="position"):
        K.full_attention_decode_reference(q, keys, values, valid, torch.tensor([1.0]), 0.25)


@pytest.mark.skipif(INTERPRETED or not K.HAS_TRITON, reason="the Triton tests ran in this process")
def test_triton_tests_in_fresh_process():
    """Triton was imported before TRITON_INTERPRET=1 here: run this file where it is set from the start."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]


# ------------------------------------------------------------------------------------------------
# Compiled kernels on a GPU
# ------------------------------------------------------------------------------------------------
GPU_SCRIPT = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location(
    "oda_hf.kernels", {init!r}, submodule_search_locations=[{root!r}])
K = importlib.util.module_from_spec(spec); sys.modules["oda_hf.kernels"] = K; spec.loader.exec_module(K)
assert K.HAS_TRITON and not K.kernels_interpreted()
torch.manual_seed(0)
dev = "cuda"
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-2)):
    for s, w, hq, hkv, d in ((4, 2048, 16, 8, 128), (0, 5, 8, 1, 24), (2, 1, 4, 2, 16), (3, 30, 32, 4, 64)):
        counts = torch.tensor([0, 1, s + w - 1, s + w, 5 * (s + w) + 3], device=dev)
        B = counts.numel()
        q = torch.randn(B, hq, 1, d, device=dev, dtype=dtype)
        wk, wv = (torch.randn(B, hkv, s + w, d, device=dev, dtype=dtype) for _ in range(2))
        ck, cv = (torch.randn(B, hkv, 1, d, device=dev, dtype=dtype) for _ in range(2))
        got = K.local_attention_decode(q, wk, wv, ck, cv, counts, s, w, d ** -0.5)
        want = K.local_attention_decode_reference(q, wk, wv, ck, cv, counts, s, w, d ** -0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        L, cap = 3, 40
        bufs = [torch.randn(L, B, hkv, n, d, device=dev, dtype=dtype) for n in (cap, cap, s + w, s + w)]
        ref = [t.clone() for t in bufs]
        fk, fv = (torch.randn(L, B, hkv, 1, d, device=dev, dtype=dtype) for _ in range(2))
        sel = torch.rand(B, device=dev) < 0.5
        pos = torch.tensor(7, device=dev)
        K.fused_commit(*bufs, bufs[2][:, :, :, -1:], bufs[3][:, :, :, -1:], fk, fv, sel, pos, counts, s, w)
        K.commit_reference(*ref, ref[2][:, :, :, -1:], ref[3][:, :, :, -1:], fk, fv, sel, pos, counts, s, w)
        assert all(torch.equal(a, b) for a, b in zip(bufs, ref))
    for columns, position, hq, hkv, d in ((16384, 16000, 14, 2, 64), (300, 299, 8, 8, 128), (40, 17, 4, 1, 24)):
        B = 3
        q = torch.randn(B, hq, 1, d, device=dev, dtype=dtype)
        keys, values = (torch.randn(B, hkv, columns + 8, d, device=dev, dtype=dtype)[:, :, :columns] for _ in range(2))
        valid = torch.ones(B, columns + 8, dtype=torch.bool, device=dev)
        valid[1, :columns // 3] = False
        pos = torch.tensor([position], device=dev)
        want = K.full_attention_decode_reference(q, keys, values, valid, pos, d ** -0.5)
        for use_dot in (False, True):
            got = K.full_attention_decode(q, keys, values, valid, pos, d ** -0.5, use_dot=use_dot)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
# bfloat16 at head_dim 128 with large logits: tl.dot took q scaled by 1/sqrt(128) and rounded to bfloat16 again
# (emulated in torch on CPU: output error 7.1e-3 of the output's size against 2.3e-3 when the product is scaled)
g = torch.Generator(device=dev).manual_seed(0)
q = (torch.randn(2, 8, 1, 128, device=dev, generator=g) * 2.5).bfloat16()
keys = (torch.randn(2, 2, 2048, 128, device=dev, generator=g) * 2.5).bfloat16()
values = torch.randn(2, 2, 2048, 128, device=dev, generator=g).bfloat16()
valid = torch.ones(2, 2048, dtype=torch.bool, device=dev)
pos = torch.tensor([2047], device=dev)
truth = K.full_attention_decode_reference(q.double(), keys.double(), values.double(), valid, pos, 128 ** -0.5)
got = K.full_attention_decode(q, keys, values, valid, pos, 128 ** -0.5, use_dot=True).double()
assert (got - truth).abs().max() / truth.abs().max() < 4e-3, float((got - truth).abs().max() / truth.abs().max())
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs the compiled Triton kernels)")
@needs_triton
def test_compiled_kernels_on_gpu():
    script = GPU_SCRIPT.format(init=str(KERNELS_DIR / "__init__.py"), root=str(KERNELS_DIR))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr
