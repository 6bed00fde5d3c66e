"""Routing decisions made on the device with each policy's own rule (`RoutingPolicy.decide_on_device`).

A `StepPlan` is the static shape of a step for one policy (does Local run, does the head run, the
constants its rule bakes in); it is part of a captured graph's key. Per-step values (scores, the step
counter, the head's threshold, precomputed draws) stay on the device, so a step never reads anything
back to the host. Policies whose decisions are host-side draws (`host_draws`, e.g. Random) get a
per-step decision table filled at request start by a copy of the policy itself (re-seeded, one
``decide`` per step in step order), so the draws are the HF path's draws.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..policies import RoutingPolicy
from ..routing import RoutingRecord
from .state import EngineState
from .support import FastPathUnsupported


@dataclass(frozen=True)
class StepPlan:
    rule: tuple  # the policy's `graph_key()`: its name and the constants its rule bakes in
    run_local: bool
    run_head: bool
    host_draws: bool = False
    never_full: bool = False


def plan_for(policy: RoutingPolicy, has_head: bool) -> StepPlan:
    """The step plan of a policy, with the HF path's rule for when the head runs."""
    if not policy.fast_path:
        raise FastPathUnsupported(
            f"Routing policy {policy!r} does not declare a device rule (fast_path = True) so the fast path cannot run "
            "it (it supports HeadPolicy, 'full', 'local', SchedulePolicy and RandomPolicy). Use the HF path: "
            "model.generate(...) without oda_fast."
        )
    if policy.uses_head and not has_head:
        raise ValueError("policy='head' needs a recall head; attach one with model.set_head().")
    device_rule = next(cls for cls in type(policy).__mro__ if "decide_on_device" in cls.__dict__)
    if device_rule is not RoutingPolicy and type(policy).decide is not device_rule.decide:
        # e.g. a HeadPolicy subclass with its own `decide`: the inherited device rule would run instead, silently
        raise FastPathUnsupported(
            f"Routing policy {policy!r} overrides decide() but inherits {device_rule.__name__}'s decide_on_device, "
            "which the fast path would run instead of it. Define decide_on_device to match, or use the HF path: "
            "model.generate(...) without oda_fast.")
    keeps_state = [name for name in ("reset", "observe_window")
                   if getattr(type(policy), name) is not getattr(RoutingPolicy, name)
                   and not (name == "reset" and policy.host_draws)]
    if keeps_state:
        # A captured step runs the rule on every step, in-window ones included, where the HF path calls `decide`
        # only once some row is past the window and `observe_window` before it: a counter would drift.
        raise FastPathUnsupported(
            f"Routing policy {policy!r} keeps per-request state (it defines {' and '.join(keeps_state)}): the fast "
            "path runs decide_on_device on every step, also where every row is within sinks + window and the HF "
            "path does not call decide, so its state would not follow. Make the rule stateless, draw its decisions "
            "per request on the host (host_draws = True), or use the HF path: model.generate(...) without oda_fast.")
    run_head = not policy.skips_local and (policy.uses_head or (policy.run_head and has_head))
    return StepPlan(policy.graph_key(), not policy.skips_local, run_head, policy.host_draws, policy.never_full)


def prepare_request(state: EngineState, policy: RoutingPolicy, plan: StepPlan, batch: int, max_steps: int) -> None:
    """Host-side, once per request: device threshold, and the decision table for table policies."""
    threshold = getattr(policy, "threshold", None)   # what decide_on_device gets; rules without one ignore it
    state.threshold.fill_(0.0 if threshold is None else float(threshold))
    if plan.host_draws:
        if max_steps > state.decision_table.shape[0]:
            raise ValueError(f"{max_steps} routed steps exceed the engine's capacity {state.decision_table.shape[0]}.")
        draws = copy.deepcopy(policy)  # never advance the user's policy object
        draws.reset()
        table = [draws.decide(None, step, batch, "cpu") for step in range(1, max_steps + 1)]
        if table:
            state.decision_table[:max_steps] = torch.stack(table).to(state.decision_table.device)


def decide(state: EngineState, policy: RoutingPolicy, plan: StepPlan, scores: torch.Tensor | None) -> torch.Tensor:
    """bool ``[B]`` on the device: True = this row selects Full at this step."""
    if plan.host_draws:
        return state.decision_table.index_select(0, state.step_counter).view(state.batch_size)
    # step_counter counts the steps taken; the policy's steps are 1-based.
    return policy.decide_on_device(scores, state.step_counter + 1, state.batch_size, state.valid_count.device,
                                   state.threshold)


def record(state: EngineState, select_full: torch.Tensor, scores: torch.Tensor | None, in_window: torch.Tensor) -> None:
    """Write this step's decisions, scores and window flags at row ``step_counter`` of the device record."""
    state.decisions.index_copy_(0, state.step_counter, select_full.view(1, -1))
    state.in_window.index_copy_(0, state.step_counter, in_window.view(1, -1))
    if scores is not None:
        state.scores.index_copy_(0, state.step_counter, scores.detach().float().view(1, -1))


def routing_record(state: EngineState, steps: int, finished_at: torch.Tensor | None = None) -> RoutingRecord:
    """The request's `RoutingRecord` (one host read, at the end of the request)."""
    routing = RoutingRecord(state.batch_size)
    decisions = state.decisions[:steps].cpu()
    scores = state.scores[:steps].cpu()
    in_window = state.in_window[:steps].cpu()
    for step in range(steps):
        routing.record(decisions[step], scores[step], in_window[step])
    if finished_at is not None:
        routing.finished_at = finished_at.clone()
    return routing
