"""Local and mixed routing equal an independent reference: one masked full recompute replaying decisions."""

import pytest
import torch

from oda_hf import HeadPolicy, OdaConfig, OdaForCausalLM, RandomPolicy, RecallHead, RecallHeadConfig, SchedulePolicy
from reference import replay_logits, step_logits_from_reference
from tiny_models import FAMILIES, left_padded_prompts, tiny_model

TOL = 2e-5


def run_and_compare(base, ids, mask, sinks, window, policy, max_new_tokens=14, head=None, **generate_kwargs):
    model = OdaForCausalLM(base, head, OdaConfig(sinks=sinks, window=window, policy=policy))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True, **generate_kwargs)
    decisions = model.routing.decisions
    assert decisions.shape == (ids.shape[0], max_new_tokens - 1)  # prefill output is not a routed step
    ref = replay_logits(base, out.sequences, mask, decisions, sinks, window)
    ref = step_logits_from_reference(ref, ids.shape[1], max_new_tokens)
    got = torch.stack(out.logits, dim=1)
    assert (ref - got).abs().max().item() < TOL
    return model, out, ref




@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["local", SchedulePolicy(1, 3), RandomPolicy(0.4, seed=42)],
                         ids=["local", "schedule", "random"])
def test_routing_matches_masked_reference(family, policy):
    ids, mask = left_padded_prompts(2, 9, pads=[3, 0])
    run_and_compare(tiny_model(family), ids, mask, sinks=2, window=4, policy=policy)


@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_chunked_prefill_prefills_every_prompt_token(chunk):
    """generate(prefill_chunk_size=k): a last chunk of one prompt token (9 = 4 + 4 + 1, or k = 1) was decoded as a
    routed Local step (one routed step too many, logits 0.38 off the reference); it is prompt, prefilled with Full."""
    ids, mask = left_padded_prompts(2, 9, pads=[2, 0])
    base = tiny_model("llama")
    run_and_compare(base, ids, mask, sinks=1, window=2, policy="local", max_new_tokens=6, prefill_chunk_size=chunk)
    model = OdaForCausalLM(base, None, OdaConfig(sinks=1, window=2, policy="full"))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  prefill_chunk_size=chunk)
    assert torch.equal(model.generate(**kwargs), base.generate(**kwargs)) and model.routing.routed_steps == 5
    # A call continuing a cache with 6 uncached tokens (its last output and 5 new) prefills them all with Full, in
    # chunks of one as unchunked (chunks of one had routed every one of them: 11 routed steps for 5, logits 0.25 off),
    # also when it passes only those tokens with a mask over the whole conversation (transformers then drops the
    # all-ones mask and keeps its length: they were routed again)
    model = OdaForCausalLM(base, None, OdaConfig(sinks=1, window=2, policy="local"))
    scores = {}
    for chunk in (None, 1):
        for uncached_only in (False, True):
            cache = model.new_cache()
            first = model.generate(input_ids=ids[1:], max_new_tokens=6, do_sample=False, pad_token_id=0,
                                   past_key_values=cache)
            more = torch.cat([first, torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(3))], 1)
            fed = dict(input_ids=more[:, cache.get_seq_length():], attention_mask=torch.ones_like(more)) \
                if uncached_only else dict(input_ids=more)
            out = model.generate(**fed, max_new_tokens=6, do_sample=False, pad_token_id=0, past_key_values=cache,
                                 output_logits=True, return_dict_in_generate=True, prefill_chunk_size=chunk)
            scores[chunk, uncached_only] = (torch.stack(out.logits, 1), model.routing.routed_steps)
    for key, (logits, routed_steps) in scores.items():
        assert routed_steps == 5, key
        torch.testing.assert_close(logits, scores[None, False][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_5"])
def test_learned_head_routing_matches_reference(family):
    base = tiny_model(family)
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    ids, mask = left_padded_prompts(2, 9, pads=[2, 0])
    model, _, _ = run_and_compare(base, ids, mask, sinks=2, window=4, policy=HeadPolicy(0.0), head=head)
    decisions = model.routing.decisions
    assert decisions.any() and not decisions.all()  # a real mix, so the test exercises both branches
    scores = model.routing.scores
    assert torch.equal(decisions, scores > 0)


@pytest.mark.parametrize("prompt_len_offset", [-1, 0, 1])
@pytest.mark.parametrize("anchor", ["w", "s+w"])
def test_window_boundaries(anchor, prompt_len_offset):
    sinks, window = 3, 6
    length = (window if anchor == "w" else sinks + window) + prompt_len_offset
    ids, mask = left_padded_prompts(1, length, pads=[0])
    base = tiny_model("qwen3")
    _, out, ref = run_and_compare(base, ids, mask, sinks, window, "local", max_new_tokens=12)
    # Up to position s + w the Local and Full access sets coincide: the first outputs equal the stock model's.
    stock = base.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    same = max(0, sinks + window - length + 1)  # outputs whose query position is <= s + w
    for k in range(min(same, 12)):
        assert torch.allclose(stock.logits[k], out.logits[k], atol=TOL)
    if same < 12:
        assert not torch.allclose(stock.logits[11], out.logits[11], atol=1e-3)


@pytest.mark.parametrize("sinks,window", [(0, 4), (2, 1), (4, 2), (1, 3)])
def test_edge_geometries_and_many_wraparounds(sinks, window):
    ids, mask = left_padded_prompts(2, 7, pads=[2, 0])
    run_and_compare(tiny_model("llama"), ids, mask, sinks, window, RandomPolicy(0.3, seed=43), max_new_tokens=30)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_ratios(kv_heads):
    ids, mask = left_padded_prompts(2, 8, pads=[1, 0])
    base = tiny_model("qwen3", num_key_value_heads=kv_heads)
    run_and_compare(base, ids, mask, 2, 4, SchedulePolicy(2, 5))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_eager_attention_matches_reference(family):
    ids, mask = left_padded_prompts(2, 9, pads=[3, 0])
    run_and_compare(tiny_model(family, attn_implementation="eager"), ids, mask, 2, 4, SchedulePolicy(1, 2))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma4"])
def test_left_padded_batch_equals_rows_alone(family):
    base = tiny_model(family)
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    ids, mask = left_padded_prompts(3, 10, pads=[4, 0, 2])
    model = OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, policy="head"))
    batch = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    batch_decisions = model.routing.decisions
    for row in range(3):
        alone_ids = ids[row : row + 1, mask[row].bool()]
        alone = model.generate(input_ids=alone_ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(alone[0, alone_ids.shape[1]:], batch[row, ids.shape[1]:])
        assert torch.equal(model.routing.decisions[0], batch_decisions[row])


def test_reference_detects_wrong_decisions():
    """The reference is sensitive to routing: replaying flipped decisions does not match."""
    base = tiny_model("qwen3")
    ids, mask = left_padded_prompts(2, 9, pads=[3, 0])
    model, out, ref = run_and_compare(base, ids, mask, 2, 4, SchedulePolicy(1, 2))
    flipped = replay_logits(base, out.sequences, mask, ~model.routing.decisions, 2, 4)
    flipped = step_logits_from_reference(flipped, ids.shape[1], 14)
    assert (flipped - ref).abs().max().item() > 1e-2


@pytest.fixture
def deferred_stop_check(monkeypatch):
    """transformers' deferred stop check, which it uses on mps only (the stop decision is read one step late and that
    step taken back: the cache cropped with crop(0) after every step and crop(-1) at the end), turned on here."""
    from transformers.generation import utils as generation_utils

    class HostEvent:   # (CPU has no torch.Event: a host copy is done when it returns)
        def __init__(self, *args, **kwargs):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

    def turn_on():
        monkeypatch.setattr(torch, "Event", HostEvent)
        monkeypatch.setattr(generation_utils.DeferredStopCheck, "is_supported", staticmethod(
            lambda device, cache, returned, is_assistant: not is_assistant and (
                cache is None or cache.is_croppable or not returned)))
    return turn_on


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_the_deferred_stop_check_changes_nothing(family, deferred_stop_check):
    """Found by an audit: OdaCache.crop(0) read 0 as a length to keep (transformers' contract: remove none), so under
    the deferred check a returned cache was emptied after the first step and generation went on from one token (exit
    0); ODA's wrapped criteria hid the max length (one extra step), and the taken-back step stayed in the routing
    record. Tokens, decisions, rows' steps and the returned cache equal a normal run's."""
    base = tiny_model(family)
    model = OdaForCausalLM(base, None, OdaConfig(sinks=1, window=3, policy=RandomPolicy(0.5, seed=3)))
    ids, mask = left_padded_prompts(2, 10, pads=[2, 0])
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = [int(free[0, 13]), int(free[1, 15])]   # rows stop after 4 and 6 outputs (or earlier, on a repeat)
    runs = {}
    for deferred in (False, True):
        if deferred:
            deferred_stop_check()
        for stop, returned in [(None, True), (eos, False), (eos, True)]:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 pad_token_id=0, eos_token_id=stop, return_dict_in_generate=returned)
            sequences = out.sequences if returned else out
            length = out.past_key_values.get_seq_length() if returned else None
            runs[deferred, str(stop), returned] = (sequences, model.routing.decisions, model.routing.valid, length)
    for (deferred, stop, returned), run in runs.items():
        normal = runs[False, stop, returned]
        assert torch.equal(run[0], normal[0]) and torch.equal(run[1], normal[1]), (deferred, stop, returned)
        assert torch.equal(run[2], normal[2]) and run[3] == normal[3], (deferred, stop, returned)
    assert runs[False, "None", True][1].shape == (2, 7)


def test_crop_follows_transformers_contract():
    """crop(-k) removes the last k positions, crop(0) none (transformers' deferred stop check calls it every step), a
    positive count is refused as transformers refuses it; crop_to(n) keeps the first n."""
    model = OdaForCausalLM(tiny_model("llama"), None, OdaConfig(sinks=1, window=3, policy="local"))
    cache = model.generate(input_ids=torch.randint(3, 90, (1, 9)), max_new_tokens=4, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True).past_key_values
    assert cache.get_seq_length() == 12
    cache.crop(0)
    assert cache.get_seq_length() == 12
    cache.crop(-2)
    assert cache.get_seq_length() == 10
    with pytest.raises(ValueError, match=r"crop\(5\): crop takes the number of positions to remove as a negative count"
                                         r".*call crop_to\(5\)"):
        cache.crop(5)
    cache.crop_to(7)
    assert cache.get_seq_length() == 7
