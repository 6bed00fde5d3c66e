"""Exact ODA on the static engine (`generate(..., oda_mode="exact", oda_fast=True)`): the same output as stock
`generate()` and as exact mode on the Transformers path, with the same drafts, verifications and counts.
(GQA layouts, padded batches, EOS and caps inside a draft: test_exact.py runs them on both backends.)"""

import math

import pytest
import torch

from oda_hf.engine import FastPathUnsupported, OdaStaticEngine
from oda_hf.kernels import kernels_interpreted
from test_exact import DRAFT_SETTINGS, SINKS, WINDOW, exact, exact_model, stock

pytestmark = pytest.mark.usefixtures("one_thread")
ENGINE_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


def both_paths(model, ids, **kwargs):
    """Exact decoding on the Transformers path and on the engine: (outputs, records)."""
    hf = exact(model, ids, **kwargs)
    hf_record = model.routing
    fast = exact(model, ids, oda_fast=True, **kwargs)
    return (hf, fast), (hf_record, model.routing)


def assert_same_records(hf_record, fast_record):
    for name in hf_record.COUNTS:
        assert getattr(fast_record, name) == getattr(hf_record, name), name


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
@pytest.mark.parametrize("max_draft,threshold", DRAFT_SETTINGS)
def test_engine_greedy_equals_stock_and_the_transformers_path(family, max_draft, threshold):
    model = exact_model(family)
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(2))
    (hf, fast), records = both_paths(model, ids, max_new_tokens=24, max_draft=max_draft, verify_threshold=threshold)
    assert torch.equal(fast, stock(model, ids, max_new_tokens=24)) and torch.equal(fast, hf)
    assert_same_records(*records)
    assert records[1].total("full_passes") >= 1


@pytest.mark.parametrize("prompt_length", [1, SINKS, WINDOW - 2, WINDOW, SINKS + WINDOW - 1, SINKS + WINDOW,
                                           SINKS + WINDOW + 1, 3 * WINDOW + 1])
def test_engine_window_boundaries_and_ring_wrap(prompt_length):
    """Drafts rejected after the ring wrapped must give back the ring slots they overwrote."""
    model = exact_model("qwen3")
    ids = torch.randint(3, 90, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    reference = stock(model, ids, max_new_tokens=20)
    for max_draft, threshold in DRAFT_SETTINGS + [(WINDOW + 3, math.inf)]:
        (hf, fast), records = both_paths(model, ids, max_new_tokens=20, max_draft=max_draft,
                                         verify_threshold=threshold)
        assert torch.equal(fast, reference) and torch.equal(hf, reference)
        assert_same_records(*records)


def test_engine_sampling_follows_the_transformers_path():
    """Same seed, same draws: the engine's drafts and verifications give the Transformers path's samples
    (whose distribution test_exact.py checks against Full's)."""
    model = exact_model("qwen3")
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(9))
    for seed in range(4):
        outputs = []
        for fast in (False, True):
            torch.manual_seed(seed)
            outputs.append(model.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.7, top_k=0,
                                          pad_token_id=0, oda_mode="exact", max_draft=3, oda_fast=fast))
        assert torch.equal(*outputs)


@pytest.mark.parametrize("kernels,graph_mode", [("reference", "emulate"), ("sdpa", "emulate"),
                                                pytest.param("triton", "eager", marks=pytest.mark.skipif(
                                                    not kernels_interpreted(), reason="needs TRITON_INTERPRET=1"))])
def test_engine_backends_and_graph_replay(kernels, graph_mode):
    """Local kernels and the captured draft graph (emulated on CPU: the same bookkeeping as CUDA capture)."""
    model = exact_model("llama")
    ids = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(8))  # starts within s + w
    engine = OdaStaticEngine(model, max_length=64, kernels=kernels, graph_mode=graph_mode)
    model.__dict__["_oda_static_engine"] = engine  # generate() reuses an engine that fits
    out = exact(model, ids, max_new_tokens=20, max_draft=3, verify_threshold=0.0, oda_fast=True)
    assert model.__dict__["_oda_static_engine"] is engine
    assert torch.equal(out, stock(model, ids, max_new_tokens=20))
    if graph_mode == "emulate":  # one draft graph per head setting (within the window the head does not run)
        assert set(key.plan.run_head for key in engine.graphs.captures) == {True, False}
        assert sum(engine.graphs.replays.values()) == model.routing.total("drafted") + model.routing.total(
            "head_verifications")


def test_engine_exact_then_routed_request_on_the_same_engine():
    """An exact request leaves nothing behind: the next routed request on the same engine equals a fresh one."""
    model = exact_model("qwen3")
    ids = torch.randint(3, 90, (1, 26), generator=torch.Generator().manual_seed(10))
    exact(model, ids, max_new_tokens=12, max_draft=4, oda_fast=True)
    after = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, oda_fast=True)
    routing_after = model.routing
    model.__dict__.pop("_oda_static_engine").release()
    fresh = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, oda_fast=True)
    assert torch.equal(after, fresh) and torch.equal(routing_after.decisions, model.routing.decisions)


def test_engine_exact_refusals():
    hybrid = exact_model("qwen3_5")  # recurrent layers: the HF path only
    with pytest.raises(FastPathUnsupported, match="not supported by the fast path"):
        exact(hybrid, torch.randint(3, 90, (1, 12)), max_new_tokens=4, oda_fast=True)
    model = exact_model("qwen3")
    model.generate(torch.randint(3, 90, (2, 12)), max_new_tokens=4, do_sample=False, pad_token_id=0, oda_fast=True)
    engine = model.__dict__["_oda_static_engine"]
    with pytest.raises(ValueError, match="one row at a time"):
        engine.draft_step(5, run_head=True)
    with pytest.raises(ValueError, match=r"keep a verified position"):
        single = OdaStaticEngine(model, max_length=32)
        single.prefill(torch.randint(3, 90, (1, 12)))
        single.keep_verified(12, torch.zeros(model.config.hidden_size))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])  # the draft step holds no branch: graphs on any torch
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_exact_on_gpu_equals_stock(family, graphs):
    """On a GPU the engine runs the compiled Triton kernels and (with graphs) replays its draft step as a CUDA graph."""
    model = exact_model(family).cuda()
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(11)).cuda()
    reference = stock(model, ids, max_new_tokens=24)
    engine = OdaStaticEngine(model, max_length=80, graph_mode="cuda" if graphs else "eager")
    model.__dict__["_oda_static_engine"] = engine  # generate() reuses an engine that fits
    for max_draft, threshold in DRAFT_SETTINGS:
        out = exact(model, ids, max_new_tokens=24, max_draft=max_draft, verify_threshold=threshold, oda_fast=True)
        assert model.__dict__["_oda_static_engine"] is engine and engine.kernels == "triton"
        assert torch.equal(out, reference), (max_draft, threshold)
        if graphs:
            assert sum(engine.graphs.replays.values()) >= model.routing.total("drafted")
