"""Analytical cost model of ODA decoding (paper Section 2.3, Appendix "Cost of conditional
recomputation" and the major-operation FLOPs ledger of the runtime appendix; ODA_SPEC section 7).

Conventions (the paper's): per routed decode step, 2 FLOPs per multiply-add, matrix products only
(no norms, activations, softmax, RoPE, biases or elementwise gating). For one token the terms are

* ``B``     history-independent backbone: every layer's projections and MLP (paid once per pass);
* ``A(n)``  attention over ``n`` positions: ``2 * 2 * n * head_dim * query_heads`` per layer that
            reads the history (``QK^T`` and ``AV``; query heads, not KV heads, set the FLOPs);
* ``R``     recall head: ``2 * head_params`` (paid on every ODA step, including recalled ones);
* ``O``     one vocabulary projection ``2 * d * vocab`` (paid once per step by every method).

With ``n_t = input_len + t`` for routed step ``t = 1..N`` (the current token included) and
``l_t = min(n_t, s + w)``::

    F_Full  = sum_t B + A(n_t) + O
    F_Local = sum_t B + A(l_t) + O
    F_ODA   = sum_t (1 + a_t) B + A(l_t) + a_t A(n_t) + R + O

For Qwen3-1.7B with ``s = 4, w = 2048``, a 1,009-token continuation (1,008 routed steps) and Full
on the first 2/4/8 of every 16 steps, this reproduces the paper's "FLOPs saved" column exactly
(e.g. 516,788 input tokens at 12.5%: 84.31% saved, Full/ODA FLOPs ratio 6.375).

Hybrid and heterogeneous models are counted layer by layer (`ModelShape.from_config`):

* ``full_attention`` layers read ``n`` positions under Full and ``min(n, s + w)`` under Local;
  they are the only layers whose reads differ between the branches.
* ``sliding_attention`` layers read ``min(n, sliding_window)`` and ``chunked_attention`` layers
  ``(n - 1) % chunk + 1`` positions in both branches (ODA leaves them native).
* ``linear_attention`` (Gated DeltaNet) layers read no history; their per-token work is in ``B``.
* KV-shared consumer layers (``dummy`` in `get_layer_types_and_kwargs`, Gemma4) still attend: they
  read whatever their kind in ``config.layer_types`` reads, but have no K/V projections.

So for a hybrid the paper's ``A(n)`` generalizes to ``A_full(n)`` (all layers, Full reads) and
``A(l)`` to ``A_local(n)`` (all layers, Local reads); for a dense model they are exactly the
paper's ``A(n)`` and ``A(min(n, s + w))``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from .cli_common import UsageError, user_input
from .validation import MAX_SPAN, argument, integer, number

# --- the paper's setting -------------------------------------------------------------------------

#: Qwen3-1.7B text config (the fields the cost model reads), so `oda flops` needs no download.
QWEN3_1_7B_CONFIG = {
    "model_type": "qwen3",
    "_name_or_path": "Qwen/Qwen3-1.7B",
    "num_hidden_layers": 28,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
#: Input lengths of the paper's runtime matrix (Appendix "Runtime protocol and complete results").
PAPER_INPUT_LENGTHS = (4139, 15918, 31400, 63852, 128852, 261696, 516788)
PAPER_CONTINUATION = 1009  # generated tokens; the first comes from prefill, so 1,008 routed steps
PAPER_PERIOD = 16
PAPER_FULL_STEPS = (2, 4, 8)  # Full on the first k of every 16 routed steps: 12.5 / 25 / 50 %
DEFAULT_SINKS, DEFAULT_WINDOW = 4, 2048

# Families whose full-attention q_proj also emits an output gate (q_proj width 2 * Hq * hd).
_GATED_QUERY_MODEL_TYPES = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


# --- the recall head -----------------------------------------------------------------------------


def head_param_count(hidden_size: int, head_width: int | None = None) -> int:
    """Parameters of the recall head for hidden size ``d`` and tower width ``m`` (default ``d // 2``).

    Same architecture as `oda_hf.head.RecallHead` (ODA_SPEC section 4), counted without torch:
    three towers RMSNorm(d) + Linear(d, m, bias); fusion Linear(9m, m, bias); two SwiGLU blocks
    RMSNorm(m) + gate/up Linear(m, 2m) + down Linear(2m, m); final RMSNorm(m) + Linear(m, 1, bias).
    The input variant does not change the count (missing streams reuse a tower input).
    """
    d = integer("hidden_size", hidden_size, minimum=1)
    m = integer("head_width", head_width if head_width is not None else d // 2, minimum=1)
    towers = 3 * (d + d * m + m)
    fusion = 9 * m * m + m
    blocks = 2 * (m + 2 * (m * 2 * m) + 2 * m * m)
    final = m + m + 1
    return towers + fusion + blocks + final


def head_params_from_config(head_config) -> int:
    """Head parameters from a `RecallHeadConfig`, a dict, or a path to a head ``config.json`` (or its folder)."""
    if isinstance(head_config, (str, os.PathLike)):
        head_config = _read_head_config(os.fspath(head_config))
    if not isinstance(head_config, dict):
        head_config = {"hidden_size": head_config.hidden_size, "head_width": head_config.head_width}
    return head_param_count(head_config["hidden_size"], head_config.get("head_width"))


def _read_head_config(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON ({err}).") from None


# --- model shapes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's per-token cost terms.

    `macs` is the layer's history-independent matrix work per token (multiply-adds): projections,
    MLP and, for Gated DeltaNet, the depthwise conv and the recurrent state update (`state_macs` of them: work on
    each row's own state, not on weights, so a batched pass does not read them as weights). The attention
    reads are described by `kind`, `query_heads`, `head_dim` and `span` and priced by
    `attention_flops`.
    """

    index: int
    cache_type: str  # as get_layer_types_and_kwargs reports it (may be "dummy")
    kind: str  # what the layer reads: full/sliding/chunked_attention, linear_attention, or "none"
    macs: int
    query_heads: int = 0
    head_dim: int = 0
    span: int | None = None  # sliding window or attention chunk size
    kv_heads: int = 0  # K/V heads the layer reads (its source layer's on KV-shared layers); prices KV bytes
    state_macs: int = 0  # of `macs`, the recurrent state update's (Gated DeltaNet)

    def positions_read(self, n: int, local_range: int | None = None) -> int:
        """Positions this layer attends to at history length `n` (current token included).

        `local_range` = ``s + w`` prices the Local branch; None prices Full.
        """
        if self.kind == "full_attention":
            return n if local_range is None else min(n, local_range)
        if self.kind == "sliding_attention":
            return min(n, self.span)
        if self.kind == "chunked_attention":
            return (n - 1) % self.span + 1
        return 0  # linear attention / attention-free: the history is in a fixed-size state

    def attention_flops(self, n: int, local_range: int | None = None) -> int:
        # QK^T and AV over the query heads: 2 products x 2 FLOPs per multiply-add.
        return 2 * 2 * self.positions_read(n, local_range) * self.head_dim * self.query_heads


@dataclass(frozen=True)
class ModelShape:
    """Per-token cost terms of a decoder-only LM, layer by layer.

    `model_macs` holds matrix work outside the layers that every pass repeats (Gemma4's per-layer
    embedding projection). The vocabulary projection is separate (`output_flops`).
    """

    name: str
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerShape, ...]
    model_macs: int = 0

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def qwen3_1_7b(cls) -> "ModelShape":
        """The paper's model, from the built-in `QWEN3_1_7B_CONFIG` (no download)."""
        return cls.from_config(dict(QWEN3_1_7B_CONFIG))

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """Shapes from a transformers config, a config dict, or a path to a ``config.json`` (or its folder).

        Multimodal wrappers are reduced to their text decoder (``get_text_config(decoder=True)``).
        Per layer (``get_layer_types_and_kwargs`` for the layer types, ``config.per_layer_config``
        for heterogeneous shapes), multiply-adds per token:

        * attention layers: q ``d * Hq * hd`` (doubled for the gated-query Qwen3.5 / Qwen3-Next
          attention), k and v ``d * Hkv * hd`` each (none on KV-shared layers; no v on Gemma4
          ``attention_k_eq_v`` global layers), o ``Hq * hd * d``;
        * Gated DeltaNet layers (``linear_*`` fields; ``Kd = nk * dk``, ``Vd = nv * dv``):
          in_proj_qkv ``d * (2 Kd + Vd)``, in_proj_z ``d * Vd``, in_proj_a and in_proj_b
          ``d * nv`` each, out_proj ``Vd * d``; the depthwise causal conv ``(2 Kd + Vd) * kernel``;
          and the recurrent state update as three state-sized products per value head
          ``3 * nv * dk * dv`` (read ``S^T k``, rank-1 write ``k delta^T``, output ``S^T q``); the
          state decay, beta and the gate are elementwise and not counted;
        * MLP: gate, up and down ``3 * d * ffn`` (Gemma4: doubled ffn on KV-shared layers with
          ``use_double_wide_mlp``; with ``enable_moe_block`` plus the router ``d * E`` and
          ``top_k`` experts of ``3 * d * moe_ffn``; `UNGATED_MLP` types: up and down ``2 * d * ffn``);
        * Gemma4 per-layer inputs: ``2 * d * p`` per layer and ``d * L * p`` once per token.
        """
        config = _load_config(config)
        from transformers.cache_utils import get_layer_types_and_kwargs

        cache_types, _ = get_layer_types_and_kwargs(config)
        declared = list(getattr(config, "layer_types", None) or cache_types)
        sharing = list(getattr(config, "kv_sharing_modes", None) or [None] * len(cache_types))
        model_type = getattr(config, "model_type", "")
        _reject_unmodeled_moe(config, model_type)

        d = config.hidden_size
        layers = []
        for index, (cache_type, layer_config) in enumerate(zip(cache_types, config.per_layer_config)):
            kv_shared = sharing[index] == "reuse"
            # A KV-shared consumer is a "dummy" cache layer but still attends like its declared kind.
            kind = declared[index] if cache_type == "dummy" else cache_type
            if kind in ("moe", "mlp"):
                kind = "none"
            if kind in _ATTENTION_KINDS:
                layers.append(_attention_layer(index, cache_type, kind, config, layer_config, model_type, kv_shared))
            elif kind == "linear_attention":
                macs, state_macs = _gated_deltanet_macs(layer_config)
                layers.append(LayerShape(index, cache_type, kind, macs, state_macs=state_macs))
            elif kind == "none":
                layers.append(LayerShape(index, cache_type, kind, 0))
            else:
                raise ValueError(f"Layer {index} has type {kind!r}, which the ODA cost model does not count.")
            # Every layer also runs its feed-forward (and Gemma4's per-layer-input block).
            extra = _mlp_macs(config, layer_config, model_type, kv_shared) + _per_layer_input_macs(config, model_type)
            layers[-1] = replace(layers[-1], macs=layers[-1].macs + extra)

        model_macs = 0
        if model_type == "gemma4_text" and getattr(config, "hidden_size_per_layer_input", 0):
            # per_layer_model_projection: d -> L * p, once per token.
            model_macs = d * config.num_hidden_layers * config.hidden_size_per_layer_input
        name = getattr(config, "_name_or_path", "") or model_type or type(config).__name__
        shape = cls(name, d, config.vocab_size, tuple(layers), model_macs)
        shape.check()
        return shape

    def check(self) -> None:
        """Raise ValueError/TypeError naming the config field behind a size that is not a whole number >= 1 (or a
        count >= 0): a hand-edited config with ``hidden_size: -5`` must not price negative FLOPs."""
        integer("hidden_size", self.hidden_size, minimum=1)
        integer("vocab_size", self.vocab_size, minimum=1)
        integer("model-level multiply-adds", self.model_macs, minimum=0)
        if not self.layers:
            raise ValueError("The config has no decoder layers (num_hidden_layers must be >= 1).")
        for layer in self.layers:
            where = f"layer {layer.index}"
            integer(f"{where} multiply-adds (hidden/intermediate sizes)", layer.macs, minimum=0)
            if layer.kind in _ATTENTION_KINDS:
                integer(f"{where} num_attention_heads", layer.query_heads, minimum=1)
                integer(f"{where} head_dim", layer.head_dim, minimum=1)
                integer(f"{where} num_key_value_heads", layer.kv_heads, minimum=1)
            if layer.kind in ("sliding_attention", "chunked_attention"):
                integer(f"{where} sliding_window / attention_chunk_size", layer.span, minimum=1)

    # -- cost terms -------------------------------------------------------------------------------
    @property
    def backbone_flops(self) -> int:
        """``B``: history-independent backbone FLOPs of one pass for one token."""
        return 2 * (sum(layer.macs for layer in self.layers) + self.model_macs)

    @property
    def weight_macs(self) -> int:
        """Multiply-adds on weights of one pass for one token: `backbone_flops` / 2 less the recurrent state updates
        (each row's own state: a batched pass reads the weights once, not the rows' states)."""
        return sum(layer.macs - layer.state_macs for layer in self.layers) + self.model_macs

    @property
    def output_flops(self) -> int:
        """``O``: the vocabulary projection, once per step."""
        return 2 * self.hidden_size * self.vocab_size

    def attention_flops(self, n: int, local_range: int | None = None) -> int:
        """``A(n)`` over all layers at history length `n`; Local reads when `local_range` = ``s + w``."""
        return sum(layer.attention_flops(n, local_range) for layer in self.layers)

    @property
    def global_attention_flops_per_position(self) -> int:
        """Slope of the Full-only part of ``A(n)``: FLOPs per history position over the global layers."""
        return sum(4 * layer.head_dim * layer.query_heads for layer in self.layers if layer.kind == "full_attention")

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the layers that read the whole history (the ones Local restricts)."""
        return tuple(layer.index for layer in self.layers if layer.kind == "full_attention")

    def describe(self) -> str:
        kinds = {}
        for layer in self.layers:
            kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
        layout = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        return f"{self.name}: {len(self.layers)} layers ({layout}), hidden {self.hidden_size}, vocab {self.vocab_size}"


#: Sizes a config file should give: transformers' class defaults (e.g. Llama's 11008-wide MLP) count otherwise.
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _load_config(config):
    """A text-decoder `PretrainedConfig` from a config, a dict or a path."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            config = AutoConfig.from_pretrained(path)
        elif os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                try:
                    config = json.load(handle)
                except ValueError as err:
                    raise ValueError(f"{path} is not valid JSON ({err}).") from None
        else:
            raise FileNotFoundError(f"No transformers config at {path!r} (give a config.json or its folder).")
    if isinstance(config, dict):
        config = dict(config)
        model_type = config.pop("model_type", None)
        if model_type is None:
            raise ValueError("The config has no 'model_type', so its architecture cannot be identified.")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        defaulted = [key for key in SIZE_KEYS if key not in text]
        if defaulted:   # (a loaded model would get them too, but a hand-written file usually means to give them)
            logging.getLogger(__name__).warning(
                f"The config gives no {', '.join(defaulted)}: transformers' {model_type} defaults are counted.")
        try:
            config = AutoConfig.for_model(model_type, **config)
        except Exception as err:   # (huggingface_hub's strict-dataclass errors are not ValueErrors)
            raise ValueError(f"The config does not make a {model_type} config: {err}") from None
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"Expected a transformers config, a dict or a path; got {type(config).__name__}.")
    return config.get_text_config(decoder=True)


def _reject_unmodeled_moe(config, model_type: str) -> None:
    if model_type == "gemma4_text":
        return
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            raise ValueError(
                f"{model_type!r} has a mixture-of-experts feed-forward ({key}={getattr(config, key)}), which the "
                "ODA cost model does not count; only dense MLPs (and Gemma4's MoE block) are modeled."
            )


def _attention_layer(index, cache_type, kind, config, layer_config, model_type, kv_shared) -> LayerShape:
    d = config.hidden_size
    hq = layer_config.num_attention_heads
    hd = getattr(layer_config, "head_dim", None) or d // hq
    hkv = getattr(layer_config, "num_key_value_heads", None) or hq
    q_width = hq * hd * (2 if model_type in _GATED_QUERY_MODEL_TYPES else 1)
    macs = d * q_width + hq * hd * d  # q and o
    if not kv_shared:
        k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and kind != "sliding_attention"
        macs += d * hkv * hd * (1 if k_eq_v else 2)
    span = None
    if kind == "sliding_attention":
        span = layer_config.sliding_window
    elif kind == "chunked_attention":
        span = layer_config.attention_chunk_size
    return LayerShape(index, cache_type, kind, macs, hq, hd, span, hkv)


def _gated_deltanet_macs(layer_config) -> tuple[int, int]:
    """The layer's multiply-adds per token, and how many of them update the recurrent state."""
    d = layer_config.hidden_size
    nk, dk = layer_config.linear_num_key_heads, layer_config.linear_key_head_dim
    nv, dv = layer_config.linear_num_value_heads, layer_config.linear_value_head_dim
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    projections = d * conv_dim + d * value_dim + 2 * d * nv + value_dim * d
    conv = conv_dim * layer_config.linear_conv_kernel_dim
    state = 3 * nv * dk * dv  # q and k are repeated to the nv value heads before the update
    return projections + conv + state, state


#: Model types whose MLP is two matrices (up, down) with no gate.
UNGATED_MLP = frozenset({"gpt_neox", "phi", "starcoder2"})


def _mlp_macs(config, layer_config, model_type, kv_shared) -> int:
    d = config.hidden_size
    ffn = layer_config.intermediate_size
    if model_type in UNGATED_MLP:   # (counted as gated, these were 1.5x too many MLP multiply-adds)
        return 2 * d * ffn
    if model_type == "gemma4_text":
        if getattr(config, "use_double_wide_mlp", False) and kv_shared:
            ffn *= 2
        macs = 3 * d * ffn
        if getattr(config, "enable_moe_block", False):
            macs += d * config.num_experts + config.top_k_experts * 3 * d * config.moe_intermediate_size
        return macs
    return 3 * d * ffn


def _per_layer_input_macs(config, model_type) -> int:
    if model_type != "gemma4_text":
        return 0
    p = getattr(config, "hidden_size_per_layer_input", 0) or 0
    return 2 * config.hidden_size * p  # per_layer_input_gate (d -> p) and per_layer_projection (p -> d)


# --- schedules and the ledger --------------------------------------------------------------------

_BLOCK = 1 << 16  # routed steps per numpy block in `CostLedger.sequence_totals`


def _count(name: str, value, minimum: int, maximum: int = MAX_SPAN, meaning: str = "") -> int:
    """An integer length or count in [minimum, maximum] (ValueError/TypeError naming it otherwise)."""
    return integer(name, value, minimum=minimum, maximum=maximum, meaning=meaning)


def _reads(kind: str, span, n, local_range):
    """`LayerShape.positions_read` for a numpy array of history lengths."""
    import numpy as np

    if kind == "full_attention":
        return n if local_range is None else np.minimum(n, local_range)
    if kind == "sliding_attention":
        return np.minimum(n, span)
    return (n - 1) % span + 1  # chunked_attention


def schedule_first_k(k: int, period: int, steps: int) -> list[bool]:
    """Full on the first `k` of every `period` routed steps (``a_t`` for ``t = 1..steps``), as in the paper."""
    if not isinstance(period, int) or not isinstance(k, int) or period < 1 or not 0 <= k <= period:
        raise ValueError(f"Need period >= 1 and 0 <= k <= period; got k={k}, period={period}.")
    steps = _count("steps", steps, 0)
    return [(t - 1) % period < k for t in range(1, steps + 1)]


@dataclass(frozen=True)
class StepCosts:
    """Cost terms (FLOPs) of one routed step at history length `n` (current token included)."""

    n: int
    backbone: int  # B
    attention_full: int  # A(n)
    attention_local: int  # A(l), l = min(n, s + w) on global layers
    head: int  # R
    output: int  # O

    @property
    def full(self) -> int:
        return self.backbone + self.attention_full + self.output

    @property
    def local(self) -> int:
        return self.backbone + self.attention_local + self.output

    def oda(self, recall: bool) -> int:
        """Local attempt + head every step, plus the Full pass when `recall`; one output projection."""
        extra = self.backbone + self.attention_full if recall else 0
        return self.backbone + self.attention_local + self.head + extra + self.output


METHODS = ("full", "local", "oda")


@dataclass(frozen=True)
class FlopsRow:
    """One row of the FLOPs table: `saved_pct` and `ratio` are relative to Full on the same input."""

    input_tokens: int
    method: str  # "Full", "Local" or "ODA"
    full_pct: float  # share of routed steps that ran Full
    flops: int
    saved_pct: float
    ratio: float  # Full FLOPs / this method's FLOPs


class CostLedger:
    """The paper's major-operation FLOPs ledger and additive speed model for one model + head.

    Args:
        shape: the backbone's `ModelShape`.
        head_params: recall-head parameter count (``R = 2 * head_params``); see `head_param_count`.
        sinks, window: the Local access set ``s`` and ``w`` (Local reads ``min(n, s + w)`` positions).
    """

    def __init__(self, shape: ModelShape, head_params: int, sinks: int = DEFAULT_SINKS,
                 window: int = DEFAULT_WINDOW):
        sinks, window = _count("sinks", sinks, 0), _count("window", window, 1)
        head_params = integer("head_params", head_params, minimum=0)
        self.shape, self.head_params, self.sinks, self.window = shape, head_params, sinks, window

    @classmethod
    def qwen3_1_7b(cls, sinks: int = DEFAULT_SINKS, window: int = DEFAULT_WINDOW) -> "CostLedger":
        """The paper's setting: Qwen3-1.7B with its 28,325,889-parameter head (d = 2048, m = 1024)."""
        shape = ModelShape.qwen3_1_7b()
        return cls(shape, head_param_count(shape.hidden_size), sinks, window)

    schedule_first_k = staticmethod(schedule_first_k)

    @property
    def local_range(self) -> int:
        return self.sinks + self.window

    @property
    def head_flops(self) -> int:
        return 2 * self.head_params

    def step_costs(self, n: int) -> StepCosts:
        shape = self.shape
        return StepCosts(n, shape.backbone_flops, shape.attention_flops(n), shape.attention_flops(n, self.local_range),
                         self.head_flops, shape.output_flops)

    def _steps(self, input_len: int, count: int):
        return (self.step_costs(input_len + t) for t in range(1, count + 1))

    def sequence_totals(self, input_len: int, steps: int, period: int = 1,
                        full_steps: Sequence[int] = ()) -> tuple[int, int, list[tuple[int, int]]]:
        """``(F_Full, F_Local, [(recalled steps, F_ODA) per k in full_steps])`` over routed steps ``t = 1..steps``
        after an `input_len`-token prompt, ODA with Full on the first ``k`` of every `period` steps.

        Exact integers, equal to summing `step_costs` step by step, but in bounded memory and time: only the
        attention reads depend on the step, and they are summed per layer group in blocks of steps (numpy
        int64 partial sums of positions, far from overflow; the FLOPs products are Python integers)."""
        import numpy as np

        input_len = _count("input_len", input_len, 0)
        steps, period = _count("steps", steps, 0), _count("period", period, 1)
        ks = [_count("k", k, 0, period) for k in full_steps]
        groups: dict[tuple[str, int | None], int] = {}  # (kind, span) -> FLOPs per position read
        for layer in self.shape.layers:
            if layer.kind in _ATTENTION_KINDS and layer.head_dim * layer.query_heads:
                key = (layer.kind, layer.span)
                groups[key] = groups.get(key, 0) + 4 * layer.head_dim * layer.query_heads
        full_reads = local_reads = 0
        scheduled, recalled = [0] * len(ks), [0] * len(ks)
        for start in range(1, steps + 1, _BLOCK):
            t = np.arange(start, min(steps, start + _BLOCK - 1) + 1, dtype=np.int64)
            n, phase = input_len + t, (t - 1) % period
            masks = [phase < k for k in ks]
            for i, mask in enumerate(masks):
                recalled[i] += int(mask.sum())
            for (kind, span), flops_per_read in groups.items():
                full, local = _reads(kind, span, n, None), _reads(kind, span, n, self.local_range)
                full_reads += flops_per_read * int(full.sum())
                local_reads += flops_per_read * int(local.sum())
                for i, mask in enumerate(masks):
                    scheduled[i] += flops_per_read * int(full[mask].sum())
        b, o, r = self.shape.backbone_flops, self.shape.output_flops, self.head_flops
        full_total = steps * (b + o) + full_reads
        local_total = steps * (b + o) + local_reads
        oda = [(m, steps * (b + r + o) + local_reads + m * b + extra) for m, extra in zip(recalled, scheduled)]
        return full_total, local_total, oda

    def sequence_flops(self, method: str, input_len: int, schedule: Sequence[bool] | int) -> int:
        """Total FLOPs of the routed steps after an `input_len`-token prompt.

        `schedule` is the Full-call sequence ``a_1..a_N`` (only ODA reads its values; Full and Local
        use its length) or just the number of routed steps ``N`` (ODA then never recalls).
        """
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}; got {method!r}.")
        if isinstance(schedule, int):  # a count: no per-step list (it may be millions of steps)
            full, local, ((_, oda),) = self.sequence_totals(input_len, schedule, 1, [0])
            return {"full": full, "local": local, "oda": oda}[method]
        calls = [bool(a) for a in schedule]
        total = 0
        for step, recall in zip(self._steps(input_len, len(calls)), calls):
            total += step.full if method == "full" else step.local if method == "local" else step.oda(recall)
        return total

    # -- additive speed model (paper Appendix "Cost of conditional recomputation") -----------------
    def speed_model(self, n: int, rho: float, d_full: float = 0.0, d_oda: float = 0.0) -> tuple[float, float]:
        """``(T_F(n), T_ODA(n, rho))`` with ``T_F = B + A(n) + O + D_F`` and
        ``T_ODA = B + A(l) + R + rho [B + A(n)] + O + D_ODA`` (costs in FLOPs; overheads in the same unit)."""
        number("rho", rho, meaning="a recall rate")
        c = self.step_costs(integer("n", n, minimum=1))
        t_full = c.backbone + c.attention_full + c.output + d_full
        t_oda = c.backbone + c.attention_local + c.head + rho * (c.backbone + c.attention_full) + c.output + d_oda
        return t_full, t_oda

    def break_even_rate(self, n: int, d_full: float = 0.0, d_oda: float = 0.0) -> float:
        """The recall rate below which ODA is cheaper than Full at history length `n`:
        ``rho < (A(n) - A(l) - H) / (B + A(n))`` with ``H = R + D_ODA - D_F``. Negative when no
        recall rate pays off at this length (e.g. ``n <= s + w``, where both branches read alike)."""
        c = self.step_costs(n)
        h = c.head + d_oda - d_full
        return (c.attention_full - c.attention_local - h) / (c.backbone + c.attention_full)

    def break_even_length(self, rho: float, d_full: float = 0.0, d_oda: float = 0.0,
                          max_length: int = 1 << 40) -> int | None:
        """Smallest history length `n` at which ODA at recall rate `rho` is cheaper than Full, or None.

        For ``A(n) = a n`` this is the paper's ``n > [rho B + a l + H] / [(1 - rho) a]``. Found by
        bisection: up to ``s + w`` both branches read the same history, so the Full - ODA gap only
        shrinks there (``-rho`` times Full's growth); beyond it the gap grows for ``rho < 1``. Hence
        if ODA does not already pay at ``n = 1``, the lengths where it pays form one tail.
        """
        def pays(n: int) -> bool:
            t_full, t_oda = self.speed_model(n, rho, d_full, d_oda)
            return t_oda < t_full

        if pays(1):  # only with overheads D_F > R + D_ODA: then even the shortest history pays
            return 1
        if not pays(max_length):
            return None
        low, high = 1, max_length  # pays(high) holds and pays(low) does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if pays(mid) else (mid, high)
        return high

    # -- the paper's table -------------------------------------------------------------------------
    def flops_table(self, input_lengths: Sequence[int] = PAPER_INPUT_LENGTHS,
                    continuation: int = PAPER_CONTINUATION, period: int = PAPER_PERIOD,
                    full_steps: Sequence[int] = PAPER_FULL_STEPS) -> list[FlopsRow]:
        """Rows Full, Local, then ODA at each ``k`` (Full on the first ``k`` of every `period`
        routed steps), per input length; a `continuation` of N tokens has ``N - 1`` routed steps."""
        continuation = _count("continuation", continuation, 2, meaning="a continuation of N tokens has N - 1 "
                              "routed steps")
        steps = continuation - 1
        period = _count("period", period, 1)
        full_steps = [_count("full_steps", k, 0, period) for k in full_steps]
        rows = []
        for input_len in input_lengths:
            input_len = _count("input_lengths", input_len, 1)
            full, local, oda = self.sequence_totals(input_len, steps, period, full_steps)
            totals = [("Full", 100.0, full), ("Local", 0.0, local)]
            totals += [("ODA", 100.0 * recalled / steps, flops) for recalled, flops in oda]
            for method, share, flops in totals:
                saved = float(100 * (1 - Fraction(flops, full)))
                rows.append(FlopsRow(input_len, method, share, flops, saved, full / flops))
        return rows


def format_flops_table(rows: Sequence[FlopsRow], style: str = "markdown") -> str:
    """The paper's layout (Input tokens, Method, Full %, FLOPs saved %) plus the Full/method FLOPs ratio.

    `style` "markdown" gives a pipe table; "plain" aligned columns with a blank line between inputs.
    """
    header = ["Input tokens", "Method", "Full (%)", "FLOPs saved (%)", "Full/method FLOPs"]
    body = [[f"{r.input_tokens:,}", r.method, f"{r.full_pct:.1f}", f"{r.saved_pct:.2f}", f"{r.ratio:.3f}"]
            for r in rows]
    if style == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:", ":---", "---:", "---:", "---:"]) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    if style != "plain":
        raise ValueError(f"style must be 'markdown' or 'plain'; got {style!r}.")
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [line(header)]
    for i, (row, cells) in enumerate(zip(rows, body)):
        if i and row.input_tokens != rows[i - 1].input_tokens:
            lines.append("")
        lines.append(line(cells))
    return "\n".join(lines)


# --- batch economics: many rows per step (docs/serving.md) ---------------------------------------
#
# A batched decode step runs every row through one pass, so weights are read once per pass however
# many rows it carries, while attention reads each row's own KV. ODA adds a Local pass and the head
# for every row, and a Full pass for the rows that recall. Two ways to run that Full pass:
#
# * "whole": if any row recalls, the whole batch reruns Full and each row keeps its selected
#   candidate (what `OdaStaticEngine` does: one device predicate per step; `OdaForCausalLM` for
#   hybrids and when more than `max_row_retry_fraction` of the rows recall);
# * "rows":  only the recalling rows rerun Full (a gathered sub-batch of the recalling rows; what
#   `OdaForCausalLM` does otherwise);
# * "masked": the Full pass runs every row through the projections and MLP (fixed shapes, so one
#   captured graph serves every pattern) but attention reads history only for the recalling rows
#   (the others' attention lengths masked to zero on the device).
#
# Rows may sit at different history lengths (continuous batching): every function takes one length
# per row. Recalls are per-row independent Bernoulli(rate) draws for the expectations; the
# `*_pattern` functions take a given decision pattern instead.
#
# Latency is a roofline per kernel phase, ``max(FLOPs / peak, bytes / bandwidth)``, summed over the
# phases of a step: linear (projections + MLP: all rows of a pass share one weight read), attention
# (priced per row, since each row streams its own KV; equal to the batch roofline whenever rows have
# the same arithmetic intensity, which holds for every layer whose Hq/Hkv is fixed), the recall head
# (FP32 weights) and the output projection (once per step). Assumptions: weights and KV are read
# from device memory once per pass (no cross-pass reuse in on-chip caches); activations, embeddings,
# KV writes of the current token and recurrent (Gated DeltaNet) state traffic are not counted; the
# weights a token touches are its multiply-adds (exact for dense models; for Gemma4's MoE block a
# batch touches more experts than one token does). `pass_overhead_s` stands for the paper's
# execution overheads D (launch and bookkeeping cost per pass), zero by default.

BATCH_MODES = ("whole", "rows", "masked")


@dataclass(frozen=True)
class Hardware:
    """An accelerator for the roofline: dense peak FLOP/s at the backbone dtype and memory bandwidth (B/s)."""

    name: str
    peak_flops: float
    bandwidth: float

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / self.bandwidth)


#: Datasheet numbers (dense BF16 tensor-core peak, HBM bandwidth); replace with measured ones when known.
HARDWARE = {
    "h100-sxm": Hardware("NVIDIA H100 SXM (BF16 dense)", 989.4e12, 3.35e12),
    "a100-sxm-80gb": Hardware("NVIDIA A100 SXM 80GB (BF16 dense)", 312e12, 2.039e12),
}
DEFAULT_HARDWARE = "h100-sxm"


@dataclass(frozen=True)
class BatchStepCost:
    """Cost of one batched decode step (or its expectation): FLOPs, bytes read, roofline seconds."""

    flops: float
    bytes: float
    seconds: float

    def __add__(self, other: "BatchStepCost") -> "BatchStepCost":
        return BatchStepCost(self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds)

    def scaled(self, factor: float) -> "BatchStepCost":
        return BatchStepCost(self.flops * factor, self.bytes * factor, self.seconds * factor)


_ZERO = BatchStepCost(0.0, 0.0, 0.0)


class BatchCostModel:
    """Per-step FLOPs, bytes and roofline latency of native Full and ODA for a batch of rows.

    Args:
        ledger: the per-token terms (`CostLedger`: model shape, head size, ``s`` and ``w``).
        hardware: a `Hardware` or a key of `HARDWARE` (default H100 SXM).
        weight_bytes: bytes per backbone / output-projection weight (2 for BF16).
        kv_bytes: bytes per cached K or V element (2 for BF16).
        head_weight_bytes: bytes per recall-head weight (4: the head runs in FP32).
        pass_overhead_s: fixed seconds added to every backbone pass (the paper's D terms).
    """

    def __init__(self, ledger: CostLedger, hardware: Hardware | str = DEFAULT_HARDWARE, weight_bytes: int = 2,
                 kv_bytes: int = 2, head_weight_bytes: int = 4, pass_overhead_s: float = 0.0):
        if isinstance(hardware, str):
            if hardware not in HARDWARE:
                raise ValueError(f"Unknown hardware {hardware!r}; use one of {sorted(HARDWARE)} or pass a Hardware.")
            hardware = HARDWARE[hardware]
        if min(weight_bytes, kv_bytes, head_weight_bytes) <= 0 or pass_overhead_s < 0:
            raise ValueError("Byte sizes must be positive and pass_overhead_s non-negative.")
        self.ledger, self.hardware = ledger, hardware
        self.weight_bytes, self.kv_bytes, self.head_weight_bytes = weight_bytes, kv_bytes, head_weight_bytes
        self.pass_overhead_s = float(pass_overhead_s)

    # -- per-row and per-pass pieces ---------------------------------------------------------------
    def kv_bytes_read(self, n: int, local: bool) -> int:
        """K and V bytes one row reads over all layers at history `n` (Full, or Local when `local`)."""
        local_range = self.ledger.local_range if local else None
        return sum(2 * layer.kv_heads * layer.head_dim * self.kv_bytes * layer.positions_read(n, local_range)
                   for layer in self.ledger.shape.layers)

    def _attention(self, n: int, local: bool) -> BatchStepCost:
        flops = self.ledger.shape.attention_flops(n, self.ledger.local_range if local else None)
        nbytes = self.kv_bytes_read(n, local)
        return BatchStepCost(flops, nbytes, self.hardware.seconds(flops, nbytes))

    def _linear(self, rows: int) -> BatchStepCost:
        """Projections + MLP for `rows` rows in one pass: the weights are read once for all of them."""
        if rows == 0:
            return _ZERO
        flops = rows * self.ledger.shape.backbone_flops
        nbytes = self.ledger.shape.weight_macs * self.weight_bytes
        return BatchStepCost(flops, nbytes, self.hardware.seconds(flops, nbytes) + self.pass_overhead_s)

    def _head(self, rows: int) -> BatchStepCost:
        flops, nbytes = rows * self.ledger.head_flops, self.ledger.head_params * self.head_weight_bytes
        return BatchStepCost(flops, nbytes, self.hardware.seconds(flops, nbytes))

    def _output(self, rows: int) -> BatchStepCost:
        shape = self.ledger.shape
        flops, nbytes = rows * shape.output_flops, shape.hidden_size * shape.vocab_size * self.weight_bytes
        return BatchStepCost(flops, nbytes, self.hardware.seconds(flops, nbytes))

    def _pass(self, lengths: Sequence[int], local: bool) -> BatchStepCost:
        total = self._linear(len(lengths))
        for n in lengths:
            total = total + self._attention(n, local)
        return total

    # -- one step with given decisions -----------------------------------------------------------------
    def full_step(self, lengths: Sequence[int]) -> BatchStepCost:
        """Native Full: one pass over every row, then the output projection."""
        lengths = _check_lengths(lengths)
        return self._pass(lengths, local=False) + self._output(len(lengths))

    def local_step(self, lengths: Sequence[int]) -> BatchStepCost:
        """StreamingLLM (always Local): one Local pass over every row, then the output projection; no head."""
        lengths = _check_lengths(lengths)
        return self._pass(lengths, local=True) + self._output(len(lengths))

    def oda_step_pattern(self, lengths: Sequence[int], decisions: Sequence[bool], mode: str) -> BatchStepCost:
        """ODA with a given decision per row (True = Full): Local pass + head for every row, the
        Full pass as `mode` runs it, one output projection."""
        lengths = _check_lengths(lengths)
        _check_mode(mode)
        if len(decisions) != len(lengths):
            raise ValueError(f"Need one decision per row: {len(decisions)} decisions for {len(lengths)} rows.")
        recalled = [n for n, a in zip(lengths, decisions) if a]
        if not recalled:
            full = _ZERO
        elif mode == "whole":
            full = self._pass(lengths, local=False)
        elif mode == "rows":
            full = self._pass(recalled, local=False)
        else:  # masked: every row through the linear layers, history attention for the recalling rows only
            full = self._linear(len(lengths))
            for n in recalled:
                full = full + self._attention(n, local=False)
        return self._pass(lengths, local=True) + self._head(len(lengths)) + full + self._output(len(lengths))

    # -- expectations over independent Bernoulli(rate) recalls ---------------------------------------------
    def oda_step_expected(self, lengths: Sequence[int], rate: float, mode: str) -> BatchStepCost:
        """Expected ODA step cost when every row recalls independently with probability `rate`.

        whole: the Full pass over all rows runs with probability ``1 - (1 - rate)^B``.
        rows: each row's Full attention with probability `rate`; the Full pass's weight read and
        overhead whenever at least one row recalls; its linear-phase time averaged over the
        Binomial(B, rate) count of recalling rows (the roofline is not linear in the count).
        masked: the linear phase of all B rows with probability ``1 - (1 - rate)^B``, each row's
        Full attention with probability `rate`.
        """
        lengths = _check_lengths(lengths)
        _check_mode(mode)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be a probability in [0, 1]; got {rate}.")
        rows = len(lengths)
        p_any = 1.0 - (1.0 - rate) ** rows
        base = self._pass(lengths, local=True) + self._head(rows) + self._output(rows)
        if mode == "whole":
            return base + self._pass(lengths, local=False).scaled(p_any)
        attention = _ZERO
        for n in lengths:
            attention = attention + self._attention(n, local=False)
        if mode == "masked":
            return base + attention.scaled(rate) + self._linear(rows).scaled(p_any)
        linear = _ZERO
        for k in range(1, rows + 1):
            linear = linear + self._linear(k).scaled(_binomial(rows, k, rate))
        return base + attention.scaled(rate) + linear

    def speedup(self, lengths: Sequence[int], rate: float, mode: str) -> float:
        """Native Full's step time over ODA's expected step time (= throughput ratio at a fixed batch)."""
        return self.full_step(lengths).seconds / self.oda_step_expected(lengths, rate, mode).seconds

    def flops_ratio(self, lengths: Sequence[int], rate: float, mode: str) -> float:
        """Native Full's step FLOPs over ODA's expected step FLOPs."""
        return self.full_step(lengths).flops / self.oda_step_expected(lengths, rate, mode).flops


def _binomial(n: int, k: int, p: float) -> float:
    """P(Binomial(n, p) = k); in log space where comb(n, k) would overflow a float (batches above ~1,000 rows)."""
    if n <= 1000 or p in (0.0, 1.0):
        return math.comb(n, k) * p ** k * (1.0 - p) ** (n - k)
    log = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    return math.exp(log)


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    if not lengths:
        raise ValueError("Need at least one row and history lengths >= 1 (current token included); got [].")
    return [_count("history lengths", n, 1, meaning="current token included") for n in lengths]


def _check_mode(mode: str) -> None:
    if mode not in BATCH_MODES:
        raise ValueError(f"mode must be one of {BATCH_MODES}; got {mode!r}.")


@dataclass(frozen=True)
class BatchRow:
    """One row of a batch-economics table (per step; `speedup` and `flops_ratio` relative to native Full)."""

    batch: int
    rate: float
    mode: str
    mean_history: float
    full: BatchStepCost
    oda: BatchStepCost
    p_any: float

    @property
    def speedup(self) -> float:
        return self.full.seconds / self.oda.seconds

    @property
    def flops_ratio(self) -> float:
        return self.full.flops / self.oda.flops


def batch_table(model: BatchCostModel, batches: Sequence[int], rates: Sequence[float], histories: Sequence[int],
                modes: Sequence[str] = BATCH_MODES) -> list[BatchRow]:
    """Rows for every (history, rate, batch, mode): `histories` are per-row lengths of one batch when
    `batches` is empty (continuous batching), else one length that every row of each batch shares."""
    groups = [[list(histories)]] if not batches else [[[n] * b for b in batches] for n in histories]
    rows = []
    for lengths_group in groups:
        for rate in rates:
            for lengths in lengths_group:
                full = model.full_step(lengths)
                p_any = 1.0 - (1.0 - rate) ** len(lengths)
                for mode in modes:
                    rows.append(BatchRow(len(lengths), rate, mode, sum(lengths) / len(lengths), full,
                                         model.oda_step_expected(lengths, rate, mode), p_any))
    return rows


def format_batch_table(rows: Sequence[BatchRow]) -> str:
    """A markdown table: per-step seconds and GB for native Full and ODA, speedup and FLOPs ratio."""
    header = ["Mean history", "Batch", "Rate", "Mode", "P(any Full)", "Full ms", "ODA ms", "Full GB", "ODA GB",
              "Speedup", "Full/ODA FLOPs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * 3 + [":---"] + ["---:"] * 7) + "|"]
    for r in rows:
        cells = [f"{r.mean_history:,.0f}", str(r.batch), f"{r.rate:g}", r.mode, f"{r.p_any:.3f}",
                 f"{r.full.seconds * 1e3:.3f}", f"{r.oda.seconds * 1e3:.3f}", f"{r.full.bytes / 1e9:.2f}",
                 f"{r.oda.bytes / 1e9:.2f}", f"{r.speedup:.3f}", f"{r.flops_ratio:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- `oda flops` -------------------------------------------------------------------------------


MAX_LIST = 4096  # entries of one comma-separated flag (a table row or a batch row each)
MAX_BATCH = 1 << 16  # rows of one batch


def _list(check, name: str, **bounds):
    """argparse type for a comma-separated list of values, each checked like a single flag value."""
    parse = argument(check, name, **bounds)

    def convert(text: str) -> list:
        parts = text.split(",")
        if not text.strip() or any(not part.strip() for part in parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated values without empty entries; got {text!r}.")
        if len(parts) > MAX_LIST:
            raise argparse.ArgumentTypeError(f"at most {MAX_LIST} values; got {len(parts)}.")
        return [parse(part.replace("_", "") if check is integer else part) for part in parts]

    return convert


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register ``oda flops`` on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "flops", help="analytical FLOPs of Full, Local and scheduled ODA decoding (paper's FLOPs table)",
        description="Major-operation FLOPs ledger of the paper (2 FLOPs per multiply-add, matrix products "
                    "only). Without --config: Qwen3-1.7B and the paper's seven input lengths.")
    parser.add_argument("--config", type=_path, default=None,
                        help="a transformers config.json (or its folder); default: built-in Qwen3-1.7B shapes")
    parser.add_argument("--head-config", type=_path, default=None,
                        help="recall head config.json (or its folder); default: width hidden_size // 2")
    parser.add_argument("--input-lengths", type=_list(integer, "input-lengths", minimum=1, maximum=MAX_SPAN),
                        default=None,
                        help="comma-separated prompt lengths (default: the paper's 4139,...,516788)")
    parser.add_argument("--continuation", type=argument(integer, "continuation", minimum=2, maximum=MAX_SPAN),
                        default=None,
                        help="generated tokens incl. the prefill output (routed steps = N - 1; default 1009)")
    parser.add_argument("--period", type=argument(integer, "period", minimum=1, maximum=MAX_SPAN), default=None,
                        help="schedule period (default 16)")
    parser.add_argument("--full-steps", type=_list(integer, "full-steps", minimum=0, maximum=MAX_SPAN),
                        default=None,
                        help="Full on the first k of every period, one ODA row per k (default 2,4,8)")
    parser.add_argument("--sinks", type=argument(integer, "sinks", minimum=0, maximum=MAX_SPAN), default=None,
                        help="sink positions s (default: the head's or 4)")
    parser.add_argument("--window", type=argument(integer, "window", minimum=1, maximum=MAX_SPAN), default=None,
                        help="recent window w (default: the head's or 2048)")
    parser.add_argument("--format", choices=("markdown", "plain"), default="markdown", dest="table_format",
                        help="table style (default markdown)")
    batch = parser.add_argument_group(
        "batch economics", "per-step FLOPs, bytes and roofline latency for a batch of rows (docs/serving.md); "
                           "given --batch or --histories, these replace the sequence table")
    batch.add_argument("--batch", type=_list(integer, "batch"), default=None,
                       help="comma-separated batch sizes, e.g. 1,8,64")
    batch.add_argument("--history", type=argument(integer, "history", minimum=1, maximum=MAX_SPAN), default=None,
                       help="history length n of every row (with --batch)")
    batch.add_argument("--histories", type=_list(integer, "histories", minimum=1, maximum=MAX_SPAN), default=None,
                       help="one history length per row (continuous batching; the batch is their count)")
    batch.add_argument("--rate", type=_list(number, "rate"), default=None,
                       help="per-row Full-call probability rho, comma-separated (default 0.125,0.25,0.5)")
    batch.add_argument("--mode", choices=(*BATCH_MODES, "all"), default=None,
                       help="Full retry for the whole batch when any row recalls (whole), for the recalling rows "
                            "only (rows), or all rows' projections with only the recalling rows' attention (masked)")
    batch.add_argument("--hardware", choices=sorted(HARDWARE), default=None,
                       help=f"roofline peak and bandwidth (default {DEFAULT_HARDWARE})")
    batch.add_argument("--pass-overhead-us", type=argument(number, "pass-overhead-us", minimum=0.0), default=None,
                       help="fixed microseconds per backbone pass (launch/bookkeeping; default 0)")
    parser.set_defaults(func=run_cli)
    return parser


def _path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file or folder path; got an empty string.")
    return text


def _as_value_error(function, *args):
    """`function(*args)`, with the TypeError/KeyError/AttributeError of a malformed file read as ValueError."""
    try:
        return function(*args)
    except (TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"malformed ({type(err).__name__}: {err})") from None


def _head_shape(path: str) -> dict:
    """The fields of a head config.json that the ledger reads, checked (a corrupt or hand-edited file is a
    one-line error naming the field, never negative FLOPs)."""
    head = _read_head_config(path)
    if not isinstance(head, dict):
        raise ValueError(f"{path} must hold a JSON object; got {type(head).__name__}.")
    if head.get("model_type", "oda_recall_head") != "oda_recall_head":   # (a model's config.json: default width)
        raise ValueError(f"{path} is not a recall head's config (model_type {head.get('model_type')!r}, not "
                         "'oda_recall_head'): give the head folder's config.json to --head-config.")
    checked = {}
    for key, minimum in (("hidden_size", 1), ("head_width", 1), ("sinks", 0), ("window", 1)):
        if head.get(key) is not None:
            checked[key] = integer(f"config.json: {key}", head[key], minimum=minimum, maximum=MAX_SPAN)
    return checked


# Flags that only one of the two tables reads, with their defaults: given for the other table, they would be
# silently ignored (``--history 100`` without --batch printed the sequence table), so they are refused.
SEQUENCE_FLAGS = {"input_lengths": None, "continuation": PAPER_CONTINUATION, "period": PAPER_PERIOD,
                  "full_steps": list(PAPER_FULL_STEPS)}
BATCH_FLAGS = {"history": None, "rate": [0.125, 0.25, 0.5], "mode": "all", "hardware": DEFAULT_HARDWARE,
               "pass_overhead_us": 0.0}


def _check_table_flags(args) -> None:
    """Refuse the flags of the table not printed, then fill in the defaults of the given table's flags."""
    batch = args.batch is not None or args.histories is not None
    unused, table = (SEQUENCE_FLAGS, "the sequence table (without --batch/--histories)") if batch else \
        (BATCH_FLAGS, "the batch table (--batch with --history, or --histories)")
    given = ["--" + key.replace("_", "-") for key in unused if getattr(args, key, None) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} to {table}, which this "
                         "command does not print: "
                         f"drop {'them' if len(given) > 1 else 'it'}"
                         + (", or add --batch with --history, or --histories." if not batch else "."))
    for key, default in {**SEQUENCE_FLAGS, **BATCH_FLAGS}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, default)


def run_cli(args) -> int:
    """Print the model's cost terms and the FLOPs table for `args` (from `add_cli`'s parser)."""
    _check_table_flags(args)
    with user_input(f"--config {args.config}", "give a transformers config.json or its folder"):
        shape = ModelShape.qwen3_1_7b() if args.config is None else _as_value_error(ModelShape.from_config, args.config)
    head = {}
    if args.head_config:
        with user_input(f"--head-config {args.head_config}", "give a recall head's config.json or its folder"):
            head = _as_value_error(_head_shape, args.head_config)
    head_hidden = head.get("hidden_size", shape.hidden_size)
    if head_hidden != shape.hidden_size:
        raise UsageError(f"the head reads hidden size {head_hidden}, the model has {shape.hidden_size}.")
    head_params = head_param_count(head_hidden, head.get("head_width"))
    # Explicit flags win, then the Local set the head was trained with, then the paper's defaults.
    sinks = next(v for v in (args.sinks, head.get("sinks"), DEFAULT_SINKS) if v is not None)
    window = next(v for v in (args.window, head.get("window"), DEFAULT_WINDOW) if v is not None)
    ledger = CostLedger(shape, head_params, sinks, window)
    if args.batch is not None or args.histories is not None:
        return _run_batch_cli(args, ledger)
    input_lengths = args.input_lengths or list(PAPER_INPUT_LENGTHS)
    if args.continuation < 2 or args.period < 1:
        raise UsageError("need --continuation >= 2 (one routed step) and --period >= 1.")
    for k in args.full_steps:
        if not 0 <= k <= args.period:
            raise UsageError(f"--full-steps {k} is outside 0..--period {args.period}.")
    rows = ledger.flops_table(input_lengths, args.continuation, args.period, args.full_steps)

    step = ledger.step_costs(ledger.local_range)
    print(shape.describe())
    print(f"per step: B = {step.backbone:,}  global-layer attention = {shape.global_attention_flops_per_position:,} "
          f"* n ({len(shape.global_layers)} of {len(shape.layers)} layers)  R = {step.head:,} "
          f"({head_params:,} head params)  O = {step.output:,}")
    print(f"Local range s + w = {sinks} + {window}; {args.continuation - 1:,} routed steps; "
          f"Full on the first k of every {args.period} for k in {','.join(map(str, args.full_steps))}")
    print()
    print(format_flops_table(rows, args.table_format))
    return 0


def _run_batch_cli(args, ledger: CostLedger) -> int:
    if args.histories is not None and (args.batch is not None or args.history is not None):
        raise UsageError("give either --histories (one length per row) or --batch with --history.")
    if args.batch is not None and args.history is None:
        raise UsageError("--batch needs --history (the length every row has), or use --histories.")
    lengths = args.histories if args.histories is not None else [args.history]
    if min(lengths) < 1 or (args.batch is not None and min(args.batch) < 1):
        raise UsageError("batch sizes and history lengths must be >= 1.")
    if max(args.batch or [0]) > MAX_BATCH or len(lengths) > MAX_BATCH:
        raise UsageError(f"at most {MAX_BATCH:,} rows per batch; got {max(max(args.batch or [0]), len(lengths)):,}.")
    if not all(0.0 <= rate <= 1.0 for rate in args.rate):
        raise UsageError(f"--rate values are probabilities in [0, 1]; got {args.rate}.")
    if args.pass_overhead_us < 0:
        raise UsageError("--pass-overhead-us must be >= 0.")
    model = BatchCostModel(ledger, args.hardware, pass_overhead_s=args.pass_overhead_us * 1e-6)
    modes = BATCH_MODES if args.mode == "all" else (args.mode,)
    rows = batch_table(model, args.batch or [], args.rate, lengths, modes)
    print(ledger.shape.describe())
    print(f"{model.hardware.name}: {model.hardware.peak_flops / 1e12:g} TFLOP/s, "
          f"{model.hardware.bandwidth / 1e12:g} TB/s; BF16 weights and KV, FP32 head; "
          f"Local range s + w = {ledger.sinks} + {ledger.window}; per-row recalls ~ Bernoulli(rate)")
    print("whole = Full for the whole batch when any row recalls; rows = Full for the recalling rows only; "
          "masked = all rows' projections, recalling rows' attention")
    print()
    print(format_batch_table(rows))
    return 0
