"""ODA inside vLLM: model classes, a model runner that keeps per-request routing state, and helpers.

Install beside vLLM (see README, "Serving with vLLM"); vLLM loads `register` through its ``vllm.general_plugins``
entry point in every process. Then::

    from vllm import LLM, SamplingParams
    from oda_hf.vllm import engine_args, routing_stats

    llm = LLM(**engine_args("smollm2", head="smollm2", max_model_len=8192))
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, extra_args={"oda_policy": "head"}))
    routing_stats(llm, outs)      # per request: Full calls, routed steps, decisions, scores

This package imports vLLM only inside functions, so ``import oda_hf.vllm`` works without it.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter

from .requests import (  # noqa: F401
    FINISHED_KEPT,
    POLICY_KEY,
    THRESHOLD_KEY,
    RequestRouting,
    by_caller_id,
    external_request_id,
    parse_policy,
    pooled,
    records_of,
    request_routing,
    trimmed,
)

logger = logging.getLogger(__name__)

ODA_ARCHITECTURES = {
    "LlamaForCausalLM": "OdaLlamaForCausalLM",
    "MistralForCausalLM": "OdaLlamaForCausalLM",
    "Qwen2ForCausalLM": "OdaQwen2ForCausalLM",
    "Qwen3ForCausalLM": "OdaQwen3ForCausalLM",
    "Qwen3_5ForCausalLM": "OdaQwen3_5ForCausalLM",
    "Gemma3ForCausalLM": "OdaGemma3ForCausalLM",
}


def register() -> None:
    """vLLM plugin entry point: register the ODA model classes (lazily, by name; idempotent) and their config hooks."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for name in sorted(set(ODA_ARCHITECTURES.values())):
        if name not in known:
            ModelRegistry.register_model(name, f"oda_hf.vllm.model:{name}")
    _register_config_hooks()


def _register_config_hooks() -> None:
    """Give every ODA architecture vLLM's config hook of its base architecture, which vLLM finds by architecture name
    (e.g. Qwen3.5's: the recurrent state's dtype from the checkpoint and one-dimensional rotary positions), so an
    engine configured by hand (``hf_overrides`` naming an ODA class) is configured as `engine_args` configures it.
    The hook also gives an engine without a head the admission check that refuses head requests
    (`settings.add_admission_checks`), however it was built, instead of failing inside a model step."""
    try:
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
    except ImportError:  # another vLLM layout: engine_args still applies the base's settings itself
        logger.debug("vLLM has no MODELS_CONFIG_MAP: ODA's config hooks are not registered.")
        return
    for oda_name in sorted(set(ODA_ARCHITECTURES.values())):
        if oda_name in MODELS_CONFIG_MAP:
            continue
        bases = [base for base, name in ODA_ARCHITECTURES.items() if name == oda_name]
        base_hooks = tuple(dict.fromkeys(MODELS_CONFIG_MAP[b] for b in bases if b in MODELS_CONFIG_MAP))
        MODELS_CONFIG_MAP[oda_name] = _config_hook(oda_name, base_hooks, VerifyAndUpdateConfig)


def _config_hook(oda_name: str, base_hooks: tuple, hook_base: type) -> type:
    def verify_and_update_config(vllm_config) -> None:
        for hook in base_hooks:
            hook.verify_and_update_config(vllm_config)
        from .settings import check_no_speculative_decoding, add_admission_checks

        # first: vLLM refuses the headless check (a custom logits processor) beside speculative decoding, in words
        # that do not say why ODA cannot serve it
        check_no_speculative_decoding(getattr(vllm_config, "speculative_config", None))
        add_admission_checks(vllm_config)

    def verify_and_update_model_config(model_config) -> None:
        for hook in base_hooks:
            hook.verify_and_update_model_config(model_config)

    return type(f"{oda_name}Config", (hook_base,), {
        "__doc__": f"vLLM's config hooks of {oda_name}'s base architecture, and the head's admission check.",
        "verify_and_update_config": staticmethod(verify_and_update_config),
        "verify_and_update_model_config": staticmethod(verify_and_update_model_config)})


def oda_architecture(model_folder: str) -> str:
    """The ODA class name for the base model in `model_folder` (ValueError for an unsupported family)."""
    path = os.path.join(model_folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_folder} has no config.json: give a local model folder (hub ids are not "
                                "resolved here; download the model first).")
    with open(path) as f:
        architectures = json.load(f).get("architectures") or []
    for name in architectures:
        if name in ODA_ARCHITECTURES:
            return ODA_ARCHITECTURES[name]
    if any(name.endswith("ForConditionalGeneration") for name in architectures):
        raise ValueError(f"{model_folder} is a multimodal checkpoint ({architectures}); ODA serves text-only causal LMs "
                         f"({sorted(ODA_ARCHITECTURES)}): save its text model with `oda text-model {model_folder} "
                         "OUT` (in oda_hf's own environment) and serve OUT.")
    raise ValueError(f"ODA's vLLM plugin serves {sorted(ODA_ARCHITECTURES)}; {model_folder} is {architectures}. "
                     "Serve it with oda_hf's Transformers path (OdaForCausalLM) instead.")


def engine_args(base: str, head: str | None = None, *, sinks: int | None = None, window: int | None = None,
                threshold: float | None = None, policy: str | None = None, **vllm_kwargs) -> dict:
    """Keyword arguments for ``vllm.LLM`` (or `AsyncEngineArgs`) that serve `base` with ODA.

    `base` is a local model folder or ``smollm2`` (after ``oda fetch smollm2``); `head` a recall-head folder or a
    shipped head (``smollm2``). Sinks, window, threshold and policy default to the head's saved ``oda_config.json``;
    they are the engine's defaults, and a request may choose its own policy and threshold (``extra_args``).
    """
    from ..known_models import resolve_base
    from .settings import ServingSettings, check_no_speculative_decoding, check_unquantized_kv_cache

    check_no_speculative_decoding(vllm_kwargs.get("speculative_config"))
    check_unquantized_kv_cache(vllm_kwargs.get("kv_cache_dtype"), vllm_kwargs.get("dtype"))   # (also at start)
    folder = os.path.abspath(os.fspath(resolve_base(base)))
    settings = ServingSettings.resolve(head, sinks, window, threshold, policy)
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"   # ODA's runner extends the V1 runner
    if settings.head is not None:
        check_head_fits(settings.head, folder)
    overrides = dict(vllm_kwargs.pop("hf_overrides", None) or {})
    for key in ("oda", "architectures"):   # (replaced below: a caller's own were dropped without a word)
        if key in overrides:
            raise ValueError(f"engine_args sets hf_overrides[{key!r}] itself; pass ODA's settings as its arguments "
                             "(head=, sinks=, window=, threshold=, policy=), not inside hf_overrides.")
    architecture = oda_architecture(folder)
    overrides.update(architectures=[architecture], oda=settings.to_override())
    kwargs = dict(model=folder, hf_overrides=overrides, worker_cls=worker_class_name())
    if architecture == "OdaQwen3_5ForCausalLM":
        kwargs.update(_qwen3_5_settings(folder, overrides))
    if not kwargs["worker_cls"].endswith("OdaCPUWorker"):
        kwargs["enforce_eager"] = True   # no CUDA graphs for ODA's routed step (see model.py); never run here
        # Asynchronous scheduling (vLLM's GPU default) schedules a step before the last one's tokens are known; ODA's
        # runner was built and tested with synchronous steps only (the CPU platform forces them)
        kwargs["async_scheduling"] = False
        # Local reads the paged cache in FlashAttention's layout (`attention.paged_layout`); vLLM may pick another
        # backend on a GPU, which the engine would refuse at start (a backend the caller names wins)
        if not names_attention_backend(vllm_kwargs):
            kwargs["attention_backend"] = "FLASH_ATTN"
    kwargs.update(vllm_kwargs)
    return kwargs


def names_attention_backend(vllm_kwargs: dict) -> bool:
    """Whether engine arguments choose an attention backend: ``attention_backend``, or ``attention_config`` naming
    one (vLLM refuses the two together)."""
    if vllm_kwargs.get("attention_backend") is not None:
        return True
    config = vllm_kwargs.get("attention_config")
    backend = config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    return backend is not None


def _qwen3_5_settings(model_folder: str, overrides: dict) -> dict:
    """What vLLM does for its own Qwen3.5 class by architecture name (`Qwen3_5ForCausalLMConfig`), which the ODA
    name does not reach: the recurrent state's dtype from the checkpoint (``mamba_ssm_dtype``) and one-dimensional
    rotary positions for the text model. Prefix caching defaults to off: it would cache recurrent states written by
    Local steps (the model refuses it)."""
    with open(os.path.join(model_folder, "config.json")) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and ({"mrope_section", "mrope_interleaved"} & rope.keys()):
        overrides["rope_parameters"] = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    settings = {"enable_prefix_caching": False}
    if config.get("mamba_ssm_dtype"):
        settings["mamba_ssm_cache_dtype"] = config["mamba_ssm_dtype"]
    return settings


def check_head_fits(head_folder: str, model_folder: str) -> None:
    """ValueError unless the head reads hidden states and a vocabulary of the base model's sizes (before any
    engine process starts)."""
    from transformers import AutoConfig

    from ..head import RecallHeadConfig

    RecallHeadConfig.from_pretrained(head_folder).check_compatible(AutoConfig.from_pretrained(model_folder))


def worker_class_name() -> str:
    from vllm.platforms import current_platform

    return "oda_hf.vllm.worker.OdaCPUWorker" if current_platform.is_cpu() else "oda_hf.vllm.worker.OdaGPUWorker"


def routing_stats(llm, outputs=None) -> dict:
    """ODA's counts per request (`outputs`' request ids, or every request the engine kept) and pooled over them.

    Per request: ``policy``, ``routed_steps`` (outputs after the first), ``decided_steps`` (those past sinks +
    window), ``full_calls``, ``full_call_rate`` (Full / decided), ``decisions`` and ``scores`` per routed step.
    A request with ``n > 1`` samples has one record per sample, keyed ``<k>_<request id>`` as vLLM names them.
    Requests that shared an id (added one after another by `LLMEngine.add_request` or `AsyncLLM`) are all kept, the
    later ones under their engine ids; with `outputs`, such an id is refused (an output does not say which it is).
    With `outputs`, each record counts only the steps of the tokens returned (`requests.trimmed`: after a stop string
    the engine has run a step or more that no output holds).
    """
    callers = None if outputs is None else [caller for out in outputs for caller in _caller_ids(out)]
    stats = llm.collective_rpc("oda_routing_stats", kwargs={"caller_ids": callers} if callers else None)[0]
    by_request = by_caller_id(stats["requests"])
    if outputs is not None:
        times = Counter(map(external_request_id, stats["requests"]))
        shared = sorted(caller for caller, count in times.items() if count > 1)
        if shared:   # (requests added one after another under one id, by `LLMEngine.add_request` or `AsyncLLM`)
            raise ValueError(f"Several requests the engine kept used the ids {shared}: an output does not say which "
                             "of them it is. Call routing_stats(llm) without outputs (the later requests keep their "
                             "engine ids there), or give each request its own id.")
        chosen, missing = {}, []
        for out in outputs:
            records = records_of(by_request, out.request_id)  # one per sample of an n > 1 request
            for completion in out.outputs:
                key = out.request_id if out.request_id in records else f"{completion.index}_{out.request_id}"
                if key in records:
                    records[key] = trimmed(records[key], len(completion.token_ids) - 1)
            chosen.update(records)
            if not records:
                missing.append(out.request_id)
        if missing:
            raise KeyError(f"The engine has no ODA routing record of requests {missing} (it keeps the newest "
                           f"{FINISHED_KEPT:,} finished ones).")
        by_request = chosen
    return pooled(by_request)


def _caller_ids(output) -> list[str]:
    """The ids of the engine requests behind one `RequestOutput`: its own, or one per sample (``<k>_<id>``)."""
    if len(output.outputs) == 1 and output.outputs[0].index == 0:
        return [output.request_id, f"0_{output.request_id}"]
    return [f"{completion.index}_{output.request_id}" for completion in output.outputs]
