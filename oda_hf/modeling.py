"""`OdaForCausalLM`: a frozen causal LM that decodes Local-first and recalls Full on demand.

The stock `generate()` drives it unchanged: `forward` performs one routed step (paper Algorithm 1)
and `_prepare_cache_for_generation` installs an `OdaCache`.

    prefill (Full) -> for each new token:
        Local pass (full-attention layers read sinks + window)  -> h_L, pending KV
        q = head(h_prev, embed(x_t), h_L); Full if q > theta or q not finite (or the policy says so)
        Full pass from the same pre-step cache where chosen     -> h_F, pending KV
        commit the selected candidate per row; logits = lm_head(selected h); h_prev = selected h
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
import json
import os
import threading
import weakref

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, StoppingCriteria, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import PushToHubMixin, logging

from .architectures import NATIVE_MASK_BUILDERS, resolve_architecture
from .cache import FULL, LOCAL, PREFILL, OdaCache, select_rows
from .compat import CACHE_ARG, cache_kwargs
from .config import CALIBRATION_NAME, ODA_CONFIG_NAME, ROUTING_KEYS, OdaConfig
from .head import RecallHead, head_fingerprint, pop_push_kwargs, push_published
from .known_models import resolve_base, resolve_head
from .loading import HEAD_MODEL_TYPE, HUB_KWARGS, read_model_type, resolve_local_folder
from .packed_attention import packed_attention
from .routing import RoutingRecord

logger = logging.get_logger(__name__)

_UNSUPPORTED_GENERATE_KWARGS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate")
#: transformers' continuous batching (`generate_batch`, `cache_implementation="paged"`) runs its own paged cache and
#: attention, where ODA's routing cannot run.
_CONTINUOUS_BATCHING = ("transformers' continuous batching runs its own paged cache and attention, where ODA cannot "
                        "route: serve ODA with continuous batching through vLLM (oda_hf.vllm, `oda serve`), or call "
                        "generate() on a padded batch.")
#: One lock per model (model -> [lock, thread running a call]): the running request's routing state lives on the
#: model, so generate() calls on one model run one after another.
_GENERATING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GENERATING_LOCK = threading.Lock()


@contextmanager
def _one_call_at_a_time(model):
    """Run one generate() call on `model` at a time: a call from another thread waits for the running one to end; a
    call from inside the running one (a stopping criterion, streamer or logits processor calling generate() on the
    same model) is refused, since it would replace the running request's policy state and record."""
    thread = threading.get_ident()
    with _GENERATING_LOCK:
        entry = _GENERATING.setdefault(model, [threading.Lock(), None])
    if entry[1] == thread:
        raise RuntimeError("generate() was called on this OdaForCausalLM from inside a generate() call on it (e.g. "
                           "from a stopping criterion or streamer): the inner request would replace the running one's "
                           "routing state. Call it after the outer call returns, or on another OdaForCausalLM.")
    with entry[0]:
        entry[1] = thread
        try:
            yield
        finally:
            entry[1] = None


class OdaForCausalLM(GenerationMixin, PushToHubMixin, nn.Module):
    """ODA decoding around a frozen ``*ForCausalLM``.

    Build it with `from_pretrained(base, head=...)` or directly from loaded objects. After
    `generate()`, `routing` holds the request's per-row decisions and Full-call rate.

    Only the recall head is ODA's own: `save_pretrained`/`push_to_hub` write the head (and the
    routing defaults), never the base weights.
    """

    main_input_name = "input_ids"
    #: A Full retry runs on the chosen rows only while they are at most this fraction of the batch (0 = always the
    #: whole batch, 1 = the chosen rows whenever some row keeps Local). See `_retry_rows`.
    max_row_retry_fraction = 0.5
    _is_stateful = False
    base_model_prefix = "base_model"

    def __init__(self, base_model, recall_head: RecallHead | None = None, oda_config: OdaConfig | None = None):
        nn.Module.__init__(self)
        if hasattr(base_model, "get_base_model") and hasattr(base_model, "peft_config"):
            base_model = base_model.get_base_model()  # adapters are injected in place: its forward applies them
        self.base_model = base_model
        self.architecture = resolve_architecture(base_model)
        self.oda_config = oda_config if oda_config is not None else _config_for_head(recall_head)
        self.recall_head = None
        if recall_head is not None:
            self.set_head(recall_head)
        self.routing = RoutingRecord(0)
        self._policy = None
        self._generate_call_starting = False  # the next forward is the first of a generate() call
        self._request_prefilled = False  # the current request's first output came from a prefill
        self._beam_generation = False  # the current generate() call runs beam search: outputs are not cache rows
        self._prefilling = False  # generate()'s prefill is running (`_prefill`), maybe in chunks
        self._prefilled_chunk = False  # ... and its chunks are all prompt (prefilled with Full)
        self._call_eos_token_id = _NOT_SEEN  # the EOS of the running generate() call's merged generation config
        self._pads_finished_rows = False  # ... and generate() pads rows after they stop (some criterion has an EOS)
        self.oda_config.routing_policy()  # validate now
        if self.oda_config.routing_policy().uses_head and self.recall_head is None:
            raise ValueError(
                "policy='head' needs a recall head: pass head=<RecallHead, hub id or folder>, or choose a non-learned "
                "policy ('full', 'local', RandomPolicy(p, seed), SchedulePolicy(k, period))."
            )

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        base,
        head: RecallHead | str | os.PathLike | None = None,
        *,
        oda_config: OdaConfig | None = None,
        head_kwargs: dict | None = None,
        **kwargs,
    ) -> "OdaForCausalLM":
        """Load (or wrap) a base causal LM and a recall head.

        Args:
            base: hub id, local folder, or an already loaded ``*ForCausalLM`` / peft ``PeftModel``. A recall
                head's folder (or hub id) alone also works: the base model it records is loaded with it.
                Short names: ``"smollm2"`` (after ``oda fetch smollm2``) and ``"organism"`` (shipped).
            head: a `RecallHead`, a hub id or folder of one, the short name of a head shipped in the package
                (``"organism"``, ``"smollm2"``), or None with a non-learned policy.
            oda_config: routing defaults; the keyword arguments ``sinks``, ``window``, ``threshold``
                and ``policy`` override single fields.
            head_kwargs: extra arguments for `RecallHead.from_pretrained` (``revision``, ``token``...).
            **kwargs: remaining arguments go to `AutoModelForCausalLM.from_pretrained` for the base.
        """
        routing = {key: kwargs.pop(key) for key in ROUTING_KEYS if key in kwargs}
        if routing:
            OdaConfig.from_kwargs(**routing)  # bad routing values fail before anything is loaded
        for name, value in (("base", base), ("head", head)):
            if isinstance(value, (str, os.PathLike)) and not os.fspath(value).strip():
                raise ValueError(f"`{name}` is an empty string; give a hub id, a local folder or a short name"
                                 + (" (or head=None with a non-learned policy)." if name == "head" else "."))
        base, head = resolve_base(base), resolve_head(head)  # short names: "smollm2", "organism"
        if isinstance(base, (str, os.PathLike)):
            base, head, head_kwargs = _base_of_head_folder(os.fspath(base), head, kwargs, head_kwargs)
            base = resolve_base(base)  # a head may record a short name as its base ("smollm2")
        given_head_object = isinstance(head, RecallHead) and oda_config is None and "threshold" not in routing
        if isinstance(head, (str, os.PathLike)):
            name = os.fspath(head)
            head = _load_head(name, head_kwargs or {})
            folder = getattr(head, "_oda_source_folder", None) or os.path.expanduser(name)
            saved = _saved_oda_config(name, folder, head_kwargs or {})
            if oda_config is None and saved is not None:
                oda_config = saved
        oda_config = OdaConfig.from_kwargs(oda_config if oda_config is not None else _config_for_head(head), **routing)
        if given_head_object:
            _warn_unapplied_threshold(head, oda_config)
        if isinstance(base, (str, os.PathLike)):
            resolve_local_folder(base, "base model", kwargs.get("revision"))
            base = AutoModelForCausalLM.from_pretrained(base, **kwargs)
        elif kwargs:
            raise TypeError(f"Unexpected arguments {sorted(kwargs)} for an already loaded base model.")
        return cls(base, head, oda_config)

    def set_head(self, head: RecallHead | None) -> None:
        """Attach a recall head (moved to the base model's device, kept in FP32)."""
        if head is None:
            self.recall_head = None
            return
        if not isinstance(head, RecallHead):
            raise TypeError(f"set_head takes a RecallHead (load one with RecallHead.from_pretrained(...)); got "
                            f"{type(head).__name__}.")
        head.check_compatible(self.base_model.config)
        head.check_base_fingerprint(self.base_model)  # one warning if the head was trained on other weights
        _warn_other_geometry(head, self.oda_config)
        previous = self._modules.get("recall_head")
        head = head.to(device=self.device, dtype=torch.float32).eval()   # (both FP32: compared by their weights)
        # (a save would publish that threshold with the new weights)
        if previous is not None and self.oda_config.threshold != OdaConfig().threshold \
                and head_fingerprint(previous) != head_fingerprint(head):
            logger.warning(f"The routing threshold {self.oda_config.threshold:g} was set with the previous recall "
                           "head and stays: calibrate this head (`oda calibrate`) or set its own with "
                           "set_routing(threshold=...).")
        self.recall_head = head

    def _apply(self, fn, recurse: bool = True):
        """The path of `to()`, `half()`, `bfloat16()`, `float()`, `cuda()`...: the base model gets `fn`; the
        recall head gets it only where it keeps the dtype (device moves, shared memory), so it stays FP32 and
        is never rounded through a lower precision."""
        head = self._modules.get("recall_head")
        if head is None or not recurse:
            return super()._apply(fn, recurse)

        def keep_dtype(tensor):
            applied = fn(tensor)
            return applied if applied.dtype == tensor.dtype else tensor.to(device=applied.device)

        self._modules["recall_head"] = None
        try:
            super()._apply(fn, recurse)
        finally:
            self._modules["recall_head"] = head
        head._apply(keep_dtype)
        return self

    def set_routing(self, **changes) -> None:
        """Change routing knobs (``sinks``, ``window``, ``threshold``, ``policy``) for later requests."""
        config = OdaConfig.from_kwargs(self.oda_config, **changes)
        if config.routing_policy().uses_head and self.recall_head is None:
            # Checked before assigning: a refused change leaves the model as it was.
            raise ValueError("policy='head' needs a recall head; call set_head() first.")
        if self.recall_head is not None and {"sinks", "window"} & set(changes):
            _warn_other_geometry(self.recall_head, config)   # as from_pretrained(window=...) and set_head warn
        self.oda_config = config

    # -- what GenerationMixin expects of a model ---------------------------------------------------
    def __getattr__(self, name: str):
        # Like peft's wrappers: anything ODA does not define (hf_device_map, experts implementation, ...)
        # is the base model's.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

    @property
    def config(self):
        return self.base_model.config

    @property
    def generation_config(self):
        return self.base_model.generation_config

    @generation_config.setter
    def generation_config(self, value):
        self.base_model.generation_config = value

    @property
    def device(self) -> torch.device:
        return self.base_model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base_model.dtype

    @classmethod
    def can_generate(cls) -> bool:
        return True

    @classmethod
    def is_remote_code(cls) -> bool:
        return False

    def get_input_embeddings(self):
        return self.base_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.base_model.get_output_embeddings()

    def get_decoder(self):
        return self.base_model.get_decoder()

    def new_cache(self, max_cache_len: int | None = None) -> OdaCache:
        """An empty `OdaCache` for this model and the current sinks/window (preallocated if `max_cache_len`)."""
        cache = OdaCache(self.config, sinks=self.oda_config.sinks, window=self.oda_config.window,
                         max_cache_len=max_cache_len)
        cache.on_reorder.append(self._reorder_rows)
        return cache

    def _reorder_rows(self, indices: torch.Tensor) -> None:
        """Beam search reordered the cache's rows: the routing record and the policy's per-row state follow."""
        self.routing.reorder(indices)
        if self._policy is not None:
            self._policy.reorder(indices)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size=None,
                                      max_cache_length=None, *args, **kwargs):
        if generation_mode in (GenerationMode.ASSISTED_GENERATION, GenerationMode.CONTRASTIVE_SEARCH,
                               GenerationMode.DOLA_GENERATION):
            raise ValueError(
                f"{generation_mode.value} is not supported by ODA: it needs to crop or re-run the cache, while ODA "
                "commits one routed token per step. Use greedy, sampling or beam search."
            )
        self._beam_generation = (generation_config.num_beams or 1) > 1
        if generation_config.guidance_scale is not None and generation_config.guidance_scale != 1:
            raise ValueError(
                f"guidance_scale={generation_config.guidance_scale} (classifier-free guidance) is not supported by "
                "ODA: its unconditional pass runs a second request through the model inside each step, which would "
                "share the call's routing state and record. Leave guidance_scale unset (or 1).")
        if generation_config.use_cache is False:
            raise ValueError("ODA decodes from its KV cache: generate() with use_cache=False is not supported.")
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported: ODA installs its "
                "own OdaCache. Leave cache_implementation unset."
            )
        cache = model_kwargs.get(CACHE_ARG)
        if cache is None:
            # generate() knows the final length (prompt + new tokens): allocate once, never regrow.
            model_kwargs[CACHE_ARG] = self.new_cache(max_cache_len=max_cache_length)
        elif not isinstance(cache, OdaCache):
            raise TypeError(
                f"ODA needs an OdaCache, got {type(cache).__name__}. Omit past_key_values or pass model.new_cache()."
            )

    def generate(self, *args, oda_fast: bool = False, oda_mode: str = "approximate", max_draft: int | None = None,
                 verify_threshold: float | None = None, **kwargs):
        """The stock `generate()`; afterwards `self.routing` describes this call's routing, also when the call
        continues a reused ``past_key_values`` (multi-turn chat): each call starts a new record and policy state.

        ``oda_fast=True`` runs the request on the static decode engine (`oda_hf.engine.OdaStaticEngine`:
        preallocated buffers, device-side routing, CUDA graphs on GPU; greedy or sampling, full-attention
        families). Settings it cannot run raise `FastPathUnsupported`. With ``ODA_DISABLE_FAST_PATH=1``
        it runs this HF path instead (logged; same results).

        ``oda_mode="exact"`` returns Full's output token for token (`oda_hf.exact`): Local drafts up to
        `max_draft` tokens (default 3), and one Full pass verifies them when the head's score passes
        `verify_threshold` (default: the routing threshold; ``math.inf`` verifies every `max_draft` tokens, head
        unused); with ``oda_fast=True`` on the static engine.
        ``model.routing`` is then an `ExactRecord` (drafted, accepted, corrected tokens, Full passes).
        """
        with _one_call_at_a_time(self):
            return self._generate(*args, oda_fast=oda_fast, oda_mode=oda_mode, max_draft=max_draft,
                                  verify_threshold=verify_threshold, **kwargs)

    def _generate(self, *args, oda_fast: bool, oda_mode: str, max_draft: int | None, verify_threshold: float | None,
                  **kwargs):
        if oda_mode not in ("approximate", "exact"):
            raise ValueError(f"oda_mode must be 'approximate' (routed: Local or Full per step) or 'exact' (Local "
                             f"drafts, Full verifies); got {oda_mode!r}.")
        if oda_mode == "exact":
            from .exact import generate_exact

            return generate_exact(self, *args, max_draft=max_draft, verify_threshold=verify_threshold,
                                  oda_fast=oda_fast, **kwargs)
        for name, value in (("max_draft", max_draft), ("verify_threshold", verify_threshold)):
            if value is not None:
                raise ValueError(f"{name} only applies with oda_mode='exact'; drop it or pass oda_mode='exact'.")
        _check_prompt_not_empty(args[0] if args else kwargs.get("input_ids"))
        if oda_fast:
            from .engine import fast_path_enabled, generate_fast

            if fast_path_enabled():
                return generate_fast(self, *args, **kwargs)
        for key in _UNSUPPORTED_GENERATE_KWARGS:
            if kwargs.get(key) is not None:
                raise ValueError(f"generate({key}=...) is not supported by ODA (it needs cache cropping/re-runs).")
        if kwargs.get("cache_implementation") == "paged":   # (transformers switches before preparing a cache)
            raise ValueError("generate(cache_implementation='paged') is not supported by ODA: " + _CONTINUOUS_BATCHING)
        # Routing describes each call, also when it continues a reused cache (multi-turn chat).
        self._generate_call_starting, self._beam_generation = True, False
        self._call_eos_token_id, self._pads_finished_rows = _NOT_SEEN, False
        try:
            output = super().generate(*args, **kwargs)
        finally:
            self._generate_call_starting = False
        self._drop_undone_steps(output, args, kwargs)
        self._mark_eos_rows(output, kwargs)
        return output

    def _drop_undone_steps(self, output, args, kwargs) -> None:
        """Forget routed steps whose tokens `generate` took back: transformers' deferred stop check (on mps) learns
        that generation stopped one step late and removes that step's token (and cache position: `OdaCache.crop`);
        its routing would otherwise count in the record."""
        sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
        prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if self._beam_generation or sequences is None:
            return
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and not prompt.is_floating_point():
            prompt_length = prompt.shape[1]
        elif prompt is None and kwargs.get("inputs_embeds") is not None:
            prompt_length = 0   # (the output holds the new tokens only)
        else:
            return
        offset = 0 if self._request_prefilled else 1
        extra = self.routing.routed_steps + 1 - offset - (sequences.shape[1] - prompt_length)
        if extra > 0:
            self.routing.drop_last_steps(extra)

    def generate_batch(self, *args, **kwargs):
        raise NotImplementedError("generate_batch() is not supported by ODA: " + _CONTINUOUS_BATCHING)

    def init_continuous_batching(self, *args, **kwargs):
        raise NotImplementedError("init_continuous_batching() is not supported by ODA: " + _CONTINUOUS_BATCHING)

    def continuous_batching_context_manager(self, *args, **kwargs):
        raise NotImplementedError("continuous_batching_context_manager() is not supported by ODA: "
                                  + _CONTINUOUS_BATCHING)

    def _get_stopping_criteria(self, generation_config, stopping_criteria, tokenizer=None, **kwargs):
        # Every criterion of the call (EOS, stop strings, max length, the user's), after transformers has merged the
        # user's with its own, tells ODA when each row stopped: its later steps are padding, not routed steps.
        criteria = super()._get_stopping_criteria(generation_config, stopping_criteria, tokenizer, **kwargs)
        self._call_eos_token_id = generation_config.eos_token_id   # the call's, however it was passed
        self._pads_finished_rows = any(hasattr(criterion, "eos_token_id") for criterion in criteria)  # as generate()
        return _RecordingCriteriaList([_RecordFinishedRows(criterion, self) for criterion in criteria])

    def _mark_eos_rows(self, output, kwargs) -> None:
        """Rows that emitted EOS stop counting routed steps after it (their later tokens are padding)."""
        sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
        eos = self._call_eos_token_id   # merged by transformers from the call's config (keyword or positional)
        if eos is _NOT_SEEN:
            generation_config = kwargs.get("generation_config") or self.generation_config
            eos = kwargs.get("eos_token_id", generation_config.eos_token_id)
        if self._beam_generation or sequences is None or eos is None or sequences.shape[0] != self.routing.batch_size:
            # beam search returns hypotheses, not cache rows (also when as many as the beams): routing rows stay per
            # beam slot
            return
        # With a prefill, output k came from routed step k (output 0 from the prefill); a call that continued a
        # cache with one token has no prefill output, and its output k came from routed step k + 1.
        offset = 0 if self._request_prefilled else 1
        outputs = self.routing.routed_steps + 1 - offset
        if outputs == 0:
            return
        generated = sequences[:, -outputs:]
        is_eos = torch.isin(generated, torch.as_tensor(eos, device=sequences.device).flatten()).cpu()
        first_eos = is_eos.int().argmax(dim=1) + offset
        known = self.routing.finished_at
        update = is_eos.any(dim=1) & ((known < 0) | (first_eos < known))
        known[update] = first_eos[update]

    def _check_cache_geometry(self, cache: OdaCache) -> None:
        """A cache keeps the Local ring of the sinks/window it was made with: refuse to route it with others
        (set_routing after new_cache(), or a reused past_key_values) instead of silently using the old ones."""
        config = self.oda_config
        if (cache.sinks, cache.window) != (config.sinks, config.window):
            raise ValueError(
                f"This OdaCache was made for sinks={cache.sinks}, window={cache.window}, but the model now routes "
                f"with sinks={config.sinks}, window={config.window}. Start a new cache (omit past_key_values or "
                f"model.new_cache()) or set_routing(sinks={cache.sinks}, window={cache.window}) to continue it.")

    # -- the routed step ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: OdaCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: OdaCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Prefill (Full) when the cache is empty or several tokens arrive; otherwise one routed step.

        With ``use_cache=False`` this is the base model's plain Full forward; otherwise (``use_cache`` None reads
        the config's, as transformers' models do) a call without a cache makes one, and a call whose cache is empty
        starts a request: `routing` then describes it. The cache comes as ``cache`` (transformers >= 5.24) or
        ``past_key_values`` (5.23); both names are accepted. ``labels`` give the base's loss over the logits
        returned (a prefill's are Full's).
        """
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("Pass the OdaCache once: as cache= or as past_key_values=, not both.")
        past_key_values = cache if cache is not None else past_key_values
        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(flag, False):
                raise ValueError(f"{flag}=True is not supported by OdaForCausalLM (two passes per step).")
        kwargs.pop("return_dict", None)
        labels = kwargs.pop("labels", None)
        # (the loss function's own arguments: HF Trainer passes num_items_in_batch under gradient accumulation)
        loss_kwargs = {key: kwargs.pop(key) for key in ("num_items_in_batch", "ignore_index", "shift_labels")
                       if key in kwargs}
        if use_cache is None:   # (as transformers' models: the config's, so model(ids) returns a cache to continue)
            use_cache = getattr(self.config, "use_cache", True)
        if past_key_values is None:
            if use_cache:
                past_key_values = self.new_cache()
            else:
                return self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, use_cache=False, logits_to_keep=logits_to_keep,
                                       labels=labels, **loss_kwargs, **kwargs)
        if not isinstance(past_key_values, OdaCache):
            raise TypeError(f"OdaForCausalLM needs an OdaCache (model.new_cache()); got {type(past_key_values).__name__}.")
        cache = past_key_values
        self._check_cache_geometry(cache)
        held = next((layer.keys for layer in cache.global_layers if layer.is_initialized), None)
        if held is not None and held.is_inference() and not torch.is_inference_mode_enabled():
            # (the cache writes into its buffers in place, which torch refuses for inference tensors)
            raise RuntimeError("This OdaCache was filled under torch.inference_mode(), so it can only be continued "
                               "under it: continue inside torch.inference_mode(), or fill it under torch.no_grad().")
        batch_size, num_tokens = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        prefill = cache.get_seq_length() == 0 or num_tokens > 1 or self._prefilled_chunk
        self._prefilled_chunk = prefill and self._prefilling
        if cache.get_seq_length() == 0 or self._generate_call_starting:
            continuing = self._generate_call_starting and not prefill
            self._generate_call_starting = False
            self._start_request(batch_size, prefilled=prefill)
            if continuing and attention_mask is not None and attention_mask.dim() == 2 \
                    and attention_mask.shape[-1] == cache.get_seq_length() + 1:   # (one token: not a prefill)
                # A call that continues a cache with no new prompt token runs no prefill, which is where the Local
                # workspace follows the call's mask: this one may hide history columns the last call showed (the
                # padding after a row's EOS), which Local would otherwise still read and count.
                masked = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
                if masked and getattr(self.oda_config.routing_policy(), "name", None) != "full":
                    # Full decodes it without reading it; Local's step always reads its own token
                    raise ValueError(
                        f"Rows {masked} continue from a token their attention_mask hides (the last column is 0, e.g. "
                        "the padding after a row's EOS): ODA's Local step cannot decode from a hidden token as Full "
                        "does. Append the next prompt tokens to every row (the usual next turn), or keep those "
                        "columns visible (attention_mask 1, as generate() kept them).")
                cache.rebuild_workspace(attention_mask[:, :-1], batch_size)
        if prefill:
            hidden = self._full_prefill(cache, input_ids, inputs_embeds, attention_mask, position_ids, kwargs)
            if isinstance(logits_to_keep, int):
                hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
            else:
                hidden = hidden[:, logits_to_keep]
        else:
            try:
                hidden = self._routed_step(cache, input_ids, inputs_embeds, attention_mask, position_ids, kwargs)
            except BaseException:
                cache.discard_pending()
                raise
        logits = self.lm_logits(hidden)
        loss = None
        if labels is not None:   # (the base's own loss over these logits: Full's for a prefill)
            loss = self.base_model.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1],
                                                 **loss_kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_kwargs(cache))

    def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        """transformers' prefill of a generate() call. Chunked (``prefill_chunk_size``), a chunk may be one token:
        where the call feeds more than one uncached token (unchunked: one Full prefill), every chunk is prompt,
        prefilled with Full, not a routed step (a call continuing a cache with chunks of one routed them all)."""
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        cached = cache.get_seq_length() if isinstance(cache, OdaCache) else 0
        mask, embeds = model_kwargs.get("attention_mask"), model_kwargs.get("inputs_embeds")
        # (transformers' own rule for what it feeds: the uncached tail when the mask covers the whole sequence; an
        # all-ones mask was dropped, its length kept in the config)
        mask_length = mask.shape[-1] if mask is not None else getattr(generation_config, "_mask_length", -1)
        if embeds is not None:
            fed = embeds.shape[1] - cached
        else:
            fed = input_ids.shape[1] - cached if mask_length == input_ids.shape[1] else input_ids.shape[1]
        self._prefilling, self._prefilled_chunk = True, fed > 1 and cached > 0
        try:
            return super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        finally:
            self._prefilling = self._prefilled_chunk = False

    def _decoder_inputs(self, input_ids, inputs_embeds) -> dict:
        if input_ids is not None:
            return {"input_ids": input_ids}
        return {"inputs_embeds": inputs_embeds}

    def _full_prefill(self, cache, input_ids, inputs_embeds, attention_mask, position_ids, kwargs) -> torch.Tensor:
        batch_size = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        cache.set_mode(PREFILL)
        out = self.get_decoder()(
            **self._decoder_inputs(input_ids, inputs_embeds), attention_mask=attention_mask,
            position_ids=position_ids, **cache_kwargs(cache), use_cache=True, **kwargs,
        )
        cache.rebuild_workspace(attention_mask, batch_size)
        cache.selected_hidden = out.last_hidden_state[:, -1]
        return out.last_hidden_state

    def begin_request(self, cache: OdaCache, selected_hidden: torch.Tensor) -> None:
        """Start routing on a cache whose history was filled outside `forward` (`OdaCache.load_history`).

        `selected_hidden`: ``[batch, hidden]``, the final normed hidden state of the last history position
        (the head's H input for the first routed step).
        """
        cache.selected_hidden = selected_hidden
        self._start_request(selected_hidden.shape[0], prefilled=False)

    def _start_request(self, batch_size: int, prefilled: bool) -> None:
        self._request_prefilled = prefilled
        self._policy = self.oda_config.routing_policy()
        if self._policy.uses_head and self.recall_head is None:
            raise ValueError("policy='head' needs a recall head; pass head=... or set a non-learned policy.")
        self._policy.reset()
        self.routing = RoutingRecord(batch_size)

    def _routed_step(self, cache, input_ids, inputs_embeds, attention_mask, position_ids, kwargs) -> torch.Tensor:
        policy = self._policy
        if policy is None or self.routing.batch_size != cache.selected_hidden.shape[0]:
            raise RuntimeError("A routed step needs a prefill first (the cache holds no request of this batch size).")
        decoder = self.get_decoder()
        embeds = inputs_embeds if inputs_embeds is not None else self.get_input_embeddings()(input_ids)
        inputs = self._decoder_inputs(input_ids, inputs_embeds)
        batch_size, step = embeds.shape[0], self.routing.routed_steps + 1
        local_hidden = scores = None
        # Rows whose history fits in sinks + window: Local reads what Full would, so they take Local and
        # nothing is decided for them; when every row does, the head and the retry are skipped.
        in_window = cache.rows_within_window()
        if policy.skips_local:
            select_full = policy.decide(None, step, batch_size, embeds.device)
        else:
            cache.begin_step()
            cache.set_mode(LOCAL)
            out = decoder(**inputs, attention_mask=self._local_masks(cache, embeds, attention_mask, position_ids),
                          position_ids=position_ids, **cache_kwargs(cache), use_cache=True, **kwargs)
            local_hidden = out.last_hidden_state[:, -1]
            if bool(in_window.all()):
                if policy.host_draws:
                    policy.decide(None, step, batch_size, embeds.device)  # every step consumes its draw (as the engine)
                select_full = torch.zeros(batch_size, dtype=torch.bool, device=embeds.device)
            else:
                if policy.uses_head or (policy.run_head and self.recall_head is not None):
                    scores = self.recall_head(cache.selected_hidden, embeds[:, -1], local_hidden)
                policy.observe_window(in_window)
                select_full = policy.decide(scores, step, batch_size, embeds.device) & ~in_window.to(embeds.device)
                if self._pads_finished_rows and not self._beam_generation:
                    # a stopped row's later tokens are padding, whatever they attend: no Full pass for them
                    finished = self.routing.finished_at >= 0
                    if bool(finished.any()):
                        select_full = select_full & ~finished.to(embeds.device)
        hidden = local_hidden
        run_full = bool(select_full.any())
        rows = None if local_hidden is None or not run_full else self._retry_rows(
            select_full, cache, attention_mask, position_ids, kwargs)
        if rows is not None:
            # Only the rows that chose Full: gather their history, recompute, scatter hidden state and KV back.
            retry = cache.full_retry_rows(rows)
            with packed_attention(self):
                out = decoder(**{name: value.index_select(0, rows) for name, value in inputs.items()},
                              attention_mask=None if attention_mask is None else attention_mask.index_select(0, rows),
                              position_ids=None if position_ids is None else position_ids.index_select(0, rows),
                              **cache_kwargs(retry), use_cache=True, **kwargs)
            cache.scatter_full_rows(retry, rows)
            hidden = local_hidden.index_copy(0, rows, out.last_hidden_state[:, -1])
        elif run_full:
            if local_hidden is not None:
                cache.prepare_full_retry()
            cache.set_mode(FULL)
            # A recalled step: stock static's kernel form, not enable_gqa's (packed_attention.py); always-Full (no
            # Local pass): transformers' own choice, so that its output is stock generate()'s bit for bit.
            with packed_attention(self) if local_hidden is not None else nullcontext():
                out = decoder(**inputs, attention_mask=attention_mask, position_ids=position_ids,
                              **cache_kwargs(cache), use_cache=True, **kwargs)
            full_hidden = out.last_hidden_state[:, -1]
            hidden = full_hidden if local_hidden is None else select_rows(select_full, full_hidden, local_hidden)
        cache.commit(select_full if run_full else None)
        cache.selected_hidden = hidden
        self.routing.record(select_full, scores, in_window)
        return hidden[:, None]

    def _retry_rows(self, select_full, cache, attention_mask, position_ids, kwargs) -> torch.Tensor | None:
        """Rows (long ``[k]``) for a Full retry of those rows only, or None to retry the whole batch.

        The whole batch is retried when at least `max_row_retry_fraction` of the rows chose Full (gathering
        copies the selected rows' history, so a retry of most rows is cheaper in place), for hybrids (the
        model updates recurrent state in place for the whole batch), and when an input cannot be split by
        rows (a 4D or per-layer mask, multimodal 3D positions, other per-row tensors).
        """
        batch_size = select_full.shape[0]
        rows = select_full.nonzero().flatten()
        if rows.numel() > self.max_row_retry_fraction * batch_size or cache.linear_layers:
            return None
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            return None
        if position_ids is not None and position_ids.dim() != 2:
            return None
        if any(isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch_size for value in kwargs.values()):
            return None
        return rows

    def _local_masks(self, cache, embeds, attention_mask, position_ids):
        """Masks for the Local pass: explicit sinks+window visibility for global layers, native for others."""
        visible = cache.local_visibility().to(embeds.device)[:, None, None, :]
        if self.config._attn_implementation == "eager":
            zero = torch.zeros((), dtype=embeds.dtype, device=embeds.device)
            visible = torch.where(visible, zero, torch.finfo(embeds.dtype).min)
        if not self.architecture.accepts_mask_dict:
            return visible
        layer_types = set(getattr(self.config, "layer_types", None) or cache.layer_types) - {"dummy"}
        mask_position_ids = position_ids if position_ids is None or position_ids.dim() == 2 else position_ids[0]
        masks = {}
        for layer_type in layer_types:
            if layer_type == "full_attention":
                masks[layer_type] = visible
            else:
                masks[layer_type] = NATIVE_MASK_BUILDERS[layer_type](
                    config=self.config, inputs_embeds=embeds, attention_mask=attention_mask,
                    position_ids=mask_position_ids, **cache_kwargs(cache),
                )
        return masks

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of final normed hidden states (lm_head, then the soft-cap where the model has one)."""
        logits = self.get_output_embeddings()(hidden)
        cap_attr = self.architecture.logit_softcap_attr
        cap = getattr(self.config, cap_attr, None) if cap_attr else None
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- saving ------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        """Save the recall head (config.json, model.safetensors, README.md) and the routing defaults.

        A policy object (RandomPolicy, SchedulePolicy) is not saved: sinks, window and threshold are,
        with a warning saying so. As `RecallHead.save_pretrained`: all files are published together, config.json
        last; a calibration of other weights in the folder is dropped; ``push_to_hub=True`` then uploads them.
        """
        if self.recall_head is None:
            raise ValueError("There is no recall head to save: ODA never saves the base model's weights.")
        push = pop_push_kwargs(push_to_hub, kwargs)
        # oda_config.json is staged with the head's files: a save killed midway never leaves the old head with
        # the new routing defaults.
        written = self.recall_head._save_folder(save_directory, oda_config=self.oda_config, **kwargs)
        if push is not None:
            push_published(save_directory, written, **push)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the head, its generated model card and the routing defaults (never the base weights)."""
        from .hub import push_saved_to_hub

        return push_saved_to_hub(self, repo_id, **kwargs)


_NOT_SEEN = object()   # `_call_eos_token_id` before transformers built the call's stopping criteria


def _check_prompt_not_empty(input_ids) -> None:
    """A prompt of no token has no position to decode from (transformers fails deep inside with a reshape error)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() >= 1 and input_ids.shape[-1] == 0:
        raise ValueError("input_ids has no token (shape %s): ODA decodes from a prompt of at least one token."
                         % (tuple(input_ids.shape),))


class _RecordingCriteriaList(StoppingCriteriaList):
    """The call's criteria, each wrapped in `_RecordFinishedRows`, with the max length still visible: transformers
    reads it through an isinstance test (`StoppingCriteriaList.max_length`), and its deferred stop check (mps)
    without it runs one step past the length."""

    @property
    def max_length(self) -> int | None:
        return StoppingCriteriaList(getattr(c, "criterion", c) for c in self).max_length


class _RecordFinishedRows(StoppingCriteria):
    """Wraps a stopping criterion so ODA knows when each row stopped (its later steps are padding). Its attributes
    are the criterion's: `generate` pads finished rows only if some criterion has an ``eos_token_id``."""

    def __init__(self, criterion, model: OdaForCausalLM):
        self.criterion, self.model = criterion, model

    def __getattr__(self, name):
        if name in ("criterion", "model"):  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.criterion, name)

    def __call__(self, input_ids, scores, **kwargs):
        done = self.criterion(input_ids, scores, **kwargs)
        if isinstance(done, torch.Tensor) and done.dim() == 1 and done.shape[0] == self.model.routing.batch_size:
            rows = done.detach().cpu()  # one host read per step
            # When every row stops at once (max length, max time) generation ends there: no later step is padding.
            if not rows.all():
                self.model.routing.mark_finished(rows)
        return done


def _warn_other_geometry(head: RecallHead, oda_config: OdaConfig) -> None:
    """Warn where routing's sinks or window differ from those the head was trained with, or from those its
    folder's threshold was calibrated at (a calibrated threshold holds for that geometry only)."""
    for name in ("sinks", "window"):
        trained, used = getattr(head.config, name), getattr(oda_config, name)
        if trained is not None and trained != used:
            logger.warning(f"The recall head was trained with {name}={trained}, but routing uses {name}={used}.")
    calibration = _calibration_of(head)
    if calibration is None or calibration.get("threshold") != oda_config.threshold:
        return
    for name in ("sinks", "window"):
        calibrated, used = calibration.get(name), getattr(oda_config, name)
        if calibrated is not None and calibrated != used and calibrated != getattr(head.config, name):
            logger.warning(f"The routing threshold {oda_config.threshold:g} was calibrated at {name}={calibrated}, "
                           f"but routing uses {name}={used}: calibrate again at this geometry (`oda calibrate`).")


def _calibration_of(head: RecallHead) -> dict | None:
    """The chosen threshold and geometry of the calibration saved beside the head's weights, or None."""
    folder = getattr(head, "_oda_source_folder", None)
    path = os.path.join(folder, CALIBRATION_NAME) if folder else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        return {"threshold": saved["chosen"]["threshold"], **{key: saved.get(key) for key in ("sinks", "window")}}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _config_for_head(head: RecallHead | None) -> OdaConfig:
    """Default routing: the Local geometry the head was trained with, if it records one."""
    if head is not None and not isinstance(head, RecallHead):
        raise TypeError(f"head must be a RecallHead, a hub id or a folder; got {type(head).__name__}.")
    trained = {} if head is None else {key: getattr(head.config, key) for key in ("sinks", "window")
                                       if getattr(head.config, key, None) is not None}
    return OdaConfig(**trained)


def _load_head(name: str, head_kwargs: dict) -> RecallHead:
    try:
        return RecallHead.from_pretrained(name, **head_kwargs)
    except (FileNotFoundError, NotADirectoryError):
        raise  # they already name the path and the fix
    except OSError as err:
        raise OSError(
            f"Could not load the recall head {name!r}: {err}\nGive a local folder written by save_pretrained, or a hub "
            "id that is cached locally when offline (HF_HUB_OFFLINE=1 uses only the cache)."
        ) from err


def _base_of_head_folder(name: str, head, base_kwargs: dict, head_kwargs: dict | None):
    """``(base, head, head_kwargs)``: `name` itself when it is a base model; the base a recall head records when it
    is a head, whose ``revision`` / ``subfolder`` in `base_kwargs` then name where the head is (moved into
    `head_kwargs`; the base loads at the revision the head records) and whose other hub arguments (token,
    cache_dir...) serve both."""
    model_type, values = read_model_type(name, base_kwargs)
    if model_type != HEAD_MODEL_TYPE:
        return name, head, head_kwargs
    if head is not None:
        raise ValueError(
            f"{name!r} is a recall head, and head= was given too. Pass the base model first and the head as head=..., "
            "or the head alone (its recorded base model is loaded)."
        )
    recorded = values.get("base_model_name_or_path")
    if not recorded:
        raise ValueError(
            f"The recall head {name!r} does not record its base model (base_model_name_or_path). Pass the base "
            f"explicitly: OdaForCausalLM.from_pretrained(<base>, head={name!r})."
        )
    beside = os.path.join(os.path.expanduser(name), recorded)
    if not os.path.isabs(recorded) and not os.path.exists(recorded) and os.path.isdir(beside):
        recorded = beside  # a base path recorded relative to the head folder
    head_kwargs = dict(head_kwargs or {})
    for key in ("revision", "subfolder"):   # (read_model_type found the head with them: its location, not the base's)
        if key in base_kwargs:
            head_kwargs.setdefault(key, base_kwargs.pop(key))
    for key in HUB_KWARGS:
        if key in base_kwargs:
            head_kwargs.setdefault(key, base_kwargs[key])
    if values.get("base_model_revision"):
        base_kwargs["revision"] = values["base_model_revision"]
    logger.info(f"Loading the base model {recorded!r} recorded by the recall head {name!r}.")
    return recorded, name, head_kwargs


def _saved_oda_config(name: str, folder: str, head_kwargs: dict) -> OdaConfig | None:
    """The routing defaults saved with the head `name`, read from `folder`, the one its weights were loaded from
    (``~`` expanded, ``subfolder`` applied, or the hub snapshot)."""
    path = os.path.join(folder, ODA_CONFIG_NAME)
    if os.path.isfile(path):
        return OdaConfig.from_json_file(path)
    if os.path.isdir(os.path.expanduser(name)):
        return None  # a local head folder without routing defaults
    try:  # a hub id: oda_config.json is not downloaded with the head's weights
        from transformers.utils import cached_file

        path = cached_file(name, ODA_CONFIG_NAME, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False,
                           **{key: value for key, value in head_kwargs.items() if key in HUB_KWARGS})
    except OSError:
        return None
    if path:
        return OdaConfig.from_json_file(path)
    from huggingface_hub import try_to_load_from_cache

    hub = {key: head_kwargs[key] for key in ("cache_dir", "revision") if head_kwargs.get(key) is not None}
    filename = "/".join(filter(None, [head_kwargs.get("subfolder"), ODA_CONFIG_NAME]))
    if try_to_load_from_cache(name, filename, **hub) is None:   # neither cached nor known to be absent
        logger.warning(
            f"The routing defaults of the recall head {name!r} ({ODA_CONFIG_NAME}: its calibrated threshold, sinks and "
            "window) could not be read: not in the local cache, and the hub unreachable (offline?). Routing uses the "
            "head's trained geometry and the default threshold. Download the whole repository while online "
            "(huggingface_hub.snapshot_download), or pass threshold=... .")
    return None


def _warn_unapplied_threshold(head: RecallHead, oda_config: OdaConfig) -> None:
    """head=<RecallHead object> brings no routing defaults: say so when its folder saved another threshold."""
    folder = getattr(head, "_oda_source_folder", None)
    path = os.path.join(folder, ODA_CONFIG_NAME) if folder else None
    if path is None or not os.path.isfile(path) or not oda_config.routing_policy().uses_head:
        return
    try:
        saved = OdaConfig.from_json_file(path)
    except (OSError, ValueError):
        return  # head=<folder> reports it
    if saved.threshold != oda_config.threshold:
        logger.warning(
            f"The recall head was loaded from {folder}, whose {ODA_CONFIG_NAME} sets threshold={saved.threshold:g} "
            f"(a calibrated one, if `oda calibrate` ran), but a RecallHead object brings no routing defaults: routing "
            f"uses threshold={oda_config.threshold:g}. Pass head={folder!r} to use the folder's routing defaults, or "
            f"threshold={saved.threshold:g}.")
