"""Steps whose history is within sinks + window: Local reads what Full reads, so no head, no retry, and the
record names them (``in_window``) and keeps both rates (past the window, and the paper's over all steps)."""

import pytest
import torch

from oda_hf import OdaConfig, OdaForCausalLM, RandomPolicy, RecallHead, RecallHeadConfig, SchedulePolicy
from oda_hf.engine import OdaStaticEngine
from oda_hf.routing import RoutingRecord
from reference import replay_logits, step_logits_from_reference
from tiny_models import left_padded_prompts, tiny_model

SINKS, WINDOW = 2, 4  # s + w = 6
TOL = 2e-5


def make(policy, family="qwen3"):
    base = tiny_model(family)
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    return OdaForCausalLM(base, head, OdaConfig(sinks=SINKS, window=WINDOW, policy=policy))


def generate(model, ids, mask, new):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def count_calls(module):
    calls = []
    module.register_forward_hook(lambda *args: calls.append(1))
    return calls


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_in_window_steps_skip_head_and_retry_and_match_the_reference(family):
    # One row, 3 prompt tokens: steps 1..3 have histories 4..6 <= s + w; from step 4 on they are past it.
    model = make(RandomPolicy(1.0, seed=0), family)  # wants Full on every step it decides
    ids, mask = left_padded_prompts(1, 3, pads=(0,))
    decoder_calls = count_calls(model.get_decoder())
    out = generate(model, ids, mask, new=9)
    routing = model.routing
    window = torch.tensor([[True, True, True, False, False, False, False, False]])
    assert torch.equal(routing.in_window, window)
    assert torch.equal(routing.decisions, ~window)  # in-window steps take Local
    # prefill + 3 Local-only steps + 5 steps of Local and Full
    assert len(decoder_calls) == 1 + 3 + 2 * 5
    reference = replay_logits(model.base_model, out.sequences, mask, routing.decisions, SINKS, WINDOW)
    expected = step_logits_from_reference(reference, ids.shape[1], 9)
    assert (torch.stack(out.logits, dim=1) - expected).abs().max().item() < TOL
    # Both rates, named: past the window (5 of 5) and the paper's over every routed step (5 of 8).
    assert routing.full_call_rate == 1.0
    assert routing.paper_full_call_rate == pytest.approx(5 / 8)
    assert routing.window_steps_per_row.tolist() == [3] and routing.decided_steps_per_row.tolist() == [5]
    assert "3 within sinks + window" in routing.summary()


def test_the_head_does_not_run_while_every_row_is_in_the_window():
    model = make("head")
    head_calls = count_calls(model.recall_head)
    ids, mask = left_padded_prompts(2, 4, pads=(2, 0))  # valid prompts of 2 and 4 tokens
    generate(model, ids, mask, new=8)
    routing = model.routing
    # Histories: row 0 3..9, row 1 5..11; row 1 is past s + w = 6 from step 3 on, row 0 from step 5 on.
    all_in = routing.in_window.all(dim=0)
    assert all_in.tolist() == [True, True, False, False, False, False, False]
    assert len(head_calls) == int((~all_in).sum())
    assert torch.isnan(routing.scores[:, all_in]).all()
    # Mixed steps: the head ran for both rows, but the row still in the window takes Local and decided nothing: its
    # score is NaN, as on every in-window step (and as vLLM records it)
    mixed = routing.in_window.any(dim=0) & ~all_in
    assert mixed.any() and torch.isfinite(routing.scores[~routing.in_window]).all()
    assert torch.isnan(routing.scores[routing.in_window]).all()
    assert not routing.decisions[routing.in_window].any()


def test_always_full_still_equals_stock_generate_and_counts_full_in_the_window():
    model = make("full")
    ids, mask = left_padded_prompts(2, 4, pads=(2, 0))
    out = generate(model, ids, mask, new=8)
    stock = model.base_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, stock)
    routing = model.routing
    assert routing.decisions.all() and routing.in_window.any()
    assert routing.full_call_rate == 1.0 and routing.paper_full_call_rate == 1.0


def test_in_window_steps_consume_their_random_draw():
    # Draw i belongs to step i whether or not the step was in the window (as the engine's precomputed table).
    policy = RandomPolicy(0.5, seed=7)
    model = make(policy)
    ids, mask = left_padded_prompts(2, 3, pads=(0, 0))
    generate(model, ids, mask, new=10)
    generator = torch.Generator().manual_seed(7)
    draws = torch.stack([torch.rand(2, generator=generator) < 0.5 for _ in range(9)], dim=1)
    routing = model.routing
    assert routing.in_window[:, :3].all() and not routing.in_window[:, 3:].any()
    assert torch.equal(routing.decisions, draws & ~routing.in_window)


@pytest.mark.parametrize("policy", ["head", "full", SchedulePolicy(1, 2), RandomPolicy(0.6, seed=3)],
                         ids=["head", "full", "schedule", "random"])
def test_engine_matches_hf_path_across_the_window(policy):
    model = make(policy)
    ids, mask = left_padded_prompts(2, 5, pads=(3, 0))  # rows enter past-window steps at different steps
    reference = generate(model, ids, mask, new=10)
    hf = model.routing
    engine = OdaStaticEngine(model, max_length=15, batch_size=2, bucket_size=8)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(reference.sequences, got.sequences)
    assert torch.equal(hf.in_window, engine.routing.in_window) and hf.in_window.any() and not hf.in_window.all()
    assert torch.equal(hf.decisions, engine.routing.decisions)
    assert torch.allclose(hf.scores, engine.routing.scores, atol=1e-5, equal_nan=True)


def _engine_and_hf_path(model, new=10):
    ids, mask = left_padded_prompts(2, 5, pads=(3, 0))
    reference, hf = generate(model, ids, mask, new=new), model.routing
    engine = OdaStaticEngine(model, max_length=5 + new, batch_size=2, bucket_size=8)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return reference, hf, got, engine.routing


def test_engine_reads_the_routing_threshold():
    """Every engine test ran at the default threshold 0: an engine that filled its threshold with 0 whatever was
    asked passed them all (a mutation audit). At a threshold inside the scores' range both paths split alike."""
    model = make("head")
    _, first, _, _ = _engine_and_hf_path(model)
    decided = first.scores[~first.in_window]
    threshold = float(decided.median())
    model.set_routing(threshold=threshold)
    reference, hf, got, engine = _engine_and_hf_path(model)
    assert torch.equal(reference.sequences, got.sequences) and torch.equal(hf.decisions, engine.decisions)
    asked = hf.decisions[~hf.in_window]
    assert asked.any() and not asked.all() and not torch.equal(asked, decided > 0)   # not threshold 0's split


def test_a_score_equal_to_the_threshold_stays_local_on_every_path():
    """The rule is score > threshold: a head scoring exactly the threshold routes Local on the HF path, the engine and
    the vLLM plugin (`head_asks`); a non-finite score goes Full. No test held a tie (a mutation audit: `>=` passed)."""
    from oda_hf.policies import head_asks

    model = make("head")
    with torch.no_grad():
        model.recall_head.score.weight.zero_()
        model.recall_head.score.bias.fill_(0.5)
    for threshold, full in ((0.5, False), (float(torch.nextafter(torch.tensor(0.5), torch.tensor(0.0))), True)):
        model.set_routing(threshold=threshold)
        reference, hf, got, engine = _engine_and_hf_path(model)
        assert torch.equal(reference.sequences, got.sequences) and torch.equal(hf.decisions, engine.decisions)
        assert (hf.decisions[~hf.in_window] == full).all() and (hf.scores[~hf.in_window] == 0.5).all()
    scores = torch.tensor([0.5, 0.25, 0.75, float("nan"), float("inf"), -float("inf")])
    assert head_asks(scores, 0.5).tolist() == [False, False, True, True, True, True]
    assert head_asks(scores, torch.full((6,), 0.5)).tolist() == [False, False, True, True, True, True]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_head_reads_the_selected_state_the_token_and_the_local_state(family):
    """Scores recomputed from the masked reference's hidden states: the head reads the previous step's state of the
    pass it kept (Full after a recall, else Local), the current token's embedding and this step's Local state. A
    mutation audit found either state taken from the wrong pass caught only by comparing the engine with the HF
    path."""
    model = make(SchedulePolicy(1, 2, run_head=True), family)   # Full and Local steps follow each other
    prompt = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    out = generate(model, prompt, torch.ones_like(prompt), new=10)
    routing, sequence, length = model.routing, out.sequences, prompt.shape[1]
    decisions = routing.decisions
    assert decisions[0, ~routing.in_window[0]].any() and not decisions[0, ~routing.in_window[0]].all()

    def states(upto, kept):   # final hidden states of columns 0..upto with the steps' kept passes `kept`
        return replay_logits(model.base_model, sequence[:, :upto + 1], torch.ones_like(prompt), kept, SINKS, WINDOW,
                             hidden=True)[0]

    checked = 0
    for step in range(decisions.shape[1]):
        if routing.in_window[0, step]:
            continue
        column = length + step   # the token this step feeds
        local = states(column, torch.cat([decisions[:, :step], torch.zeros(1, 1, dtype=torch.bool)], 1))[column]
        selected = states(column - 1, decisions[:, :step])[column - 1]   # the prompt's last column: Full
        embedding = model.base_model.get_input_embeddings()(sequence[:, column])[0]
        with torch.no_grad():
            expected = model.recall_head(selected[None], embedding[None], local[None])
        torch.testing.assert_close(routing.scores[0, step], expected.reshape(()), atol=TOL, rtol=TOL)
        checked += 1
    assert checked >= 6


def test_records_without_window_flags_count_every_step_as_decided():
    routing = RoutingRecord(1)
    for decision in (True, False, False, True):
        routing.record(torch.tensor([decision]), None)
    assert routing.window_steps_per_row.tolist() == [0]
    assert routing.full_call_rate == routing.paper_full_call_rate == 0.5
