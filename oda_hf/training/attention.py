"""Three-stream attention for paired supervision, plugged in through transformers' AttentionInterface.

The decoder runs on a batch that stacks ``[trunk; local_cf; full_cf]`` along the batch dimension
(``3B`` rows, same tokens and positions). In every attention layer, for query column ``t``:

* the *trunk* reads its own keys/values at ``j <= t`` (ordinary causal Full attention);
* each *counterfactual* reads the **trunk's** keys/values at ``j < t`` (Local-cf only inside
  ``S_L(t)`` on full-attention layers) plus its **own** key/value at ``j = t``.

The two partial attentions (trunk history, own current token) are merged by online softmax: one
fused SDPA call over the disjoint union of the two key sets, whose softmax is exactly the
log-sum-exp merge of the partials - what a decode step computes after appending the current token
to the committed cache. Counterfactual rows never write anything the trunk reads, so one forward gives,
for every position at once, what a Local step and a Full step from the trunk cache at ``t - 1``
would compute. Layer kinds follow ODA's rules: full-attention layers are restricted for Local-cf;
native sliding-window layers keep their window for both counterfactuals; Gemma4's KV-shared layers
get the storing layer's ``3B``-row keys/values through the model's own mechanism, so they need no
special case. Segment (packing) and padding boundaries are applied to every stream.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

from .layout import SequenceLayout

ATTENTION_NAME = "oda_paired"
_STREAMS = 3  # trunk, Local counterfactual, Full counterfactual (in this order along the batch)
QUERY_BLOCK = 256  # queries per SDPA call: bounds the mask to block x (T + block) booleans


@dataclass
class PairContext:
    """What the paired attention needs besides q/k/v; passed to the decoder as ``oda_pair=...``."""

    layout: SequenceLayout
    layer_kinds: list[str] | None  # config.layer_types (KV-shared layers keep their attention kind)
    block_size: int = QUERY_BLOCK
    _segments: object = field(default=None, repr=False)  # deltanet.SegmentRows, built once per forward

    def layer_kind(self, module) -> str:
        kind = getattr(module, "layer_type", None)
        if kind is None and self.layer_kinds is not None and getattr(module, "layer_idx", None) is not None:
            kind = self.layer_kinds[module.layer_idx]
        return kind or "full_attention"


def _sdpa_takes_gqa(query, valid, key, value) -> bool:
    """Whether SDPA is given the grouped keys as they are (``enable_gqa``) rather than repeated per query head (a
    function of its own so that a CPU test can take the CUDA path's repeat)."""
    return query.device.type == "cpu" or use_gqa_in_sdpa(valid, key, value)


def paired_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             sliding_window=None, softcap=None, oda_pair: PairContext | None = None, **kwargs):
    """AttentionInterface function: ``query`` ``[3B, Hq, T, D]``, ``key``/``value`` ``[3B, Hkv, T, D]``."""
    if oda_pair is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} only runs inside oda_hf.training.paired_streams(); the model was "
            "left in this mode. Call model.set_attn_implementation('sdpa') to restore it."
        )
    if dropout:
        raise ValueError("Paired supervision needs deterministic attention: put the backbone in eval() mode.")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("Learned attention sinks (s_aux) are not supported by paired supervision.")
    if softcap is not None:
        raise NotImplementedError("Attention logit soft-capping is not supported by paired supervision.")
    kind = oda_pair.layer_kind(module)
    if kind == "sliding_attention":
        window = sliding_window or getattr(module, "sliding_window", None) or module.config.sliding_window
    elif kind == "full_attention":
        window = None
    else:
        raise NotImplementedError(f"Paired supervision has no rule for attention layers of kind {kind!r}.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = three_stream_attention(query, key, value, oda_pair.layout, scale=scale, native_window=window,
                                 restrict_local=kind == "full_attention", block_size=oda_pair.block_size)
    return out.transpose(1, 2).contiguous(), None


def three_stream_attention(query, key, value, layout: SequenceLayout, *, scale: float,
                           native_window: int | None = None, restrict_local: bool = True,
                           block_size: int = QUERY_BLOCK) -> torch.Tensor:
    """Attention output ``[3B, Hq, T, Dv]`` of the three streams (see the module docstring).

    Per block of queries ``[t0, t1)`` and stream, one SDPA call over the keys ``[trunk j < t1 | own t0..t1-1]``
    with the mask ``[history(t) | diagonal]``: the softmax over that disjoint union is the online-softmax
    (log-sum-exp) merge of the history partial and the current-token partial, done inside the fused kernel.
    For the trunk its own current key already sits at column ``t`` of its keys, so no concatenation is needed.
    """
    rows, hq, seq, _ = query.shape
    batch = rows // _STREAMS
    if rows != _STREAMS * batch or tuple(layout.valid.shape) != (batch, seq):
        raise ValueError(f"Paired attention expects 3 x {tuple(layout.valid.shape)} rows; got query {tuple(query.shape)}.")
    q = query.view(_STREAMS, batch, hq, seq, -1)
    k = key.view(_STREAMS, batch, key.shape[1], seq, -1)
    v = value.view(_STREAMS, batch, value.shape[1], seq, -1)
    groups = hq // key.shape[1]
    native_gqa = groups > 1 and _sdpa_takes_gqa(query, layout.valid, key, value)
    if groups > 1 and not native_gqa:  # CUDA falls back to the math kernel for masked GQA: repeat instead
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    gqa = {"enable_gqa": True} if native_gqa else {}
    segment, index, valid = layout.segment, layout.index, layout.valid
    columns = torch.arange(seq, device=query.device)
    sinks, window = layout.sinks, layout.window

    out = torch.empty(_STREAMS, batch, hq, seq, v.shape[-1], dtype=query.dtype, device=query.device)
    for t0 in range(0, seq, block_size):
        t1 = min(seq, t0 + block_size)
        # History visibility of queries t0..t1-1 over keys 0..t1-1: j < t, same segment, both valid.
        q_idx, k_idx = index[:, t0:t1, None], index[:, None, :t1]
        history = (columns[None, None, :t1] < columns[t0:t1, None]) & (segment[:, t0:t1, None] == segment[:, None, :t1])
        history &= valid[:, t0:t1, None] & valid[:, None, :t1]
        if native_window is not None:
            history &= q_idx - k_idx < native_window
        local = history & ((k_idx <= sinks) | (k_idx >= q_idx - window + 1)) if restrict_local else history
        own = torch.eye(t1 - t0, dtype=torch.bool, device=query.device).expand(batch, -1, -1)

        trunk_mask = history | (columns[None, None, :t1] == columns[t0:t1, None])
        out[0, :, :, t0:t1] = F.scaled_dot_product_attention(
            q[0, :, :, t0:t1], k[0, :, :, :t1], v[0, :, :, :t1], attn_mask=trunk_mask[:, None], scale=scale, **gqa)
        for stream, visible in ((1, local), (2, history)):
            keys = torch.cat([k[0, :, :, :t1], k[stream, :, :, t0:t1]], dim=2)
            values = torch.cat([v[0, :, :, :t1], v[stream, :, :, t0:t1]], dim=2)
            out[stream, :, :, t0:t1] = F.scaled_dot_product_attention(
                q[stream, :, :, t0:t1], keys, values, attn_mask=torch.cat([visible, own], dim=-1)[:, None],
                scale=scale, **gqa)
    return out.view(rows, hq, seq, -1)


@contextlib.contextmanager
def paired_attention(model):
    """Switch `model` (a ``*ForCausalLM``) to the paired attention for the duration of the block."""
    AttentionInterface.register(ATTENTION_NAME, paired_attention_forward)  # idempotent; a new name, no override
    original = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
