"""Exact ODA: Local drafts tokens, Full verifies them when the head says so, and the output is Full's.

Self-speculative decoding with the model's own Local attention (sinks + window over the same KV cache)
as the draft and Full attention as the target, as in MagicDec or TriForce; what ODA adds is *when* to
verify: the recall head scores every Local step, and a score above ``verify_threshold`` (or not finite)
ends the draft at that step instead of after a fixed number of tokens.

One row at a time (the rows of a batch are decoded one after another, each without its padding):

* ``x_V`` is the last token whose value is final (from the prefill or a verification); positions below
  ``V`` hold Full KV. Drafted tokens after it are *pending*; their positions hold Local KV.
* Draft step: a Local step on the current token gives the head's score and Local's logits. If the head
  asks (score > threshold), the step is dropped and the pending tokens are verified; otherwise Local's
  token (greedy argmax, or a draw from Local's distribution) becomes pending.
* Verification, when the head asks, ``max_draft`` tokens are pending, an EOS is pending or the output is
  full: roll the cache back to ``V``, run one Full pass over ``x_V`` and the pending tokens (it writes
  their Full KV), keep the longest prefix Full agrees with, take Full's token at the first disagreement
  (or after the last draft), and crop the cache to the kept positions. Greedy: a draft is kept when it is
  Full's argmax. Sampling: the standard speculative-sampling rule with Full as the target
  (`speculative_verify`), so the output distribution is Full's.

Hybrids with recurrent (Gated DeltaNet) state cannot crop: after a disagreement they roll back and run
the kept tokens through Full once more (counted in ``full_passes``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers.generation import GenerateDecoderOnlyOutput, RepetitionPenaltyLogitsProcessor

from .cache import LOCAL, PREFILL, OdaCache, OdaGlobalLayer, OdaSlidingWindowLayer
from .packed_attention import packed_attention
from .compat import cache_kwargs
from .validation import integer, number
from .policies import HeadPolicy

#: Full's top two processed logits closer than this (float32; in lower precision `near_tie` widens it to the
#: dtype's rounding): batched and single-token Full passes may round to different tokens there. Such verified
#: positions, and a first token so close (it comes from the row's unpadded prefill), are counted
#: (`ExactRecord.near_ties`), never hidden.
NEAR_TIE = 1e-4
#: ...and within this many units of the logits' dtype at the top logit: a bfloat16 logit moves in steps of 2^-7 of
#: its size, and a tie stock broke one way went the other in a batched pass from the first differing token on (a
#: tiny bfloat16 model's sweep: 10 of 72 greedy runs differed from stock, 6 with no tie counted at 1e-4 alone; with
#: hidden size 128 and flatter logits such runs remain, tests/test_exact.py).
NEAR_TIE_ULPS = 4
MAX_DRAFT_LIMIT = 1024
#: Drafts per verification at most when the caller gives none (best on SmolLM2 at 2K-7K, benchmarks/exact_decoding.py).
DEFAULT_MAX_DRAFT = 3


class ExactDecodingUnsupported(ValueError):
    """A generation setting exact decoding does not run."""


def _refuse(what: str) -> ExactDecodingUnsupported:
    return ExactDecodingUnsupported(
        f"{what} is not supported with oda_mode='exact', which runs greedy decoding or sampling (temperature, "
        "top_k, top_p, min_p, repetition_penalty) with EOS and max_new_tokens as the stopping rules.")


@dataclass
class ExactRecord:
    """What exact decoding did in one `generate()` call, per row (lists indexed by row).

    * ``generated``: output tokens; ``drafted``: tokens Local proposed; ``accepted``: drafts Full confirmed;
      ``corrected``: drafts Full replaced (at most one per verification); ``bonus``: tokens Full produced
      after the last draft of a verification (no draft to compare, e.g. when the head asked to verify);
      ``full_passes``: Full forward passes after the prefill; ``head_verifications``: passes the head asked
      for (the rest came from ``max_draft``, EOS or the output cap); ``near_ties``: verified positions (and first
      tokens) whose top two Full logits were within `near_tie` of each other (where greedy output may differ from
      stock's).
    """

    batch_size: int
    max_draft: int
    verify_threshold: float
    generated: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    corrected: list[int] = field(default_factory=list)
    bonus: list[int] = field(default_factory=list)
    full_passes: list[int] = field(default_factory=list)
    head_verifications: list[int] = field(default_factory=list)
    near_ties: list[int] = field(default_factory=list)

    COUNTS = ("generated", "drafted", "accepted", "corrected", "bonus", "full_passes", "head_verifications",
              "near_ties")

    def __post_init__(self):
        for name in self.COUNTS:
            if not getattr(self, name):
                setattr(self, name, [0] * self.batch_size)

    def total(self, name: str) -> int:
        return sum(getattr(self, name))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, pooled over rows (NaN without drafts)."""
        drafted = self.total("drafted")
        return self.total("accepted") / drafted if drafted else math.nan

    @property
    def tokens_per_full_pass(self) -> float:
        """Output tokens per Full pass after the prefill (the prefill's token excluded), pooled."""
        passes = self.total("full_passes")
        return (self.total("generated") - self.batch_size) / passes if passes else math.nan

    @property
    def full_passes_per_token(self) -> float:
        tokens = self.total("generated")
        return self.total("full_passes") / tokens if tokens else math.nan

    def summary(self) -> str:
        head = ("fixed drafts (head not used)" if math.isinf(self.verify_threshold)
                else f"verify threshold {self.verify_threshold:g}")
        return (f"exact: {self.total('generated')} tokens, {self.total('full_passes')} Full passes "
                f"({self.full_passes_per_token:.3f} per token), drafted {self.total('drafted')}, accepted "
                f"{self.total('accepted')} ({self.acceptance_rate:.1%}), corrected {self.total('corrected')}, "
                f"bonus {self.total('bonus')}, head-asked verifications {self.total('head_verifications')}, "
                f"max_draft {self.max_draft}, {head}, near-ties {self.total('near_ties')}")

    def __repr__(self) -> str:
        return f"ExactRecord({self.summary()})"


# -- the acceptance rules (pure functions, tested against independent implementations) ----------------------


def sample_from(probs: torch.Tensor, uniform: float) -> int:
    """The token at `uniform` in [0, 1) of the cumulative distribution `probs` ``[vocab]`` (inverse CDF)."""
    cdf = probs.double().cumsum(0)
    point = torch.tensor([uniform * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    index = int(torch.searchsorted(cdf, point, right=True))
    return min(index, probs.shape[0] - 1)


def speculative_verify(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       accept_uniforms: list[float], sample_uniforms: list[float]) -> tuple[int, int | None]:
    """The speculative-sampling rule: ``(accepted drafts, next token)``.

    Draft ``j`` (drawn from ``draft_probs[j]``) is kept when ``u_j < min(1, q(x) / p(x))`` with ``q`` =
    ``target_probs[j]``; the first rejected draft is replaced by a draw from ``max(0, q - p)`` normalised.
    When every draft is kept and ``target_probs`` has one more row, the next token is drawn from it (else
    None). `target_probs`: ``[len(drafts) (+1), vocab]``; one accept and one sample uniform per row."""
    for j, token in enumerate(drafts):
        p, q = float(draft_probs[j, token]), float(target_probs[j, token])
        if accept_uniforms[j] * p < q:
            continue
        residual = (target_probs[j].double() - draft_probs[j].double()).clamp(min=0)
        if float(residual.sum()) <= 0:  # only through rounding (a rejection means q < p somewhere)
            residual = target_probs[j].double()
        return j, sample_from(residual, sample_uniforms[j])
    if target_probs.shape[0] > len(drafts):
        return len(drafts), sample_from(target_probs[len(drafts)], sample_uniforms[len(drafts)])
    return len(drafts), None


def near_tie(top: float, dtype: torch.dtype) -> float:
    """How close Full's top two logits must be (the top one `top`, computed in `dtype`) to count as a near tie."""
    return max(NEAR_TIE, NEAR_TIE_ULPS * torch.finfo(dtype).eps * abs(top))


def greedy_verify(drafts: list[int], target_scores: torch.Tensor,
                  logits_dtype: torch.dtype = torch.float32) -> tuple[int, int | None, int]:
    """Greedy verification: ``(accepted drafts, next token or None, near ties among the positions used)``;
    `logits_dtype`: the dtype the logits were computed in (`near_tie`)."""
    near_ties = 0
    for j in range(min(len(drafts) + 1, target_scores.shape[0])):
        top2 = torch.topk(target_scores[j].float(), 2).values
        near_ties += int(float(top2[0] - top2[1]) < near_tie(float(top2[0]), logits_dtype))
        best = int(torch.argmax(target_scores[j]))
        if j == len(drafts):
            return j, best, near_ties
        if best != drafts[j]:
            return j, best, near_ties
    return len(drafts), None, near_ties


# -- the decode loop ---------------------------------------------------------------------------------------


@dataclass
class _Settings:
    max_draft: int
    verify_threshold: float
    use_head: bool


def check_exact_settings(model, max_draft, verify_threshold) -> _Settings:
    """Validate the exact-mode knobs against the model's routing (errors name what is supported)."""
    max_draft = integer("max_draft", DEFAULT_MAX_DRAFT if max_draft is None else max_draft, minimum=1, maximum=MAX_DRAFT_LIMIT,
                        meaning="drafted tokens per verification at most")
    policy = model.oda_config.routing_policy()
    named = f"verify_threshold={verify_threshold}"
    if verify_threshold is None:   # the routing threshold: a HeadPolicy(t)'s own t, else the config's
        verify_threshold = policy.threshold if isinstance(policy, HeadPolicy) else model.oda_config.threshold
        named = f"the routing threshold {verify_threshold} (verify_threshold's default)"
    verify_threshold = number("verify_threshold", verify_threshold, finite=False)
    if verify_threshold == -math.inf:
        raise ValueError(f"{named} would verify every token: that is Full decoding, use oda_mode's default with "
                         "policy='full' instead.")
    use_head = math.isfinite(verify_threshold)
    if use_head and (not policy.uses_head or model.recall_head is None):
        raise ValueError(
            f"oda_mode='exact' verifies when the recall head asks, but the routing policy is {policy!r}. Use "
            "policy='head' with a recall head, or verify_threshold=math.inf for fixed-length drafts (max_draft "
            "tokens per verification, no head).")
    if getattr(policy, "name", None) == "budget":   # (with fixed-length drafts too: it went unread, exit 0)
        raise ValueError(f"oda_mode='exact' does not apply a Full-call budget ({policy!r}): it verifies whenever the "
                         "head's score passes verify_threshold (or every max_draft tokens), as often as that takes to "
                         "match Full. Use policy='head' (verify_threshold=... sets how eagerly it verifies), or the "
                         "default oda_mode for a budget.")
    return _Settings(max_draft, verify_threshold, use_head)


@torch.no_grad()
def generate_exact(model, inputs=None, generation_config=None, *, max_draft: int | None = None,
                   verify_threshold: float | None = None, oda_fast: bool = False, **kwargs):
    """`OdaForCausalLM.generate(..., oda_mode="exact")`: Full's output, drafted by Local (see the module).

    ``oda_fast=True`` runs the drafts and passes on the static engine (full-attention families and Gemma 3; a batch-1
    engine kept on the model, rows one after another as here)."""
    from .engine.generation import engine_for, fast_path_enabled, resolve_request
    from .engine.support import check_model_supported

    settings = check_exact_settings(model, max_draft, verify_threshold)
    if oda_fast:
        check_model_supported(model)
    request = resolve_request(model, inputs, generation_config, kwargs, refuse=_refuse)
    if request.output_scores or request.output_logits:
        raise _refuse("output_scores / output_logits")
    for processor in request.processors:
        if isinstance(processor, RepetitionPenaltyLogitsProcessor):
            # Built for the padded batch (it skips each row's left padding); each row here is processed from its
            # first real column on (`_decode_row`).
            processor.prompt_ignore_length = None
    engine = None
    if oda_fast and fast_path_enabled():
        longest = int(request.attention_mask.sum(dim=1).max())
        engine = engine_for(model, 1, longest + request.max_new_tokens + settings.max_draft + 1)
    if not bool(request.attention_mask[:, -1].all()):
        # Rows are decoded unpadded, so a right-padded row would continue from its last real token, where stock
        # generate() continues after the pad columns: another output than the Full one promised.
        raise ValueError("Exact mode supports left padding only: the last column must be a real token in every row "
                         "(pad on the left, e.g. tokenizer.padding_side='left').")
    _check_no_interior_holes(model, request.attention_mask)
    # (the last output token is never fed: the longest forward reads prompt + max_new_tokens - 1 positions)
    _check_static_rope(model, int(request.attention_mask.sum(dim=1).max()) + request.max_new_tokens - 1)
    eos = set() if request.eos is None else {int(t) for t in request.eos.flatten().tolist()}
    batch = request.input_ids.shape[0]
    record = ExactRecord(batch, settings.max_draft, settings.verify_threshold)
    outputs = []
    for row in range(batch):
        real = request.attention_mask[row].bool()
        if not bool(real.any()):
            raise ValueError(f"Row {row} of the batch has no prompt token (its attention_mask is all zeros).")
        # The model reads the real tokens only; the logits processors read the row from its first real column on,
        # masked interior tokens included, as generate()'s do (a repetition penalty counts those too).
        seen = request.input_ids[row][int(real.int().argmax()):]
        outputs.append(_decode_row(model, request.input_ids[row][real], request, settings, eos, record, row, engine,
                                   seen.tolist()))
    model.routing = record
    length = max(len(tokens) for tokens in outputs)
    pad = int(request.pad.flatten()[0]) if request.pad is not None else 0
    new = torch.full((batch, length), pad, dtype=torch.long, device=request.input_ids.device)
    for row, tokens in enumerate(outputs):
        new[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    sequences = torch.cat([request.input_ids, new], dim=1)
    return GenerateDecoderOnlyOutput(sequences=sequences) if request.return_dict else sequences


def _check_static_rope(model, reach: int) -> None:
    """Refuse a RoPE whose frequencies follow the longest position of each forward ("dynamic", "longrope") once a
    request can pass the length where they change: a verification pass runs several positions in one forward, so its
    tokens would get the frequencies of its last position where stock decoding, one position per forward, gives each
    its own (greedy output then differs from Full's with no near tie to show it)."""
    from .engine.support import HOST_DEPENDENT_ROPE, rope_parameter_sets

    config = model.config
    config = getattr(config, "get_text_config", lambda: config)()
    for params in rope_parameter_sets(config):
        kind = str(params.get("rope_type", params.get("type", "default")))
        if not any(name in kind for name in HOST_DEPENDENT_ROPE):
            continue
        original = params.get("original_max_position_embeddings")
        limit = min(original, config.max_position_embeddings) if isinstance(original, int) \
            else config.max_position_embeddings
        if reach > limit:
            raise ExactDecodingUnsupported(
                f"oda_mode='exact' on this model's {kind!r} RoPE: its frequencies change past {limit} positions, "
                f"following the longest position of each forward, and this request reaches {reach} (prompt + "
                "max_new_tokens - 1), where a verification pass over several positions would not give "
                "stock's tokens. Keep requests within that length, or use oda_mode='approximate'.")


def _full_pass(model, cache: OdaCache, tokens: list[int], start: int) -> torch.Tensor:
    """Run `tokens` (at positions start...) through the model with Full attention, appending their KV;
    returns their final hidden states ``[len(tokens), hidden]``."""
    device = model.device
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    positions = torch.arange(start, start + len(tokens), device=device)[None]
    cache.set_mode(PREFILL)
    with packed_attention(model) if start > 0 else nullcontext():
        out = model.get_decoder()(input_ids=ids, position_ids=positions,
                                  attention_mask=torch.ones(1, start + len(tokens), dtype=torch.long, device=device),
                                  **cache_kwargs(cache), use_cache=True)
    cache.extend_workspace(len(tokens))
    return out.last_hidden_state[0]


def _local_step(model, cache: OdaCache, token: int, position: int, use_head: bool):
    """One Local step on `token`: ``(local hidden [1, hidden], head score or None)``, its KV left pending."""
    device = model.device
    ids = torch.tensor([[token]], dtype=torch.long, device=device)
    positions = torch.tensor([[position]], device=device)
    mask = torch.ones(1, position + 1, dtype=torch.long, device=device)
    embeds = model.get_input_embeddings()(ids)
    in_window = bool(cache.rows_within_window()[0])
    cache.begin_step()
    cache.set_mode(LOCAL)
    out = model.get_decoder()(input_ids=ids, position_ids=positions,
                              attention_mask=model._local_masks(cache, embeds, mask, positions),
                              **cache_kwargs(cache), use_cache=True)
    hidden = out.last_hidden_state[:, -1]
    score = None
    if use_head and not in_window:  # within sinks + window Local reads what Full reads: nothing to ask
        score = float(model.recall_head(cache.selected_hidden, embeds[:, -1], hidden)[0])
    return hidden, score


def _processed(request, prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
    """`generate()`'s logits processing of one position's logits ``[vocab]`` after token ids `prefix`."""
    if not request.processors:  # plain greedy: no processing, no prefix tensor
        return logits.float()
    ids = torch.tensor([prefix], dtype=torch.long, device=logits.device)
    return request.processors(ids, logits.float()[None])[0]


def new_exact_cache(model, max_cache_len: int) -> OdaCache:
    """An `OdaCache` for exact decoding: window layers keep the positions a verification may crop back over."""
    cache = model.new_cache(max_cache_len=max_cache_len)
    for layer in cache.layers:
        if isinstance(layer, OdaSlidingWindowLayer):
            layer.activate_past_recording()
    return cache


class CacheDrafts:
    """Drafts and verification passes on the Transformers path: an `OdaCache` (every supported family).

    The interface `decode_after_prefill` drives (`EngineDrafts` is the static engine's): `draft` runs a
    Local step whose KV stays pending, `accept` commits it, `reject` drops it; `verify` runs one Full pass
    over the tokens from the last verified position; `keep` keeps the verified prefix (its Full KV) and
    returns the Full passes it had to add (recurrent layers cannot crop: they recompute the kept tokens).
    """

    def __init__(self, model, cache: OdaCache, last_hidden: torch.Tensor):
        self.model, self.cache = model, cache
        cache.selected_hidden = last_hidden
        self.checkpoint = cache.checkpoint()

    def draft(self, token: int, position: int, use_head: bool):
        return _local_step(self.model, self.cache, token, position, use_head)

    def accept(self, hidden: torch.Tensor) -> None:
        self.cache.commit(None)
        self.cache.selected_hidden = hidden

    def reject(self) -> None:
        self.cache.discard_pending()

    def verify(self, tokens: list[int], start: int) -> torch.Tensor:
        self.cache.rollback(self.checkpoint)
        return _full_pass(self.model, self.cache, tokens, start)

    def keep(self, tokens: list[int], start: int, keep: int, hidden: torch.Tensor) -> int:
        extra_passes = 0
        if keep < len(tokens) and self.cache.linear_layers:  # recurrent state cannot crop: recompute the kept tokens
            self.cache.rollback(self.checkpoint)
            hidden = _full_pass(self.model, self.cache, tokens[:keep], start)
            extra_passes = 1
        for layer in self.cache.layers:  # drop the rejected positions; window layers go back to their window
            if isinstance(layer, (OdaGlobalLayer, OdaSlidingWindowLayer)):
                layer.crop_to(start + keep)
        self.cache.selected_hidden = hidden[keep - 1: keep]
        self.checkpoint = self.cache.checkpoint()
        return extra_passes


class EngineDrafts:
    """Drafts and verification passes on the static engine (`OdaStaticEngine`, batch 1, full-attention
    families and Gemma 3): Local steps over its workspace (captured graphs on CUDA), Full passes over its cache."""

    def __init__(self, engine):
        self.engine = engine

    def draft(self, token: int, position: int, use_head: bool):
        if position != self.engine.length:
            raise RuntimeError(f"Draft at position {position}, but the engine holds {self.engine.length} positions.")
        return self.engine.draft_step(token, use_head)

    def accept(self, hidden: torch.Tensor) -> None:
        self.engine.accept_draft()

    def reject(self) -> None:
        """Nothing to undo: the draft wrote only the workspace's current slot, which the next step overwrites."""

    def verify(self, tokens: list[int], start: int) -> torch.Tensor:
        return self.engine.verify(torch.tensor(tokens, dtype=torch.long), start)

    def keep(self, tokens: list[int], start: int, keep: int, hidden: torch.Tensor) -> int:
        self.engine.keep_verified(start + keep, hidden[keep - 1])
        return 0


def _check_no_interior_holes(model, attention_mask) -> None:
    """Rows are decoded without their masked columns. Stock generate() keeps them in the sequence wherever a layer
    counts positions: a sliding-window layer's window counts masked columns too, and a Gated DeltaNet layer runs its
    causal convolution and its state's decay over them (zeroed, not skipped). Without them the output would not be
    Full's (measured: Gemma 3 with two masked columns inside a prompt, every token differed; Qwen3.5 with three, 2 of
    40 batches differed; both exit 0). Left padding is exact: nothing real precedes it."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    # the layer kinds as OdaCache builds its layers from them (a Mistral-style sliding_window included)
    layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    counting = {"sliding_attention", "chunked_attention", "linear_attention"} & set(layer_types)
    if not counting:
        return
    real = attention_mask.bool()
    first = real.int().argmax(dim=1)
    after_first = torch.arange(real.shape[1], device=real.device)[None, :] >= first[:, None]
    holed = (after_first & ~real).any(dim=1).nonzero().flatten().tolist()
    if holed:
        kinds = " and ".join(sorted(counting))
        raise ValueError(f"Exact mode on a model with {kinds} layers supports left padding only: rows {holed} have "
                         "masked columns inside their prompt, which those layers count in stock generate() and exact "
                         "mode's unpadded decoding would not. Remove those columns from the prompt, or use "
                         "approximate mode.")


def _decode_row(model, prompt: torch.Tensor, request, settings: _Settings, eos: set, record: ExactRecord,
                row: int, engine=None, seen: list[int] | None = None) -> list[int]:
    if engine is not None:
        engine.prefill(prompt[None])  # its logits are not used: the first token comes from the hidden state, as below
        drafts = EngineDrafts(engine)
        last_hidden = engine.state.selected_hidden.clone()
    else:
        cache = new_exact_cache(model, prompt.numel() + request.max_new_tokens + settings.max_draft + 1)
        last_hidden = _full_pass(model, cache, prompt.tolist(), start=0)[-1:]
        drafts = CacheDrafts(model, cache, last_hidden)
    return decode_after_prefill(model, drafts, prompt.tolist(), last_hidden, request, settings, eos, record, row,
                                seen)


def decode_after_prefill(model, drafts, prompt: list[int], last_hidden: torch.Tensor, request,
                         settings: _Settings, eos: set, record: ExactRecord, row: int = 0,
                         seen: list[int] | None = None) -> list[int]:
    """Exact decoding of one row whose prompt is already in `drafts`' cache (Full KV; `last_hidden` ``[1, hidden]``
    is the final hidden state of its last position). `drafts`: `CacheDrafts` or `EngineDrafts`. Returns the new
    tokens; counts go to `record` row `row`. `seen`: the prompt as the logits processors read it (default `prompt`;
    with masked tokens among the real ones, those too)."""
    max_new, sampling = request.max_new_tokens, request.do_sample
    final = list(prompt)
    length = len(final)
    seen = final if seen is None else list(seen)

    def processed(prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The processed logits after `prefix` (the prompt, then new tokens): `_processed` over `seen` instead."""
        return _processed(request, seen + prefix[length:], logits)

    def choose(scores: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if not sampling:
            return int(torch.argmax(scores)), None
        probs = torch.softmax(scores, dim=-1)
        return sample_from(probs, float(torch.rand(()))), probs

    first = processed(final, model.lm_logits(last_hidden[-1:])[0])
    if not sampling:   # the prefill's token, computed unpadded: in bfloat16 it may differ from a padded batch's too
        record.near_ties[row] += greedy_verify([], first[None], last_hidden.dtype)[2]
    final.append(choose(first)[0])
    pending: list[int] = []
    pending_probs: list[torch.Tensor] = []
    while True:
        produced = len(final) - length + len(pending)
        if not pending and (final[-1] in eos or produced >= max_new):
            break
        must_verify = len(pending) >= settings.max_draft or produced >= max_new or (pending and pending[-1] in eos)
        head_asked = False
        if not must_verify:
            current = pending[-1] if pending else final[-1]
            local_hidden, score = drafts.draft(current, len(final) - 1 + len(pending), settings.use_head)
            if score is not None and not score <= settings.verify_threshold:  # NaN asks too
                drafts.reject()
                head_asked = True
            else:
                token, probs = choose(processed(final + pending, model.lm_logits(local_hidden)[0]))
                drafts.accept(local_hidden)
                pending.append(token)
                pending_probs.append(probs)
                record.drafted[row] += 1
                continue
        # Verify: Full over x_V and the pending drafts (the last one only when a token must follow it).
        need_next = produced < max_new and not (pending and pending[-1] in eos)
        tokens = [final[-1]] + (pending if need_next else pending[:-1])
        start = len(final) - 1
        hidden = drafts.verify(tokens, start)
        record.full_passes[row] += 1
        record.head_verifications[row] += int(head_asked)
        prefix = final + pending
        scores = torch.stack([processed(prefix[: start + 1 + j], model.lm_logits(hidden[j:j + 1])[0])
                              for j in range(len(tokens))])
        if sampling:
            accepted, following = speculative_verify(
                pending, torch.stack(pending_probs) if pending else scores[:0], torch.softmax(scores, dim=-1),
                [float(torch.rand(())) for _ in pending], [float(torch.rand(())) for _ in tokens])
        else:
            accepted, following, ties = greedy_verify(pending, scores, hidden.dtype)
            record.near_ties[row] += ties
        record.accepted[row] += accepted
        if following is not None:
            if accepted < len(pending):
                record.corrected[row] += 1
            else:
                record.bonus[row] += 1
        keep = min(accepted + 1, len(tokens))  # x_V and the accepted drafts hold Full KV now
        record.full_passes[row] += drafts.keep(tokens, start, keep, hidden)
        final += pending[:accepted] + ([following] if following is not None else [])
        pending, pending_probs = [], []
    generated = final[length:]
    if eos and any(token in eos for token in generated):
        generated = generated[: next(i for i, token in enumerate(generated) if token in eos) + 1]
    generated = generated[:max_new]
    record.generated[row] = len(generated)
    return generated
