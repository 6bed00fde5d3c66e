"""Per-request routing knobs and state for ODA served by vLLM.

A request picks its routing with ``SamplingParams.extra_args`` (in the OpenAI API: ``vllm_xargs``):

* ``oda_policy``: ``head`` | ``full`` | ``local`` | ``random:P[:SEED]`` | ``schedule:K:PERIOD`` |
  ``budget:RATE[:THRESHOLD]`` (the head under a Full-call budget that holds for the request, as
  `oda_hf.BudgetPolicy`) (default: the engine's, normally ``head``);
* ``oda_threshold``: the head's threshold theta for this request (default: the engine's).

`OdaRequestValidator` checks them when a request is admitted (vLLM runs every logits processor's
``validate_params`` in the front end), so a bad value fails that request with HTTP 400 / ``ValueError`` and the
engine keeps serving the others. The worker parses the same values with the same function.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..validation import number, parse_float, parse_policy_text

if TYPE_CHECKING:   # (imported lazily: `oda --help` loads this module without torch)
    import torch

POLICY_KEY = "oda_policy"
THRESHOLD_KEY = "oda_threshold"
KNOWN_KEYS = (POLICY_KEY, THRESHOLD_KEY)
FINISHED_KEPT = 100_000  # finished requests whose routing records the worker keeps
COUNTS = ("full_calls", "decided_steps", "routed_steps")
DETAILS = ("decisions", "scores")   # a record's per-step lists (what `counts_only` leaves out)


@dataclass(frozen=True)
class RequestRouting:
    """One request's routing rule."""

    policy: str = "head"            # head | full | local | random | schedule | budget
    threshold: float = 0.0
    p: float = 0.0                  # random: the probability; budget: the rate
    seed: int = 42                  # random
    k: int = 0                      # schedule
    period: int = 1                 # schedule

    def spec(self) -> str:
        """The policy as `parse_policy` reads it (the threshold is separate)."""
        if self.policy == "random":
            return f"random:{exact_text(self.p)}:{self.seed}"
        if self.policy == "schedule":
            return f"schedule:{self.k}:{self.period}"
        if self.policy == "budget":
            return f"budget:{exact_text(self.p)}"
        return self.policy


def exact_text(value: float) -> str:
    """`value` as text that reads back as the same float (the engine's default policy reaches the workers as text):
    short where that is exact (0.25), every digit where not (0.1234567, not 0.123457)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _number(value, name: str) -> float:
    """A finite number; OpenAI's ``vllm_xargs`` may carry it as a string."""
    if isinstance(value, str):
        try:
            value = parse_float(value)   # (strict: "1_0", which float() reads as 10, is refused)
        except ValueError as err:
            raise ValueError(f"{name} {err}") from None
    try:
        return number(name, value)
    except TypeError as err:
        raise ValueError(str(err)) from None


def parse_policy(text, threshold: float) -> RequestRouting:
    """'head', 'full', 'local', 'random:P[:SEED]', 'schedule:K:PERIOD' or 'budget:RATE[:THRESHOLD]' as a
    `RequestRouting` (ValueError if not). A budget's own threshold wins over `threshold`."""
    try:
        spec = parse_policy_text(text)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{POLICY_KEY}: {err}") from None
    params = {key: getattr(spec, key) for key in ("p", "seed", "k", "period") if getattr(spec, key) is not None}
    if spec.kind == "budget" and spec.threshold is not None:
        threshold = spec.threshold
    return RequestRouting(policy=spec.kind, threshold=threshold, **params)


def is_oda_key(key) -> bool:
    """Whether a request's extra-args key is meant for ODA: ``oda_...`` in any case, with stray spaces or dashes, or a
    knob's name in another spelling (``odaPolicy``, ``oda.threshold``: JSON clients camel-case), or misspelled
    (``odaPolciy``, ``odPolicy``, ``odaTreshold``: once squashed, an ``o`` and two of ``oda``'s letters first, within
    2 letters of a knob's length and at least 80% alike; ``thresholds``, ``lora_policy`` or ``odata``, keys another
    plugin may read, are not)."""
    if not isinstance(key, str):
        return False
    squashed = re.sub(r"[\W_]", "", key.lower())
    if key.strip().lower().replace("-", "_").startswith("oda_") or squashed.startswith(("odapolicy", "odathreshold")):
        return True
    if not squashed.startswith("o") or difflib.SequenceMatcher(None, squashed[:3], "oda").ratio() < 2 / 3:
        return False
    return any(abs(len(squashed) - len(knob)) <= 2 and difflib.SequenceMatcher(None, squashed, knob).ratio() >= 0.8
               for knob in ("odapolicy", "odathreshold"))


def request_routing(extra_args: dict | None, default: RequestRouting,
                    default_threshold: float | None = None) -> RequestRouting:
    """The routing a request asks for in its extra args, over the engine's `default` (ValueError if invalid).
    `default_threshold`: the threshold of a request that names its own policy and no threshold (the head's; the
    default policy's when None). It differs from ``default.threshold`` when the engine's policy is a budget with its
    own threshold, which `OdaForCausalLM` also applies to that policy alone."""
    extra_args = extra_args or {}
    misspelled = [key for key in extra_args if is_oda_key(key) and key not in KNOWN_KEYS]
    if misspelled:  # served with the engine's default instead, it would look like ODA had ignored the request's knob
        raise ValueError(f"Unknown ODA request key(s) {', '.join(map(repr, misspelled))}: ODA reads "
                         f"{POLICY_KEY!r} and {THRESHOLD_KEY!r}, spelled exactly so.")
    asked = extra_args.get(THRESHOLD_KEY)
    asked = None if asked is None else _number(asked, THRESHOLD_KEY)
    if extra_args.get(POLICY_KEY) is None:
        return RequestRouting(**{**default.__dict__, "threshold": default.threshold if asked is None else asked})
    routing = parse_policy(extra_args[POLICY_KEY],
                           asked if asked is not None else default.threshold if default_threshold is None
                           else default_threshold)
    if asked is not None and routing.policy not in ("head", "budget"):   # served, the knob would go unread
        raise ValueError(f"{THRESHOLD_KEY} {asked:g} is the recall head's threshold, but {POLICY_KEY} "
                         f"{extra_args[POLICY_KEY]!r} does not ask the head: drop {THRESHOLD_KEY}, or ask for "
                         "'head' or 'budget:RATE'.")
    if asked is not None and routing.threshold != asked:   # the budget's own threshold would win, unseen
        raise ValueError(f"{POLICY_KEY} {extra_args[POLICY_KEY]!r} and {THRESHOLD_KEY} {asked} give two thresholds: "
                         f"give it once ({THRESHOLD_KEY} with 'budget:RATE', or 'budget:RATE:T' alone).")
    return routing


@dataclass
class RequestState:
    """What the worker keeps for one request: its rule, the preceding selected hidden state and its counts."""

    routing: RequestRouting
    prev_hidden: object | None = None  # torch.Tensor [hidden]
    routed_steps: int = 0        # decode steps (every output after the first)
    decided_steps: int = 0       # of those, past sinks + window (where Local differs from Full)
    full_calls: int = 0
    decisions: list = field(default_factory=list)   # per routed step: True = Full
    scores: list = field(default_factory=list)      # per routed step: the head's q (NaN where it did not run)
    recomputed_tokens: int = 0   # generated tokens whose KV was recomputed (as routed) after a preemption
    generator: object | None = None   # torch.Generator of a Random request (torch imported here: `oda --help` stays fast)
    earlier_turns: dict | None = None  # a streaming-input session's earlier turns: their `summary`
    # ... and their routed steps: (position of a turn's first routed step's input, that turn's decisions)
    earlier_steps: list = field(default_factory=list)
    sample: int = 0              # which sample of an n > 1 request (`sample_index`)
    turn: int = 0                # which turn of a streaming-input session

    def __post_init__(self):
        if self.routing.policy == "random":
            import torch

            self.generator = torch.Generator().manual_seed(sample_seed(self.routing.seed, self.sample, self.turn))

    def next_turn(self, routing: RequestRouting, prompt_tokens: int) -> "RequestState":
        """The state of a streaming-input session's next turn, whose prompt now holds this turn's routed steps' input
        tokens (every output but the last, from position `prompt_tokens` on): routed afresh with the turn's own
        `routing`, keeping the counts, and each earlier step's decision for a recompute after a preemption."""
        steps = list(self.earlier_steps) + ([(prompt_tokens, list(self.decisions))] if self.decisions else [])
        return RequestState(routing, earlier_turns=self.summary(), earlier_steps=steps, sample=self.sample,
                            turn=self.turn + 1)

    def earlier_decision(self, position: int) -> bool | None:
        """The decision (True = Full) of the earlier turn's routed step whose input token sits at `position` (it is
        part of the prompt now), or None if no earlier step's did."""
        for first, decisions in self.earlier_steps:
            if first <= position < first + len(decisions):
                return decisions[position - first]
        return None

    def reaches_earlier_steps(self, first: int, count: int) -> bool:
        """Whether positions ``first .. first + count - 1`` hold any earlier turn's routed step."""
        return any(start < first + count and first < start + len(decisions) for start, decisions in self.earlier_steps)

    def record(self, full: bool, score: float = math.nan, decided_step: bool = True) -> None:
        """Count one routed step: its decision (True = Full), the head's score if it ran, and whether it was past
        sinks + window (a step within them takes Local, which equals Full there, and is not decided)."""
        self.routed_steps += 1
        self.decided_steps += int(decided_step)
        self.full_calls += int(full)
        self.decisions.append(bool(full))
        self.scores.append(float(score))

    def within_budget(self) -> bool:
        """Whether a Full call at the next decided step keeps the request within its budget (always, unless the
        policy is ``budget``): ``calls + 1 <= rate * n`` at its ``n``-th decided step, as `oda_hf.BudgetPolicy`."""
        if self.routing.policy != "budget":
            return True
        from ..policies import within_budget   # (here: `oda --help` imports this module, and no torch)

        return within_budget(self.full_calls, self.decided_steps + 1, self.routing.p)

    def predecided(self, step: int) -> bool | None:
        """The decision for routed `step` (1-based) when it does not depend on the head, else None.

        Random draws one value per step, in-window steps included, as `oda_hf.RandomPolicy` does at batch 1.
        """
        policy = self.routing.policy
        if policy == "full":
            return True
        if policy == "local":
            return False
        if policy == "random":
            import torch

            # compared as `RandomPolicy` does, in float32 (a draw between p and p's float32 value went otherwise)
            return bool(torch.rand(1, generator=self.generator) < self.routing.p)
        if policy == "schedule":
            return (step - 1) % self.routing.period < self.routing.k
        return None

    def summary(self, details: bool = True) -> dict:
        """The request's counts, decisions and scores; `details=False`: the counts alone. A streaming session's
        counts are every turn's so far, with ``turns`` holding each turn's policy and counts; its ``policy`` and
        ``threshold`` are the turns' own when all share them, else ``"mixed"`` and None (a session whose turns were
        ``head`` then ``budget:0.25`` had read as one budget of 0.25 at a rate of 0.61, with exit 0)."""
        earlier = self.earlier_turns or {}
        routed, decided, full = (self.routed_steps + earlier.get("routed_steps", 0),
                                 self.decided_steps + earlier.get("decided_steps", 0),
                                 self.full_calls + earlier.get("full_calls", 0))
        turns = ((earlier.get("turns") or [turn_counts(earlier)]) if earlier else []) + [turn_counts({
            "policy": self.routing.spec(), "threshold": self.routing.threshold, "routed_steps": self.routed_steps,
            "decided_steps": self.decided_steps, "full_calls": self.full_calls})]
        same = len({(turn["policy"], turn["threshold"]) for turn in turns}) == 1
        policy, threshold = (turns[0]["policy"], turns[0]["threshold"]) if same else ("mixed", None)
        record = {"policy": policy, "threshold": threshold, "routed_steps": routed, "decided_steps": decided,
                  "full_calls": full, "full_call_rate": full / decided if decided else 0.0,
                  "recomputed_tokens": self.recomputed_tokens + earlier.get("recomputed_tokens", 0)}
        if len(turns) > 1:
            record["turns"] = turns
        if details:
            record["decisions"] = earlier.get("decisions", []) + list(self.decisions)
            record["scores"] = earlier.get("scores", []) + [json_score(s) for s in self.scores]
        return record


def turn_counts(record: dict) -> dict:
    """One turn's entry in a streaming session's ``turns``: its policy, threshold and counts (from a summary of it)."""
    decided, full = record["decided_steps"], record["full_calls"]
    return {"policy": record["policy"], "threshold": record["threshold"], "routed_steps": record["routed_steps"],
            "decided_steps": decided, "full_calls": full, "full_call_rate": full / decided if decided else 0.0}


def json_score(score: float) -> float | None:
    """A step's head score as the records give it: None where the head did not run (NaN), or where its score was not
    finite (NaN or +-inf, which route the step Full): JSON has no such numbers, and a server answering with them fails
    the whole response."""
    return score if math.isfinite(score) else None


def replay_flags(state: RequestState, prompt: int, first: int, count: int, span: int) -> tuple[list, bool]:
    """How each token of a recomputed chunk (positions ``first .. first + count - 1`` of a request whose prompt has
    `prompt` tokens) attends: True = Local; and whether the head decides its last token.

    vLLM resumes a preempted request by recomputing its KV (prompt and generated tokens) as a prompt chunk.
    Recomputed with Full attention, the generated tokens would get KV that no Local step wrote, and the request
    would continue differently from one that was never preempted. So each generated token is recomputed the way
    its routed step went (its recorded decision: Local, or Full and native), and the newest generated token, when
    the chunk reaches it, is a new routed step, routed as a decode step is. In a streaming-input session the
    earlier turns' generated tokens are part of the prompt now, and are recomputed as their steps went too."""
    flags, head = [], False
    for i in range(count):
        position = first + i
        if position < prompt:
            earlier = state.earlier_decision(position)
            flags.append(earlier is False and position + 1 > span)
            state.recomputed_tokens += int(earlier is not None)
            continue
        routed_step = position - prompt + 1        # the token at this position was that step's input
        if routed_step <= state.routed_steps:
            flags.append(not state.decisions[routed_step - 1] and position + 1 > span)
            state.recomputed_tokens += 1
            continue
        # Only the newest generated token lies past the recorded steps, and nothing comes after it.
        if routed_step != state.routed_steps + 1 or i != count - 1:
            raise RuntimeError(f"ODA internal error: a recomputed chunk reaches routed step {routed_step} of a "
                               f"request that has made {state.routed_steps}.")
        decided = state.predecided(routed_step)
        if position + 1 <= span:
            state.record(False, decided_step=False)
            flags.append(False)
        elif decided is None:
            flags.append(True)
            head = True
        else:
            state.record(decided)
            flags.append(not decided)
    return flags, head


def external_request_id(engine_id: str) -> str:
    """The id a caller gave (or the API server made) for a request: vLLM's engine appends ``-<8 hex digits>``, unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set (then a caller's own ``job-deadbeef`` is kept whole)."""
    if _ids_not_randomized():
        return engine_id
    head, _, tail = engine_id.rpartition("-")
    return head if head and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail) else engine_id


def _ids_not_randomized() -> bool:
    """vLLM's ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``, read as vLLM reads it (an integer, 0 by default)."""
    value = os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0")
    try:
        return bool(int(value))
    except ValueError:   # vLLM itself fails on it
        raise ValueError(f"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION must be an integer (0 or 1); got {value!r}") from None


def sample_of(request_id: str) -> tuple[int, str] | None:
    """``(k, id)`` when `request_id` is the k-th sample of an ``n > 1`` request (vLLM serves it as the request
    ``<k>_<id>``); None for any other. vLLM's names cannot tell such a sample from a request whose caller gave it an
    id of that form (``AsyncLLM.generate(..., request_id="2_abc")``): that one is read as sample 2 too (its Random
    draws are then sample 2's of its seed); the OpenAI server's completion and chat ids never have that form."""
    sample, underscore, parent = request_id.partition("_")
    return (int(sample), parent) if underscore and parent and sample.isdigit() else None


def sample_index(request_id: str) -> int:
    """k of the k-th sample of an ``n > 1`` request; 0 for any other."""
    sample = sample_of(request_id)
    return 0 if sample is None else sample[0]


def sample_seed(seed: int, sample: int, turn: int = 0) -> int:
    """The Random policy's seed for one sample: `seed` itself for the first (and for a request of one sample), a seed
    derived from both for the others, so that the samples of one request draw independently (as the rows of a batch
    do in `RandomPolicy`) rather than all recalling on the same steps; likewise each later turn of a streaming-input
    session (`turn`), which would otherwise repeat the first turn's draws."""
    if sample == 0 and turn == 0:
        return seed
    import hashlib

    key = f"{seed}:{sample}" if turn == 0 else f"{seed}:{sample}:{turn}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def cacheable_tokens(request) -> int:
    """How many of a request's leading tokens prefix caching may share: those a Full prefill wrote, its prompt. A
    streaming-input session (vLLM's resumable request) counts each turn's earlier output as prompt, decoded with Local
    steps among it, so there only the first turn's prompt (remembered on the request at its first caching)."""
    if not getattr(request, "resumable", False):
        return request.num_prompt_tokens
    return request.__dict__.setdefault("oda_first_prompt_tokens", request.num_prompt_tokens)


def by_caller_id(records: dict) -> dict:
    """Engine-keyed records keyed by the ids callers know (vLLM's ``-<8 hex>`` suffix dropped). Two requests can
    share one (an ``X-Request-Id`` header or a body ``request_id`` used twice): the later keeps its engine id."""
    keyed = {}
    for rid, value in records.items():
        key = external_request_id(rid)
        keyed[key if key not in keyed else rid] = value
    return keyed


def records_of(records: dict, request_id: str, sub_requests: bool = False, key=None) -> dict:
    """The routing records of one request: its own id, or one per sample when it asked for several (``n > 1``:
    vLLM serves each sample as a request with the id ``<k>_<id>``). `sub_requests`: also the per-prompt requests
    of an OpenAI response (``<id>-<i>`` for completions, ``<id>_<i>`` for chat), and their samples. `key`: the id a
    record's key stands for (e.g. `external_request_id` of an engine id), the keys returned unchanged."""
    def matches(rid: str) -> bool:
        if rid == request_id:
            return True
        sample = sample_of(rid)
        if sample is not None and matches_parent(sample[1]):  # one sample of a parallel-sampling request
            return True
        return sub_requests and _is_sub_request(rid, request_id)

    def matches_parent(parent: str) -> bool:
        return parent == request_id or (sub_requests and _is_sub_request(parent, request_id))

    return {rid: value for rid, value in records.items() if matches(key(rid) if key else rid)}


def _without_index(request_id: str) -> str:
    """`request_id` without a trailing ``-<i>`` / ``_<i>`` (one prompt's request of an OpenAI response)."""
    for separator in "-_":
        head, found, index = request_id.rpartition(separator)
        if found and head and index.isdigit():
            return head
    return request_id


def lookup_names(caller_id: str) -> set[str]:
    """Every id under which `records_of` may ask for the record of the request `caller_id`: its own, and for a sample
    or one prompt's request, its parent's and its response's."""
    names = {caller_id, _without_index(caller_id)}
    sample = sample_of(caller_id)
    if sample is not None:
        names |= {sample[1], _without_index(sample[1])}
    return names


class FinishedRecords:
    """The routing records of finished requests a worker keeps (the newest `kept`, `packed`), keyed by engine id and
    found by the ids callers know without a scan: a lookup runs inside vLLM's engine loop, where every running
    request waits for it (filtering 100,000 records took 0.14-0.19 s per response, measured); `evicted`: the summed
    counts of the records dropped beyond `kept` (so that `/metrics`' totals never fall)."""

    def __init__(self, kept: int | None = None):
        self.kept = FINISHED_KEPT if kept is None else kept
        self.records: OrderedDict[str, dict] = OrderedDict()
        self.evicted = dict.fromkeys(COUNTS, 0)
        self._by_name: dict[str, list[str]] = {}   # lists, not sets: a third of the memory, and few ids a name
        # engine id -> (its rank in finish order, the wall-clock time it finished): lookups return records in that
        # order; the time orders the records of several engines (data parallelism) as one
        self._added: dict[str, tuple[int, float]] = {}
        self._count = 0

    def __len__(self) -> int:
        return len(self.records)

    def add(self, engine_id: str, record: dict) -> None:
        self.records[engine_id] = record
        self.records.move_to_end(engine_id)
        self._count += 1
        self._added[engine_id] = (self._count, time.time())
        for name in lookup_names(external_request_id(engine_id)):
            ids = self._by_name.setdefault(name, [])
            if engine_id not in ids:
                ids.append(engine_id)
        while len(self.records) > self.kept:
            dropped_id, dropped = self.records.popitem(last=False)
            del self._added[dropped_id]
            for name in COUNTS:
                self.evicted[name] += dropped[name]
            for name in lookup_names(external_request_id(dropped_id)):
                ids = self._by_name[name]
                ids.remove(dropped_id)
                if not ids:
                    del self._by_name[name]

    def named(self, request_id: str) -> dict:
        """The records `records_of(..., request_id, sub_requests=True, key=external_request_id)` may match (a
        superset: filter them with it)."""
        return self._in_order(self._by_name.get(request_id, ()))

    def of_callers(self, caller_ids) -> dict:
        """The records whose caller's id (`external_request_id`) is one of `caller_ids`."""
        wanted = set(caller_ids)
        return self._in_order(rid for name in wanted for rid in self._by_name.get(name, ())
                              if external_request_id(rid) in wanted)

    def finish_time(self, engine_id: str) -> float:
        """When the kept request `engine_id` finished (seconds since the epoch)."""
        return self._added[engine_id][1]

    def _in_order(self, engine_ids) -> dict:
        return {rid: self.records[rid] for rid in sorted(set(engine_ids), key=self._added.__getitem__)}


# How vLLM's OpenAI server names one prompt's engine request of a response, by the response id's prefix: ``<id>_<i>``
# for chat and Responses API responses, ``<id>-<i>`` for completions and generative scoring.
SUB_REQUEST_SEPARATORS = (("chatcmpl-", "_"), ("resp_", "_"), ("cmpl-", "-"), ("generative-scoring-", "-"))
COMPLETION_ID_PREFIXES = tuple(prefix for prefix, separator in SUB_REQUEST_SEPARATORS if separator == "-")


def _is_sub_request(rid: str, request_id: str) -> bool:
    """Whether `rid` is one prompt's request of the OpenAI response `request_id`, in the form its prefix has
    (`SUB_REQUEST_SEPARATORS`), never the other (``chatcmpl-job-2``, the chat of caller id ``job-2``, is no part of
    the chat response ``chatcmpl-job``). A response id of no such prefix is a caller's own Responses API
    ``request_id``, which vLLM takes as given (``<id>_<i>``; the server refuses one beginning like a completion's), or
    another's: either form (a caller's ``myresp-x`` answered 404 for its ``myresp-x_0``)."""
    rest = rid[len(request_id):] if rid.startswith(request_id) else ""
    separators = next((separator for prefix, separator in SUB_REQUEST_SEPARATORS if request_id.startswith(prefix)),
                      "_-")
    return len(rest) > 1 and rest[0] in separators and rest[1:].isdigit()


def trimmed(record: dict, steps: int) -> dict:
    """`record` as if only its first `steps` routed steps had run. A stop string is matched outside the engine
    (vLLM's output processor), which then aborts the request: by then the engine has run one step or more beyond
    it, routed and counted like any other, whose tokens are never returned. Steps within sinks + window come first
    (positions only grow), so the dropped ones are decided unless fewer than the undecided remain."""
    steps = max(0, steps)
    if record["routed_steps"] <= steps or "decisions" not in record:   # (a record evicted between two reads)
        return record
    decisions = record["decisions"][:steps]
    cut = {**record, "routed_steps": steps, "decisions": decisions, "scores": record["scores"][:steps]}
    if "turns" in record:   # a streaming session
        cut["turns"] = _trimmed_turns(record["turns"], decisions)
        decided = sum(turn["decided_steps"] for turn in cut["turns"])
    else:
        decided = max(0, steps - (record["routed_steps"] - record["decided_steps"]))
    full = sum(decisions)
    cut.update(decided_steps=decided, full_calls=full, full_call_rate=full / decided if decided else 0.0)
    return cut


def _trimmed_turns(turns: list, decisions: list) -> list:
    """A streaming session's `turns` cut to its first ``len(decisions)`` routed steps: each turn's steps in order,
    its undecided ones first."""
    kept_turns, first = [], 0
    for turn in turns:
        kept = min(turn["routed_steps"], len(decisions) - first)
        if kept <= 0:
            break
        undecided = turn["routed_steps"] - turn["decided_steps"]
        kept_turns.append(turn_counts({**turn, "routed_steps": kept, "decided_steps": max(0, kept - undecided),
                                       "full_calls": sum(decisions[first:first + kept])}))
        first += kept
    return kept_turns


def packed(record: dict) -> dict:
    """A finished request's record as the worker keeps it: decisions as one byte per step and scores as 32-bit floats
    (NaN where the head did not run): 5.6 bytes a step instead of 16-40 as Python lists (measured), so that the up to
    FINISHED_KEPT records of a long-running server's worker stay small. `unpacked` gives the record back."""
    from array import array

    return {**record, "decisions": bytes(record["decisions"]),
            "scores": array("f", [math.nan if score is None else score for score in record["scores"]])}


def unpacked(record: dict) -> dict:
    """The record `packed` kept, with its decisions and scores as lists again (`json_score`: None where the head did
    not run or scored a non-finite number; the scores rounded to 32-bit floats)."""
    return {**record, "decisions": [bool(d) for d in record["decisions"]],
            "scores": [json_score(score) for score in record["scores"]]}


def counts_only(record: dict) -> dict:
    """A record without its per-step lists."""
    return {key: value for key, value in record.items() if key not in DETAILS}

# Tokens vLLM's front end returned for each finished request (`stats.ReturnedTokens` notes them in the server's
# process): caller's request id -> the counts of the finished requests that had it (two when a caller reused an id).
_RETURNED: OrderedDict[str, list[int]] = OrderedDict()


def note_returned(request_id: str, tokens: int) -> None:
    _RETURNED.setdefault(request_id, []).append(tokens)
    _RETURNED.move_to_end(request_id)
    while len(_RETURNED) > FINISHED_KEPT:
        _RETURNED.popitem(last=False)


def times_returned(request_id: str) -> int:
    """How many finished requests with this caller's id the front end has counted."""
    return len(_RETURNED.get(request_id, ()))


def returned_tokens(request_id: str) -> int | None:
    """Tokens returned for the finished request with this caller's id; None when unknown, or when the id was used by
    more than one request."""
    counts = _RETURNED.get(request_id)
    return counts[0] if counts is not None and len(counts) == 1 else None


def pooled(requests: dict, evicted: dict | None = None) -> dict:
    """Per-request summaries and their totals; the pooled Full-call rate is Full / decided steps over them.
    `evicted`: the summed counts of records no longer kept (the worker's), added to the totals."""
    totals = {name: sum(v[name] for v in requests.values()) + (evicted or {}).get(name, 0) for name in COUNTS}
    full, decided = totals["full_calls"], totals["decided_steps"]
    return {"requests": requests, **totals, "pooled_full_call_rate": full / decided if decided else 0.0}


def rank_zeros_decisions(asks: torch.Tensor, group=None) -> torch.Tensor:
    """The head's decisions of tensor-parallel rank 0, on every rank of the group (vLLM's TP group by default).

    Each rank runs the head on its own copy of the hidden states, and the Full pass that follows is a collective
    (its layers all-reduce): ranks that decided otherwise, for a score at the threshold that rounding put on either
    side, would hang or mix Full and Local rows into wrong tokens. Identical on one rank."""
    if group is None:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    if group.world_size == 1:
        return asks
    import torch

    flags = asks.to(torch.uint8)
    group.broadcast(flags, src=0)
    return flags.bool()
