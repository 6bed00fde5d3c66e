"""Whole requests on the static engine, with `generate()`'s own setup so results match the HF path.

The request is resolved by the same `GenerationMixin` helpers `generate()` uses (generation config
merging and defaults, special tokens, attention-mask inference, logits processors), so greedy and
sampled tokens equal the HF path's (sampling draws from the global RNG in the same order). The decode
loop is the engine's: prefill, then one `OdaStaticEngine.step` per token; the host reads tokens only
(for EOS), never routing scores. Anything the engine cannot run raises `FastPathUnsupported`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.utils import logging

from .support import DISABLE_ENV, FastPathUnsupported, fast_path_disabled

logger = logging.get_logger(__name__)

#: Logits processors the engine's output path runs (plain tensor ops on the device).
SUPPORTED_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                        RepetitionPenaltyLogitsProcessor)
_UNSUPPORTED_ARGUMENTS = ("logits_processor", "stopping_criteria", "streamer", "prefix_allowed_tokens_fn",
                          "synced_gpus", "assistant_model", "assistant_tokenizer", "tokenizer", "negative_prompt_ids",
                          "negative_prompt_attention_mask", "custom_generate", "inputs_embeds", "past_key_values", "cache",
                          "prompt_lookup_num_tokens", "assistant_early_exit")


def _unsupported(what: str) -> FastPathUnsupported:
    return FastPathUnsupported(f"{what} is not supported by the fast path (static engine). Use the HF path: "
                               "model.generate(...) without oda_fast.")


@dataclass
class Request:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    do_sample: bool
    processors: LogitsProcessorList
    eos: torch.Tensor | None
    pad: torch.Tensor | None
    return_dict: bool
    output_scores: bool
    output_logits: bool


def resolve_request(model, inputs, generation_config, kwargs: dict, refuse=None) -> Request:
    """`generate()`'s setup for one request, or `FastPathUnsupported` naming the setting the engine lacks.

    `refuse(what)`: the exception for an unsupported setting (default: the fast path's); exact decoding
    (`oda_hf.exact`) shares this setup with its own message."""
    _unsupported = refuse or globals()["_unsupported"]
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    if input_ids is None:
        raise _unsupported("Generating without input_ids (e.g. from inputs_embeds)")
    attention_mask = kwargs.pop("attention_mask", None)
    for name in _UNSUPPORTED_ARGUMENTS:
        value = kwargs.pop(name, None)
        if value is not None and not (name in ("logits_processor", "stopping_criteria") and len(value) == 0):
            raise _unsupported(f"generate({name}=...)")
    # generate()'s own test, made before the defaults fill the config: no max_length from the caller, the config
    # given or the model's, so the default max_length (20) counts new tokens rather than the whole sequence
    default_max_length = (kwargs.get("max_length") is None
                          and (generation_config is None or generation_config.max_length is None)
                          and model.generation_config.max_length is None)
    # The private helpers are the ones generate() itself calls: the only way to get its exact defaults.
    generation_config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    leftover = sorted(set(model_kwargs) - {"use_cache"})
    if leftover:
        raise _unsupported(f"generate() arguments {leftover}")
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise _unsupported(f"{mode.value} (num_beams={generation_config.num_beams})")
    checks = {
        "num_return_sequences > 1": (generation_config.num_return_sequences or 1) > 1,
        "use_cache=False": generation_config.use_cache is False,
        "output_attentions / output_hidden_states": bool(generation_config.output_attentions
                                                          or generation_config.output_hidden_states),
        "max_time": generation_config.max_time is not None,
        "stop_strings": generation_config.stop_strings is not None,
        "token_healing": bool(getattr(generation_config, "token_healing", False)),
        f"cache_implementation={generation_config.cache_implementation!r}":
            generation_config.cache_implementation not in (None, "dynamic"),
    }
    for what, bad in checks.items():
        if bad:
            raise _unsupported(what)

    device = model.device
    input_ids = input_ids.to(device)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length]; got shape {tuple(input_ids.shape)}.")
    batch, length = input_ids.shape
    model._prepare_special_tokens(generation_config, attention_mask is not None, device=device, batch_size=batch)
    if attention_mask is None:
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, generation_config, {})
    attention_mask = attention_mask.to(device)
    if generation_config.max_new_tokens is not None:
        max_new_tokens = generation_config.max_new_tokens
    else:
        max_length = generation_config.max_length
        if default_max_length:   # as generate(): after the prompt, within max_position_embeddings
            max_length += length
            limit = getattr(model.config, "max_position_embeddings", None)
            max_length = max_length if limit is None else min(max_length, limit)
        max_new_tokens = max_length - length
    if max_new_tokens < 1:
        raise ValueError(f"Nothing to generate: max_new_tokens={max_new_tokens} (prompt of {length} tokens, "
                         f"max_length={generation_config.max_length}).")
    processors = model._get_logits_processor(
        generation_config=generation_config, input_ids_seq_length=length, encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=device,
        model_kwargs={"attention_mask": attention_mask})
    unsupported = [type(p).__name__ for p in processors if not isinstance(p, SUPPORTED_PROCESSORS)]
    if unsupported:
        raise _unsupported(f"The logits processing {unsupported} (supported: temperature, top_k, top_p, min_p, "
                           "repetition_penalty)")
    return Request(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
        do_sample=bool(generation_config.do_sample), processors=processors,
        eos=generation_config._eos_token_tensor, pad=generation_config._pad_token_tensor,
        return_dict=bool(generation_config.return_dict_in_generate),
        output_scores=bool(generation_config.output_scores), output_logits=bool(generation_config.output_logits),
    )


@torch.no_grad()
def run_request(engine, request: Request):
    """Prefill + decode loop, as `GenerationMixin._sample` does it; sets `engine.routing` (and `model.routing`)."""
    input_ids, eos, pad = request.input_ids, request.eos, request.pad
    batch, prompt = input_ids.shape
    total = prompt + request.max_new_tokens
    sequences = torch.empty(batch, total, dtype=torch.long, device=input_ids.device)
    sequences[:, :prompt] = input_ids
    if total - 1 > engine.capacity:  # the last output is never fed back, so it needs no column
        raise ValueError(f"A prompt of {prompt} tokens plus {request.max_new_tokens} new ones exceeds the engine's "
                         f"capacity of {engine.capacity} columns; build it with max_length >= {total - 1}.")
    unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
    scores, raw_logits = [], []
    logits = engine.prefill(input_ids, request.attention_mask, max_new_tokens=request.max_new_tokens)
    length = prompt
    while True:
        next_logits = logits.to(copy=True, dtype=torch.float32)
        next_scores = request.processors(sequences[:, :length], next_logits)
        if request.output_scores:
            scores.append(next_scores)
        if request.output_logits:
            raw_logits.append(next_logits)
        if request.do_sample:
            next_tokens = torch.multinomial(torch.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(next_scores, dim=-1)
        if eos is not None:  # finished rows emit padding, as generate() does
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        sequences[:, length] = next_tokens
        length += 1
        if eos is not None:
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
        if length >= total or (eos is not None and int(unfinished.max()) == 0):
            break
        logits = engine.step(next_tokens, None if eos is None else unfinished.bool())
    sequences = sequences[:, :length]
    if eos is not None:
        engine.mark_finished(_first_eos(sequences[:, prompt:], eos))
    engine.model.routing = engine.routing
    if not request.return_dict:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences, scores=tuple(scores) if request.output_scores else None,
        logits=tuple(raw_logits) if request.output_logits else None)


def _first_eos(generated: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Index of each row's first EOS among its generated tokens (= routed steps taken), -1 if none."""
    is_eos = torch.isin(generated, eos)
    first = is_eos.int().argmax(dim=1)
    return torch.where(is_eos.any(dim=1), first, torch.full_like(first, -1)).cpu()


def run_generate(engine, inputs, generation_config, kwargs: dict):
    return run_request(engine, resolve_request(engine.model, inputs, generation_config, kwargs))


# ------------------------------------------------------------------------------------------------
# model.generate(..., oda_fast=True)
# ------------------------------------------------------------------------------------------------
def fast_path_enabled() -> bool:
    """False (and a logged note) when ``ODA_DISABLE_FAST_PATH`` turns the fast path off."""
    if fast_path_disabled():
        logger.warning(f"{DISABLE_ENV} is set: oda_fast=True runs the HF path instead (same results, slower).")
        return False
    return True


def generate_fast(model, inputs=None, generation_config=None, *args, **kwargs):
    """`OdaForCausalLM.generate(..., oda_fast=True)`: the request on a static engine kept on the model.

    The engine is built on first use and reused while it fits (same batch size, enough capacity, same
    sinks/window); otherwise it is released and rebuilt. Routing lands in ``model.routing`` as usual.
    """
    from .support import check_model_supported

    if args:
        raise _unsupported("Positional generate() arguments after generation_config")
    check_model_supported(model)
    request = resolve_request(model, inputs, generation_config, kwargs)
    batch, prompt = request.input_ids.shape
    return run_request(engine_for(model, batch, prompt + request.max_new_tokens), request)


def engine_for(model, batch: int, max_length: int):
    """The static engine kept on `model`, rebuilt unless it fits (batch size, capacity, routing geometry, device)."""
    from .engine import OdaStaticEngine

    engine = model.__dict__.get("_oda_static_engine")
    fits = (engine is not None and not engine._released and engine.batch_size == batch
            and engine.capacity >= max_length
            and (engine.sinks, engine.window) == (model.oda_config.sinks, model.oda_config.window)
            and (engine.device, engine.dtype) == (model.device, model.dtype))
    if not fits:
        if engine is not None and not engine._released:
            engine.release()
        engine = OdaStaticEngine(model, max_length=max_length, batch_size=batch)
        model.__dict__["_oda_static_engine"] = engine
    return engine
