"""`OdaCache`: one committed history, two ways of reading it.

Every decode step runs the backbone once in *local* mode (full-attention layers read only the
sinks + recent-window workspace) and, when routing asks for it, once more in *full* mode (they read
the complete history). Neither pass commits anything: each layer keeps the current token's
candidate state as *pending*, and `OdaCache.commit(select_full)` writes the selected candidate of
every row into both history views at once.

Layer kinds (from `transformers.cache_utils.get_layer_types_and_kwargs`):

* ``full_attention``  -> `OdaGlobalLayer`: full KV buffer (grown geometrically, written in place)
  plus the Local workspace ``[sinks (s) | ring (w - 1) | current (1)]``.
* ``sliding_attention`` / ``chunked_attention`` -> `OdaSlidingWindowLayer`: native window, only the
  append is deferred until commit.
* ``linear_attention`` -> `OdaLinearAttentionLayer`: Gated DeltaNet conv/recurrent state updated in
  place by the model; snapshot before Local, restore before a Full retry, select per row after.
* ``dummy`` (KV-shared consumers) -> `DummyLayer`: they see whatever the storing layer returned.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

PREFILL, LOCAL, FULL = "prefill", "local", "full"
_MODES = (PREFILL, LOCAL, FULL)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention", "dummy")


def workspace_geometry(sinks: int, window: int, max_positions: int) -> tuple[int, int]:
    """The smallest ``(sinks, window)`` whose Local access sets equal those of ``(sinks, window)`` for
    every position below `max_positions`: a workspace of ``s + w`` slots never needs more than
    ``max_positions + 1`` (all positions up to the last one, the current token's slot included).
    """
    ws_sinks = min(sinks, max_positions)
    return ws_sinks, min(window, max(1, max_positions + 1 - ws_sinks))


def select_rows(select_full: torch.Tensor | None, full: torch.Tensor | None, local: torch.Tensor) -> torch.Tensor:
    """Per-row choice between two candidates whose batch dimension is dim 0."""
    if select_full is None or full is None:
        return local
    shape = (-1,) + (1,) * (local.dim() - 1)
    return torch.where(select_full.to(local.device).view(shape), full, local)


def removal_count(tokens_to_remove: int) -> int:
    """How many positions ``crop(tokens_to_remove)`` removes under transformers' contract (``crop(-k)`` removes the
    last ``k``, ``crop(0)`` none; transformers' own deferred stop check calls ``crop(0)`` after every step). A positive
    count, which older transformers read as a length to keep, is refused as transformers refuses it."""
    if tokens_to_remove > 0:
        raise ValueError(f"crop({tokens_to_remove}): crop takes the number of positions to remove as a negative count "
                         f"(crop(-2) removes the last two); to keep the first {tokens_to_remove} positions call "
                         f"crop_to({tokens_to_remove}).")
    return -tokens_to_remove


class OdaGlobalLayer(CacheLayerMixin):
    """A layer that natively attends to the whole history: Local restricts it to sinks + window.

    Storage:
    * ``keys``/``values``: ``[batch, kv_heads, capacity, head_dim]``; columns ``< seq_length`` are
      committed (left padding included, as in the stock cache). A committed token is written in
      place rather than concatenated: capacity is preallocated when the final length is known
      (`generate()` knows it) and otherwise doubles when full.
    * ``ws_keys``/``ws_values``: ``[batch, kv_heads, width, head_dim]`` laid out as
      ``[sinks | ring | current]``. The ring slot of 1-based valid position ``p > s`` is
      ``(p - s - 1) % (w - 1)``; positions keep their original RoPE rotation. ``width`` is
      ``s + w`` once the history can reach that; before, it is only as wide as the history needs
      (the request's maximum length when known, else grown geometrically). While ``width < s + w``
      the ring has not wrapped, so every committed position ``p`` sits in slot ``p`` and the
      current token in the last slot: exactly the ``s + w`` layout without its unused slots.
    * ``valid_count[b]``: committed non-padding positions of row ``b`` (its logical length).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, sinks: int, window: int, max_cache_len: int | None = None, **kwargs):
        super().__init__()
        self.sinks, self.window = sinks, window
        self.max_cache_len = max_cache_len
        self.mode = PREFILL
        self.seq_length = 0
        self.ws_keys = self.ws_values = None
        self.valid_count: torch.Tensor | None = None  # long, on CPU: ring addressing is host bookkeeping
        # some row's history has masked columns after its first real one (as of the last rebuild): `crop` cannot
        # re-derive the workspace from `valid_count` alone
        self.interior_holes = False
        self.pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- storage ---------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.keys = key_states.new_zeros((b, h, self.max_cache_len or 0, dk))
        self.values = value_states.new_zeros((b, h, self.max_cache_len or 0, dv))
        # Committed positions plus the current slot; never more than the request can reach.
        needed = max(self.max_cache_len or 0, key_states.shape[-2]) + 1
        width = min(self.sinks + self.window, needed)
        self.ws_keys = key_states.new_zeros((b, h, width, dk))
        self.ws_values = value_states.new_zeros((b, h, width, dv))
        self.valid_count = torch.zeros(b, dtype=torch.long)
        self.is_initialized = True

    @property
    def workspace_width(self) -> int:
        return self.ws_keys.shape[-2]

    def _ensure_workspace(self, needed: int) -> None:
        """Widen the workspace to hold `needed` slots (capped at s + w), keeping the committed positions."""
        full_width = self.sinks + self.window
        width = self.workspace_width
        needed = min(full_width, needed)
        if needed <= width:
            return
        new_width = min(full_width, max(needed, 2 * width))
        for name in ("ws_keys", "ws_values"):
            old = getattr(self, name)
            grown = old.new_zeros((*old.shape[:2], new_width, old.shape[-1]))
            grown[:, :, : width - 1] = old[:, :, : width - 1]  # no wrap yet: slot p holds position p
            setattr(self, name, grown)

    def _reserve(self, needed: int) -> None:
        capacity = self.keys.shape[-2]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, 16)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros((*old.shape[:2], new_capacity, old.shape[-1]))
            grown[:, :, : self.seq_length] = old[:, :, : self.seq_length]
            setattr(self, name, grown)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.seq_length, key_states.shape[-2]
        if self.mode == PREFILL:
            self._reserve(n + q)
            self.keys[:, :, n : n + q] = key_states
            self.values[:, :, n : n + q] = value_states
            self.seq_length = n + q
            return self.keys[:, :, : n + q], self.values[:, :, : n + q]
        if q != 1:
            raise ValueError(f"OdaCache routes one token per step; got {q} query tokens in {self.mode} mode.")
        self.pending[self.mode] = (key_states, value_states)
        if self.mode == LOCAL:
            self.ws_keys[:, :, -1:] = key_states
            self.ws_values[:, :, -1:] = value_states
            return self.ws_keys, self.ws_values
        # FULL: the candidate sits at column n, which only commit() makes part of the history.
        self._reserve(n + 1)
        self.keys[:, :, n : n + 1] = key_states
        self.values[:, :, n : n + 1] = value_states
        return self.keys[:, :, : n + 1], self.values[:, :, : n + 1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_length

    def get_max_length(self) -> int:
        return -1

    # -- Local workspace -------------------------------------------------------------------------
    def _workspace_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Workspace slot of each 0-based valid position (sinks first, then the ring)."""
        ring = self.window - 1
        in_sinks = positions < self.sinks
        ring_slot = self.sinks + (positions - self.sinks).clamp(min=0) % max(ring, 1)
        return torch.where(in_sinks, positions, ring_slot)

    def _workspace_keeps(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        """Which of a row's 0-based valid positions (of `count`) the workspace holds."""
        return (positions < self.sinks) | (positions >= max(self.sinks, count - (self.window - 1)))

    def rebuild_workspace(self, valid_columns: torch.Tensor) -> None:
        """Fill the workspace from the committed history. `valid_columns`: bool ``[batch, seq_length]``."""
        self._ensure_workspace(int(valid_columns.sum(dim=1).max()) + 1)
        self.ws_keys.zero_()
        self.ws_values.zero_()
        valid_columns = valid_columns.cpu()
        self.interior_holes = False
        for row in range(valid_columns.shape[0]):
            columns = valid_columns[row].nonzero().flatten()
            count = columns.numel()
            self.interior_holes |= count > 0 and int(columns[0]) != valid_columns.shape[1] - count
            positions = torch.arange(count)
            keep = self._workspace_keeps(positions, count)
            slots = self._workspace_slots(positions[keep]).to(self.device)
            src = columns[keep].to(self.device)
            self.ws_keys[row, :, slots] = self.keys[row, :, src]
            self.ws_values[row, :, slots] = self.values[row, :, src]
            self.valid_count[row] = count

    def local_visibility(self) -> torch.Tensor:
        """bool ``[batch, width]``: which workspace slots the current Local query may read."""
        slots = torch.arange(self.workspace_width)
        count = self.valid_count[:, None]
        sink_ok = slots[None, :] < torch.minimum(count, torch.tensor(self.sinks))
        ring_index = slots[None, :] - self.sinks
        ring_filled = (count - self.sinks).clamp(min=0, max=self.window - 1)
        ring_ok = (slots[None, :] >= self.sinks) & (ring_index < ring_filled)
        current = slots[None, :] == self.workspace_width - 1
        return sink_ok | ring_ok | current

    # -- commit ----------------------------------------------------------------------------------
    def workspace_write_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) on this layer's device where each row's next committed position goes.

        Every global layer of a cache shares `valid_count`, so `OdaCache.commit` computes this once per step.
        """
        rows = torch.arange(self.valid_count.shape[0], device=self.device)
        return rows, self._workspace_slots(self.valid_count).to(self.device)

    def commit(self, select_full: torch.Tensor | None, write_index: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        local, full = self.pending.get(LOCAL), self.pending.get(FULL)
        if local is None and full is None:
            raise RuntimeError("commit() called without a pending candidate.")
        if local is None:
            keys, values = full
        else:
            keys = select_rows(select_full, full and full[0], local[0])
            values = select_rows(select_full, full and full[1], local[1])
        n = self.seq_length
        self._reserve(n + 1)
        if self.workspace_width < self.sinks + self.window:  # after this commit: positions + the next current slot
            self._ensure_workspace(int(self.valid_count.max()) + 2)
        self.keys[:, :, n : n + 1] = keys
        self.values[:, :, n : n + 1] = values
        self.seq_length = n + 1
        if write_index is None:
            write_index = self.workspace_write_index()
        rows, slots = (t.to(self.device) for t in write_index)  # no-op unless layers span devices
        self.ws_keys[rows, :, slots] = keys[:, :, 0]
        self.ws_values[rows, :, slots] = values[:, :, 0]
        self.valid_count += 1
        self.pending.clear()

    # -- batch bookkeeping -----------------------------------------------------------------------
    def _index_rows(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        dev = indices.to(self.device)
        self.keys, self.values = self.keys[dev], self.values[dev]
        self.ws_keys, self.ws_values = self.ws_keys[dev], self.ws_values[dev]
        self.valid_count = self.valid_count[indices.cpu()]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_rows(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_rows(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers' contract: ``crop(0)`` removes none, a
        positive count is refused); `crop_to` keeps a given length."""
        self.crop_to(self.seq_length - removal_count(tokens_to_remove))

    def crop_to(self, max_length: int) -> None:
        """Keep the first `max_length` positions.

        The complete history is kept, so the Local workspace is re-derived from it: the ring slots the removed
        positions overwrote get their older positions back. Rows are left-padded (as `generate` pads), so a row's
        valid positions are its last `valid_count` columns and cropping removes the same count from every row."""
        self.check_crop(max_length)
        removed = self.seq_length - max_length
        if not self.is_initialized or removed <= 0:
            return
        self.seq_length = max_length
        self.valid_count -= removed
        self.sync_workspace()

    def check_crop(self, max_length: int) -> None:
        """Raise if `crop_to(max_length)` cannot be done (nothing changes here)."""
        if not self.is_initialized:
            return
        if self.pending:
            raise RuntimeError("crop() with an uncommitted step: commit or discard it first.")
        removed = self.seq_length - max_length
        if removed <= 0:
            return
        if removed > int(self.valid_count.min()):
            raise ValueError(f"crop_to({max_length}) would remove {removed} positions, more than a row holds.")
        if self.interior_holes:   # the workspace would be re-derived from other columns than the row's own
            raise ValueError("crop() needs every row's history to be its last columns (left padding), but a row of "
                             "this cache has masked columns inside its history (attention_mask zeros after its first "
                             "real token). Generate again from the shorter prompt instead.")

    def sync_workspace(self) -> None:
        """Write every row's sinks and its last ``window - 1`` valid positions into the workspace from the complete
        history (after positions were removed, or appended by a multi-token forward: `OdaCache.extend_workspace`).
        Rows are left-padded: a row's valid positions are its last `valid_count` columns."""
        self._ensure_workspace(int(self.valid_count.max()) + 1)
        for row in range(self.valid_count.shape[0]):
            count = int(self.valid_count[row])
            sinks = min(self.sinks, count)
            positions = torch.cat([torch.arange(sinks), torch.arange(max(sinks, count - (self.window - 1)), count)])
            if positions.numel() == 0:
                continue
            slots = self._workspace_slots(positions).to(self.device)
            columns = (positions + (self.seq_length - count)).to(self.device)
            self.ws_keys[row, :, slots] = self.keys[row, :, columns]
            self.ws_values[row, :, slots] = self.values[row, :, columns]

    def reset(self) -> None:
        self.keys = self.values = self.ws_keys = self.ws_values = None
        self.valid_count = None
        self.interior_holes = False
        self.seq_length = 0
        self.pending.clear()
        self.is_initialized = False


class OdaSlidingWindowLayer(DynamicSlidingWindowLayer):
    """A native sliding-window layer: same computation in both modes, append deferred to commit."""

    is_croppable = True

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window)
        self.mode = PREFILL
        self.pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, *args, **kwargs):
        if self.mode == PREFILL:
            return super().update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending[self.mode] = (key_states, value_states)
        # With past recording on (exact decoding) the layer may hold more than its window: attend to the window.
        held = self.keys.shape[-2] - max(self.sliding_window - 1, 0)
        keys, values = (self.keys[:, :, held:], self.values[:, :, held:]) if held > 0 else (self.keys, self.values)
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    def commit(self, select_full: torch.Tensor | None) -> None:
        local, full = self.pending.get(LOCAL), self.pending.get(FULL)
        if local is None:
            keys, values = full
        else:
            keys = select_rows(select_full, full and full[0], local[0])
            values = select_rows(select_full, full and full[1], local[1])
        super().update(keys, values)
        self.pending.clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions and go back to the window (transformers' contract:
        ``crop(0)`` removes none, a positive count is refused); `crop_to` keeps a given length."""
        if self.is_initialized:
            self.crop_to(self.cumulative_length - removal_count(tokens_to_remove))
        else:
            removal_count(tokens_to_remove)

    def crop_to(self, max_length: int) -> None:
        """Keep the first `max_length` positions, of which the layer then holds its last ``sliding_window - 1``.
        It holds no more than those unless past recording is on (`activate_past_recording`, as exact decoding and
        transformers' deferred stop check do): a crop needing an evicted position is an error, never a silent wrong
        window."""
        self.check_crop(max_length)
        if not self.is_initialized:
            return
        length = self.cumulative_length
        held = self.keys.shape[-2]  # positions [length - held, length)
        start = max(0, max_length - (self.sliding_window - 1))
        begin, end = start - (length - held), min(max_length, length) - (length - held)
        self.keys, self.values = self.keys[:, :, begin:end], self.values[:, :, begin:end]
        self.cumulative_length = min(max_length, length)

    def check_crop(self, max_length: int) -> None:
        """Raise if `crop_to(max_length)` cannot be done (nothing changes here)."""
        if not self.is_initialized:
            return
        if self.pending:
            raise RuntimeError("crop() with an uncommitted step: commit or discard it first.")
        length, held = self.cumulative_length, self.keys.shape[-2]
        start = max(0, max_length - (self.sliding_window - 1))
        if max_length < length and start < length - held:
            raise ValueError(
                f"This sliding-window layer no longer holds position {start} (it keeps its last {held}); call "
                "activate_past_recording() before the steps that may be cropped.")


class OdaLinearAttentionLayer(LinearAttentionLayer):
    """Gated DeltaNet state: the model overwrites it in place, so a Full retry must first restore it."""

    def _state_tensors(self) -> list[tuple[dict, int]]:
        return [
            (store, i)
            for store, ready in ((self.conv_states, self.is_conv_states_initialized),
                                 (self.recurrent_states, self.is_recurrent_states_initialized))
            for i in range(self.number_of_states)
            if ready[i]
        ]

    def snapshot(self) -> list[torch.Tensor]:
        return [store[i].clone() for store, i in self._state_tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for (store, i), value in zip(self._state_tensors(), saved):
            store[i].copy_(value)  # copy, not rebind: the model and CUDA graphs hold these addresses

    def select(self, select_full: torch.Tensor, local_state: list[torch.Tensor]) -> None:
        """Current state holds Full's update; put Local's back in the rows that selected Local."""
        for (store, i), local in zip(self._state_tensors(), local_state):
            store[i].copy_(select_rows(select_full, store[i], local))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ValueError(
            "Gated DeltaNet state is one recurrent state, not one entry per position: it cannot be cropped. Take an "
            "OdaCache.checkpoint() before the steps to undo and rollback() to it.")


class OdaCache(Cache):
    """The ODA cache: complete history for Full, sinks + ring workspace for Local, per-row commit.

    `max_cache_len` (optional) preallocates the full-history buffers for that many positions.
    It also carries the preceding selected hidden state (the head's `H` input), so that beam
    reordering and batch selection keep it aligned with the history it came from.
    """

    is_compileable = False

    def __init__(self, config, sinks: int, window: int, max_cache_len: int | None = None):
        text_config = config.get_text_config(decoder=True)
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text_config)
        unsupported = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
        if unsupported:
            raise ValueError(
                f"OdaCache does not support layer types {unsupported} (supported: {list(SUPPORTED_LAYER_TYPES)})."
            )
        if "full_attention" not in layer_types:
            raise ValueError(
                "This model has no full-attention layer, so Local and Full attention would be identical: "
                "ODA has nothing to route. (Layer types: %s)" % sorted(set(layer_types))
            )
        layers = []
        for layer_type, kwargs in zip(layer_types, per_layer_kwargs):
            if layer_type == "full_attention":
                layers.append(OdaGlobalLayer(sinks=sinks, window=window, max_cache_len=max_cache_len))
            elif layer_type in ("sliding_attention", "chunked_attention"):
                layers.append(OdaSlidingWindowLayer(**kwargs))
            elif layer_type == "linear_attention":
                layers.append(OdaLinearAttentionLayer(**kwargs))
            else:
                layers.append(DummyLayer())
        super().__init__(layers=layers)
        self.layer_types = layer_types
        self.sinks, self.window = sinks, window
        self.selected_hidden: torch.Tensor | None = None
        self._pre_step_state: list[list[torch.Tensor]] | None = None
        self._local_state: list[list[torch.Tensor]] | None = None
        #: Called with the row indices on every beam reorder (the routing record follows its rows).
        self.on_reorder: list = []

    def __deepcopy__(self, memo):
        """A copy of the cached state whose reorders still reach the same listeners: the callbacks are not copied (a
        model's bound method would copy the whole model, its weights included, and the copy's reorders would reach
        that copy, not the model decoding with it)."""
        memo[id(self.on_reorder)] = list(self.on_reorder)
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()})
        return clone

    # -- modes -----------------------------------------------------------------------------------
    @property
    def global_layers(self) -> list[OdaGlobalLayer]:
        return [layer for layer in self.layers if isinstance(layer, OdaGlobalLayer)]

    @property
    def linear_layers(self) -> list[OdaLinearAttentionLayer]:
        return [layer for layer in self.layers if isinstance(layer, OdaLinearAttentionLayer)]

    def set_mode(self, mode: str) -> None:
        if mode not in _MODES:
            raise ValueError(f"Unknown OdaCache mode {mode!r}; expected one of {_MODES}.")
        for layer in self.layers:
            if hasattr(layer, "pending"):
                layer.mode = mode

    # -- one routed step -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Snapshot recurrent state so that a Full retry can start from the same pre-step history."""
        self._pre_step_state = [layer.snapshot() for layer in self.linear_layers]
        self._local_state = None

    def prepare_full_retry(self) -> None:
        """Keep Local's recurrent update aside, then restore the pre-step state for Full."""
        if self._pre_step_state is None:
            raise RuntimeError("prepare_full_retry() called before begin_step().")
        self._local_state = [layer.snapshot() for layer in self.linear_layers]
        for layer, saved in zip(self.linear_layers, self._pre_step_state):
            layer.restore(saved)

    def full_retry_rows(self, rows: torch.Tensor) -> "FullRetryRows":
        """A cache holding only `rows` (long ``[k]``) of the pre-step history, for a Full retry of those rows.

        Run the Full pass on it with the rows' inputs, then `scatter_full_rows` puts its candidates back.
        Recurrent (Gated DeltaNet) state is updated in place by the model, so hybrids retry the whole batch.
        """
        if self.linear_layers:
            raise ValueError("A per-row Full retry is not available with recurrent-state layers; retry the whole batch.")
        return FullRetryRows(self, rows)

    def scatter_full_rows(self, retry: "FullRetryRows", rows: torch.Tensor) -> None:
        """Full candidates of `retry` become those of `rows`; the other rows keep their Local candidate (they do
        not select Full, so `commit` never reads their Full entry)."""
        for layer, sub in zip(self.layers, retry.layers):
            if not hasattr(layer, "pending") or FULL not in sub.pending:
                continue
            local_keys, local_values = layer.pending[LOCAL]
            sub_keys, sub_values = sub.pending[FULL]
            index = rows.to(local_keys.device)
            layer.pending[FULL] = (local_keys.index_copy(0, index, sub_keys), local_values.index_copy(0, index, sub_values))

    def commit(self, select_full: torch.Tensor | None) -> None:
        """Commit the selected candidate of every row. `select_full`: bool ``[batch]`` or None (= Local)."""
        if self._local_state is not None and select_full is not None:
            for layer, local in zip(self.linear_layers, self._local_state):
                layer.select(select_full, local)
        global_layers = [layer for layer in self.global_layers if layer.is_initialized]
        write_index = global_layers[0].workspace_write_index() if global_layers else None
        for layer in self.layers:
            if isinstance(layer, OdaGlobalLayer):
                layer.commit(select_full, write_index)
            elif hasattr(layer, "commit"):
                layer.commit(select_full)
        self._pre_step_state = self._local_state = None
        self.set_mode(PREFILL)

    def discard_pending(self) -> None:
        """Drop uncommitted candidates (e.g. after an exception mid-step) and restore recurrent state."""
        if self._pre_step_state is not None:
            for layer, saved in zip(self.linear_layers, self._pre_step_state):
                layer.restore(saved)
        for layer in self.layers:
            if hasattr(layer, "pending"):
                layer.pending.clear()
        self._pre_step_state = self._local_state = None
        self.set_mode(PREFILL)

    def rebuild_workspace(self, attention_mask: torch.Tensor | None, batch_size: int) -> None:
        """Re-derive every Local workspace from the committed history (after a multi-token forward)."""
        n = self.get_seq_length()
        if attention_mask is None:
            valid = torch.ones(batch_size, n, dtype=torch.bool)
        else:
            if attention_mask.dim() != 2 or attention_mask.shape[-1] != n:
                raise ValueError(
                    f"ODA needs a 2D attention_mask covering the whole history ({n} columns); got shape "
                    f"{tuple(attention_mask.shape)}."
                )
            valid = attention_mask.bool()
        for layer in self.global_layers:
            if layer.is_initialized:
                layer.rebuild_workspace(valid)

    def extend_workspace(self, added: int) -> None:
        """After a multi-token Full forward appended `added` positions to every row (exact decoding's verification),
        count them as valid and bring the Local workspaces up to date."""
        for layer in self.global_layers:
            if layer.is_initialized:
                layer.valid_count += added
                layer.sync_workspace()

    def local_visibility(self) -> torch.Tensor:
        return self.global_layers[0].local_visibility()

    def rows_within_window(self) -> torch.Tensor:
        """bool ``[batch]`` (CPU): rows whose next step's history (committed positions plus the current token)
        fits in sinks + window, where Local reads every position Full reads."""
        return self.global_layers[0].valid_count + 1 <= self.sinks + self.window

    def load_history(self, key_values, attention_mask: torch.Tensor | None = None) -> None:
        """Commit KV computed elsewhere as this cache's history (e.g. a stock prefill, or a synthetic one).

        `key_values`: one ``(keys, values)`` pair ``[batch, kv_heads, n, head_dim]`` per layer (None for
        KV-shared layers), RoPE already applied, as a stock `DynamicCache` holds them. Any iterable works
        and is consumed one layer at a time, so a generator never holds more than one layer's history.
        Recurrent (Gated DeltaNet) state cannot be rebuilt from KV, so hybrids must prefill through the model.
        """
        if self.get_seq_length() != 0:
            raise ValueError("load_history() needs an empty OdaCache.")
        if self.linear_layers:
            raise ValueError("Recurrent-state layers cannot be loaded from KV; prefill hybrids through the model.")
        self.set_mode(PREFILL)
        sliding, length, batch_size, count = [], 0, None, 0
        for index, (layer, kv) in enumerate(zip(self.layers, key_values)):
            count += 1
            if isinstance(layer, DummyLayer):
                continue
            if kv is None:
                raise ValueError(f"Layer {index} stores KV but got None.")
            keys, values = kv
            batch_size = keys.shape[0]
            if isinstance(layer, OdaSlidingWindowLayer):
                keep = min(keys.shape[-2], layer.sliding_window - 1)
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys[:, :, keys.shape[-2] - keep :], values[:, :, values.shape[-2] - keep :]
                sliding.append(layer)
            else:
                layer.update(keys, values)
                length = max(length, keys.shape[-2])
        if count != len(self.layers):
            raise ValueError(f"Expected one (keys, values) per layer ({len(self.layers)}), got {count}.")
        for layer in sliding:  # they hold only their last window - 1 positions: the length comes from global layers
            layer.cumulative_length = length
        self.rebuild_workspace(attention_mask, batch_size)

    # -- batch bookkeeping -----------------------------------------------------------------------
    def _index_hidden(self, indices: torch.Tensor) -> None:
        if self.selected_hidden is not None:
            self.selected_hidden = self.selected_hidden[indices.to(self.selected_hidden.device)]

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._index_hidden(beam_idx)
        for callback in self.on_reorder:
            callback(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._index_hidden(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.selected_hidden is not None:
            self.selected_hidden = self.selected_hidden.repeat_interleave(repeats, dim=0)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions from every layer, as transformers' `Cache.crop`
        (``crop(0)`` removes none; a positive count is refused: `crop_to` keeps a given length). Hybrids with
        recurrent (Gated DeltaNet) state cannot remove positions: use `checkpoint` / `rollback`."""
        self.crop_to(self.get_seq_length() - removal_count(tokens_to_remove))

    def crop_to(self, max_length: int) -> None:
        """Keep the first `max_length` positions in every layer (window layers then hold their window)."""
        removed = self.get_seq_length() - max_length
        if self.linear_layers and removed > 0:
            self.linear_layers[0].crop(-removed)  # raises, naming checkpoint/rollback
        croppable = [layer for layer in self.layers if isinstance(layer, (OdaGlobalLayer, OdaSlidingWindowLayer))]
        for layer in croppable:   # every layer first: a refusal leaves none cropped
            layer.check_crop(max_length)
        for layer in croppable:
            layer.crop_to(max_length)

    def checkpoint(self) -> "CacheCheckpoint":
        """The committed state now, to `rollback` to after speculative steps (no pending step allowed)."""
        if any(getattr(layer, "pending", None) for layer in self.layers):
            raise RuntimeError("checkpoint() with an uncommitted step: commit or discard it first.")
        return CacheCheckpoint(
            length=self.get_seq_length(),
            sliding=[(layer.keys, layer.values, layer.cumulative_length) if layer.is_initialized else None
                     for layer in self.layers if isinstance(layer, OdaSlidingWindowLayer)],
            linear=[layer.snapshot() for layer in self.linear_layers],
            selected_hidden=self.selected_hidden,
        )

    def rollback(self, checkpoint: "CacheCheckpoint") -> None:
        """Return to `checkpoint`: drop pending candidates and every position committed after it."""
        self.discard_pending()
        for layer in self.global_layers:
            layer.crop_to(checkpoint.length)
        sliding = [layer for layer in self.layers if isinstance(layer, OdaSlidingWindowLayer)]
        for layer, saved in zip(sliding, checkpoint.sliding):
            if saved is not None:  # update() replaces these tensors, never writes into them
                layer.keys, layer.values, layer.cumulative_length = saved
        for layer, saved in zip(self.linear_layers, checkpoint.linear):
            layer.restore(saved)
        self.selected_hidden = checkpoint.selected_hidden


@dataclass
class CacheCheckpoint:
    """What `OdaCache.rollback` needs: the history length, sliding-window tensors, recurrent state."""

    length: int
    sliding: list
    linear: list
    selected_hidden: torch.Tensor | None


class FullRetryRows(Cache):
    """Some rows of an `OdaCache`'s pre-step history, gathered into a smaller batch for a Full retry.

    Each layer is a shallow copy of the parent's layer with its tensors indexed by the rows (a copy of
    those rows' history: gathering costs one read and write of it, which is why a retry of most rows
    runs on the whole batch instead). Nothing here is ever committed: `OdaCache.scatter_full_rows` takes
    its pending Full candidates.
    """

    is_compileable = False

    def __init__(self, parent: OdaCache, rows: torch.Tensor):
        super().__init__(layers=[_layer_rows(layer, rows) for layer in parent.layers])
        self.layer_types = parent.layer_types


def _layer_rows(layer, rows: torch.Tensor):
    if isinstance(layer, DummyLayer) or not getattr(layer, "is_initialized", False):
        return layer
    sub = copy.copy(layer)
    sub.pending, sub.mode = {}, FULL
    index = rows.to(layer.keys.device)
    if isinstance(layer, OdaGlobalLayer):
        n = layer.seq_length
        layer._reserve(n + 1)  # room for the candidate column: the retry writes it, nothing grows
        sub.keys = layer.keys[:, :, : n + 1].index_select(0, index)
        sub.values = layer.values[:, :, : n + 1].index_select(0, index)
        sub.ws_keys = sub.ws_values = None  # Full never reads the Local workspace
        sub.valid_count = layer.valid_count[rows.cpu()]
    else:
        sub.keys, sub.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
    return sub
