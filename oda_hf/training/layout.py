"""Where the segments of a training batch are, and which positions carry supervision.

Everything here needs only ``input_ids``/``attention_mask``/``position_ids``/``labels`` (no model),
so the trainer can count eligible tokens of a whole optimizer update before any backbone runs.

Conventions (columns are 0-based, positions in the paper's sense are 1-based):

* a token is *valid* where ``attention_mask`` is 1 (all tokens without a mask);
* a *segment* starts at the first valid token of a row and wherever ``position_ids`` do not increase
  (packed sequences restart them at 0); it contains the valid tokens up to the next start;
* ``index`` is the 1-based position of a valid token inside its segment, counting valid tokens only
  (the same count `OdaCache` uses for sinks and window), so ``S_L(t)`` is
  ``index <= s  or  index >= index_t - w + 1``;
* column ``t`` is *eligible* when tokens ``t`` and ``t + 1`` are valid, in the same segment, with
  consecutive position ids, ``labels[t + 1] != -100`` and ``labels[t] != -100`` (when labels are given: a masked
  prompt's last token is never a routed step), and ``index_t > s + w``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class SequenceLayout:
    """Segment structure of a ``[batch, seq]`` token batch (all tensors ``[batch, seq]``)."""

    valid: torch.Tensor           # bool
    position_ids: torch.Tensor    # long, what the model receives (derived from the mask when not given)
    segment: torch.Tensor         # long, batch-unique segment id; -1 on invalid tokens
    index: torch.Tensor           # long, 1-based index inside the segment; 0 on invalid tokens
    segment_start: torch.Tensor   # bool
    prev_column: torch.Tensor     # long, column of the previous valid token of the same segment; -1 if none
    eligible: torch.Tensor        # bool
    sinks: int
    window: int

    @property
    def num_eligible(self) -> int:
        return int(self.eligible.sum())

    @property
    def num_segments(self) -> int:
        return int(self.segment.max()) + 1 if self.valid.any() else 0


def _check_sizes(sinks: int, window: int) -> None:
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise ValueError(f"sinks must be an integer >= 0; got {sinks!r}.")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an integer >= 1 (current token included); got {window!r}.")


def build_layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    sinks: int,
    window: int,
) -> SequenceLayout:
    """Segments, in-segment indices and eligibility of a token batch (see the module docstring)."""
    _check_sizes(sinks, window)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}.")
    batch, seq = input_ids.shape
    device = input_ids.device
    for name, tensor in (("attention_mask", attention_mask), ("position_ids", position_ids), ("labels", labels)):
        if tensor is not None and tuple(tensor.shape) != (batch, seq):
            raise ValueError(f"{name} must have the shape of input_ids {(batch, seq)}; got {tuple(tensor.shape)}.")
    valid = torch.ones(batch, seq, dtype=torch.bool, device=device) if attention_mask is None \
        else attention_mask.to(device).bool()
    if position_ids is None:
        position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)
    position_ids = position_ids.to(device).long()

    columns = torch.arange(seq, device=device).expand(batch, seq)
    # Previous valid column in the row (-1 if none): running max of valid column numbers, shifted by one.
    last_valid = torch.where(valid, columns, torch.full_like(columns, -1)).cummax(dim=-1).values
    prev_valid = torch.cat([torch.full_like(last_valid[:, :1], -1), last_valid[:, :-1]], dim=-1)
    prev_pos = position_ids.gather(1, prev_valid.clamp(min=0))
    segment_start = valid & ((prev_valid < 0) | (position_ids <= prev_pos))

    # Batch-unique segment ids: running count of starts over the flattened batch.
    segment = segment_start.flatten().long().cumsum(0).view(batch, seq) - 1
    segment = torch.where(valid, segment, torch.full_like(segment, -1))
    # 1-based index inside the segment: running count of valid tokens minus the count before the start.
    count = valid.flatten().long().cumsum(0).view(batch, seq)
    num_segments = int(segment_start.sum())
    base = torch.zeros(num_segments + 1, dtype=torch.long, device=device)
    base[segment[segment_start]] = count[segment_start] - 1
    index = torch.where(valid, count - base[segment.clamp(min=0)], torch.zeros_like(count))
    prev_column = torch.where(valid & ~segment_start, prev_valid, torch.full_like(prev_valid, -1))

    eligible = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    if seq > 1:
        nxt = slice(1, None)
        cur = slice(None, -1)
        ok = valid[:, cur] & valid[:, nxt] & (segment[:, cur] == segment[:, nxt])
        ok &= position_ids[:, nxt] == position_ids[:, cur] + 1
        ok &= index[:, cur] > sinks + window
        if labels is not None:
            labels = labels.to(device)
            # ...and, with labels, a current token that is itself labelled (generated): a masked prompt's last token
            # is never a routed step (the prefill is Full and sets the next step's H to its Full state), so it would
            # train a decision never made and hand the next position a Local H inference never gives
            ok &= (labels[:, nxt] != IGNORE_INDEX) & (labels[:, cur] != IGNORE_INDEX)
        eligible[:, cur] = ok
    return SequenceLayout(valid=valid, position_ids=position_ids, segment=segment, index=index,
                          segment_start=segment_start, prev_column=prev_column, eligible=eligible,
                          sinks=sinks, window=window)


def count_eligible(batch: dict, *, sinks: int, window: int) -> int:
    """Eligible positions of a collated batch (a dict with ``input_ids`` and optional mask/positions/labels)."""
    return build_layout(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"),
                        batch.get("labels"), sinks=sinks, window=window).num_eligible


def shift_within_segments(states: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """``out[b, t] = states[b, prev valid column of t's segment]``, zero at segment starts and invalid tokens."""
    prev = layout.prev_column
    gathered = states.gather(1, prev.clamp(min=0)[..., None].expand(-1, -1, states.shape[-1]))
    return torch.where((prev >= 0)[..., None], gathered, torch.zeros_like(gathered))
