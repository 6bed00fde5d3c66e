"""How the engine drives the unmodified HF decoder: a static Cache object and one attention function.

The decoder layers of the supported families call ``past_key_values.update(k, v, layer_idx)`` and
then ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, **kwargs)``, where
``kwargs`` are the extra keyword arguments given to the decoder call. So the engine

* passes an `EngineCache` whose layers write into the engine's stacked buffers (`EngineState`) and
  return the views the attention reads, in one of three fixed modes (one cache object per mode, so
  nothing on it changes inside a conditional branch):

  - ``prefill``: columns ``[0, P)`` of the full cache; attention is the model's own (sdpa/eager);
  - ``local``: the candidate goes to the workspace's current slot; returns the whole workspace
    (read in place by the Local backend, `LocalAttention`);
  - ``full``: the candidate goes to cache column ``n`` (a device index) and to the Full candidate
    scratch; returns the first ``capacity`` columns of the bucket (static shape within a bucket);
  - ``verify`` (exact decoding, eager, batch 1): several tokens go to columns ``[start, start + m)``;
    returns columns ``[0, start + m)``, read under a causal mask;

  a native sliding-window layer (Gemma 3) attends the same way in every mode: its candidate goes to cache
  column ``n`` (in ``local`` mode also to the workspace's current slot, which the commit reads), and it reads the
  ``W`` columns ``[n - W + 1, n]`` gathered at device indices, under the engine's per-step window mask;

* registers `engine_attention_forward` under ``"oda_static_engine"`` and switches the model's
  attention implementation to it only while a routed step runs (`engine_attention`), restoring it
  afterwards: the model stays usable on the HF path next to an engine. Because that name has no
  mask function registered, the decoder skips its own mask creation (``masking_utils`` early exit),
  which would otherwise read host-side lengths; the engine passes its masks in ``oda_*`` kwargs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..kernels import (
    allocate_full_scratch,
    allocate_local_scratch,
    full_attention_decode,
    local_attention_decode,
    local_attention_decode_reference,
    local_visible_slots,
)
from ..packed_attention import packed_sdpa_forward
from .state import EngineState

ENGINE_ATTENTION = "oda_static_engine"
PREFILL, LOCAL, FULL, VERIFY = "prefill", "local", "full", "verify"


# ------------------------------------------------------------------------------------------------
# Attention function
# ------------------------------------------------------------------------------------------------
def engine_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Local: the Local backend over the workspace. Full: the Full backend over the bucket's columns. A sliding-window
    layer: its window's columns under the step's window mask, in every mode."""
    mode = kwargs.get("oda_mode")
    windows = kwargs.get("oda_windows")
    width = windows[module.layer_idx] if windows else None
    if width is not None and mode in (LOCAL, FULL, VERIFY):
        mask = kwargs["oda_window_masks"][width]
        if mode == VERIFY:
            return packed_sdpa_forward(module, query, key, value, mask, scaling=scaling)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling,
                                      is_causal=False)[0], None
    if mode == LOCAL:
        return kwargs["oda_local"](module, query, key, value, kwargs["oda_valid_count"], kwargs.get("oda_local_mask"),
                                   scaling), None
    if mode == FULL:
        return kwargs["oda_full"](module, query, key, value, kwargs["oda_full_mask"], scaling), None
    if mode == VERIFY:  # several tokens with a causal mask: query heads stacked per KV group (no K/V copies)
        return packed_sdpa_forward(module, query, key, value, kwargs["oda_full_mask"], scaling=scaling)
    raise RuntimeError(
        f"The '{ENGINE_ATTENTION}' attention implementation only runs inside an OdaStaticEngine step "
        "(it needs the engine's oda_* arguments)."
    )


def register_engine_attention() -> None:
    """Register the engine's attention function (idempotent; called when an engine is built)."""
    if AttentionInterface._global_mapping.get(ENGINE_ATTENTION) is not engine_attention_forward:
        AttentionInterface.register(ENGINE_ATTENTION, engine_attention_forward)


@contextmanager
def engine_attention(config):
    """Switch the model to the engine's attention for one step; always restore the previous one."""
    previous = config._attn_implementation
    config._attn_implementation = ENGINE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


class LocalAttention:
    """The Local attention backend: fixed (s, w), a kernel choice, persistent Triton buffers.

    * ``triton``: `kernels.local_attention_decode`, the direct-ring kernel, with per-layer
      preallocated scratch and output buffers (CUDA, or CPU under ``TRITON_INTERPRET=1``);
    * ``reference``: `kernels.local_attention_decode_reference` (plain PyTorch, FP32, any device);
    * ``sdpa``: SDPA over the whole workspace (read in place) with the visibility mask built on the
      device from ``valid_count`` -- the HF path's Local computation. The reference materializes
      FP32, masked and head-replicated copies of the workspace per layer, which makes it ~20x slower
      on CPU at real shapes (measured here, one thread, s + w = 2052, 16 query / 8 KV heads of 128:
      30 vs 1.4 ms per layer), so this is the default off CUDA.

    All three read nothing back to the host, so any of them can be captured in a CUDA graph.
    Returns the HF attention layout ``[B, 1, Hq, Dv]``.
    """

    def __init__(self, backend: str, sinks: int, window: int, *, layers: int, batch: int, q_heads: int,
                 head_dim_v: int, dtype: torch.dtype, device: torch.device):
        self.backend, self.sinks, self.window = backend, sinks, window
        self.scratch = self.outputs = None
        if backend == "triton":
            self.scratch = [allocate_local_scratch(batch, q_heads, head_dim_v, sinks, window, device)
                            for _ in range(layers)]
            self.outputs = [torch.empty(batch, q_heads, 1, head_dim_v, dtype=dtype, device=device)
                            for _ in range(layers)]

    def visibility(self, valid_count: torch.Tensor) -> torch.Tensor | None:
        """bool ``[B, 1, 1, s + w]`` workspace mask for the ``sdpa`` backend (once per step), else None."""
        if self.backend != "sdpa":
            return None
        visible = local_visible_slots(valid_count, self.sinks, self.window)
        return torch.cat([visible, visible.new_ones(visible.shape[0], 1)], dim=1)[:, None, None, :]

    def __call__(self, module, query, ws_keys, ws_values, valid_count, visibility, scaling):
        if self.backend == "sdpa":
            return sdpa_attention_forward(module, query, ws_keys, ws_values, visibility, dropout=0.0,
                                          scaling=scaling, is_causal=False)[0]
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        current_k, current_v = ws_keys[:, :, -1:], ws_values[:, :, -1:]
        if self.backend == "triton":
            layer = module.layer_idx
            out = local_attention_decode(query, ws_keys, ws_values, current_k, current_v, valid_count, self.sinks,
                                         self.window, scale, out=self.outputs[layer], scratch=self.scratch[layer])
        else:
            out = local_attention_decode_reference(query, ws_keys, ws_values, current_k, current_v, valid_count,
                                                   self.sinks, self.window, scale)
        return out.transpose(1, 2)


class FullAttention:
    """The Full pass's attention over the current bucket's cache columns (current token written at its column).

    * ``triton``: `kernels.full_attention_decode`, split-K over the columns with the length and padding read
      from the device (``cache_position``, ``column_valid``), products as tl.dot unless `use_dot` is False; one
      scratch for all layers (they run in turn);
    * otherwise SDPA with the engine's bool mask ``[B, 1, 1, columns]``. At batch 1 SDPA's masked decode runs
      one program per (row, head) over the whole history, which leaves most of a GPU idle at long context.

    Returns the HF attention layout ``[B, 1, Hq, Dv]``.
    """

    def __init__(self, backend: str, state: EngineState, *, layers: int, q_heads: int, head_dim_v: int,
                 use_dot: bool = True):
        self.backend, self.state, self.use_dot = backend, state, use_dot
        self.scratch = self.outputs = None
        if backend == "triton":
            batch, device = state.batch_size, state.cache_keys.device
            self.scratch = allocate_full_scratch(batch, q_heads, head_dim_v, state.capacity, device)
            self.outputs = [torch.empty(batch, q_heads, 1, head_dim_v, dtype=state.cache_keys.dtype, device=device)
                            for _ in range(layers)]

    def __call__(self, module, query, keys, values, full_mask, scaling):
        if self.backend != "triton":
            return sdpa_attention_forward(module, query, keys, values, full_mask, dropout=0.0, scaling=scaling,
                                          is_causal=False)[0]
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        out = full_attention_decode(query, keys, values, self.state.column_valid, self.state.cache_position, scale,
                                    out=self.outputs[module.layer_idx], scratch=self.scratch, use_dot=self.use_dot)
        return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# Static cache
# ------------------------------------------------------------------------------------------------
class _EngineLayer(CacheLayerMixin):
    """One decoder layer's view of the engine's stacked buffers, in one fixed mode."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "EngineCache", layer: int, window: int | None = None):
        super().__init__()
        self.owner, self.layer, self.window = owner, layer, window
        self.is_initialized = True  # the buffers exist before any forward

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are preallocated
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        state, layer, mode = self.owner.state, self.layer, self.owner.mode
        if mode == PREFILL:
            length = key_states.shape[-2]
            state.cache_keys[layer, :, :, :length] = key_states
            state.cache_values[layer, :, :, :length] = value_states
            return state.cache_keys[layer, :, :, :length], state.cache_values[layer, :, :, :length]
        if key_states.shape[-2] != 1 and mode != VERIFY:
            raise ValueError(f"An engine step decodes one token per row; got {key_states.shape[-2]} in {mode} mode.")
        if mode == LOCAL:
            # The workspace's current slot doubles as the Local candidate the commit reads.
            state.ws_keys[layer, :, :, -1:] = key_states
            state.ws_values[layer, :, :, -1:] = value_states
            if self.window is not None:  # a native sliding window reads the cache, candidate at column n
                state.cache_keys[layer].index_copy_(2, state.cache_position, key_states)
                state.cache_values[layer].index_copy_(2, state.cache_position, value_states)
                return self._window_view()
            return state.ws_keys[layer], state.ws_values[layer]
        if mode == VERIFY:
            start = self.owner.verify_start
            stop = start + key_states.shape[-2]
            state.cache_keys[layer, :, :, start:stop] = key_states
            state.cache_values[layer, :, :, start:stop] = value_states
            return state.cache_keys[layer, :, :, :stop], state.cache_values[layer, :, :, :stop]
        # FULL: native Full writes its candidate into column n (a device index: no host read), and
        # keeps a copy for the workspace update of the commit.
        state.cache_keys[layer].index_copy_(2, state.cache_position, key_states)
        state.cache_values[layer].index_copy_(2, state.cache_position, value_states)
        state.full_keys[layer].copy_(key_states)
        state.full_values[layer].copy_(value_states)
        if self.window is not None:
            return self._window_view()
        columns = self.owner.full_columns
        return state.cache_keys[layer, :, :, :columns], state.cache_values[layer, :, :, :columns]

    def _window_view(self):
        """Cache columns ``[n - W + 1, n]`` of this layer, at the step's indices (`EngineCache.window_columns`)."""
        state = self.owner.state
        columns = self.owner.window_columns[self.window]
        return (state.cache_keys[self.layer].index_select(2, columns),
                state.cache_values[self.layer].index_select(2, columns))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.owner.mode != PREFILL:
            raise RuntimeError("Engine decode steps build their own masks; a host-side mask size was requested.")
        return query_length, 0

    def get_seq_length(self) -> int:
        if self.owner.mode != PREFILL:
            # A host-side length would be frozen into a captured graph: the engine passes position_ids.
            raise RuntimeError("Engine decode steps must not read the cache length on the host.")
        return 0

    def get_max_length(self) -> int:
        return self.owner.state.capacity

    def reset(self) -> None:
        raise RuntimeError("Reset the engine (OdaStaticEngine.reset), not its cache view.")


class EngineCache(Cache):
    """`Cache` facade over `EngineState` for one mode (prefill, local or full).

    `windows`: per layer, the native window ``W`` of a sliding-window layer, None for a full-attention layer;
    `window_columns`: per width W, the engine's buffer of the step's window columns (filled once per step).
    """

    def __init__(self, state: EngineState, mode: str, windows: list[int | None],
                 window_columns: dict[int, torch.Tensor]):
        self.state, self.mode = state, mode
        #: Full mode: columns the attention reads (the current length bucket's capacity).
        self.full_columns = state.capacity
        #: Verify mode: the first column the pass writes (set by the engine before each pass).
        self.verify_start = 0
        self.window_columns = window_columns
        super().__init__(layers=[_EngineLayer(self, i, window) for i, window in enumerate(windows)])


def window_offsets(windows: list[int | None], device) -> dict[int, torch.Tensor]:
    """``{W: arange(-(W - 1), 1)}`` for each sliding-window width among `windows` (ascending)."""
    return {width: torch.arange(-(width - 1), 1, device=device) for width in sorted({w for w in windows if w})}
