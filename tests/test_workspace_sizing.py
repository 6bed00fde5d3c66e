"""The Local workspace is sized by what a request can reach, never by s + w alone, with unchanged results."""

from __future__ import annotations

import time

import pytest
import torch

from oda_hf.compat import cache_kwargs
from oda_hf import OdaConfig, OdaForCausalLM, RandomPolicy, RecallHead, RecallHeadConfig
from oda_hf.cache import workspace_geometry
from oda_hf.engine import OdaStaticEngine
from reference import replay_logits, step_logits_from_reference
from tiny_models import left_padded_prompts, tiny_model

TOL = 2e-5
GEN = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def capture_caches(model):
    """Record every OdaCache generate() creates."""
    caches, make = [], model.new_cache

    def new_cache(*args, **kwargs):
        caches.append(make(*args, **kwargs))
        return caches[-1]

    model.new_cache = new_cache
    return caches


def test_huge_window_on_a_short_prompt_allocates_by_the_request():
    base = tiny_model("qwen3")
    model = OdaForCausalLM(base, oda_config=OdaConfig(sinks=4, window=10**7, policy="local"))
    caches = capture_caches(model)
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    layer = caches[0].global_layers[0]
    assert layer.workspace_width == 30 + 5  # generate's maximum cache length (34) + the current slot
    assert elapsed < 5  # s + w slots took about 25 s and 5 GB on a 135M model
    # A window covering the whole request reads what Full reads: the stock model's tokens.
    assert torch.equal(out, base.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("sinks,window,prompt", [(2, 12, 5), (0, 9, 3), (7, 3, 4), (3, 40, 9)])
def test_growing_workspace_matches_the_reference(sinks, window, prompt):
    """A cache without a known length starts narrow and widens up to s + w (then wraps as before)."""
    base = tiny_model("llama")
    torch.manual_seed(0)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=sinks, window=window, policy=RandomPolicy(0.3, seed=43)))
    ids, mask = left_padded_prompts(2, prompt, pads=[2, 0])
    cache = model.new_cache()  # no max length: grows
    new_tokens = 30
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, **cache_kwargs(cache), **GEN)
    ref = replay_logits(base, out.sequences, mask, model.routing.decisions, sinks, window)
    ref = step_logits_from_reference(ref, prompt, new_tokens)
    assert (ref - torch.stack(out.logits, dim=1)).abs().max().item() < TOL
    # committed positions (prompt + new_tokens - 1) plus the current slot, never more than s + w
    assert min(sinks + window, prompt + new_tokens) <= cache.global_layers[0].workspace_width <= sinks + window


def test_known_length_below_the_window_matches_the_reference():
    base = tiny_model("qwen3")
    torch.manual_seed(0)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=2, window=512, policy=RandomPolicy(0.5, seed=1)))
    caches = capture_caches(model)
    ids, mask = left_padded_prompts(2, 9, pads=[3, 0])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, **GEN)
    assert caches[0].global_layers[0].workspace_width == 9 + 14
    ref = replay_logits(base, out.sequences, mask, model.routing.decisions, 2, 512)
    assert (step_logits_from_reference(ref, 9, 14) - torch.stack(out.logits, dim=1)).abs().max().item() < TOL


def test_workspace_geometry_keeps_every_access_set():
    """Below `max_positions`, the reduced (s, w) reads exactly the positions (s, w) reads."""
    def access(sinks, window, t):  # 1-based key positions a Local query at 1-based position t reads
        return {k for k in range(1, t + 1) if k <= sinks or k >= t - window + 1}

    for sinks in range(0, 7):
        for window in range(1, 9):
            for max_positions in range(1, 14):
                ws_sinks, ws_window = workspace_geometry(sinks, window, max_positions)
                assert ws_sinks + ws_window <= min(sinks + window, max_positions + 1)
                for t in range(1, max_positions + 1):
                    assert access(ws_sinks, ws_window, t) == access(sinks, window, t), (sinks, window, max_positions, t)


def test_static_engine_sizes_its_ring_by_capacity_and_matches_the_hf_path():
    base = tiny_model("qwen3")
    torch.manual_seed(0)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=4, window=10**7, policy=RandomPolicy(0.4, seed=42)))
    ids, mask = left_padded_prompts()
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **GEN)
    reference_decisions = model.routing.decisions.clone()
    engine = OdaStaticEngine(model, max_length=21, batch_size=2, bucket_size=8)
    assert engine.state.ws_keys.shape[3] <= engine.capacity + 1
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
    assert torch.equal(reference.sequences, got.sequences)
    assert torch.equal(reference_decisions, engine.routing.decisions)
