"""Which model families ODA supports, and what it must know about each.

One place that knows, per family: which layers Local restricts (the ``full_attention`` layers of
`get_layer_types_and_kwargs`), how to build the native masks of the other layer kinds, whether the
decoder accepts a per-layer-type mask dict, whether the final logits are soft-capped, and whether the
decoder needs ``input_ids`` (Gemma4's per-layer embeddings). Families listed here are tested;
structurally compatible others get a warning; incompatible ones a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import masking_utils
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.utils import logging

from .cache import SUPPORTED_LAYER_TYPES

logger = logging.get_logger(__name__)

# Native mask builder for each layer kind Local leaves alone.
NATIVE_MASK_BUILDERS = {
    "full_attention": masking_utils.create_causal_mask,
    "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    "chunked_attention": masking_utils.create_chunked_causal_mask,
    "linear_attention": masking_utils.create_recurrent_attention_mask,
}
SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class ArchitectureSpec:
    family: str
    #: The decoder takes ``attention_mask`` as a dict keyed by layer type (bypassing mask creation).
    accepts_mask_dict: bool = True
    #: Config attribute holding the final logit soft-cap, if the family has one.
    logit_softcap_attr: str | None = None
    #: The decoder must receive ``input_ids`` (not only embeddings) at every step.
    needs_input_ids: bool = False


SUPPORTED_ARCHITECTURES = {
    "llama": ArchitectureSpec("Llama", accepts_mask_dict=False),
    "mistral": ArchitectureSpec("Mistral", accepts_mask_dict=False),
    "qwen2": ArchitectureSpec("Qwen2"),
    "qwen3": ArchitectureSpec("Qwen3"),
    "qwen3_5_text": ArchitectureSpec("Qwen3.5 (Gated DeltaNet hybrid)"),
    "gemma3_text": ArchitectureSpec("Gemma3", logit_softcap_attr="final_logit_softcapping"),
    "gemma4_text": ArchitectureSpec("Gemma4", logit_softcap_attr="final_logit_softcapping", needs_input_ids=True),
}


def resolve_architecture(model) -> ArchitectureSpec:
    """The spec for a loaded ``*ForCausalLM``; raises a clear error when ODA cannot drive it."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"oda_hf needs a decoder-only causal LM; {model_type!r} is an encoder-decoder model.")
    if config.get_text_config(decoder=True) is not config:
        raise ValueError(
            f"oda_hf drives text-only causal LMs; {type(model).__name__} (model_type {model_type!r}) wraps a text "
            "model inside a multimodal one. Load its text-only *ForCausalLM class instead (`oda text-model SRC OUT` "
            "saves it as its own folder)."
        )
    if not (hasattr(model, "get_decoder") and hasattr(model, "lm_head")):
        raise ValueError(
            f"{type(model).__name__} has no decoder/lm_head pair (get_decoder(), lm_head): it is not a "
            f"*ForCausalLM oda_hf can drive. Supported model types: {supported}."
        )
    layer_types, _ = get_layer_types_and_kwargs(config)
    unsupported = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
    if unsupported:
        raise ValueError(
            f"Model type {model_type!r} has layer types {unsupported} that ODA cannot route "
            f"(supported layer types: {list(SUPPORTED_LAYER_TYPES)}; supported model types: {supported})."
        )
    if "full_attention" not in layer_types:
        raise ValueError(
            f"Model type {model_type!r} has no full-attention layer (all layers: {sorted(set(layer_types))}), so "
            "Local and Full would read the same history: there is nothing for ODA to route."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{model_type!r} with use_bidirectional_attention=True is not a causal decoder; ODA needs one.")
    attn = config._attn_implementation
    if attn not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"ODA's Local attention needs an explicit mask, which attn_implementation={attn!r} does not take. "
            f"Load the base model with attn_implementation='sdpa' (or 'eager')."
        )
    spec = SUPPORTED_ARCHITECTURES.get(model_type)
    if spec is None:
        mixed = len(set(layer_types) - {"dummy"}) > 1
        spec = ArchitectureSpec(model_type, accepts_mask_dict=mixed,
                                logit_softcap_attr="final_logit_softcapping"
                                if getattr(config, "final_logit_softcapping", None) else None)
        _check_logits_from_hidden(model, spec)
        logger.warning(
            f"Model type {model_type!r} is not among oda_hf's tested architectures ({supported}). Its layers look "
            "compatible, so ODA will run, but check always-Full routing against stock generate() before trusting it."
        )
    if not spec.accepts_mask_dict and set(layer_types) - {"full_attention", "dummy"}:
        raise ValueError(
            f"{spec.family} with non-global layers ({sorted(set(layer_types))}) is not supported: its decoder takes "
            "a single mask for all layers, so Local cannot restrict only the global ones."
        )
    return spec


def _check_logits_from_hidden(model, spec: ArchitectureSpec) -> None:
    """An untested model type's logits must be ``lm_head`` of its final hidden state (then the soft-cap where
    `spec` names one), which is how ODA computes them (exact mode's drafts and verification, sampling, the head's
    supervision). Some families scale them besides (Granite divides by ``logits_scaling``, Cohere multiplies by
    ``logit_scale``): greedy tokens would agree and always-Full would equal stock, while every probability ODA
    samples from or trains on would be another's. One forward of three tokens tells."""
    import torch

    config = model.config
    supported = "supported model types: " + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    vocab = int(getattr(config, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
    ids = torch.arange(1, 4, device=model.device)[None] % vocab
    training = model.training
    model.eval()   # dropout would make the two passes differ
    try:
        with torch.no_grad():
            stock = model(input_ids=ids, use_cache=False).logits
            hidden = getattr(model.get_decoder()(input_ids=ids, use_cache=False), "last_hidden_state", None)
            if hidden is None:   # (Llama 4's get_decoder() is the whole model, which returns logits)
                raise ValueError(
                    f"Model type {config.model_type!r}: its get_decoder() does not return the final hidden states "
                    f"(no last_hidden_state), which ODA reads every step. This type is not supported; {supported}.")
            ours = model.get_output_embeddings()(hidden)
    finally:
        model.train(training)
    cap = getattr(config, spec.logit_softcap_attr, None) if spec.logit_softcap_attr else None
    if cap:
        ours = torch.tanh(ours / cap) * cap
    if not torch.allclose(ours.float(), stock.float(), rtol=1e-3, atol=1e-3):
        scaling = [name for name in ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier_scale")
                   if getattr(config, name, None) is not None]
        raise ValueError(
            f"Model type {config.model_type!r} computes its logits otherwise than lm_head(final hidden state)"
            f"{' (its config has ' + ', '.join(scaling) + ')' if scaling else ''}: ODA, which computes them so for "
            "its drafts, sampling and supervision, would draw from other probabilities than the model's. This type "
            f"is not supported; {supported}.")
