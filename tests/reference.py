"""An independent ODA reference: one full forward with an explicit per-row, per-query access mask.

Query position t reads every earlier valid position when step t was prompt/Full, and only
S_L(t) = {first s valid positions} U {last w valid positions up to t} when it was Local. Because
position t's states in every layer depend only on its own access set and on earlier positions'
states, one masked forward reproduces the incremental ODA decode exactly (up to fp noise). Layers
that Local leaves alone (sliding, Gated DeltaNet) get their native masks. No OdaCache code is used.
"""

from __future__ import annotations

import torch

from oda_hf.compat import cache_kwargs
from transformers import masking_utils


def replay_logits(base, sequences, prompt_mask, decisions, sinks: int, window: int,
                  hidden: bool = False) -> torch.Tensor:
    """Logits ``[batch, T, vocab]`` of `base` over `sequences` with the access sets ODA used (`hidden`: the final
    normed hidden states ``[batch, T, hidden]`` instead, what the recall head reads).

    `prompt_mask`: 2D mask of the prompt part; `decisions`: bool ``[batch, routed_steps]``.
    """
    batch, total = sequences.shape
    prompt_len, steps = prompt_mask.shape[1], decisions.shape[1]
    mask2d = torch.cat([prompt_mask, torch.ones(batch, total - prompt_len, dtype=prompt_mask.dtype)], dim=1)
    valid = mask2d.bool()
    logical = valid.long().cumsum(-1)  # 1-based position of each valid column
    use_full = torch.ones(batch, total, dtype=torch.bool)
    use_full[:, prompt_len : prompt_len + steps] = decisions
    i = torch.arange(total)
    causal = i[None, :, None] >= i[None, None, :]
    key_pos, query_pos = logical[:, None, :], logical[:, :, None]
    in_local = (key_pos <= sinks) | (key_pos >= query_pos - window + 1)
    allowed = valid[:, None, :] & causal & (use_full[:, :, None] | in_local)
    allowed |= torch.eye(total, dtype=torch.bool)[None] & ~valid[:, :, None]  # padding queries: avoid empty rows
    full_mask = allowed[:, None]
    position_ids = (logical - 1).clamp(min=0)
    config = base.config
    if config._attn_implementation == "eager":
        full_mask = torch.where(full_mask, 0.0, torch.finfo(base.dtype).min).to(base.dtype)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types == {"full_attention"}:
        attention = full_mask
    else:
        embeds = base.get_input_embeddings()(sequences)
        builders = {
            "sliding_attention": masking_utils.create_sliding_window_causal_mask,
            "linear_attention": masking_utils.create_recurrent_attention_mask,
        }
        attention = {"full_attention": full_mask}
        for kind in layer_types - {"full_attention"}:
            attention[kind] = builders[kind](config=config, inputs_embeds=embeds, attention_mask=mask2d,
                                             position_ids=position_ids, **cache_kwargs(None))
    with torch.no_grad():
        if hidden:
            return base.get_decoder()(input_ids=sequences, attention_mask=attention, position_ids=position_ids,
                                      use_cache=False).last_hidden_state
        return base(input_ids=sequences, attention_mask=attention, position_ids=position_ids, use_cache=False).logits


def step_logits_from_reference(ref_logits, prompt_len: int, num_outputs: int) -> torch.Tensor:
    """Reference logits that produced output k (k = 0 from prefill): column prompt_len - 1 + k."""
    return ref_logits[:, prompt_len - 1 : prompt_len - 1 + num_outputs]
