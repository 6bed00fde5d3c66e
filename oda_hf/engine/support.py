"""What the static decode engine supports, and the switch that turns it off.

The engine drives the HF decoder of a causal LM whose layers are full attention (Local restricts them) or
native sliding-window attention (Gemma 3's window-global pattern: the same window in both passes, read from the
engine's cache). Recurrent layers (Qwen3.5's Gated DeltaNet), chunked attention and Gemma 4's shared KV keep state
the engine does not manage: those models run on the HF path (`OdaForCausalLM.generate`).
"""

from __future__ import annotations

import os

from transformers.cache_utils import get_layer_types_and_kwargs

#: Set to 1 to turn the fast path off: `generate(oda_fast=True)` then runs the HF path (same results,
#: logged) and `OdaStaticEngine(...)` raises.
DISABLE_ENV = "ODA_DISABLE_FAST_PATH"
#: Families whose decoders the engine has been checked against.
FAST_PATH_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
#: Layer kinds the engine runs: Local restricts full attention; sliding layers keep their native window.
FAST_PATH_LAYER_TYPES = ("full_attention", "sliding_attention")
#: RoPE variants that read position values on the host (`dynamic_rope_update`): fine eagerly, but a
#: captured CUDA graph would freeze that host decision.
HOST_DEPENDENT_ROPE = ("dynamic", "longrope")


class FastPathUnsupported(ValueError):
    """The request or the model is outside what the static engine runs; the HF path runs it."""


def fast_path_disabled() -> bool:
    """True if ``ODA_DISABLE_FAST_PATH`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check_model_supported(oda_model) -> None:
    """Raise `FastPathUnsupported` unless the engine can drive this `OdaForCausalLM`."""
    config = oda_model.config
    model_type = getattr(config, "model_type", None)
    layer_types, _ = get_layer_types_and_kwargs(config)
    others = sorted(set(layer_types) - set(FAST_PATH_LAYER_TYPES))
    if others:
        # ("dummy" is transformers' cache name for Gemma 4's layers that reuse another layer's keys and values)
        others = ["KV-sharing" if kind == "dummy" else kind for kind in others]
        raise FastPathUnsupported(
            f"This {model_type!r} model has {others} layers: not supported by the fast path, whose engine manages "
            "full-attention and sliding-window layers only (recurrent hybrids such as Qwen3.5 are not). Use the HF "
            "path: model.generate(...) without oda_fast."
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise FastPathUnsupported(f"This {model_type!r} model soft-caps attention logits (attn_logit_softcapping), "
                                  "which the engine's attention does not; use the HF path: model.generate(...) "
                                  "without oda_fast.")
    if model_type not in FAST_PATH_MODEL_TYPES:
        raise FastPathUnsupported(
            f"model type {model_type!r} is not supported by the fast path (supported: "
            f"{', '.join(FAST_PATH_MODEL_TYPES)}). Use the HF path: model.generate(...) without oda_fast."
        )
    if config.get_text_config(decoder=True) is not config:
        raise FastPathUnsupported("The fast path drives text-only *ForCausalLM models; use the HF path.")


def sliding_windows(config) -> list[int | None]:
    """Per layer: the native window of a sliding-window layer, None for a full-attention layer."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    windows = [kwargs.get("sliding_window") if kind == "sliding_attention" else None
               for kind, kwargs in zip(layer_types, layer_kwargs)]
    if any(kind == "sliding_attention" and not (isinstance(window, int) and window >= 1)
           for kind, window in zip(layer_types, windows)):
        raise FastPathUnsupported(f"A sliding-window layer needs a window of >= 1 position; this model's are {windows} "
                                  "(config.sliding_window). Use the HF path: model.generate(...) without oda_fast.")
    return windows


def rope_parameter_sets(config) -> list[dict]:
    """A model's RoPE parameters: one dict per layer kind when they are keyed by layer type (Gemma 3), else one."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return [{}]
    return [value for value in params.values() if isinstance(value, dict)] or [params]


def rope_types(config) -> list[str]:
    """The RoPE types a model uses (one per layer kind when its parameters are keyed by layer type, as Gemma 3's)."""
    return [str(p.get("rope_type", p.get("type", "default"))) for p in rope_parameter_sets(config)]
