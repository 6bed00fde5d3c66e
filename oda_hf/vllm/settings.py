"""The engine-wide ODA settings of a served model: head folder, sinks, window and the default routing.

They travel in the served model's config (``hf_overrides={"oda": {...}}``, see `engine_args`), because vLLM builds
the model in its own worker process from that config alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .requests import POLICY_KEY, THRESHOLD_KEY, RequestRouting, exact_text, parse_policy, request_routing

# The admission checks of an engine served without a recall head, and of one whose default policy does not ask the
# head (its config hook adds the one it needs to the engine's logits processors): vLLM gives a request validator
# nothing but the request, so each engine gets the check it needs.
HEADLESS_VALIDATOR = "oda_hf.vllm.validator:HeadlessEngineValidator"   # vLLM's <module>:<class> form
HEADLESS_DEFAULT_VALIDATOR = "oda_hf.vllm.validator:HeadlessDefaultValidator"


def served_head_of(vllm_config) -> bool | None:
    """Whether the engine of `vllm_config` serves a recall head, from its model's ``oda`` override (None: not an
    ODA engine, or unknown)."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    settings = getattr(hf_config, "oda", None)
    return bool(settings.get("head")) if isinstance(settings, dict) else None


def add_admission_checks(vllm_config) -> None:
    """Give an engine served without a head the admission check that refuses head requests (`HEADLESS_VALIDATOR`
    among its logits processors), however it was configured: such a request would otherwise fail inside a model step,
    which stops the engine with every request in it. An engine with a head whose default policy does not ask it
    (``policy="local"``...) gets `HEADLESS_DEFAULT_VALIDATOR`: a request's ``oda_threshold`` without its own policy
    would go unread."""
    model_config = getattr(vllm_config, "model_config", None)
    serves_head = served_head_of(vllm_config)
    check = HEADLESS_VALIDATOR if serves_head is False else \
        HEADLESS_DEFAULT_VALIDATOR if serves_head and not _default_asks_head(vllm_config) else None
    if check is not None:
        processors = list(getattr(model_config, "logits_processors", None) or [])
        if check not in processors:
            model_config.logits_processors = [*processors, check]


def _default_asks_head(vllm_config) -> bool:
    """Whether the default policy of an ODA engine with a head reads the head's threshold (head, or a budget)."""
    from ..validation import parse_policy_text

    policy = vllm_config.model_config.hf_config.oda.get("policy")
    try:
        return policy is None or parse_policy_text(policy).kind in ("head", "budget")
    except (TypeError, ValueError):   # refused, naming it, where the model is built (`ServingSettings`)
        return True


def check_no_speculative_decoding(speculative_config) -> None:
    """ValueError for an engine with speculative decoding: its verification steps score several tokens of a request
    in one pass, which ODA's routed step (one token per decode row, decided Local or Full) would run as a prompt chunk,
    with Full attention and no routing record, whatever the request asked for."""
    if speculative_config:
        raise ValueError("ODA does not serve with speculative decoding: a verification step runs several tokens of a "
                         "request in one pass, and ODA routes one token per step (those tokens would get Full "
                         "attention whatever the policy). Start the engine without speculative_config.")


# KV-cache dtypes that store keys and values as plain floating-point numbers, which Local reads as they are.
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", *FLOAT_DTYPES)
MODEL_DTYPE_NAMES = {"half": "float16", "float": "float32"}   # vLLM's aliases for a model's dtype


def check_unquantized_kv_cache(cache_dtype, model_dtype=None) -> None:
    """ValueError for a quantized KV cache (``kv_cache_dtype="fp8"`` and kin): vLLM's kernels store it in their own
    packed format with per-layer scales, which ODA's Local attention (a gather from the paged cache) does not decode,
    so every Local step would attend to wrong keys and values while the engine ran on. So for a cache in another
    float dtype than the model's (when `model_dtype` is known): vLLM's CPU kernels write the model's dtype into it,
    and Local read those bytes as the cache's dtype (a bfloat16 model with kv_cache_dtype="float16": other Local
    tokens from the second on; a float32 model with a bfloat16 cache: NaN, exit 0)."""
    if cache_dtype is not None and str(cache_dtype) not in UNQUANTIZED_KV_CACHE_DTYPES:
        raise ValueError(f"ODA does not serve with a quantized KV cache (kv_cache_dtype={cache_dtype!r}): its Local "
                         "attention reads keys and values straight from the paged cache and does not decode the "
                         "kernels' quantized format. Start the engine with kv_cache_dtype='auto'.")
    model = str(model_dtype).removeprefix("torch.") if model_dtype is not None else None
    model = MODEL_DTYPE_NAMES.get(model, model)   # (vLLM's aliases; "auto" and unknown names: not known here)
    if cache_dtype not in (None, "auto") and model in FLOAT_DTYPES and str(cache_dtype) != model:
        raise ValueError(f"ODA serves with the KV cache in the model's dtype, not kv_cache_dtype={cache_dtype!r} "
                         f"beside a {model} model: vLLM's CPU kernels write {model} keys and values into it, which "
                         "ODA's Local attention would read as another dtype (a GPU build's kernels were not checked). "
                         "Start the engine with kv_cache_dtype='auto'.")


def check_engine_features(vllm_config) -> None:
    """ValueError at engine start for what ODA's routed step cannot serve, rather than at the first request that
    needs it, where the error would stop the engine with every request in it, or than serving wrong tokens."""
    check_no_speculative_decoding(getattr(vllm_config, "speculative_config", None))
    check_unquantized_kv_cache(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None),
                               getattr(getattr(vllm_config, "model_config", None), "dtype", None))
    parallel = getattr(vllm_config, "parallel_config", None)
    stages = getattr(parallel, "pipeline_parallel_size", 1)
    if stages and stages > 1:
        raise ValueError(f"ODA serves on one pipeline stage (pipeline_parallel_size={stages}): the routed step needs "
                         "the whole model in one pass. Use tensor parallelism or pipeline_parallel_size=1.")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if isinstance(size, int) and size > 1:   # each rank then holds every size-th position of a request
            raise ValueError(f"ODA does not serve with context parallelism ({name}={size}): Local attention reads a "
                             "request's positions from one rank's paged cache, where each rank holds only some of "
                             f"them. Start the engine with {name}=1.")
    if getattr(parallel, "enable_dbo", False) is True:
        raise ValueError("ODA does not serve with dual-batch overlap (enable_dbo): the routed step decides and "
                         "retries rows over the whole batch, which DBO splits into micro-batches. Start the engine "
                         "without enable_dbo.")
    if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False) is True:
        raise ValueError("ODA does not serve with asynchronous scheduling: its routed step keeps per-request state "
                         "from the previous step, which an asynchronous scheduler plans before that step's tokens are "
                         "known (never run). Start the engine with async_scheduling=False (--no-async-scheduling); "
                         "engine_args and `oda serve` set it.")
    if getattr(getattr(vllm_config, "model_config", None), "enable_prompt_embeds", False):
        raise ValueError("ODA serves token-id prompts (the recall head reads each token's embedding): start the "
                         "engine without enable_prompt_embeds.")


def check_request_admissible(extra_args: dict | None, serves_head: bool = True,
                             default_asks_head: bool = True) -> None:
    """ValueError for a request an engine cannot serve: invalid ODA knobs, or (`serves_head` False) a policy that needs
    the recall head (it would otherwise fail inside a model step, where vLLM cannot fail one request alone), or
    (`default_asks_head` False) a threshold without a policy that would read it."""
    extra_args = extra_args or {}
    routing = request_routing(extra_args, RequestRouting())
    if extra_args.get(POLICY_KEY) is not None and routing.policy in ("head", "budget") and not serves_head:
        raise ValueError(f"{POLICY_KEY} {routing.policy!r} needs the recall head, and this server runs without one: "
                         "ask for full, local, random:P or schedule:K:PERIOD, or serve with a head (head=...).")
    if extra_args.get(THRESHOLD_KEY) is not None and not serves_head:   # served, the knob would go unread
        raise ValueError(f"{THRESHOLD_KEY} is the recall head's threshold, and this server runs without a head, so "
                         f"no policy reads it: drop {THRESHOLD_KEY}, or serve with a head (head=...).")
    if extra_args.get(THRESHOLD_KEY) is not None and extra_args.get(POLICY_KEY) is None and not default_asks_head:
        raise ValueError(f"{THRESHOLD_KEY} is the recall head's threshold, and this server's default policy does not "
                         f"ask the head: add {POLICY_KEY} 'head' (or 'budget:RATE') beside it, or drop it.")


# The keys of the served model's ``oda`` override (`ServingSettings.to_override`).
OVERRIDE_KEYS = ("head", "sinks", "window", "threshold", "policy")


@dataclass(frozen=True)
class ServingSettings:
    head: str | None
    sinks: int
    window: int
    default_routing: RequestRouting
    # the threshold of requests that name their own policy: the head's (or the one given), also where the default
    # policy is a budget with its own; None: default_routing's
    threshold: float | None = None

    def routing_for(self, extra_args: dict | None) -> RequestRouting:
        """A request's routing: its knobs (``vllm_xargs``) over these defaults (ValueError if invalid)."""
        return request_routing(extra_args, self.default_routing, self.threshold)

    @classmethod
    def resolve(cls, head: str | None = None, sinks: int | None = None, window: int | None = None,
                threshold: float | None = None, policy: str | None = None, *,
                from_override: bool = False) -> "ServingSettings":
        """Routing defaults as `OdaForCausalLM.from_pretrained` takes them (the head folder's ``oda_config.json``,
        else the geometry the head was trained with, else `OdaConfig`'s defaults), with the explicit values over
        them, validated by `OdaConfig`. Policy: ``head`` with a head, ``local`` without one."""
        from ..config import ODA_CONFIG_NAME, OdaConfig

        routing = OdaConfig()
        if head is not None:
            from ..known_models import HEAD_NAMES, resolve_head
            from ..loading import check_head_folder, read_config_json

            head = os.path.abspath(os.fspath(resolve_head(head)))
            if not os.path.isdir(head):
                raise FileNotFoundError(f"The recall head folder {head} does not exist: give a folder written by "
                                        f"save_pretrained (or a shipped head: {', '.join(HEAD_NAMES)}).")
            check_head_folder(head)
            saved = os.path.join(head, ODA_CONFIG_NAME)
            trained = {key: value for key, value in read_config_json(head).items()
                       if key in ("sinks", "window") and value is not None}
            routing = OdaConfig.from_json_file(saved) if os.path.isfile(saved) else OdaConfig(**trained)
        explicit = {key: value for key, value in (("sinks", sinks), ("window", window), ("threshold", threshold))
                    if value is not None}
        routing = OdaConfig.from_kwargs(routing, **explicit)
        if head is None and threshold is not None and not from_override:   # (`to_override` writes one for any engine)
            raise ValueError(f"threshold={threshold} is the recall head's threshold, but no head is given: the engine "
                             "would never read it. Pass head=<folder>, or drop threshold.")
        if policy is None:
            policy = routing.policy if head is not None else "local"
        default = parse_policy(policy, routing.threshold)
        if threshold is not None and default.policy == "budget" and default.threshold != routing.threshold \
                and not from_override:   # `to_override` writes both: the budget's and the other policies'
            raise ValueError(f"threshold={threshold} and policy={policy!r} give two thresholds: give it once "
                             "(threshold=T with policy 'budget:RATE', or 'budget:RATE:T' alone).")
        if default.policy in ("head", "budget") and head is None:
            raise ValueError(f"policy {default.policy!r} needs a recall head: pass head=<folder> (or policy full/local/random/"
                             "schedule for a baseline without one).")
        return cls(head=head, sinks=routing.sinks, window=routing.window, default_routing=default,
                   threshold=routing.threshold)

    def to_override(self) -> dict:
        policy = self.default_routing.spec()
        if self.default_routing.policy == "budget" and self.default_routing.threshold != self.threshold:
            policy += f":{exact_text(self.default_routing.threshold)}"   # the budget's own threshold
        return {"head": self.head, "sinks": self.sinks, "window": self.window,
                "threshold": self.default_routing.threshold if self.threshold is None else self.threshold,
                "policy": policy}

    @classmethod
    def from_override(cls, values: dict | None) -> "ServingSettings":
        if not isinstance(values, dict):
            raise ValueError("This model needs ODA settings in its config (`oda`): build the engine with "
                             "oda_hf.vllm.engine_args(...) or `oda serve`.")
        unknown = sorted(set(values) - set(OVERRIDE_KEYS))
        if unknown:   # a misspelled key would be served with the head's own setting instead
            raise ValueError(f"Unknown ODA settings {unknown} in the model config's `oda` override; the keys are "
                             f"{list(OVERRIDE_KEYS)}.")
        return cls.resolve(**{key: values.get(key) for key in OVERRIDE_KEYS}, from_override=True)
