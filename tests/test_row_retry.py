"""A Full retry runs on the rows that chose Full only (gather, recompute, scatter), with the results of the
whole-batch retry and of the independent reference."""

import pytest
import torch

from oda_hf import OdaConfig, OdaForCausalLM, RandomPolicy
from reference import replay_logits, step_logits_from_reference
from tiny_models import left_padded_prompts, tiny_model

NEW = 12
TOL = 2e-5


def decode(base, fraction, policy, ids, mask):
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=3, policy=policy))
    model.max_row_retry_fraction = fraction
    batches = []  # batch size of every decoder call
    handle = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(next(v for k, v in kwargs.items()
                                                         if k in ("input_ids", "inputs_embeds")).shape[0]),
        with_kwargs=True)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    finally:
        handle.remove()
    return out, model.routing, batches


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen3", {"num_key_value_heads": 1}), ("mistral", {}),
                                              ("gemma3", {}), ("gemma4", {})],
                         ids=["llama", "qwen3-gqa", "mistral", "gemma3-sliding", "gemma4-kv-shared"])
def test_row_retry_equals_whole_batch_retry_and_the_reference(family, overrides):
    base = tiny_model(family, **overrides)
    ids, mask = left_padded_prompts(4, 9, pads=(3, 0, 5, 1))
    policy = RandomPolicy(0.25, seed=5)
    rows_out, rows_routing, rows_batches = decode(base, 1.0, policy, ids, mask)
    whole_out, whole_routing, whole_batches = decode(base, 0.0, policy, ids, mask)
    # The per-row path really ran: Full retries of fewer rows than the batch; the whole-batch one never does.
    assert any(b < 4 for b in rows_batches) and set(whole_batches) == {4}
    assert torch.equal(rows_routing.decisions, whole_routing.decisions)
    assert torch.equal(rows_out.sequences, whole_out.sequences)
    got, whole = torch.stack(rows_out.logits, dim=1), torch.stack(whole_out.logits, dim=1)
    assert (got - whole).abs().max().item() < TOL
    reference = replay_logits(base, rows_out.sequences, mask, rows_routing.decisions, 2, 3)
    assert (got - step_logits_from_reference(reference, ids.shape[1], NEW)).abs().max().item() < TOL


def test_default_fraction_retries_few_rows_alone_and_many_in_place():
    base = tiny_model("qwen3")
    ids, mask = left_padded_prompts(4, 9, pads=(3, 0, 5, 1))
    out, routing, batches = decode(base, OdaForCausalLM.max_row_retry_fraction, RandomPolicy(0.4, seed=2), ids, mask)
    full_rows = (routing.decisions & ~routing.in_window).sum(dim=0).tolist()
    # Decoder calls: prefill, then per step Local (4 rows) and a retry of k rows (k <= 2) or of all 4 (k > 2).
    expected = [4]
    for k in full_rows:
        expected += [4] + ([k] if 0 < k <= 2 else [4] if k > 2 else [])
    assert batches == expected and any(k > 2 for k in full_rows) and any(0 < k <= 2 for k in full_rows)


def test_hybrids_keep_the_whole_batch_retry():
    # Gated DeltaNet state is updated in place by the model for the whole batch: no per-row retry there.
    base = tiny_model("qwen3_5")
    ids, mask = left_padded_prompts(4, 9, pads=(3, 0, 5, 1))
    out, routing, batches = decode(base, 1.0, RandomPolicy(0.25, seed=5), ids, mask)
    assert set(batches) == {4} and routing.decisions.any()
    reference = replay_logits(base, out.sequences, mask, routing.decisions, 2, 3)
    got = torch.stack(out.logits, dim=1)
    assert (got - step_logits_from_reference(reference, ids.shape[1], NEW)).abs().max().item() < TOL
