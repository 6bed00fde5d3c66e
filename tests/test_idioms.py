"""Everyday transformers idioms on an `OdaForCausalLM`: casting the wrapper, multi-turn cache reuse."""

import copy

import pytest
import torch

from oda_hf.compat import CACHE_ARG, cache_kwargs
from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig, SchedulePolicy
from reference import replay_logits
from tiny_models import left_padded_prompts, tiny_model

CASTS = {
    "to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "to(dtype=float16)": (lambda m: m.to(dtype=torch.float16), torch.float16),
    "half()": (lambda m: m.half(), torch.float16),
    "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    "to('cpu', bfloat16)": (lambda m: m.to("cpu", torch.bfloat16), torch.bfloat16),
}


def head_model(family="qwen3", policy="head", sinks=2, window=4):
    base = tiny_model(family)
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    return OdaForCausalLM(base, head, OdaConfig(sinks=sinks, window=window, policy=policy))


@pytest.mark.parametrize("cast", list(CASTS))
def test_casting_the_wrapper_casts_the_base_and_keeps_the_head_fp32(cast):
    apply, dtype = CASTS[cast]
    model = head_model()
    head_before = {k: v.clone() for k, v in model.recall_head.state_dict().items()}
    assert apply(model) is model
    assert model.dtype == dtype and all(p.dtype == dtype for p in model.base_model.parameters())
    for name, value in model.recall_head.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, head_before[name]), name
    ids, mask = left_padded_prompts(2, 9, pads=(2, 0))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 17)
    scores = model.routing.scores
    assert scores.shape == (2, 7) and torch.isfinite(scores).all()
    assert torch.equal(model.routing.decisions, scores > 0)
    model.float()  # and back: the base is FP32 again, the head was never touched
    assert model.dtype == torch.float32
    for name, value in model.recall_head.state_dict().items():
        assert torch.equal(value, head_before[name]), name


def test_head_scores_of_a_cast_model_come_from_the_fp32_head():
    """The score the cast model records equals the FP32 head applied to its (half precision) inputs."""
    model = head_model().to(torch.bfloat16)
    ids, mask = left_padded_prompts(1, 9, pads=(0,))
    cache = model.new_cache()
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        previous = cache.selected_hidden.clone()
        token = first.logits[:, -1].argmax(-1, keepdim=True)
        model(input_ids=token, past_key_values=cache)
    recorded = model.routing.scores[0, 0]
    head = copy.deepcopy(model.recall_head)
    assert next(head.parameters()).dtype == torch.float32
    embeds = model.get_input_embeddings()(token)[:, -1]
    # H and E are reproducible outside the step; L is the Local hidden state: rebuild it with the policy 'local'.
    local_model = OdaForCausalLM(model.base_model, None, OdaConfig(sinks=2, window=4, policy="local"))
    local_cache = local_model.new_cache()
    with torch.no_grad():
        local_model(input_ids=ids, attention_mask=mask, past_key_values=local_cache)
        local_model(input_ids=token, past_key_values=local_cache)
        local_hidden = local_cache.selected_hidden
        expected = head(previous.float(), embeds.float(), local_hidden.float())[0]
    assert recorded.item() == pytest.approx(expected.item(), abs=1e-6)


def two_turns(model, turn1_new=7, turn2_new=6, user_tokens=(5, 6, 7), **turn2_kwargs):
    """The transformers chat pattern: turn 2 passes turn 1's cache and the whole conversation's ids."""
    ids, mask = left_padded_prompts(2, 9, pads=(3, 0))
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=turn1_new, do_sample=False,
                           pad_token_id=0, return_dict_in_generate=True)
    turn1_decisions = model.routing.decisions.clone()
    conversation = torch.cat([first.sequences, torch.tensor([list(user_tokens)] * 2, dtype=torch.long)], dim=1)
    conversation_mask = torch.cat([mask, torch.ones(2, conversation.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    second = model.generate(input_ids=conversation, attention_mask=conversation_mask,
                            **cache_kwargs(getattr(first, CACHE_ARG)), max_new_tokens=turn2_new, do_sample=False,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True, **turn2_kwargs)
    return ids, mask, turn1_decisions, conversation, second


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_second_turn_on_a_reused_cache_has_its_own_routing(family):
    model = head_model(family, policy=SchedulePolicy(1, 3))
    ids, mask, turn1, conversation, second = two_turns(model)
    # Hand count: turn 2 has 6 outputs = 5 routed steps, Full on the first of every 3 (the schedule restarts).
    assert model.routing.decisions.tolist() == [[True, False, False, True, False]] * 2
    assert model.routing.full_calls_per_row.tolist() == [2, 2] and model.routing.steps_per_row.tolist() == [5, 5]
    # Turn 2's logits equal the masked reference replaying turn 1's decisions, Full for turn 2's prompt chunk
    # (turn 1's last output and the user tokens), then turn 2's decisions.
    chunk = conversation.shape[1] - ids.shape[1] - turn1.shape[1]
    decisions = torch.cat([turn1, torch.ones(2, chunk, dtype=torch.bool), model.routing.decisions], dim=1)
    reference = replay_logits(model.base_model, second.sequences, mask, decisions, sinks=2, window=4)
    start = conversation.shape[1] - 1
    expected = reference[:, start:start + len(second.logits)]
    assert (torch.stack(second.logits, dim=1) - expected).abs().max().item() < 2e-5


def test_head_scores_of_the_second_turn_match_a_fresh_model_on_a_copy_of_the_cache():
    """A second model that never ran turn 1 continues a copy of the same cache with the same routing."""
    model = head_model()
    ids, mask = left_padded_prompts(2, 9, pads=(3, 0))
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True)
    cache_copy = copy.deepcopy(getattr(first, CACHE_ARG))
    conversation = torch.cat([first.sequences, torch.tensor([[5, 6, 7]] * 2)], dim=1)
    conversation_mask = torch.cat([mask, torch.ones(2, 10, dtype=mask.dtype)], dim=1)
    kwargs = dict(input_ids=conversation, attention_mask=conversation_mask, max_new_tokens=6, do_sample=False,
                  pad_token_id=0)
    turn2 = model.generate(**cache_kwargs(getattr(first, CACHE_ARG)), **kwargs)
    fresh = OdaForCausalLM(model.base_model, model.recall_head, model.oda_config)
    fresh_turn2 = fresh.generate(**cache_kwargs(cache_copy), **kwargs)
    assert torch.equal(turn2, fresh_turn2)
    assert torch.equal(model.routing.decisions, fresh.routing.decisions)
    assert torch.equal(model.routing.scores, fresh.routing.scores) and model.routing.scores.shape == (2, 5)


def test_eos_in_turn_one_does_not_cut_turn_two():
    model = head_model(policy=SchedulePolicy(1, 2))
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    probe = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    eos = int(probe[0, 9 + 2])  # turn 1 stops at its third output
    first = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=eos,
                           return_dict_in_generate=True)
    assert first.sequences.shape[1] == 9 + 3 and model.routing.steps_per_row.tolist() == [2]
    conversation = torch.cat([first.sequences, torch.tensor([[5, 6, 7]])], dim=1)
    model.generate(input_ids=conversation, **cache_kwargs(getattr(first, CACHE_ARG)), max_new_tokens=10,
                   do_sample=False, pad_token_id=0, eos_token_id=None)
    assert model.routing.steps_per_row.tolist() == [9]
    assert model.routing.full_calls_per_row.tolist() == [5]  # steps 1, 3, 5, 7, 9


def test_continuing_without_new_tokens_routes_every_output():
    """Turn 2 = turn 1's sequences only: one uncached token, no prefill, so each of its N outputs is a routed step."""
    model = head_model(policy=SchedulePolicy(1, 3))
    ids, mask = left_padded_prompts(2, 9, pads=(3, 0))
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True)
    turn1 = model.routing.decisions.clone()
    mask2 = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
    second = model.generate(input_ids=first.sequences, attention_mask=mask2, **cache_kwargs(getattr(first, CACHE_ARG)),
                            max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                            return_dict_in_generate=True)
    assert model.routing.decisions.tolist() == [[True, False, False, True]] * 2
    decisions = torch.cat([turn1, model.routing.decisions], dim=1)
    reference = replay_logits(model.base_model, second.sequences, mask, decisions, sinks=2, window=4)
    start = first.sequences.shape[1] - 1
    expected = reference[:, start:start + 4]
    assert (torch.stack(second.logits, dim=1) - expected).abs().max().item() < 2e-5


def _per_query_local_logits(base, sequences, query_masks, use_full, sinks, window, position_ids):
    """A full-attention model's logits where query t sees the keys `query_masks[:, t]` allows (each call's own
    mask: turn 1's queries read turn 1's, turn 2's the turn-2 mask), restricted to sinks + window over the positions
    that mask leaves, unless `use_full[:, t]`."""
    total = sequences.shape[1]
    valid = query_masks.bool()
    logical = valid.long().cumsum(-1)   # each key's position among those its query sees
    index = torch.arange(total)
    query_position = logical[:, index, index][:, :, None]
    in_local = (logical <= sinks) | (logical >= query_position - window + 1)
    allowed = valid & (index[:, None] >= index[None, :]) & (use_full[:, :, None] | in_local)
    with torch.no_grad():
        return base(input_ids=sequences, attention_mask=allowed[:, None], position_ids=position_ids,
                    use_cache=False).logits


def test_continuing_without_new_tokens_follows_the_new_mask():
    """Turn 2 = turn 1's sequences with some of turn 1's output columns now hidden: no prefill runs, and the Local
    workspace had kept reading (and counting) them while Full did not (logits up to 0.17 off the reference, `in_window`
    wrong). A row whose last token is hidden cannot be decoded by Local as Full decodes it: refused, naming the fix;
    always-Full still runs it as stock does."""
    sinks, window = 2, 4
    model = head_model(family="llama", policy="local", sinks=sinks, window=window)
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    kwargs = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    first = model.generate(input_ids=ids, max_new_tokens=8, **kwargs)
    turn1_length = first.sequences.shape[1]   # 17: 16 cached, the last output not yet
    hidden = [10, 11, 12, 13]
    mask2 = torch.ones_like(first.sequences)
    mask2[:, hidden] = 0
    second = model.generate(input_ids=first.sequences, attention_mask=mask2, output_logits=True, max_new_tokens=4,
                            **cache_kwargs(copy.deepcopy(getattr(first, CACHE_ARG))), **kwargs)
    total = second.sequences.shape[1]
    mask_all = torch.cat([mask2, torch.ones(1, total - turn1_length, dtype=mask2.dtype)], dim=1)
    turn2 = torch.arange(total)[:, None] >= turn1_length - 1   # queries of the second call
    query_masks = torch.where(turn2[None], mask_all[:, None, :], torch.ones(1, total, total, dtype=mask2.dtype))
    use_full = torch.arange(total)[None] < ids.shape[1]          # every prompt position: Full prefill
    positions = torch.where(turn2[:, 0][None], (mask_all.cumsum(-1) - 1).clamp(min=0), torch.arange(total)[None])
    expected = _per_query_local_logits(model.base_model, second.sequences, query_masks, use_full, sinks, window,
                                       positions)[:, turn1_length - 1:turn1_length + 3]
    assert (torch.stack(second.logits, dim=1) - expected).abs().max().item() < 2e-5
    mask2[:, -1] = 0   # the token turn 2 decodes from, hidden
    with pytest.raises(ValueError, match=r"Rows \[0\] continue from a token their attention_mask hides"):
        model.generate(input_ids=first.sequences, attention_mask=mask2, max_new_tokens=2,
                       **cache_kwargs(copy.deepcopy(getattr(first, CACHE_ARG))), **kwargs)
    model.set_routing(policy="full")   # no Local step: runs (always-Full equals stock; the audit measured 0.0)
    full = model.generate(input_ids=first.sequences, attention_mask=mask2, max_new_tokens=3,
                          **cache_kwargs(copy.deepcopy(getattr(first, CACHE_ARG))), **kwargs)
    assert full.sequences.shape[1] == turn1_length + 3
