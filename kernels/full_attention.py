"""Split-K Full attention for one decode token over a static cache (the engine's Full pass).

The query of each row reads the cache columns ``c < columns`` with ``column_valid[b, c]`` and
``c <= position`` (``position``: the current token's column, already written; shared by the rows; a
device tensor, so the launch can be captured in a CUDA graph and replayed at every length of a bucket).

Why a kernel: at batch 1 a decode query has one row per head, so SDPA's masked kernels run one
program per (row, head) over the whole history: 14 programs for 14 query heads on a 132-SM GPU
(measured on an H200: the engine's always-Full step took 8.4 ms at 16K and 14.0 ms at 32K, against
3.1 and 4.1 ms for compiled stock decoding). Splitting the history (flash-decoding) keeps every SM busy.

1. ``_full_partial_kernel``, grid ``(batch * kv_heads, splits)``: split ``i`` covers columns
   ``[i * SPLIT, (i + 1) * SPLIT)`` in blocks of ``BLOCK_N``, with an online softmax; it loads each
   K/V row once for all ``Hq / Hkv`` query heads of its KV head and writes FP32 partials (maximum,
   exponential sum, weighted values) in the layout of the Local kernel.
2. The Local kernel's combine (`local_attention._local_combine_kernel`) merges the splits.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, check_devices, next_power_of_2, require_triton, tl, triton
from .local_attention import LocalAttentionScratch

SPLIT_POSITIONS = 256  # columns per program of kernel 1
FULL_BLOCK_POSITIONS = 16  # columns per inner iteration (registers: group x block x head_dim FP32 products)


#: Split partials the combine kernel merges per iteration (a constant: see `full_attention_decode`).
COMBINE_BLOCKS = 32


def num_full_splits(columns: int, split_positions: int = SPLIT_POSITIONS) -> int:
    return max(1, -(-columns // split_positions))


def allocate_full_scratch(batch: int, q_heads: int, head_dim_v: int, capacity: int, device: torch.device | str,
                          split_positions: int = SPLIT_POSITIONS) -> LocalAttentionScratch:
    """Partials for `full_attention_decode` at up to `capacity` columns (one per engine: layers run in turn)."""
    shape = (batch, q_heads, num_full_splits(capacity, split_positions))
    return LocalAttentionScratch(
        maxima=torch.empty(shape, dtype=torch.float32, device=device),
        sums=torch.empty(shape, dtype=torch.float32, device=device),
        partials=torch.empty((*shape, head_dim_v), dtype=torch.float32, device=device),
    )


def _check_shapes(q, keys, values, column_valid, position):
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [batch, q_heads, 1, head_dim]; got {tuple(q.shape)}.")
    batch, q_heads, _, head_dim = q.shape
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError("keys / values must be [batch, kv_heads, columns, head_dim] with the same first three sizes.")
    kv_heads, columns = keys.shape[1], keys.shape[2]
    if keys.shape[0] != batch or keys.shape[-1] != head_dim:
        raise ValueError(f"keys {tuple(keys.shape)} do not match q {tuple(q.shape)}.")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}).")
    if column_valid.dim() != 2 or column_valid.shape[0] != batch or column_valid.shape[1] < columns:
        raise ValueError(f"column_valid must be bool [batch, >= columns] = [{batch}, >= {columns}]; "
                         f"got {tuple(column_valid.shape)}.")
    if position.numel() != 1 or position.dtype.is_floating_point:
        raise ValueError("position must be a one-element integer tensor (the current token's column).")
    return batch, q_heads, kv_heads, head_dim, values.shape[-1], columns


def full_attention_decode_reference(q, keys, values, column_valid, position, scale: float) -> torch.Tensor:
    """Plain PyTorch FP32 reference of `full_attention_decode` (GQA by head replication)."""
    batch, q_heads, kv_heads, _, _, columns = _check_shapes(q, keys, values, column_valid, position)
    column = torch.arange(columns, device=q.device)
    visible = column_valid[:, :columns].to(q.device) & (column <= position.reshape(()).to(q.device))  # [B, C]
    slot_mask = visible[:, None, :, None]
    keys = torch.where(slot_mask, keys.float(), torch.zeros((), device=q.device))  # stale or NaN columns never leak
    values = torch.where(slot_mask, values.float(), torch.zeros((), device=q.device))
    group = q_heads // kv_heads
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).to(q.dtype)


if HAS_TRITON:
    from .local_attention import _local_combine_kernel

    @triton.jit
    def _full_partial_kernel(
        q_ptr, k_ptr, v_ptr, valid_ptr, pos_ptr,
        max_ptr, sum_ptr, acc_ptr,
        kv_heads, columns, scale,
        s_qb, s_qh, s_qd,
        s_kb, s_kh, s_kc, s_kd,
        s_vb, s_vh, s_vc, s_vd,
        s_cb, s_cc,
        s_mb, s_mh, s_mn,
        s_ab, s_ah, s_an, s_ad,
        GROUP: tl.constexpr, HEAD_DIM_K: tl.constexpr, HEAD_DIM_V: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
        SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
    ):
        """Online-softmax partials of one (row, KV head, split of SPLIT columns) for its GROUP q heads.

        USE_DOT: the two products as `tl.dot` (tensor cores; blocks padded to 16; K/V and the probabilities in the
        cache's dtype, FP32 accumulation, IEEE FP32 products for an FP32 cache) instead of FP32 elementwise sums."""
        pid_bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        b = pid_bh // kv_heads
        kvh = pid_bh % kv_heads
        position = tl.load(pos_ptr).to(tl.int32)

        g = tl.arange(0, BLOCK_G)
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        g_ok = g < GROUP
        dk_ok = dk < HEAD_DIM_K
        dv_ok = dv < HEAD_DIM_V
        heads = kvh * GROUP + g
        q_in = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + dk[None, :] * s_qd,
                       mask=g_ok[:, None] & dk_ok[None, :], other=0.0)
        # `tl.dot` takes q in the cache's dtype: scaled first, it would be rounded once more there (1/sqrt(128) is
        # no power of two: bfloat16 logits of ~40 then off by up to 0.07), so the FP32 product is scaled, as SDPA's
        # and FlashAttention's kernels do
        q = q_in.to(tl.float32) * scale

        running_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
        for start in range(0, SPLIT, BLOCK_N):
            c = split * SPLIT + start + tl.arange(0, BLOCK_N)
            in_range = (c < columns) & (c <= position)
            ok = in_range & (tl.load(valid_ptr + b * s_cb + c * s_cc, mask=in_range, other=0) != 0)
            k = tl.load(k_ptr + b * s_kb + kvh * s_kh + c[:, None] * s_kc + dk[None, :] * s_kd,
                        mask=ok[:, None] & dk_ok[None, :], other=0.0)
            v = tl.load(v_ptr + b * s_vb + kvh * s_vh + c[:, None] * s_vc + dv[None, :] * s_vd,
                        mask=ok[:, None] & dv_ok[None, :], other=0.0)
            if USE_DOT:
                scores = tl.dot(q_in.to(k.dtype), tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
            else:
                k = k.to(tl.float32)
                scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(running_max - shift)  # 0 while nothing was visible (running_max = -inf)
            weights = tl.exp(scores - shift[:, None])  # exactly 0 where masked
            running_sum = running_sum * rescale + tl.sum(weights, axis=1)
            if USE_DOT:
                acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            running_max = new_max

        part = b * s_mb + heads * s_mh + split * s_mn
        tl.store(max_ptr + part, running_max, mask=g_ok)
        tl.store(sum_ptr + part, running_sum, mask=g_ok)
        tl.store(acc_ptr + b * s_ab + heads[:, None] * s_ah + split * s_an + dv[None, :] * s_ad, acc,
                 mask=g_ok[:, None] & dv_ok[None, :])


def full_attention_decode(q, keys, values, column_valid, position, scale: float, *,
                          out: torch.Tensor | None = None, scratch: LocalAttentionScratch | None = None,
                          split_positions: int = SPLIT_POSITIONS,
                          block_positions: int = FULL_BLOCK_POSITIONS, use_dot: bool = True) -> torch.Tensor:
    """Full attention of one decode token per row over cache columns ``[0, columns)`` (split-K).

    Args:
        q: ``[batch, q_heads, 1, head_dim]``. keys, values: ``[batch, kv_heads, columns, head_dim(_v)]``
            (a view of the cache: any strides). column_valid: bool ``[batch, >= columns]`` (False on padding).
        position: one-element integer tensor on the device, the current token's column: columns after it are
            not read. Never copied to the host.
        split_positions, block_positions: columns per program, and per inner iteration (a power of two).
        use_dot: tensor-core products (`tl.dot`, blocks of at least 16; the default) or elementwise ones. On an
            H200 (bf16, 14 query / 2 KV heads of 64) tl.dot took 0.070-0.075 ms per layer at 16K-32K columns,
            elementwise 0.09-0.17 (benchmarks/full_decode_kernel.py --dot compares them).
        out: optional ``[batch, q_heads, 1, head_dim_v]`` buffer; scratch: `allocate_full_scratch` for at least
            these columns (else allocated per call).

    Returns ``out`` in ``q.dtype`` (or ``out.dtype``). Every row must see at least one column.
    """
    require_triton("full_attention_decode")
    batch, q_heads, kv_heads, head_dim, head_dim_v, columns = _check_shapes(q, keys, values, column_valid, position)
    if use_dot:
        block_positions = max(block_positions, 16)  # tl.dot needs every dimension >= 16
    if block_positions < 1 or block_positions & (block_positions - 1) or split_positions % block_positions:
        raise ValueError(f"block_positions must be a power of two dividing split_positions; got {block_positions}, "
                         f"{split_positions}.")
    device = check_devices(_full_partial_kernel, "full_attention_decode", q, keys, values, column_valid, position)
    splits = num_full_splits(columns, split_positions)
    if scratch is None:
        scratch = allocate_full_scratch(batch, q_heads, head_dim_v, columns, device, split_positions)
    elif scratch.maxima.shape[:2] != (batch, q_heads) or scratch.num_blocks < splits or \
            scratch.partials.shape[-1] != head_dim_v:
        raise ValueError(f"scratch holds {tuple(scratch.maxima.shape)} partials; these shapes need "
                         f"({batch}, {q_heads}, >= {splits}).")
    if out is None:
        out = torch.empty((batch, q_heads, 1, head_dim_v), dtype=q.dtype, device=device)
    elif tuple(out.shape) != (batch, q_heads, 1, head_dim_v):
        raise ValueError(f"out must be {(batch, q_heads, 1, head_dim_v)}; got {tuple(out.shape)}.")
    m, l, a = scratch.maxima, scratch.sums, scratch.partials
    group = q_heads // kv_heads
    _full_partial_kernel[(batch * kv_heads, splits)](
        q, keys, values, column_valid, position,
        m, l, a,
        kv_heads, columns, float(scale),
        q.stride(0), q.stride(1), q.stride(3),
        *keys.stride(), *values.stride(),
        *column_valid.stride(),
        *m.stride(), *a.stride(),
        GROUP=group, HEAD_DIM_K=head_dim, HEAD_DIM_V=head_dim_v,
        BLOCK_G=max(next_power_of_2(group), 16 if use_dot else 1), BLOCK_N=block_positions,
        BLOCK_DK=max(next_power_of_2(head_dim), 16 if use_dot else 1),
        BLOCK_DV=max(next_power_of_2(head_dim_v), 16 if use_dot else 1), SPLIT=split_positions, USE_DOT=use_dot,
    )
    _local_combine_kernel[(batch * q_heads,)](
        m, l, a, out,
        q_heads, splits,
        *m.stride(), *a.stride(),
        out.stride(0), out.stride(1), out.stride(3),
        # BLOCK_B fixed (the kernel loops over the runtime count): derived from `splits`, i.e. from the length
        # bucket, it made torch.cond's compiled Full branch specialise on each bucket (one retrace per 256 columns,
        # toward dynamo's recompile limit, a hard failure under fullgraph)
        HEAD_DIM_V=head_dim_v, BLOCK_B=COMBINE_BLOCKS, BLOCK_DV=next_power_of_2(head_dim_v),
    )
    return out
