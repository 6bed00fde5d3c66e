"""User-facing API: loading, routing statistics, and clear errors for what ODA does not do."""

import logging
import pytest
import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

from oda_hf.compat import cache_kwargs
from oda_hf import OdaCache, OdaConfig, OdaForCausalLM, RandomPolicy, SchedulePolicy
from tiny_models import tiny_model


def test_from_pretrained_local_path_with_routing_kwargs(tmp_path):
    tiny_model("gemma3").save_pretrained(tmp_path)
    model = OdaForCausalLM.from_pretrained(str(tmp_path), sinks=2, window=8, policy=SchedulePolicy(1, 4),
                                           dtype=torch.bfloat16)
    assert (model.oda_config.sinks, model.oda_config.window) == (2, 8)
    assert model.dtype == torch.bfloat16 and model.architecture.family == "Gemma3"
    out = model.generate(input_ids=torch.randint(3, 97, (1, 12)), max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 21)
    assert model.routing.decisions[0].tolist() == [True, False, False, False, True, False, False, False]
    assert model.routing.full_call_rate == 0.25


@pytest.mark.parametrize("bad,match", [
    (dict(sinks=-1), "sinks"), (dict(window=0), "window"), (dict(window=2.5), "window"),
    (dict(threshold=float("nan")), "threshold"), (dict(policy="sometimes"), "Unknown routing policy"),
])
def test_invalid_routing_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        OdaConfig(**bad)


def test_invalid_policy_parameters():
    with pytest.raises(ValueError, match="probability"):
        RandomPolicy(1.5)
    with pytest.raises(ValueError, match="period"):
        SchedulePolicy(5, 4)


def test_head_policy_without_head_is_an_error():
    with pytest.raises(ValueError, match="needs a recall head"):
        OdaForCausalLM(tiny_model("qwen3"), None, OdaConfig())


def test_unsupported_models_fail_clearly():
    sliding_only = transformers.MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    with pytest.raises(ValueError, match="no full-attention layer"):
        OdaForCausalLM(transformers.MistralForCausalLM(sliding_only), oda_config=OdaConfig(policy="local"))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=97, d_model=32, d_ff=48,
                                                                       num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(ValueError, match="encoder-decoder|decoder-only"):
        OdaForCausalLM(t5, oda_config=OdaConfig(policy="local"))
    flash = tiny_model("qwen3")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        OdaForCausalLM(flash, oda_config=OdaConfig(policy="local"))


def test_untested_but_compatible_architecture_warns(caplog):
    config = transformers.OlmoConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    base = transformers.OlmoForCausalLM(config).eval()
    with caplog.at_level("WARNING"):
        model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy="full"))
    assert "not among oda_hf's tested architectures" in caplog.text
    ids = torch.randint(3, 97, (1, 9))
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0),
                       base.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0))


def test_unsupported_generation_modes_fail_clearly():
    model = OdaForCausalLM(tiny_model("qwen3"), oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 97, (1, 9))
    with pytest.raises(ValueError, match="not supported"):
        model.generate(input_ids=ids, max_new_tokens=4, assistant_model=tiny_model("qwen3"))
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(input_ids=ids, max_new_tokens=4, use_cache=False)
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(input_ids=ids, max_new_tokens=4, cache_implementation="static")
    with pytest.raises(TypeError, match="OdaCache"):
        model.generate(input_ids=ids, max_new_tokens=4, **cache_kwargs(transformers.DynamicCache()))
    # Found by an audit: transformers' continuous batching ran without ODA (paged: the prompt back with no new token,
    # exit 0; generate_batch: every request failed), and classifier-free guidance's unconditional pass shared the
    # call's routing state (a schedule of every second step ran Full on every step while recording half)
    with pytest.raises(ValueError, match="cache_implementation='paged'.*through vLLM"):
        model.generate(input_ids=ids, max_new_tokens=4, cache_implementation="paged")
    for entry in ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager"):
        with pytest.raises(NotImplementedError, match="continuous batching runs its own paged cache"):
            getattr(model, entry)([[5, 6, 7]])
    with pytest.raises(ValueError, match="guidance_scale=1.5 .classifier-free guidance. is not supported"):
        model.generate(input_ids=ids, max_new_tokens=4, guidance_scale=1.5)
    assert model.generate(input_ids=ids, max_new_tokens=2, guidance_scale=1.0, do_sample=False).shape == (1, 11)


def test_generate_calls_on_one_model_run_one_at_a_time():
    """Found by an audit: two threads' generate() calls shared the running request's routing state (a schedule policy
    ran other steps Full: every threaded output differed from the same call alone, exit 0). A second thread's call now
    waits for the running one; a call from inside the running one is refused (it would replace its state)."""
    import threading

    model = OdaForCausalLM(tiny_model("llama"), oda_config=OdaConfig(sinks=2, window=4, policy=SchedulePolicy(1, 3)))
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    alone = model.generate(**kwargs)
    events, outputs, errors = [], {}, []

    def second():
        outputs["second"] = model.generate(**kwargs)
        events.append("second ended")

    worker = threading.Thread(target=second)

    class StartsASecondCall(StoppingCriteria):   # runs inside the first call's decode loop
        def __call__(self, input_ids, scores, **_):
            if not worker.is_alive() and "second ended" not in events:
                worker.start()
                worker.join(timeout=0.5)   # it waits for this call instead of running beside it
                events.append("first still running")
            try:
                if not errors:
                    model.generate(**kwargs)   # nested, in the same thread
            except RuntimeError as err:
                errors.append(err)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    first = model.generate(**kwargs, stopping_criteria=StoppingCriteriaList([StartsASecondCall()]))
    worker.join()
    assert events[0] == "first still running" and events[-1] == "second ended"
    assert torch.equal(first, alone) and torch.equal(outputs["second"], alone)
    assert "from inside a generate() call on it" in str(errors[0])

def test_routing_excludes_prefill_output_and_rows_after_eos():
    base = tiny_model("qwen3")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy=SchedulePolicy(1, 2)))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    free = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert model.routing.decisions.shape == (2, 9) and model.routing.steps_per_row.tolist() == [9, 9]
    generated = free[:, 9:]
    eos = int(generated[0, 3])  # row 0 emits this at output index 3 (maybe earlier too)
    first = [int((row == eos).nonzero()[0]) if (row == eos).any() else None for row in generated]
    out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos)
    steps = model.routing.steps_per_row.tolist()
    assert steps[0] == first[0]  # routed steps 1..j produced outputs 1..j; later ones are padding
    assert steps[1] == (first[1] if first[1] is not None else out.shape[1] - 9 - 1)
    expected_full = sum(sum(1 for k in range(1, n + 1) if (k - 1) % 2 == 0) for n in steps)
    assert int(model.routing.full_calls_per_row.sum()) == expected_full
    assert model.routing.full_call_rate == expected_full / sum(steps)


class StopRowZeroAt(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[0] = input_ids.shape[1] >= self.length
        return done


def test_custom_stopping_criteria_finish_rows():
    model = OdaForCausalLM(tiny_model("qwen3"), oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 97, (2, 9))
    model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0,
                   stopping_criteria=StoppingCriteriaList([StopRowZeroAt(9 + 4)]))
    assert model.routing.steps_per_row.tolist() == [3, 9]


def test_user_stopping_criteria_behave_as_in_stock_generate():
    """A user's EosTokenCriteria pads finished rows, and a user's MaxLengthCriteria replaces the built-in one, as
    in stock generate(); the rows' routed steps stop where they did (ODA once wrapped the user's criteria before
    transformers merged them, which hid both)."""
    from transformers import EosTokenCriteria, MaxLengthCriteria

    base = tiny_model("qwen3")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy="full"))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    free = base.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = int(free[0, 9 + 3])
    for criteria in ([EosTokenCriteria(eos_token_id=eos)], [MaxLengthCriteria(max_length=9 + 6)]):
        kwargs = dict(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0,
                      stopping_criteria=StoppingCriteriaList(criteria))
        stock = base.generate(**kwargs)
        assert torch.equal(model.generate(**kwargs), stock)
    stock = base.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos_token_id=eos)]))
    first = [int((row == eos).nonzero()[0]) if (row == eos).any() else 9 for row in stock[:, 9:]]
    model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0,
                   stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos_token_id=eos)]))
    assert model.routing.steps_per_row.tolist() == first


def test_rows_after_the_generation_configs_eos_are_not_routed_steps():
    """EOS from the model's generation config under a user config that leaves it unset, or from a config passed
    positionally: rows after it are padding, not routed steps."""
    from transformers import GenerationConfig

    model = OdaForCausalLM(tiny_model("qwen3"), oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    free = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = int(free[0, 9 + 3])
    first = [int((row == eos).nonzero()[0]) if (row == eos).any() else 9 for row in free[:, 9:]]
    model.generation_config.eos_token_id = eos
    for call in (lambda: model.generate(ids, GenerationConfig(max_new_tokens=10, pad_token_id=0)),
                 lambda: model.generate(input_ids=ids, generation_config=GenerationConfig(max_new_tokens=10,
                                                                                          pad_token_id=0))):
        call()
        assert model.routing.steps_per_row.tolist() == first
    # The call's own EOS, passed positionally, wins over the model's: the model's was taken, and the rows counted
    # as stopped at a token that did not stop them.
    model.generate(ids, GenerationConfig(max_new_tokens=10, pad_token_id=0, eos_token_id=97 + 5))
    assert model.routing.steps_per_row.tolist() == [9, 9]


def test_manual_decode_loop_with_forward():
    """forward() is usable without generate(): prefill, then one routed step per call."""
    base = tiny_model("qwen3_5")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 97, (1, 8))
    cache = model.new_cache()
    assert isinstance(cache, OdaCache)
    out = model(input_ids=ids, past_key_values=cache)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(5):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    assert cache.get_seq_length() == 8 + 5 and model.routing.routed_steps == 5
    reference = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert reference[0, 8:].tolist() == tokens


def test_the_stock_manual_decoding_idiom_continues_from_the_returned_cache():
    """``out = model(ids)`` then ``model(next, past_key_values=out.past_key_values)`` (transformers' manual loop, no
    use_cache given): the first call returned no cache (use_cache None was read as False), so each later step decoded
    one token without history (exit 0). It now returns an OdaCache, as stock models return theirs."""
    base = tiny_model("llama")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 97, (1, 8), generator=torch.Generator().manual_seed(2))
    out = model(ids)
    assert isinstance(out.past_key_values, OdaCache)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(5):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values)
        tokens.append(int(out.logits[0, -1].argmax()))
    assert model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 8:].tolist() == tokens


def test_labels_give_the_base_models_loss_with_or_without_a_cache():
    """labels with a cache were dropped (loss None, exit 0): the prefill's loss is the base's (Full)."""
    base = tiny_model("llama")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(4))
    expected = base(input_ids=ids, labels=ids).loss
    for extra in ({}, {"use_cache": False}, {"use_cache": True}, {"cache": model.new_cache()}):
        torch.testing.assert_close(model(input_ids=ids, labels=ids, **extra).loss, expected)
    # (HF Trainer's gradient accumulation passes num_items_in_batch to the loss: it was dropped with a cache)
    accumulated = base(input_ids=ids, labels=ids, num_items_in_batch=5).loss
    torch.testing.assert_close(model(input_ids=ids, labels=ids, num_items_in_batch=5).loss, accumulated)


def test_a_cache_filled_under_inference_mode_continues_only_under_it():
    """Its in-place writes failed with torch's own error outside inference mode; now a message names the fix."""
    model = OdaForCausalLM(tiny_model("llama"), oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 97, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        out = model(ids)
    with pytest.raises(RuntimeError, match="filled under torch.inference_mode.*continue inside"):
        model(ids[:, :1], past_key_values=out.past_key_values)
    with torch.inference_mode():
        assert model(ids[:, :1], past_key_values=out.past_key_values).logits.shape == (1, 1, 97)


def test_no_cache_forward_is_plain_full():
    base = tiny_model("llama")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 97, (2, 10))
    assert torch.equal(model(input_ids=ids, use_cache=False).logits, base(input_ids=ids).logits)


def test_batch_select_indices_keeps_rows_aligned():
    """Dropping rows from the cache mid-request keeps each remaining row's history and hidden state."""
    base = tiny_model("gemma3")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy=SchedulePolicy(1, 2)))
    ids = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(2))

    def decode(cache, first_logits, steps, rows):
        tokens = [first_logits[:, -1].argmax(-1)]
        for _ in range(steps):
            out = model(input_ids=tokens[-1][:, None], past_key_values=cache)
            tokens.append(out.logits[:, -1].argmax(-1))
        return torch.stack(tokens, 1)

    cache = model.new_cache()
    first = model(input_ids=ids, past_key_values=cache).logits
    decode(cache, first, 3, None)
    full_run = decode(cache, model(input_ids=torch.zeros(3, 1, dtype=torch.long) + 5, past_key_values=cache).logits,
                      4, None)
    cache2 = model.new_cache()
    first = model(input_ids=ids, past_key_values=cache2).logits
    decode(cache2, first, 3, None)
    cache2.batch_select_indices(torch.tensor([0, 2]))
    model.routing.batch_size = 2  # the caller owns the request's row bookkeeping when it drops rows
    part = decode(cache2, model(input_ids=torch.zeros(2, 1, dtype=torch.long) + 5, past_key_values=cache2).logits,
                  4, None)
    assert torch.equal(part, full_run[[0, 2]])


def test_generate_preallocates_once_and_matches_a_growing_cache():
    base = tiny_model("qwen3")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy=SchedulePolicy(1, 3)))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(max_cache_len=9 + 12)
    out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0, **cache_kwargs(cache))
    layer = cache.global_layers[0]
    assert layer.keys.shape[2] == 21 and cache.get_seq_length() == 9 + 11
    pointer = layer.keys.data_ptr()
    model(input_ids=out[:, -1:], past_key_values=cache)  # one more step still fits: no reallocation
    assert layer.keys.data_ptr() == pointer

    growing = model.new_cache()  # starts empty and doubles
    manual = [model(input_ids=ids, past_key_values=growing).logits[:, -1].argmax(-1)]
    for _ in range(11):
        manual.append(model(input_ids=manual[-1][:, None], past_key_values=growing).logits[:, -1].argmax(-1))
    assert torch.equal(torch.stack(manual, 1), out[:, 9:])
    assert growing.global_layers[0].keys.shape[2] >= 20


def test_load_history_from_a_stock_prefill_continues_like_generate():
    """ODA can start from KV computed by the stock model (here a DynamicCache prefill)."""
    base = tiny_model("gemma3")  # layer 0 is a sliding layer whose stock KV is truncated to its window
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy=SchedulePolicy(1, 3)))
    ids = torch.randint(3, 97, (1, 11), generator=torch.Generator().manual_seed(6))
    expected = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    stock_cache = transformers.DynamicCache(config=base.config)
    with torch.no_grad():
        prefill = base.model(input_ids=ids, **cache_kwargs(stock_cache), use_cache=True)
    cache = model.new_cache()
    cache.load_history([(layer.keys, layer.values) for layer in stock_cache.layers])
    assert cache.get_seq_length() == 11 and [l.get_seq_length() for l in cache.layers] == [11] * 4
    model.begin_request(cache, prefill.last_hidden_state[:, -1])
    logits = [model.lm_logits(prefill.last_hidden_state[:, -1])]
    for _ in range(7):
        logits.append(model(input_ids=logits[-1].argmax(-1)[:, None], past_key_values=cache).logits[:, -1])
    assert torch.allclose(torch.stack(logits, 1), torch.stack(expected.logits, 1), atol=1e-5)
    assert model.routing.decisions[0].tolist() == [True, False, False, True, False, False, True]
    with pytest.raises(ValueError, match="Recurrent-state layers"):
        OdaForCausalLM(tiny_model("qwen3_5"), oda_config=OdaConfig(policy="local")).new_cache().load_history([None] * 4)


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_untested_architecture_whose_logits_are_scaled_is_refused(family):
    """Granite divides its logits by logits_scaling and Cohere multiplies them by logit_scale; ODA computes logits as
    lm_head(hidden), so exact mode sampled from other probabilities (measured: total variation 0.18 / 0.21 from
    Full's first-token distribution) while greedy tokens and always-Full still equalled stock."""
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0)
    if family == "granite":
        base = transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=8.0)).eval()
    else:
        base = transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.0625)).eval()
    with pytest.raises(ValueError, match="otherwise than lm_head.*(logits_scaling|logit_scale)"):
        OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy="full"))


def test_untested_architecture_without_final_hidden_states_is_refused(caplog):
    """Llama 4's get_decoder() is the whole model, which returns logits: construction said "ODA will run" and then
    failed with an AttributeError about `last_hidden_state`."""
    config = transformers.Llama4TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, intermediate_size_mlp=48, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_hidden_layers=4, pad_token_id=0, attention_chunk_size=6,
        num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2)
    config._attn_implementation = "sdpa"
    base = transformers.Llama4ForCausalLM(config).eval()
    with caplog.at_level(logging.WARNING), \
            pytest.raises(ValueError, match="'llama4_text': its get_decoder\\(\\) does not return the final hidden"):
        OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy="full"))
    assert "ODA will run" not in caplog.text


def test_rows_stopped_at_eos_run_no_full_pass():
    """generate() pads a row after its EOS, so ODA runs no Full pass for it (a recall there would be a whole retry
    spent on padding); the rows still decoding are untouched: with Full on every decided step they equal stock."""
    base = tiny_model("qwen3")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=2, window=4, policy=SchedulePolicy(1, 1)))
    ids = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(5))
    free = base.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = int(free[0, 9 + 2])
    stock = base.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)
    out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(out, stock)
    finished_at = model.routing.finished_at.tolist()
    assert finished_at[0] == 2 and out.shape[1] > 9 + 4   # row 0 stops early, another row decodes on
    raw = torch.stack(model.routing._decisions)           # [routed steps, rows], steps after a stop included
    for row, stop in enumerate(finished_at):
        taken = raw[:, row] if stop < 0 else raw[:stop, row]
        assert bool(taken.all())                           # Full on every step while the row decodes
        if stop >= 0:
            assert not bool(raw[stop:, row].any())         # none after it
