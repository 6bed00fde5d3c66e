"""Routing policies: who decides, per row and per routed step, whether to recompute with Full.

All policies run through the same decode step in `OdaForCausalLM`; only the decision differs. That is
what makes the evaluation controls (StreamingLLM = always-Local, Random at a matched rate, fixed
schedules for the runtime benchmark) comparable with the learned head.
"""

from __future__ import annotations

import copy
import functools
from abc import ABC, abstractmethod
from fractions import Fraction

import torch

from .validation import integer, number, probability
from .validation import seed as check_seed


class RoutingPolicy(ABC):
    """Base class. `decide` returns a bool tensor ``[batch]`` (True = recompute with Full).

    A policy's `decide` is its only decision rule: the HF path calls it with the routed step as an int,
    the static engine (`oda_fast=True`) calls `decide_on_device` with the step as a device tensor, so
    neither path reads anything back from the device and both apply the same code.
    """

    name = "policy"
    #: The policy needs the recall head's score to decide.
    uses_head = False
    #: The policy never accepts Local, so the Local attempt can be skipped (the always-Full control).
    skips_local = False
    #: Run the head every step even though the decision does not depend on it (runtime benchmarks).
    run_head = False
    #: The policy never selects Full (the engine skips writing Full candidates).
    never_full = False
    #: The static engine can run `decide_on_device` inside a captured step (tensor ops only, no host reads).
    fast_path = False
    #: Decisions come from host-side draws (Random): the engine precomputes them per request with `decide`.
    host_draws = False

    def reset(self) -> None:
        """Called at the start of every request (prefill), so seeded policies are reproducible."""

    def reorder(self, indices: torch.Tensor) -> None:
        """Rows moved (beam search: row ``i`` continues row ``indices[i]``): per-row state must follow them."""

    def observe_window(self, in_window: torch.Tensor) -> None:
        """Rows (bool ``[batch]``, CPU) whose step is within sinks + window, given before `decide` on the HF path
        (their decision is ignored; policies that count decided steps need it)."""

    @abstractmethod
    def decide(self, scores: torch.Tensor | None, step, batch_size: int, device) -> torch.Tensor:
        """Decisions for routed `step` (1-based: an int, or a long tensor ``[1]`` on the device); `scores` are the
        head's q, or None if it did not run."""

    def decide_on_device(self, scores: torch.Tensor | None, step: torch.Tensor, batch_size: int, device,
                         threshold: torch.Tensor) -> torch.Tensor:
        """The static engine's call: `decide` with a device step counter and the threshold as a device scalar
        (so a captured graph bakes in neither)."""
        return self.decide(scores, step, batch_size, device)

    def graph_key(self) -> tuple:
        """The values a captured step bakes in (constants of the rule): part of the engine's graph key."""
        return (self.name,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def head_asks(scores: torch.Tensor, threshold) -> torch.Tensor:
    """The head's rule, on every path (Transformers, the static engine, vLLM): Full where the score is above the
    threshold (a score equal to it stays Local) or not finite (NaN, +-inf); `threshold` a number or a tensor."""
    return (scores > threshold) | ~torch.isfinite(scores)


class HeadPolicy(RoutingPolicy):
    """The learned recall head: Full when ``q > threshold`` or ``q`` is not finite. ``threshold=None`` takes the
    routing threshold (`OdaConfig.threshold`, a head's calibrated one); used on its own, 0."""

    name = "head"
    uses_head = True

    def __init__(self, threshold: float | None = None):
        # (+-inf: never / always Full; NaN, a string or a bool refused: NaN > x is false, so it would never recall)
        self.threshold = None if threshold is None else number("HeadPolicy threshold", threshold, finite=False)

    fast_path = True

    def with_threshold(self, threshold: float) -> "HeadPolicy":
        """This policy with `threshold` where it has none (the routing threshold): a copy, so that one policy object
        can serve models routed at different thresholds (a subclass's own fields are copied with it)."""
        if self.threshold is not None:
            return self
        resolved = copy.copy(self)
        resolved.threshold = float(threshold)
        return resolved

    def decide(self, scores, step, batch_size, device):
        return head_asks(scores, 0.0 if self.threshold is None else self.threshold)

    def decide_on_device(self, scores, step, batch_size, device, threshold):
        return head_asks(scores, threshold)

    def __repr__(self) -> str:
        return f"HeadPolicy(threshold={self.threshold})"


class AlwaysFullPolicy(RoutingPolicy):
    """Every routed step uses Full: equals the stock model's decoding."""

    name = "full"
    skips_local = True
    fast_path = True

    def decide(self, scores, step, batch_size, device):
        return torch.ones(batch_size, dtype=torch.bool, device=device)


class AlwaysLocalPolicy(RoutingPolicy):
    """Every routed step uses Local: this is the StreamingLLM (sinks + window) baseline."""

    name = "local"
    never_full = True
    fast_path = True

    def decide(self, scores, step, batch_size, device):
        return torch.zeros(batch_size, dtype=torch.bool, device=device)


class RandomPolicy(RoutingPolicy):
    """Full with probability ``p`` at each routed step and row, from a seeded generator.

    The generator is re-seeded at every request, so the same prompt and seed give the same draws.
    Draw ``i`` of a request is ``torch.rand(batch, generator=torch.Generator().manual_seed(seed))``
    taken in step order, one row per column; steps within sinks + window take their draw too (and
    ignore it), so a step's draw depends only on its number.
    """

    name = "random"
    fast_path = True
    host_draws = True

    def __init__(self, p: float, seed: int = 42, run_head: bool = False):
        self.p = probability("RandomPolicy p", p)
        self.seed = check_seed("RandomPolicy seed", seed)
        self.run_head = run_head
        self.reset()

    def reset(self) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)

    def decide(self, scores, step, batch_size, device):
        return (torch.rand(batch_size, generator=self._generator) < self.p).to(device)

    def __repr__(self) -> str:
        return f"RandomPolicy(p={self.p}, seed={self.seed})"


class SchedulePolicy(RoutingPolicy):
    """Full on the first ``k`` of every ``period`` routed steps (1-based steps), for every row."""

    name = "schedule"
    fast_path = True

    def __init__(self, k: int, period: int, run_head: bool = False):
        # Counts, not rounded: SchedulePolicy(2.9, 3.5) is an error, not (2, 3).
        self.period = integer("SchedulePolicy period", period, minimum=1)
        self.k = integer("SchedulePolicy k", k, minimum=0, maximum=self.period,
                         meaning=f"Full steps in every period of {self.period}")
        self.run_head = run_head

    @property
    def rate(self) -> float:
        return self.k / self.period

    def decide(self, scores, step, batch_size, device):
        step = torch.as_tensor(step, device=device).reshape(1)
        return (torch.remainder(step - 1, self.period) < self.k).repeat(batch_size)

    def graph_key(self) -> tuple:
        return (self.name, self.k, self.period)

    def __repr__(self) -> str:
        return f"SchedulePolicy(k={self.k}, period={self.period})"


@functools.lru_cache(maxsize=256)
def rate_fraction(rate: float) -> tuple[int, int]:
    # The fraction of denominator <= 1e12 nearest the rate's shortest decimal (0.29 is 29/100, 1/3 is 1/3), unless
    # that fraction, as a float, is above the rate: 0.2499999999999 would be 1/4, whose realised rate 0.25 exceeds
    # it, so such a rate keeps its decimal's own fraction (2499999999999/10**13).
    decimal = Fraction(repr(rate))
    simplest = decimal.limit_denominator(10 ** 12)
    return (decimal if float(simplest) > rate else simplest).as_integer_ratio()


def within_budget(calls: int, decided: int, rate: float) -> bool:
    """Whether one more Full call at a row's `decided`-th decided step (this one counted) keeps ``calls + 1 <= rate *
    decided``, in integers for the fraction the rate stands for (`rate_fraction`). In floats 0.29 * 100 is
    28.999999999999996, a tolerance for that let a rate of 0.2499999999 reach 0.25, and 1/3's shortest decimal
    denied the call of every third step."""
    numerator, denominator = rate_fraction(float(rate))
    return (calls + 1) * denominator <= numerator * decided


class BudgetPolicy(RoutingPolicy):
    """The head under a Full-call budget that holds for every request and row: Full when the head asks (``q >
    threshold``, or ``q`` not finite) *and* the row's Full calls stay within ``rate`` of its decided steps so far.

    A row may call Full at its ``n``-th decided step (steps past sinks + window, this one counted) only while
    ``calls + 1 <= rate * n``, so its Full-call rate never exceeds ``rate`` at any point of the request, whatever
    its length or where it stops. The cost of the guarantee: early steps cannot spend budget not yet earned, and
    a non-finite score is Local when the budget is spent. ``threshold=None`` takes the routing threshold
    (`OdaConfig.threshold`). The HF path and the vLLM plugin (`oda_policy="budget:R"`); not the static engine
    (its captured step has no per-row counters).
    """

    name = "budget"
    uses_head = True

    def __init__(self, rate: float, threshold: float | None = None):
        self.rate = probability("BudgetPolicy rate", rate)
        self.threshold = None if threshold is None else number("BudgetPolicy threshold", threshold)
        self.reset()

    def with_threshold(self, threshold: float) -> "BudgetPolicy":
        """A fresh copy of this policy (its own counters: one object given to two models ran one budget for both),
        with `threshold` where it has none (the routing threshold)."""
        return BudgetPolicy(self.rate, threshold if self.threshold is None else self.threshold)

    def reset(self) -> None:
        self._calls = self._decided = None
        self._in_window = None

    def observe_window(self, in_window: torch.Tensor) -> None:
        self._in_window = in_window

    def reorder(self, indices: torch.Tensor) -> None:
        if self._calls is not None:  # each beam keeps the counts of the beam it continues
            indices = indices.cpu()
            self._calls, self._decided = self._calls[indices], self._decided[indices]

    def decide(self, scores, step, batch_size, device):
        if self._calls is None or self._calls.shape[0] != batch_size:
            self._calls = torch.zeros(batch_size, dtype=torch.long)
            self._decided = torch.zeros(batch_size, dtype=torch.long)
        decided = torch.ones(batch_size, dtype=torch.bool) if self._in_window is None else ~self._in_window.cpu()
        self._decided += decided.long()
        asks = head_asks(scores.detach().float().cpu(), self.threshold)
        allowed = torch.tensor([within_budget(calls, n, self.rate) for calls, n in
                                zip(self._calls.tolist(), self._decided.tolist())], dtype=torch.bool)
        full = asks & allowed & decided
        self._calls += full.long()
        return full.to(device)

    def __repr__(self) -> str:
        return f"BudgetPolicy(rate={self.rate}, threshold={self.threshold})"


def resolve_policy(policy, threshold: float) -> RoutingPolicy:
    """Turn the `OdaConfig.policy` value into a policy object; a head policy without its own threshold takes
    `threshold` (``HeadPolicy()`` once kept its default 0 over the routing threshold, a calibrated one included)."""
    if isinstance(policy, (BudgetPolicy, HeadPolicy)):
        return policy.with_threshold(threshold)
    if isinstance(policy, RoutingPolicy):
        return policy
    named = {"head": lambda: HeadPolicy(threshold), "full": AlwaysFullPolicy, "local": AlwaysLocalPolicy}
    if policy not in named:
        raise ValueError(
            f"Unknown routing policy {policy!r}: use 'head', 'full', 'local', RandomPolicy(p, seed) or "
            "SchedulePolicy(k, period)."
        )
    return named[policy]()
