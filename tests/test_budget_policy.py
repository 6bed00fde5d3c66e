"""`BudgetPolicy`: the head under a Full-call budget that no request and no row ever exceeds."""

import math

import pytest
import torch

from oda_hf import BudgetPolicy, OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from oda_hf.cli import parse_policy
from oda_hf.policies import within_budget
from tiny_models import tiny_model


def model_with_head(threshold=-10.0, seed=0):
    base = tiny_model("qwen3", seed=seed)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, threshold=threshold))


def replay(rate, asks, in_window=None):
    """Decisions of a BudgetPolicy over a sequence of head scores (one row), with optional in-window steps."""
    policy = BudgetPolicy(rate, threshold=0.0)
    policy.reset()
    out = []
    for t, ask in enumerate(asks):
        if in_window is not None:
            policy.observe_window(torch.tensor([in_window[t]]))
        out.append(bool(policy.decide(torch.tensor([1.0 if ask else -1.0]), t + 1, 1, "cpu")[0]))
    return out


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.25, 0.4, 0.5, 1.0])
def test_rate_never_exceeded_at_any_prefix_and_budget_is_spent_when_asked(rate):
    decisions = replay(rate, [True] * 40)
    for n in range(1, 41):
        assert sum(decisions[:n]) <= rate * n + 1e-9
    assert sum(decisions) == math.floor(rate * 40 + 1e-9)  # the head always asks: all earned budget is spent


def test_head_decides_within_the_budget_and_in_window_steps_do_not_count():
    asks = [True, True, False, True, True, True, True, False]
    # step n may call Full while calls + 1 <= n / 2: not at step 1 (0.5 earned), yes at 2, 4 and 6, not at 5 or 7
    assert replay(0.5, asks) == [False, True, False, True, False, True, False, False]
    # Two in-window steps first: they neither count as decided steps nor call Full.
    assert replay(0.5, [True, True] + asks, in_window=[True, True] + [False] * 8)[:2] == [False, False]


def test_nan_scores_are_full_only_within_budget():
    policy = BudgetPolicy(0.5, threshold=0.0)
    got = [bool(policy.decide(torch.tensor([math.nan]), t, 1, "cpu")[0]) for t in range(1, 7)]
    assert got == [False, True, False, True, False, True]


def test_every_beam_holds_its_budget():
    """Beam search reorders rows: each beam's counts follow the beam it continues, so the budget holds along every
    final beam's history (with the counts left on their slots, beams went to 11 calls in 29 steps at a 30% rate)."""
    model = model_with_head(threshold=0.5, seed=2)
    model.set_routing(policy=BudgetPolicy(0.3))
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(2))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, num_beams=4, do_sample=False,
                   early_stopping=False, pad_token_id=0)
    routing = model.routing
    decided = ~routing.in_window & routing.valid
    calls = torch.cumsum((routing.decisions & decided).long(), dim=1)
    steps = torch.cumsum(decided.long(), dim=1)
    assert bool((calls <= 0.3 * steps + 1e-9).all()), (calls[:, -1], steps[:, -1])
    assert int(calls[:, -1].max()) > 0


def test_generate_realised_rate_holds_per_row_where_the_plain_head_exceeds_it():
    model = model_with_head(threshold=-10.0)  # the head asks at every step
    ids = torch.randint(3, 90, (3, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert model.routing.full_call_rate > 0.9  # the plain head: Full almost everywhere
    model.set_routing(policy=BudgetPolicy(0.25))  # threshold from the routing config (-10)
    model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    record = model.routing
    decided = record.decided_steps_per_row
    calls = (record.decisions & record.valid & ~record.in_window).sum(dim=1)
    assert (calls.double() <= 0.25 * decided.double() + 1e-9).all() and calls.sum() > 0
    assert record.full_call_rate <= 0.25


@pytest.mark.parametrize("text,expected", [("budget:0.25", (0.25, None)), ("budget:0.4:0.1", (0.4, 0.1))])
def test_policy_text(text, expected):
    policy = parse_policy(text)
    assert isinstance(policy, BudgetPolicy) and (policy.rate, policy.threshold) == expected


@pytest.mark.parametrize("make,fragment", [
    (lambda: BudgetPolicy(1.5), "`BudgetPolicy rate` must be a finite number >= 0 and <= 1"),
    (lambda: BudgetPolicy(math.nan), "finite"),
    (lambda: BudgetPolicy(0.2, threshold=math.inf), "`BudgetPolicy threshold` must be a finite number"),
])
def test_bad_budget_values(make, fragment):
    with pytest.raises(ValueError) as info:
        make()
    assert fragment in str(info.value)


def test_the_budget_is_exact_for_the_decimal_rate_given():
    """Found by an audit: a 1e-9 tolerance let rate 0.2499999999 call Full once in 4 decided steps (0.25, above the
    budget); without one, 0.29 * 100 = 28.999999999999996 in floats would deny the 29th call that 0.29 earns."""
    assert not within_budget(0, 4, 0.2499999999) and within_budget(0, 4, 0.25)
    assert within_budget(28, 100, 0.29) and not within_budget(29, 100, 0.29)
    assert within_budget(0, 10, 0.1) and not within_budget(0, 9, 0.1)
    assert not within_budget(0, 10 ** 6, 0.0) and within_budget(10 ** 6 - 1, 10 ** 6, 1.0)
    assert within_budget(0, 3, 1 / 3) and within_budget(1, 3, 2 / 3) and not within_budget(1, 5, 1 / 3)
    policy = BudgetPolicy(0.2499999999, threshold=-1.0)
    full = [bool(policy.decide(torch.ones(1), step, 1, "cpu")) for step in range(1, 41)]
    assert all(sum(full[:n]) <= 0.2499999999 * n for n in range(1, 41)) and sum(full) == 9


@pytest.mark.parametrize("rate", [0.2499999999999, 0.3333333333333, 0.1999999999999, 1 / 3, 2 / 3, 0.6666666666667])
def test_a_rate_just_below_a_simple_fraction_is_not_rounded_up_to_it(rate):
    """Found by an audit: the rule's fraction (denominator <= 1e12) of 0.2499999999999 was 1/4, so a row called Full
    once in 4 decided steps, a realised rate of 0.25 above the rate asked, and 0.3333333333333 ran at 1/3. The float
    nearest 1/3 still runs at 1/3 (its realised rate 13/39 is that same float)."""
    calls = 0
    for decided in range(1, 400):
        calls += within_budget(calls, decided, rate)
        assert calls / decided <= rate, (calls, decided)
    assert (calls + 1) / 399 > rate  # and the budget earned is spent: one more call would exceed it


def test_one_budget_object_given_to_two_models_gives_each_request_its_own_counters():
    """Found by an audit: `with_threshold` returned the object itself when it had its own threshold, so two models
    sharing one BudgetPolicy ran one set of counters (one model's rows got 17 Full calls in 39 steps at 0.25)."""
    shared = BudgetPolicy(0.25, threshold=-1.0)
    first, second = shared.with_threshold(0.0), shared.with_threshold(0.0)
    assert first is not shared and first is not second and first.threshold == second.threshold == -1.0
    for step in range(1, 8):   # 7 decided steps, 1 call: shared counters would allow a call at the next step
        first.decide(torch.ones(2), step, 2, "cpu")
    assert [second.decide(torch.ones(2), step, 2, "cpu").tolist() for step in range(1, 5)] == \
        [[False, False]] * 3 + [[True, True]]   # its own budget: the first call is earned at the 4th step


def test_in_window_steps_earn_no_budget_for_the_steps_after_them():
    """A request starting within sinks + window banks no budget there: Full first at the 4th decided step at 25%."""
    decisions = replay(0.25, [True] * 30, in_window=[True] * 10 + [False] * 20)
    # counting the 10 in-window steps as decided let steps 11, 12 and 13 all call Full (100% of the first three)
    assert decisions == [False] * 10 + [False, False, False, True] * 5
