"""Everyday transformers idioms on an `OdaForCausalLM`: casting the wrapper, multi-turn cache reuse."""

import copy

import pytest
import torch

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
