"""ODA inside vLLM (CPU build) on Llama-style models (Llama, Qwen2, Qwen3), against stock vLLM and against oda_hf's
Transformers path: window edges, GQA ratios, every routing policy, sampling, bad requests, prefix caching,
preemption, chunked prefill, LoRA, the OpenAI-compatible server. The hybrids (Gemma 3, Qwen3.5) are in
`test_vllm_hybrids.py`; what both files share is `vllm_harness.py`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess

import pytest
import torch
import transformers

from oda_hf import BudgetPolicy, OdaForCausalLM, RandomPolicy, SchedulePolicy
from vllm_harness import (EAGER, EDGE_LENGTHS, PREEMPT_PROMPTS, REPO, SAMPLING, SINKS, SPAN, VLLM_PYTHON, WINDOW,
                          build_model, check_preempted_equals_unpressed, extension, hf_generate, preemption_batches,
                          prompt, request, run_vllm)


@pytest.fixture(scope="module")
def gqa3(tmp_path_factory):
    """Heads 6 / KV heads 2: one stock engine and one ODA engine, each serving every batch below once."""
    tmp = tmp_path_factory.mktemp("vllm_gqa3")
    folder = str(tmp / "model")
    model = build_model(folder, heads=6, kv_heads=2)
    head = os.path.join(folder, "head")
    long = [prompt(n, seed=n) for n in EDGE_LENGTHS]
    batches = {
        "full": [request(ids, policy="full", logprobs=1) for ids in long],
        "local": [request(ids, policy="local") for ids in long],
        "head": [request(ids, policy="head", threshold=0.0) for ids in long],
        "random": [request(long[5], policy="random:0.4:7"), request(long[6], policy="random:0.3")],
        "schedule": [request(long[5], policy="schedule:2:4"), request(long[6], policy="schedule:1:3")],
        "budget": [request(ids, policy="budget:0.3:0.0") for ids in long[4:]],
        "mixed": [request(long[6], policy="local"), request(long[5], policy="full"),
                  request(long[4], policy="head", threshold=0.0), request(long[3], policy="schedule:2:4")],
        "bad_policy": [request(long[0], policy="sometimes")],
        "bad_nan": [request(long[0], threshold="nan")],
        "bad_text": [request(long[0], threshold="high")],
        "after_bad": [request(long[5], policy="local")],
        # seeded sampling, one request with two samples: Full's equal stock vLLM's; each sample has its own record
        "sampled": [request(long[5], policy="full", sampling=SAMPLING[0]), request(long[6], policy="full",
                                                                               sampling=SAMPLING[1]),
                    request(long[6], policy="head", threshold=0.0, sampling=SAMPLING[0])],
        # the requests of the preemption test, without memory pressure
        "preempt_free": preemption_batches(PREEMPT_PROMPTS, 60)[0],
    }
    # prefix reuse: a request whose prompt extends an earlier ODA request's prompt and Local output
    batches["extended"] = [extension(list(batches), "local", 6, long[6], prompt(5, seed=99), policy="full",
                                     logprobs=1)]
    order = list(batches)
    oda = run_vllm(tmp, "oda", folder, [batches[name] for name in order],
                   oda={"head": head, "sinks": SINKS, "window": WINDOW}, enable_prefix_caching=True, one_process=False)
    results = dict(zip(order, oda))
    extended = long[6] + results["local"]["outputs"][6]["tokens"] + prompt(5, seed=99)
    # stock vLLM: the Full batch, seeded samples, and the extension read cold (its engine has no prefix cache)
    stock_sampled = [request(long[5], sampling=SAMPLING[0]), request(long[6], sampling=SAMPLING[1])]
    stock = run_vllm(tmp, "stock", folder, [batches["full"], stock_sampled, [request(extended, logprobs=1)]],
                     oda=None, enable_prefix_caching=False, **EAGER)
    return dict(model=model, head=head, long=long, batches=batches, stock=stock[0], stock_sampled=stock[1],
                oda=results, cold=stock[2])


def test_always_full_equals_stock_vllm(gqa3):
    for ours, stock in zip(gqa3["oda"]["full"]["outputs"], gqa3["stock"]["outputs"]):
        assert ours["tokens"] == stock["tokens"]
        assert max(abs(a - b) for a, b in zip(ours["logprobs"], stock["logprobs"])) < 1e-4
        assert ours["routing"]["routed_steps"] == 11
        assert ours["routing"]["full_calls"] == ours["routing"]["decided_steps"]


def test_always_local_equals_transformers_streamingllm_at_window_edges(gqa3):
    for ids, ours in zip(gqa3["long"], gqa3["oda"]["local"]["outputs"]):
        tokens, routing = hf_generate(gqa3["model"], None, ids, 12, "local")
        assert ours["tokens"] == tokens, f"prompt of {len(ids)} tokens"
        assert ours["routing"]["full_calls"] == 0
        # decided = routed steps whose history is past sinks + window
        assert ours["routing"]["decided_steps"] == sum(len(ids) + t > SPAN for t in range(1, 12))


def test_local_differs_from_full_past_the_window(gqa3):
    """The check above could pass with Local silently reading the whole history: make sure it does not."""
    local = [o["tokens"] for o in gqa3["oda"]["local"]["outputs"]]
    full = [o["tokens"] for o in gqa3["oda"]["full"]["outputs"]]
    for ids, ours, stock in zip(gqa3["long"], local, full):
        first_local = next((i for i in range(1, 12) if len(ids) + i > SPAN), 12)   # output i comes from step i
        assert ours[:first_local] == stock[:first_local]
    assert local[-2:] != full[-2:]


def test_head_decisions_and_tokens_match_transformers_path(gqa3):
    mixed = 0
    for ids, ours in zip(gqa3["long"], gqa3["oda"]["head"]["outputs"]):
        tokens, routing = hf_generate(gqa3["model"], gqa3["head"], ids, 12, "head", threshold=0.0)
        scores = routing.scores[0].tolist()
        theirs = routing.decisions[0].tolist()
        close = [i for i, q in enumerate(scores) if math.isfinite(q) and abs(q) < 1e-4]
        assert not close, f"scores within 1e-4 of the threshold at steps {close}: report, do not hide"
        assert ours["routing"]["decisions"] == theirs
        assert ours["tokens"] == tokens
        for a, b in zip(ours["routing"]["scores"], scores):
            assert (a is None and math.isnan(b)) or abs(a - b) < 1e-4
        mixed += 0 < sum(theirs) < len(theirs)
    assert mixed, "the head never mixed Full and Local: the test would not see a wrong retry"


def test_random_and_schedule_match_transformers_path(gqa3):
    cases = [("random", RandomPolicy(0.4, seed=7), 5), ("random", RandomPolicy(0.3, seed=42), 6),
             ("schedule", SchedulePolicy(2, 4), 5), ("schedule", SchedulePolicy(1, 3), 6)]
    for index, (batch, policy, prompt_index) in enumerate(cases):
        ours = gqa3["oda"][batch]["outputs"][index % 2]
        tokens, routing = hf_generate(gqa3["model"], None, gqa3["long"][prompt_index], 12, policy)
        assert ours["tokens"] == tokens
        decided = (~routing.in_window[0]).tolist()
        theirs = [d and keep for d, keep in zip(routing.decisions[0].tolist(), decided)]
        assert ours["routing"]["decisions"] == theirs


def test_budget_matches_transformers_path_and_holds(gqa3):
    """budget:0.3 (head at threshold 0): the decisions and tokens of `BudgetPolicy(0.3, 0.0)` on the Transformers
    path, and at every decided step the request's Full calls stay within 30% of its decided steps."""
    limited = 0
    for ids, ours in zip(gqa3["long"][4:], gqa3["oda"]["budget"]["outputs"]):
        tokens, routing = hf_generate(gqa3["model"], gqa3["head"], ids, 12, BudgetPolicy(0.3, 0.0), threshold=0.0)
        decided = (~routing.in_window[0]).tolist()
        theirs = [d and keep for d, keep in zip(routing.decisions[0].tolist(), decided)]
        assert ours["routing"]["decisions"] == theirs and ours["tokens"] == tokens
        calls = [d for d, keep in zip(ours["routing"]["decisions"], decided) if keep]
        assert all(sum(calls[:n]) <= 0.3 * n + 1e-9 for n in range(1, len(calls) + 1))
        limited += sum(calls) < sum(1 for q in ours["routing"]["scores"] if q is not None and q > 0)
    assert limited, "the budget never held the head back: the test would not see a budget that does not hold"


def test_mixed_policies_in_one_batch_equal_each_request_alone(gqa3):
    oda = gqa3["oda"]
    alone = [oda["local"]["outputs"][6], oda["full"]["outputs"][5], oda["head"]["outputs"][4]]
    mixed = oda["mixed"]["outputs"]
    for ours, single in zip(mixed[:3], alone):
        assert ours["tokens"] == single["tokens"]
        assert ours["routing"]["decisions"] == single["routing"]["decisions"]
    tokens, _ = hf_generate(gqa3["model"], None, gqa3["long"][3], 12, SchedulePolicy(2, 4))
    assert mixed[3]["tokens"] == tokens


class ForcedTokens(transformers.LogitsProcessor):
    """Makes `generate()` emit `tokens` (a replay of a sampled output): ODA decides before logits processing, so its
    decisions are those of a run that drew these tokens."""

    def __init__(self, tokens: list, prompt_length: int):
        self.tokens, self.prompt_length = tokens, prompt_length

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.tokens[input_ids.shape[1] - self.prompt_length]] = 0.0
        return forced


def test_seeded_sampling_with_several_samples(gqa3):
    """Sampling (temperature, top-p, a seed, n = 2): always-Full draws stock vLLM's samples; a head request has one
    routing record per sample, with the decisions the Transformers path makes on that sample's tokens."""
    sampled, stock = gqa3["oda"]["sampled"]["outputs"], gqa3["stock_sampled"]["outputs"]
    for ours, theirs, n in zip(sampled[:2], stock, (2, 1)):
        assert ours["samples"] == theirs["samples"] and len(ours["samples"]) == n
    assert sampled[0]["samples"][0] != sampled[0]["samples"][1]  # two different draws, not one repeated
    head = sampled[2]
    assert len(head["samples"]) == 2 and head["routing"] is None  # records per sample, none under the parent's id
    ids = gqa3["long"][6]
    oda = OdaForCausalLM.from_pretrained(gqa3["model"], head=gqa3["head"], sinks=SINKS, window=WINDOW, threshold=0.0,
                                         policy="head")
    for tokens, record in zip(head["samples"], head["sample_routing"]):
        assert record is not None and record["routed_steps"] == 11
        processors = transformers.LogitsProcessorList([ForcedTokens(tokens, len(ids))])
        out = oda.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, logits_processor=processors)
        assert out[0, len(ids):].tolist() == tokens
        assert record["decisions"] == oda.routing.decisions[0].tolist()
    assert any(0 < sum(r["decisions"]) < 11 for r in head["sample_routing"]), "the head never mixed Full and Local"


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(gqa3):
    oda = gqa3["oda"]
    assert "oda_policy" in oda["bad_policy"]["error"] and "sometimes" in oda["bad_policy"]["error"]
    assert "finite" in oda["bad_nan"]["error"]
    assert "number" in oda["bad_text"]["error"]
    assert oda["after_bad"]["outputs"][0]["tokens"] == oda["local"]["outputs"][5]["tokens"]


def test_extending_an_oda_request_reads_a_cold_full_prefill(gqa3):
    """Prefix caching on: the extension reuses the earlier prompt's blocks (written by its Full prefill) and none of
    the blocks its Local decode steps wrote, so it gets what a cold Full prefill gives."""
    ours = gqa3["oda"]["extended"]["outputs"][0]
    cold = gqa3["cold"]["outputs"][0]
    prompt_blocks = len(gqa3["long"][6]) // 32 * 32          # 150-token prompt: 4 full blocks of 32
    assert ours["num_cached_tokens"] == prompt_blocks         # without the cap: 160, a block of Local decode KV
    assert ours["tokens"] == cold["tokens"]
    assert max(abs(a - b) for a, b in zip(ours["logprobs"], cold["logprobs"])) < 1e-4


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (7, 1)])
def test_always_local_at_other_gqa_ratios(tmp_path, heads, kv_heads):
    folder = str(tmp_path / "model")
    model = build_model(folder, heads=heads, kv_heads=kv_heads, seed=1)
    prompts = [prompt(n, seed=n + heads) for n in (SPAN - 1, SPAN + 1, 70)]
    local = [request(ids, policy="local") for ids in prompts]
    results = run_vllm(tmp_path, "oda", folder, [local, [request(prompts[0], policy="head")],
                                                 [request(prompts[0], policy="budget:0.25")], local[:1]],
                       oda={"sinks": SINKS, "window": WINDOW, "policy": "local"}, **EAGER)
    for ids, ours in zip(prompts, results[0]["outputs"]):
        tokens, _ = hf_generate(model, None, ids, 12, "local")
        assert ours["tokens"] == tokens
    # served without a head: a request for it is refused at admission, and the engine goes on serving
    assert "'head' needs the recall head" in results[1]["error"] and "'budget'" in results[2]["error"]
    assert results[3]["outputs"][0]["tokens"] == results[0]["outputs"][0]["tokens"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_families_with_chunked_prefill(tmp_path, family):
    """The Qwen2 and Qwen3 classes, with a token budget of 32 per step so that 70- and 150-token prompts are prefilled
    in chunks beside other rows' decode steps: Local and head routing equal the Transformers path."""
    folder = str(tmp_path / "model")
    model = build_model(folder, heads=4, kv_heads=2, seed=2, family=family)
    head = os.path.join(folder, "head")
    prompts = [prompt(n, seed=n + 7) for n in (SPAN + 1, 70, 150)]
    batch = [request(ids, policy=policy) for ids in prompts for policy in ("local", "head")]
    results = run_vllm(tmp_path, "oda", folder, [batch], oda={"head": head, "sinks": SINKS, "window": WINDOW},
                       max_num_batched_tokens=32, enable_chunked_prefill=True, **EAGER)
    for req, ours in zip(batch, results[0]["outputs"]):
        policy = req["extra_args"]["oda_policy"]
        tokens, routing = hf_generate(model, head if policy == "head" else None, req["prompt"], 12, policy)
        assert ours["tokens"] == tokens, (family, len(req["prompt"]), policy)
        if policy == "head":
            assert ours["routing"]["decisions"] == routing.decisions[0].tolist()


def test_seeded_sampling_with_chunked_prefill_equals_it_unchunked(tmp_path):
    """vLLM samples and discards a token after a prompt chunk that does not end the prompt, and rewinds a seeded
    request's generator with `set_offset`, which CPU generators lack: the engine died on any seeded request whose
    prompt was split (a prompt past `oda serve`'s default 2,048 batched tokens; found by an audit). ODA's CPU runner
    puts the generator's state back: the samples equal those of an engine that prefills each prompt at once."""
    folder = str(tmp_path / "model")
    build_model(folder, heads=4, kv_heads=2, seed=3, family="qwen3")
    head = os.path.join(folder, "head")
    batch = [request(prompt(n, seed=n + 11), policy=policy, sampling=sampling,
                     threshold=0.0 if policy == "head" else None)
             for n, policy, sampling in ((150, "full", SAMPLING[1]), (90, "head", SAMPLING[0]),
                                         (70, "local", SAMPLING[1]))]
    oda = {"head": head, "sinks": SINKS, "window": WINDOW}
    chunked = run_vllm(tmp_path, "chunked", folder, [batch], oda=oda, max_num_batched_tokens=32,
                       enable_chunked_prefill=True, **EAGER)[0]["outputs"]
    whole = run_vllm(tmp_path, "whole", folder, [batch], oda=oda, **EAGER)[0]["outputs"]
    assert [o["samples"] for o in chunked] == [o["samples"] for o in whole] and len(chunked[0]["tokens"]) == 12

    def decisions(outputs):   # per request, per sample (one record under the request's id, or one per sample)
        return [[record["decisions"] for record in ([out["routing"]] if out["routing"] else out["sample_routing"])]
                for out in outputs]

    assert decisions(chunked) == decisions(whole) and len(decisions(chunked)[1]) == 2


@contextlib.contextmanager
def oda_server(tmp_path, head: str, *vllm_flags: str, env: dict | None = None):
    """`oda serve` of the model beside `head` on a free loopback port (yielded once /health answers), eager, with
    `vllm_flags` for vLLM; stopped, its processes with it, on leaving."""
    import socket
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    oda = os.path.join(os.path.dirname(VLLM_PYTHON), "oda")
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([oda, "serve", "--base", os.path.dirname(head), "--head", head, "--sinks", str(SINKS),
                               "--window", str(WINDOW), "--port", str(port), "--", "--max-model-len", "1024",
                               "--block-size", "32", "--seed", "0", "--enforce-eager", *vllm_flags],
                              env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", **os.environ,
                                   **(env or {}), "PYTHONPATH": REPO}, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
                assert time.time() < deadline, "the server did not come up in 300 s"
                time.sleep(2)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def test_openai_server_with_oda(gqa3, tmp_path):
    """`oda serve` on loopback, driven through the official openai client: completions, streaming, chat, routing
    records in responses, on /v1/oda/routing and /metrics, and bad requests answered 400 while serving goes on."""
    folder = os.path.dirname(gqa3["head"])
    # eager: the fixture's first engine runs the compiled model; the server's own compile would add a minute here
    with oda_server(tmp_path, gqa3["head"], "--api-key", "secret", "--root-path", "/api", "--allowed-origins",
                    '["http://example.com"]', "--enable-request-id-headers") as port:
        ids = gqa3["long"][5]
        proc = subprocess.run([VLLM_PYTHON, os.path.join(REPO, "tests", "vllm_client.py"), str(port), folder,
                               json.dumps(ids)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        seen = json.loads(proc.stdout)
    offline = gqa3["oda"]["local"]["outputs"][5]["tokens"][:10]
    assert seen["completion"]["text"].split() == [f"w{t}" for t in offline]
    routing = next(iter(seen["completion"]["routing"]["requests"].values()))
    assert routing["routed_steps"] == 9 and routing["full_calls"] == 0 and routing["policy"] == "local"
    assert seen["stream"]["text"] == seen["completion"]["text"]
    assert seen["stream"]["routing"]["routed_steps"] == 9
    chat = next(iter(seen["chat"]["routing"]["requests"].values()))
    assert chat["policy"] == "schedule:1:2" and chat["routed_steps"] == 5
    sampled = seen["sampled"]["routing"]
    assert seen["sampled"]["choices"] == 4 and len(sampled["requests"]) == 4, sampled
    assert all(r["routed_steps"] == 5 and r["policy"] == "schedule:1:2" for r in sampled["requests"].values())
    assert "sometimes" in seen["bad_policy"] and "oda_threshold" in seen["bad_threshold"]
    assert "inside vllm_xargs" in seen["top_level"] and "does not route beam search" in seen["beam"]
    assert seen["responses_top_level"][0] == 400 and "inside vllm_xargs" in seen["responses_top_level"][1]
    # a stop string: the engine ran past it, every record counts the returned tokens' steps only
    stopped, both = seen["stopped"], seen["stopped_n2"]
    assert stopped["finish_reason"] == "stop" and stopped["tokens"] < 10
    assert stopped["routing"]["routed_steps"] == stopped["listed"]["routed_steps"] == stopped["tokens"] - 1
    assert both["finish_reasons"] == ["stop", "stop"] and both["tokens"] == 2 * stopped["tokens"]
    assert [r["routed_steps"] for r in both["routing"]["requests"].values()] == [stopped["tokens"] - 1] * 2
    assert seen["after_bad"] == seen["completion"]["text"]
    # ids that look like parts of other responses: each response pools its own requests alone
    # (chat_job_again reuses chat_job's X-Request-Id: it carried that earlier record too, under the plain id)
    for name, policy, steps in [("chat_job_1", "local", 4), ("chat_job", "full", 7),
                                ("chat_job_again", "schedule:1:2", 5), ("completion_batch-1", "full", 3)]:
        (record,) = seen[name]["requests"].values()
        assert (record["policy"], record["routed_steps"]) == (policy, steps), (name, seen[name])
    assert [r["routed_steps"] for r in seen["completion_batch"]["requests"].values()] == [5, 5]
    every = seen["every_record"]["requests"]   # without an id: counts only (per-step lists by id)
    assert len(every) >= 15 and not any("decisions" in record for record in every.values())
    assert seen["responses_sample_id"][0] == 400 and "<k>_<id>" in seen["responses_sample_id"][1]
    metrics = dict(line.split() for line in seen["metrics"])
    served = 9 + 9 + 5 + 4 * 5 + 3 * (stopped["tokens"] - 1) + 9 + 4 + 7 + 5 + 2 * 5 + 3   # refused: no step
    assert int(metrics["oda_routed_steps_total"]) == served
    assert 0 < int(metrics["oda_full_calls_total"]) <= int(metrics["oda_decided_steps_total"]) <= served
    # the batch chat endpoint (refused before: served with the engine's default policy, no records in its response)
    assert seen["batch_top_level"][0] == 400 and "inside vllm_xargs" in seen["batch_top_level"][1]
    status, choices, batch = seen["batch_chat"]
    assert status == 200 and choices == 2 and len(batch["requests"]) == 2, seen["batch_chat"]
    assert all(key.endswith(("_0", "_1")) for key in batch["requests"])
    assert all(r["policy"] == "schedule:1:2" and r["routed_steps"] == 4 for r in batch["requests"].values())
    # behind vLLM's middlewares: the API key guards ODA's records and refusals; CORS and X-Request-Id headers kept
    assert seen["unauthorized"] == [401, 401, 401]
    assert seen["content_type_case"] == 400 and seen["unguarded_refusal"] == 400
    assert seen["headers"] == {name: [status, "http://example.com", "hdrcheck"]
                               for name, status in [("completion", 200), ("refusal", 400), ("routing", 200)]}
    # SageMaker's /invocations: refused as the OpenAI paths refuse; the records of what it served
    invocations = seen["invocations"]
    assert [invocations[name][0] for name in ("top_level", "beam")] == [400, 400], invocations
    assert "inside vllm_xargs" in invocations["top_level"][1]["error"]["message"]
    for name, policy in [("completion", "local"), ("chat", "full"), ("fallback", "local")]:
        status, answer = invocations[name]
        (record,) = answer["oda_routing"]["requests"].values()
        assert status == 200 and (record["policy"], record["routed_steps"]) == (policy, 3), invocations[name]
    # under --root-path /api: a record in the response and by id, a misplaced key refused
    in_response, (status, listed), refused = seen["root_path"]
    assert status == 200 and listed["requests"] == in_response["requests"] and refused == 400
    assert next(iter(listed["requests"].values()))["policy"] == "local"
    status, (found, listed) = seen["responses_by_id"]   # the Responses API's "<id>_0" found by its id
    assert status == found == 200 and [r["policy"] for r in listed["requests"].values()] == ["local"], listed
    status, response_id, (found, listed) = seen["responses_by_own_id"]   # also by a request_id the caller chose
    assert status == found == 200 and response_id == "myresp-x", (status, response_id, found, listed)
    assert [r["policy"] for r in listed["requests"].values()] == ["local"], listed


def test_data_parallel_servers_keep_the_records_of_every_engine(gqa3, tmp_path):
    """With --data-parallel-size 2 the requests the second engine served had no oda_routing, a 404 from
    /v1/oda/routing and no place in /metrics (HTTP 200 all the same): the records were read from the first engine
    only. One request pinned to each engine; then one X-Request-Id used twice, on engine 1 (Full) and later on engine
    0 (Local): merged engine by engine, the later response carried the earlier request's record (an audit's server)."""
    import urllib.request

    def call(port, path, body=None, rank=None, request_id=None):
        headers = {"Content-Type": "application/json", **({} if rank is None else {"X-data-parallel-rank": rank}),
                   **({} if request_id is None else {"X-Request-Id": request_id})}
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers,
                                         data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=300) as response:
            text = response.read().decode()
            return json.loads(text) if body is not None or path.startswith("/v1") else text

    folder = os.path.dirname(gqa3["head"])
    with oda_server(tmp_path, gqa3["head"], "--data-parallel-size", "2",
                    env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as port:
        served, reused = [], []
        for rank, policy, request_id, responses in ((0, "full", None, served), (1, "local", None, served),
                                                    (1, "full", "job", reused), (0, "local", "job", reused)):
            body = {"model": folder, "prompt": gqa3["long"][5], "max_tokens": 10, "temperature": 0,
                    "ignore_eos": True, "vllm_xargs": {"oda_policy": policy}}
            responses.append(call(port, "/v1/completions", body, rank=str(rank), request_id=request_id))
        listed = [call(port, f"/v1/oda/routing?request_id={response['id']}") for response in served]
        metrics = call(port, "/metrics")
    for response, listed_one, policy, full in zip(served, listed, ("full", "local"), (9, 0)):
        record = next(iter(response["oda_routing"]["requests"].values()))
        assert (record["policy"], record["routed_steps"], record["full_calls"]) == (policy, 9, full)
        assert next(iter(listed_one["requests"].values()))["decisions"] == record["decisions"]
    assert [[r["policy"] for r in response["oda_routing"]["requests"].values()] for response in reused] == [
        ["full"], ["local"]]
    assert "oda_routed_steps_total 36" in metrics and "oda_full_calls_total 18" in metrics


def test_preempted_requests_continue_as_if_never_preempted(gqa3, tmp_path):
    """A KV space of 12 blocks for 4 requests that need 7 each forces vLLM to preempt; V1 then recomputes the prompt
    and the generated tokens as a prompt, here in chunks of at most 48 tokens (max_num_batched_tokens), so a chunk
    may start and end inside the generated tokens. Measured before ODA replayed it: recomputed with Full attention,
    always-Local requests diverged from unpreempted ones (first at output 32 and 61 of 150) and the resumed step
    was not routed. Now each generated token is recomputed as its step went (Local or Full) and the resumed step is
    routed: every policy gives the tokens and decisions of the same requests without memory pressure, and the
    Transformers path's for Full, Local and Random."""
    folder = os.path.dirname(gqa3["head"])
    oda = {"head": gqa3["head"], "sinks": SINKS, "window": WINDOW}
    pressed = run_vllm(tmp_path, "preempt", folder, preemption_batches(PREEMPT_PROMPTS, 60), oda=oda,
                       max_model_len=256, num_gpu_blocks_override=12, max_num_seqs=4,
                       max_num_batched_tokens=48, **EAGER)[0]["outputs"]
    check_preempted_equals_unpressed(pressed, gqa3["oda"]["preempt_free"]["outputs"], 60)
    assert 0 < pressed[2]["routing"]["full_calls"] < pressed[2]["routing"]["decided_steps"], "the head never mixed"
    for ids, policy, ours in zip(PREEMPT_PROMPTS, ["full", "local", None, RandomPolicy(0.5, seed=3)], pressed):
        if policy is not None:
            tokens, _ = hf_generate(gqa3["model"], None, ids, 60, policy)
            assert ours["tokens"] == tokens


def test_a_preempted_request_never_resumes_from_another_requests_prompt_blocks(gqa3, tmp_path):
    """vLLM resumes a preempted request through a prefix-cache lookup over its prompt and its output so far. B's prompt
    is A's prompt and output (Full-prefilled blocks, legitimately cached); A served again beside B is preempted, and
    resumed it found B's blocks in place of its own decode KV (written by Local steps) and replayed its routed steps
    only past them (measured by the audit's repro: tokens off from output 105, logprobs 0.98 apart, exit 0). Now its
    blocks past the prompt have hashes of its own, and it resumes as if never preempted."""
    folder = os.path.dirname(gqa3["head"])
    a_prompt = prompt(64, seed=41)
    batches = [[request(a_prompt, 120, "schedule:1:2", logprobs=1)]]
    batches.append([extension(["alone"], "alone", 0, a_prompt, prompt(4, seed=42), max_tokens=150, policy="full"),
                    request(a_prompt, 120, "schedule:1:2", logprobs=1)])
    alone, beside = run_vllm(tmp_path, "cross_hit", folder, batches, oda={"sinks": SINKS, "window": WINDOW},
                             enable_prefix_caching=True, max_model_len=320, num_gpu_blocks_override=12, **EAGER)
    reference, resumed = alone["outputs"][0], beside["outputs"][1]
    assert resumed["routing"]["recomputed_tokens"] > 0, "A was not preempted: the test saw nothing"
    assert resumed["tokens"] == reference["tokens"]
    assert resumed["routing"]["decisions"] == reference["routing"]["decisions"]


# Loaded by every process of the engine below (on its path): tensor-parallel rank 1's head scores moved by +10, as if
# its copy of the head had rounded otherwise; each time it is, a line goes to the file named by ODA_TEST_SKEWED.
SKEW_RANK_ONE = """
import os
from oda_hf.head import RecallHead
forward = RecallHead.forward
def skewed(self, *args, **kwargs):
    from vllm.distributed import get_tensor_model_parallel_rank
    scores = forward(self, *args, **kwargs)
    if get_tensor_model_parallel_rank() != 1:
        return scores
    with open(os.environ["ODA_TEST_SKEWED"], "a") as f:
        f.write("skewed\\n")
    return scores + 10.0
RecallHead.forward = skewed
"""


def test_tensor_parallel_ranks_route_as_rank_zero_decides(gqa3, tmp_path):
    """With tensor_parallel_size=2, each rank runs the head and the Full pass after it is a collective. An audit that
    moved rank 1's scores got a hang, or wrong tokens with exit 0 (rank 1 ran Full for rows rank 0 ran Local):
    every rank now takes rank 0's decisions, so the engine serves what one rank serves."""
    hook = tmp_path / "skew"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SKEW_RANK_ONE)
    skewed = tmp_path / "skewed.txt"
    names = ["head", "budget", "mixed"]
    results = run_vllm(tmp_path, "tp2", os.path.dirname(gqa3["head"]), [gqa3["batches"][name] for name in names],
                       oda={"head": gqa3["head"], "sinks": SINKS, "window": WINDOW}, one_process=False,
                       tensor_parallel_size=2, distributed_executor_backend="mp", python_path=(str(hook),),
                       env={"ODA_TEST_SKEWED": str(skewed), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, timeout=400,
                       **EAGER)
    assert skewed.exists() and len(skewed.read_text().split()) >= 10   # rank 1's head did run, skewed
    for name, result in zip(names, results):
        for ours, one_rank in zip(result["outputs"], gqa3["oda"][name]["outputs"], strict=True):
            assert ours["tokens"] == one_rank["tokens"], name
            assert ours["routing"]["decisions"] == one_rank["routing"]["decisions"], name
    decisions = [d for result in results for row in result["outputs"] for d in row["routing"]["decisions"]]
    assert 0 < sum(decisions) < len(decisions)   # the head chose both ways: rank 1's scores (+10) would be all Full


def test_speculative_decoding_is_refused_at_engine_start(tmp_path):
    """Measured before the check (ngram speculation, 2 draft tokens, policy local): of 20 tokens only 9 were routed;
    the verification steps ran as prompt chunks, with Full attention and no record. An engine built by hand (no
    engine_args, which refuses it before any process starts) must refuse it when the model is built."""
    folder = str(tmp_path / "model")
    build_model(folder, heads=2, kv_heads=1)
    engine = {"hf_overrides": {"architectures": ["OdaLlamaForCausalLM"],
                               "oda": {"head": None, "sinks": SINKS, "window": WINDOW, "policy": "local"}},
              "worker_cls": "oda_hf.vllm.worker.OdaCPUWorker",
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 1}}
    with pytest.raises(AssertionError, match="vLLM driver failed"):
        run_vllm(tmp_path, "speculative", folder, [[request(prompt(40, seed=1), policy="local")]], oda=None, **engine)
    assert "ODA does not serve with speculative decoding" in (tmp_path / "speculative.log").read_text()


def save_lora_adapter(folder, model, rank: int = 8) -> None:
    """A random PEFT LoRA adapter on the attention projections of `model` (vLLM loads it by folder)."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    weights = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "v_proj", "o_proj"):
            linear = getattr(layer.self_attn, name)
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features) * 0.3
            weights[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, rank) * 0.3
    os.makedirs(folder, exist_ok=True)
    save_file(weights, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "task_type": "CAUSAL_LM",
                   "target_modules": ["q_proj", "v_proj", "o_proj"]}, f)


def test_lora_adapters_apply_in_the_full_retry_of_a_mixed_batch(tmp_path):
    """vLLM's LoRA layers take one adapter index per token of a pass, set for the step's whole batch; the Full retry
    is a pass over a sub-batch. Measured before the fix (a Local row without an adapter, then a head row with one):
    the engine died in the retry (a mapping of 2 tokens for 1). Now the retry maps its own tokens: a head request that
    retries every decided step (threshold far below any score) equals the same request served Full natively, beside
    rows without the adapter, and a head request at threshold 0 equals itself served alone."""
    folder, adapter = str(tmp_path / "model"), str(tmp_path / "adapter")
    model = build_model(folder, heads=4, kv_heads=2)
    save_lora_adapter(adapter, model)
    lora = ["adapter", 1, adapter]
    ids, other = prompt(150, seed=31), prompt(60, seed=32)

    def with_lora(req):
        return {**req, "lora": lora}

    mixed = [request(other, 16, policy="local"), with_lora(request(ids, 16, policy="head", threshold=-1e9)),
             with_lora(request(ids, 16, policy="full")), request(ids, 16, policy="full"),
             with_lora(request(ids, 16, policy="head", threshold=0.0)), request(other, 16, policy="head", threshold=0.0)]
    alone = [with_lora(request(ids, 16, policy="head", threshold=0.0))]
    out = run_vllm(tmp_path, "lora", folder, [mixed, alone], oda={"head": os.path.join(folder, "head"),
                   "sinks": SINKS, "window": WINDOW}, enable_lora=True, max_lora_rank=8, max_loras=2, **EAGER)
    rows, single = out[0]["outputs"], out[1]["outputs"][0]
    assert rows[2]["tokens"] != rows[3]["tokens"], "the adapter changed nothing: the test would see nothing"
    assert rows[1]["tokens"] == rows[2]["tokens"]
    assert rows[1]["routing"]["full_calls"] == rows[1]["routing"]["routed_steps"] == 15
    assert rows[4]["tokens"] == single["tokens"]
    assert rows[4]["routing"]["decisions"] == single["routing"]["decisions"]
    assert 0 < rows[4]["routing"]["full_calls"] < rows[4]["routing"]["routed_steps"], "the head did not mix"
