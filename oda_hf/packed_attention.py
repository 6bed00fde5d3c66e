"""SDPA with the query heads of each KV group stacked, for the passes where transformers' choice is slow.

transformers' SDPA integration (``integrations/sdpa_attention.py``) picks one of three forms for grouped-query
attention: ``enable_gqa=True`` when there is no mask, ``pack_gqa`` (the query heads of one KV head stacked as
one block) for a single query token with a mask, and ``repeat_kv`` (K and V copied once per query head)
otherwise. On CPU the first is ~20% slower per call than the packed form, and the last copies the whole history
per layer: for a 4-token pass over 7K positions that copy costs more than the attention itself. Two ODA passes
hit those forms:

* a recalled single-token step without padding (no mask: ``enable_gqa``; always-Full keeps transformers' form, so
  that it stays stock ``generate()`` bit for bit), and
* exact decoding's verification pass, several tokens with a causal mask (``repeat_kv``).

`packed_sdpa_forward` stacks the query heads per KV head for both (the mask, when there is one, is repeated per
stacked head); each query row sees the same keys and mask, so the attention is the same, not bit-identical
(another kernel sums in another order). Everything else goes to transformers' own function.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "oda_packed_sdpa"


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention function, with query heads stacked per KV group where it would not."""
    groups = getattr(module, "num_key_value_groups", 1)
    length = query.shape[2]
    single_unmasked = length == 1 and attention_mask is None
    several_masked = length > 1 and attention_mask is not None and attention_mask.shape[1] == 1
    if groups == 1 or kwargs.get("position_bias") is not None or not (single_unmasked or several_masked):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups * length, dim)
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, length, value.shape[-1]).transpose(1, 2).contiguous(), None


@contextmanager
def packed_attention(model):
    """Use `packed_sdpa_forward` for the passes inside the block (models on ``sdpa`` only; others unchanged)."""
    config = model.config
    previous = config._attn_implementation
    if previous != "sdpa":
        yield
        return
    if AttentionInterface._global_mapping.get(PACKED_SDPA) is not packed_sdpa_forward:
        AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)  # a new name: nothing of transformers' changes
        AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    config._attn_implementation = PACKED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = previous
