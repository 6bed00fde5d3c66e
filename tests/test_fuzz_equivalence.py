"""Property-based equivalence: random tiny models, Local geometries, left-padded batches and policies.

Every run must equal an independent computation: always-Full equals the stock `generate()`; Local, Random,
schedules and the learned head equal the masked full recompute of `reference.replay_logits`, which replays
ODA's own decisions (it shares no code with `OdaCache`).

CI runs a few derandomized examples; explore more with ``ODA_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_equivalence.py``
(random draws then; hypothesis prints the failing example and a seed to reproduce it).
"""

from __future__ import annotations

import functools
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oda_hf import HeadPolicy, OdaConfig, OdaForCausalLM, RandomPolicy, RecallHead, RecallHeadConfig, SchedulePolicy
from reference import replay_logits, step_logits_from_reference
from tiny_models import FAMILIES, VOCAB, tiny_model

EXAMPLES = int(os.environ.get("ODA_FUZZ_EXAMPLES", "30"))
TOL = 5e-5


@functools.lru_cache(maxsize=None)
def cached_model(family: str, kv_heads: int, attn_implementation: str):
    base = tiny_model(family, attn_implementation=attn_implementation, num_key_value_heads=kv_heads)
    torch.manual_seed(1)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    return base, head


@st.composite
def cases(draw):
    family = draw(st.sampled_from(FAMILIES))
    sinks = draw(st.integers(0, 4))
    window = draw(st.integers(1, 8))
    batch = draw(st.integers(1, 3))
    # Prompt lengths anywhere from 1 token, or right at the window boundaries w and s + w (+-1).
    boundary = st.sampled_from([window, sinks + window]).flatmap(lambda n: st.integers(max(1, n - 1), n + 1))
    lengths = draw(st.lists(st.one_of(st.integers(1, 14), boundary), min_size=batch, max_size=batch))
    policy = draw(st.one_of(
        st.sampled_from(["full", "local"]),
        st.builds(RandomPolicy, st.floats(0.0, 1.0), st.integers(0, 2**16)),
        st.integers(1, 6).flatmap(lambda period: st.builds(SchedulePolicy, st.integers(0, period), st.just(period))),
        st.builds(HeadPolicy, st.floats(-0.2, 0.2)),
    ))
    return dict(family=family, kv_heads=draw(st.sampled_from([1, 2, 4])),
                attn=draw(st.sampled_from(["sdpa", "eager"])), sinks=sinks, window=window, lengths=lengths,
                max_new_tokens=draw(st.integers(1, 12)), policy=policy, seed=draw(st.integers(0, 2**16)))


def left_padded(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    total = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), total), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, total - length:] = 1
        ids[row, :total - length] = 0
    return ids, mask


@settings(max_examples=EXAMPLES, deadline=None, derandomize="ODA_FUZZ_EXAMPLES" not in os.environ, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_generate_equals_the_independent_reference(case):
    base, head = cached_model(case["family"], case["kv_heads"], case["attn"])
    policy = case["policy"]
    model = OdaForCausalLM(base, head, OdaConfig(sinks=case["sinks"], window=case["window"], policy=policy))
    ids, mask = left_padded(case["lengths"], case["seed"])
    new = case["max_new_tokens"]
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(**kwargs)
    got = torch.stack(out.logits, dim=1)
    decisions = model.routing.decisions
    assert decisions.shape == (len(case["lengths"]), new - 1)  # the prefill's output is not a routed step
    # Step k (0-based) of a row with a prompt of n valid tokens has a history of n + k + 1 positions.
    history = torch.tensor(case["lengths"])[:, None] + torch.arange(new - 1)[None, :] + 1
    in_window = model.routing.in_window
    assert torch.equal(in_window, history <= case["sinks"] + case["window"])
    if policy == "full":
        assert decisions.all()
        with torch.no_grad():
            stock = base.generate(**kwargs)
        assert torch.equal(out.sequences, stock.sequences)
        assert (got - torch.stack(stock.logits, dim=1)).abs().max().item() < TOL
        return
    assert not decisions[in_window].any()  # in-window rows take Local: it reads what Full would
    if policy == "local":
        assert not decisions.any()
    if isinstance(policy, HeadPolicy):
        scores, decided = model.routing.scores, ~in_window
        assert torch.equal(decisions[decided], ((scores > policy.threshold) | ~torch.isfinite(scores))[decided])
        assert torch.isnan(scores[:, in_window.all(dim=0)]).all()  # the head did not run where every row is in it
    reference = replay_logits(base, out.sequences, mask, decisions, case["sinks"], case["window"])
    expected = step_logits_from_reference(reference, ids.shape[1], new)
    assert (got - expected).abs().max().item() < TOL


ENGINE_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


@settings(max_examples=max(EXAMPLES // 3, 1), deadline=None, derandomize="ODA_FUZZ_EXAMPLES" not in os.environ,
          database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), family=st.sampled_from(ENGINE_FAMILIES), sliding_window=st.integers(1, 12))
def test_static_engine_equals_the_transformers_path(case, family, sliding_window):
    """The static engine (eager on CPU) against the Transformers path, which the test above checks against the
    independent reference: same tokens, decisions and scores, logits within TOL (Gemma 3 with a random native
    window beside Local's geometry)."""
    from oda_hf.engine import OdaStaticEngine

    overrides = {"sliding_window": sliding_window} if family == "gemma3" else {}
    base = tiny_model(family, num_key_value_heads=case["kv_heads"], **overrides)
    torch.manual_seed(1)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    model = OdaForCausalLM(base, head, OdaConfig(sinks=case["sinks"], window=case["window"], policy=case["policy"]))
    ids, mask = left_padded(case["lengths"], case["seed"])
    new = case["max_new_tokens"]
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, **kwargs)
    routing = model.routing
    engine = OdaStaticEngine(model, max_length=ids.shape[1] + new, batch_size=ids.shape[0], bucket_size=4)
    got = engine.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert torch.equal(engine.routing.decisions, routing.decisions)
    assert torch.allclose(engine.routing.scores, routing.scores, atol=1e-5, equal_nan=True)
    assert (torch.stack(got.logits, 1) - torch.stack(expected.logits, 1)).abs().max().item() < TOL
