"""Local attention read straight from vLLM's paged KV cache, and the attention-impl hook that uses it.

Local (ODA_SPEC 1) reads, for a decode token at 0-based position ``p`` (``n = p + 1`` positions in the cache,
the current one included): the sinks ``0 .. min(s, n) - 1`` and the window ``max(0, n - w) .. n - 1``. The paged
cache already holds every position, so Local gathers those ``s + w`` slots through the row's block table: no second
copy of the history, and the bytes read equal a ring's.

`oda_attention_impl_class` derives, from the backend's own impl class, one whose `forward` splits the tokens of the
current step: the rows the step plan marks Local attend here, every other token goes through the backend's native
kernel with metadata built for that subset. Without a plan (profile runs, warm-up, the Full retry) it is the native
impl unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


def local_positions(seq_lens: torch.Tensor, sinks: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[T, s + w]`` (long) that Local reads for rows with `seq_lens` cached positions, and a validity
    mask: a sink that also lies in the window is read once (from the window)."""
    seq_lens = seq_lens.to(torch.long).reshape(-1, 1)
    device = seq_lens.device
    sink = torch.arange(sinks, device=device).reshape(1, -1).expand(seq_lens.shape[0], -1)
    recent = seq_lens - window + torch.arange(window, device=device).reshape(1, -1)
    positions = torch.cat([sink, recent], dim=1)
    valid = torch.cat([(sink < seq_lens) & (sink < seq_lens - window), recent >= 0], dim=1)
    return positions.clamp(min=0), valid


def paged_local_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, sinks: int, window: int,
                          scale: float) -> torch.Tensor:
    """Local attention for one query token per row.

    Args:
        query: ``[T, Hq, D]``, one decode token per row.
        key_cache / value_cache: ``[num_blocks, Hkv, block_size, D]`` views of the paged cache (the current token's
            KV already written, as vLLM does before attending).
        block_table: ``[T, max_blocks]`` block ids of each row; seq_lens: ``[T]`` cached positions per row.
    Returns ``[T, Hq, D]`` in the query's dtype; arithmetic in float32.
    """
    tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    positions, valid = local_positions(seq_lens, sinks, window)
    blocks = block_table.to(torch.long).gather(1, positions // block_size)
    offsets = positions % block_size
    keys = key_cache[blocks, :, offsets, :].float()          # [T, S, Hkv, D]
    values = value_cache[blocks, :, offsets, :].float()
    grouped = query.float().reshape(tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("thgd,tshd->thgs", grouped, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("thgs,tshd->thgd", weights, values)
    return out.reshape(tokens, num_heads, head_dim).to(query.dtype)


def split_paged_cache(backend_name: str, kv_cache: torch.Tensor, isa: str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, Hkv, block_size, D]`` of one layer's paged cache, per backend layout."""
    if backend_name == "CPU_ATTN":
        # [num_blocks, Hkv, block_size, 2 * D]: per block and head, the keys stored dimension-major ([D, block_size])
        # by the vec/vec16 kernels, then the values token-major ([block_size, D]). Other ISAs (AMX, NEON, ...) pack
        # keys in ways this code has not been checked against.
        if isa not in ("vec", "vec16"):
            raise NotImplementedError(
                f"ODA's Local attention reads vLLM's CPU KV cache as the vec/vec16 kernels lay it out; this machine "
                f"uses the {isa!r} kernels, whose key layout it has not been checked against. Serve in float32 "
                "(which uses vec) or on a machine without AMX.")
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        kv = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1)
        head_dim = kv.shape[-1]
        keys = kv[:, :, :block_size].reshape(num_blocks, num_kv_heads, head_dim, block_size).transpose(2, 3)
        return keys, kv[:, :, block_size:]
    if backend_name.startswith("FLASH_ATTN") or backend_name in ("TRITON_ATTN", "FLASHINFER"):
        # [2, num_blocks, block_size, Hkv, D] (never run here: no GPU)
        return kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)
    raise NotImplementedError(
        f"ODA's Local attention does not know the KV cache layout of the {backend_name} attention backend; "
        "serve ODA with CPU_ATTN (vLLM's CPU build) or FLASH_ATTN."
    )


@dataclass
class LocalPlan:
    """What the attention layers do in the current pass (set by the model for one forward)."""

    sinks: int
    window: int
    local_tokens: torch.Tensor          # token indices that attend Local
    local_rows: torch.Tensor            # their request rows in the step's metadata
    native_tokens: torch.Tensor | None = None  # the other tokens, attended natively ...
    native_metadata: dict = field(default_factory=dict)  # ... with metadata built for them (layer name -> metadata)


_current_plan: LocalPlan | None = None


@contextlib.contextmanager
def local_plan(plan: LocalPlan):
    global _current_plan
    previous, _current_plan = _current_plan, plan
    try:
        yield
    finally:
        _current_plan = previous


class OdaAttentionImplMixin:
    """The methods of the ODA impl classes: Local rows attend the sinks + window through the paged cache.

    `oda_attention_impl_class` copies them into a one-base subclass of the backend's impl (a second base would
    change the instance layout, and an existing impl instance could not take the new class).
    """

    oda_backend_name: str = ""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = _current_plan
        if plan is None or attn_metadata is None:
            return self.oda_native_forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                           output_block_scale)
        if plan.native_tokens is not None and plan.native_tokens.numel():
            idx = plan.native_tokens
            sub_out = torch.empty_like(output[idx])
            self.oda_native_forward(layer, query[idx], key[idx], value[idx], kv_cache,
                                    plan.native_metadata[layer.layer_name], sub_out)
            output[idx] = sub_out
        key_cache, value_cache = split_paged_cache(self.oda_backend_name, kv_cache, getattr(layer, "isa", None))
        rows = plan.local_rows
        output[plan.local_tokens] = paged_local_attention(
            query[plan.local_tokens], key_cache, value_cache, attn_metadata.block_table[rows],
            attn_metadata.seq_lens[rows], plan.sinks, plan.window, self.scale,
        ).to(output.dtype)
        return output


_IMPL_CLASSES: dict[type, type] = {}


def oda_attention_impl_class(impl_class: type, backend_name: str) -> type:
    """The ODA subclass of a backend impl class (one per class, so isinstance checks keep working)."""
    if getattr(impl_class, "oda_backend_name", None):
        return impl_class
    if impl_class not in _IMPL_CLASSES:
        _IMPL_CLASSES[impl_class] = type(f"Oda{impl_class.__name__}", (impl_class,), {
            "__slots__": (), "__doc__": OdaAttentionImplMixin.__doc__, "oda_backend_name": backend_name,
            "forward": OdaAttentionImplMixin.forward, "oda_native_forward": impl_class.forward,
        })
    return _IMPL_CLASSES[impl_class]
