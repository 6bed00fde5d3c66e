"""Every tensor the static engine owns, allocated once at fixed addresses.

A captured CUDA graph bakes in tensor addresses, so nothing here is ever reallocated while the
engine lives: requests reset values in place. The layout is the one `oda_hf.kernels` expects
(stacked layers first):

==================  ==================================  ===========================================
tensor              shape                               meaning
==================  ==================================  ===========================================
cache_keys/values   ``[L, B, Hkv, capacity, D]``        complete history (column ``n`` = next token;
                                                        left-padding columns included)
ws_keys/values      ``[L, B, Hkv, s + w, D]``           Local workspace ``[sinks | ring | current]``
full_keys/values    ``[L, B, Hkv, 1, D]``               Full candidate KV of the current step
column_valid        bool ``[B, capacity]``              False on prompt padding columns
cache_position      long ``[1]``                        ``n``: committed columns (shared by rows)
valid_count         long ``[B]``                        committed non-padding positions per row
selected_hidden     ``[B, d]``                          the head's H input (preceding selected hidden)
input_ids           long ``[B, 1]``                     the current token (copied in before a step)
decoding            bool ``[B]``                        False for a row that stopped (EOS): no Full pass for it
step_counter        long ``[1]``                        routed steps taken in this request
full_calls          long ``[B]``                        Full decisions per row in this request
decisions / scores  ``[capacity, B]``                   per-step routing record (bool / fp32 score)
in_window           bool ``[capacity, B]``              per-step: the row's history was within s + w
decision_table      bool ``[capacity, B]``              precomputed per-step decisions (Random)
threshold           fp32 ``[]``                         the head's threshold (not baked into graphs)
==================  ==================================  ===========================================
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch

from ..kernels import workspace_slot


@dataclass
class EngineState:
    cache_keys: torch.Tensor
    cache_values: torch.Tensor
    ws_keys: torch.Tensor
    ws_values: torch.Tensor
    full_keys: torch.Tensor
    full_values: torch.Tensor
    column_valid: torch.Tensor
    cache_position: torch.Tensor
    valid_count: torch.Tensor
    selected_hidden: torch.Tensor
    input_ids: torch.Tensor
    decoding: torch.Tensor
    step_counter: torch.Tensor
    full_calls: torch.Tensor
    decisions: torch.Tensor
    scores: torch.Tensor
    in_window: torch.Tensor
    decision_table: torch.Tensor
    threshold: torch.Tensor
    rows: torch.Tensor  # arange(B), for per-row workspace writes

    @classmethod
    def allocate(cls, *, layers: int, batch: int, kv_heads: int, head_dim: int, head_dim_v: int, hidden: int,
                 capacity: int, sinks: int, window: int, dtype: torch.dtype, device: torch.device) -> "EngineState":
        # Zeros, not empty: masked columns still enter SDPA's (zero-weighted) sum, and 0 * NaN would leak.
        kv = dict(dtype=dtype, device=device)
        width = sinks + window
        return cls(
            cache_keys=torch.zeros(layers, batch, kv_heads, capacity, head_dim, **kv),
            cache_values=torch.zeros(layers, batch, kv_heads, capacity, head_dim_v, **kv),
            ws_keys=torch.zeros(layers, batch, kv_heads, width, head_dim, **kv),
            ws_values=torch.zeros(layers, batch, kv_heads, width, head_dim_v, **kv),
            full_keys=torch.zeros(layers, batch, kv_heads, 1, head_dim, **kv),
            full_values=torch.zeros(layers, batch, kv_heads, 1, head_dim_v, **kv),
            column_valid=torch.ones(batch, capacity, dtype=torch.bool, device=device),
            cache_position=torch.zeros(1, dtype=torch.long, device=device),
            valid_count=torch.zeros(batch, dtype=torch.long, device=device),
            selected_hidden=torch.zeros(batch, hidden, **kv),
            input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device),
            decoding=torch.ones(batch, dtype=torch.bool, device=device),
            step_counter=torch.zeros(1, dtype=torch.long, device=device),
            full_calls=torch.zeros(batch, dtype=torch.long, device=device),
            decisions=torch.zeros(capacity, batch, dtype=torch.bool, device=device),
            scores=torch.full((capacity, batch), float("nan"), dtype=torch.float32, device=device),
            in_window=torch.zeros(capacity, batch, dtype=torch.bool, device=device),
            decision_table=torch.zeros(capacity, batch, dtype=torch.bool, device=device),
            threshold=torch.zeros((), dtype=torch.float32, device=device),
            rows=torch.arange(batch, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.cache_keys.shape[3]

    @property
    def batch_size(self) -> int:
        return self.cache_keys.shape[1]

    @property
    def sinks_plus_window(self) -> int:
        return self.ws_keys.shape[3]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- requests ----------------------------------------------------------------------------------
    def reset(self, used_columns: int) -> None:
        """Forget the previous request: its history, workspace, hidden state and routing counters.

        Only the columns the previous request wrote are cleared (clearing the whole capacity would
        cost a full-cache memset per request).
        """
        if used_columns:
            self.cache_keys[:, :, :, :used_columns].zero_()
            self.cache_values[:, :, :, :used_columns].zero_()
        for name in ("ws_keys", "ws_values", "full_keys", "full_values", "cache_position", "valid_count",
                     "selected_hidden", "input_ids", "step_counter", "full_calls", "decisions", "in_window",
                     "decision_table", "threshold"):
            getattr(self, name).zero_()
        self.scores.fill_(float("nan"))
        self.column_valid.fill_(True)
        self.decoding.fill_(True)

    def load_prefix(self, valid: torch.Tensor, sinks: int, window: int) -> None:
        """Set the counters and build the Local workspace after columns ``[0, n)`` of the cache were filled.

        `valid`: bool ``[B, n]``, False on left-padding columns. Sinks are each row's first `sinks`
        valid positions; the ring holds its last ``window - 1`` (slot rule of `kernels.workspace_slot`).
        """
        n = valid.shape[1]
        valid = valid.to(self.column_valid.device)
        self.column_valid[:, :n] = valid
        count = valid.sum(dim=1)
        position = valid.long().cumsum(dim=1) - 1  # 0-based valid position of each column
        keep = valid & ((position < sinks) | (position >= (count[:, None] - (window - 1)).clamp(min=sinks)))
        rows, columns = keep.nonzero(as_tuple=True)
        slots = workspace_slot(position[rows, columns], sinks, window)
        self.ws_keys[:, rows, :, slots] = self.cache_keys[:, rows, :, columns]
        self.ws_values[:, rows, :, slots] = self.cache_values[:, rows, :, columns]
        self.valid_count.copy_(count)
        self.cache_position.fill_(n)

    # -- one step's writes -----------------------------------------------------------------------------
    def commit(self, select_full: torch.Tensor, with_full: bool, sinks: int, window: int) -> None:
        """PyTorch twin of `kernels.fused_commit` without host reads (any device, capturable).

        Writes each row's selected candidate into cache column ``n`` and into the workspace slot of
        its next valid position (`workspace_slot`; with ``w = 1`` positions past the sinks have no
        slot and land in the current slot, which the next Local attempt overwrites anyway).
        """
        current = self.sinks_plus_window - 1
        slots = workspace_slot(self.valid_count, sinks, window)
        slots = torch.where(slots < 0, torch.full_like(slots, current), slots)
        pairs = ((self.cache_keys, self.ws_keys, self.full_keys), (self.cache_values, self.ws_values, self.full_values))
        for cache, workspace, full in pairs:
            local = workspace[:, :, :, current:]  # the Local candidate sits in the current slot
            pick = select_full.view(1, -1, 1, 1, 1)
            chosen = torch.where(pick, full, local) if with_full else local.clone()
            cache.index_copy_(3, self.cache_position, chosen)
            workspace[:, self.rows, :, slots] = chosen[:, :, :, 0].transpose(0, 1)

    def advance(self, select_full: torch.Tensor) -> None:
        """Move past the committed token (separate from the commit, as in the paper)."""
        self.cache_position += 1
        self.valid_count += 1
        self.step_counter += 1
        self.full_calls += select_full

    # -- warm-up / capture transactions --------------------------------------------------------------
    @contextmanager
    def preserved(self, column: int, sinks: int, window: int):
        """Undo everything one step writes, so warm-up or capture runs leave no trace.

        A step writes: cache column `column` (= ``n``) of every layer and row; each row's workspace
        slot for its next valid position and the current slot; the Full candidate scratch; the hidden
        state; the position and routing counters; and row ``step_counter`` of the routing record.
        Only those are saved (the routing record whole, it is small; of the caches only the touched
        column and slots), so a capture per length bucket stays cheap.
        """
        current = self.sinks_plus_window - 1
        slots = workspace_slot(self.valid_count, sinks, window)
        slots = torch.where(slots < 0, torch.full_like(slots, current), slots)
        saved_ws = [t[:, self.rows, :, slots].clone() for t in (self.ws_keys, self.ws_values)]
        saved_current = [t[:, :, :, current].clone() for t in (self.ws_keys, self.ws_values)]
        saved_column = [t[:, :, :, column].clone() for t in (self.cache_keys, self.cache_values)]
        small = ("full_keys", "full_values", "cache_position", "valid_count", "selected_hidden", "step_counter",
                 "full_calls", "decisions", "scores", "in_window")
        saved_small = {name: getattr(self, name).clone() for name in small}
        try:
            yield
        finally:
            for t, saved in zip((self.cache_keys, self.cache_values), saved_column):
                t[:, :, :, column] = saved
            for t, saved in zip((self.ws_keys, self.ws_values), saved_ws):
                t[:, self.rows, :, slots] = saved
            for t, saved in zip((self.ws_keys, self.ws_values), saved_current):
                t[:, :, :, current] = saved
            for name, saved in saved_small.items():
                getattr(self, name).copy_(saved)
