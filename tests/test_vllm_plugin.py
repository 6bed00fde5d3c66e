"""ODA inside vLLM (CPU build), against stock vLLM and against oda_hf's Transformers path.

vLLM pins an older transformers than oda_hf needs, so it lives in its own environment (`.venv-vllm`, made by
`.ci/run`). These tests run in oda_hf's environment: they build tiny random models, run every request batch on one
vLLM engine per configuration through `tests/vllm_driver.py` under the vLLM environment's Python, and compare with
`OdaForCausalLM` here. Without that environment they are skipped (and fail under CI, where it must exist).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers

from oda_hf import BudgetPolicy, OdaForCausalLM, RandomPolicy, RecallHead, RecallHeadConfig, SchedulePolicy
from tiny_models import save_word_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.environ.get("ODA_VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin", "python"))
if not os.path.exists(VLLM_PYTHON):
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must run the vLLM tests, but {VLLM_PYTHON} does not exist (.ci/run makes it).")
    pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (.ci/run makes one)", allow_module_level=True)

SINKS, WINDOW = 4, 16
SPAN = SINKS + WINDOW
VOCAB = 128
ENGINE = dict(dtype="float32", max_model_len=1024, block_size=32, seed=0, max_num_seqs=16)


FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}


def build_model(folder, heads: int, kv_heads: int, seed: int = 0, family: str = "llama"):
    torch.manual_seed(seed)
    config_class, model_class = FAMILIES[family]
    config = config_class(
        vocab_size=VOCAB, hidden_size=32 * heads, intermediate_size=96, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=32, num_hidden_layers=2, max_position_embeddings=1024,
        pad_token_id=0, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    model = model_class(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)   # sharper logits: greedy paths that fp noise does not flip
    model.save_pretrained(folder)
    save_word_tokenizer(folder, VOCAB)
    save_random_head(model, folder)
    return model


def save_random_head(model, folder) -> None:
    RecallHead(RecallHeadConfig.for_base(model, head_width=32, sinks=SINKS, window=WINDOW)).save_pretrained(
        os.path.join(folder, "head"))


def served_model(tmp_path_factory, name: str, build, prompt_seed: int):
    """A fresh folder with a tiny model built by `build` and its random head, and a prompt at each window edge."""
    tmp = tmp_path_factory.mktemp(name)
    folder = str(tmp / "model")
    model = build(folder)
    long = [prompt(n, seed=n + prompt_seed) for n in EDGE_LENGTHS]
    return tmp, folder, model, os.path.join(folder, "head"), long


def edge_batches(long: list) -> dict:
    """Full (with logprobs), Local and head requests for each prompt of `long`."""
    return {"full": [request(ids, policy="full", logprobs=1) for ids in long],
            "local": [request(ids, policy="local") for ids in long],
            "head": [request(ids, policy="head", threshold=0.0) for ids in long]}


def _vllm_has_torchvision() -> bool:
    probe = "import torchvision, torch; torch.ops.torchvision.nms"
    return subprocess.run([VLLM_PYTHON, "-c", probe], capture_output=True).returncode == 0


def run_vllm(tmp_path, name: str, model_folder: str, batches: list, oda: dict | None, torchvision: bool = False,
             one_process: bool = True, **engine) -> list:
    """`torchvision`: the model's vLLM module imports torchvision (Qwen3.5); without a working one in the vLLM
    environment, the test stand-in `tests/vllm_stubs` is put on the path (see its README).

    `one_process`: the engine core and worker run inside the driver's process (half of each engine's start-up time
    on CI's machine). The first ODA engine of each model family passes False: engine core and worker in processes of
    their own, as `LLM` and `oda serve` run them for users."""
    spec = {"engine": {"model": model_folder, **ENGINE, **engine}, "oda": oda, "batches": batches,
            "one_process": one_process}
    spec_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    path = [REPO]
    if torchvision and not _vllm_has_torchvision():
        path.append(os.path.join(REPO, "tests", "vllm_stubs"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([VLLM_PYTHON, os.path.join(REPO, "tests", "vllm_driver.py"), str(spec_path),
                           str(out_path)], env=env, capture_output=True, text=True, timeout=900)
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)   # vLLM logs a worker's failure on stdout
    if proc.returncode != 0:
        raise AssertionError(f"vLLM driver failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out_path.read_text())


def prompt(length: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def request(ids, max_tokens=12, policy=None, threshold=None, logprobs=None, sampling=None):
    extra = {}
    if policy is not None:
        extra["oda_policy"] = policy
    if threshold is not None:
        extra["oda_threshold"] = threshold
    return {"prompt": ids, "max_tokens": max_tokens, "extra_args": extra or None, "logprobs": logprobs,
            "sampling": sampling}


SAMPLING = [dict(temperature=0.8, top_p=0.9, seed=5, n=2), dict(temperature=1.0, seed=11, n=1)]


def hf_generate(model, head_folder, ids, max_tokens, policy, threshold=0.0):
    oda = OdaForCausalLM.from_pretrained(model, head=head_folder, sinks=SINKS, window=WINDOW, threshold=threshold,
                                         policy=policy)
    out = oda.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, len(ids):].tolist(), oda.routing


# Preemption: 4 requests that need more KV blocks than the engine has, so vLLM preempts some and resumes them by
# recomputing their prompt and generated tokens as one prompt chunk.
PREEMPT_POLICIES = ["full", "local", "head", "random:0.5:3"]
PREEMPT_PROMPTS = [prompt(140, seed=200 + i) for i in range(4)]


def preemption_batches(prompts: list, max_tokens: int) -> list:
    return [[request(ids, max_tokens, policy, threshold=0.0 if policy == "head" else None)
             for ids, policy in zip(prompts, PREEMPT_POLICIES)]]


def check_preempted_equals_unpressed(pressed: list, free: list, max_tokens: int) -> None:
    """Requests that vLLM preempted (and resumed by recomputing their history) equal the same requests without
    memory pressure: tokens, decisions, every output after the first a routed step."""
    for ours, alone in zip(pressed, free):
        assert len(ours["tokens"]) == max_tokens
        assert ours["tokens"] == alone["tokens"]
        assert ours["routing"]["decisions"] == alone["routing"]["decisions"]
        assert ours["routing"]["routed_steps"] == max_tokens - 1
        assert alone["routing"]["recomputed_tokens"] == 0
    assert any(o["routing"]["recomputed_tokens"] for o in pressed), "no request was preempted: the test saw nothing"


# Window edges: routed steps at seq_len w, w+1, s+w, s+w+1 and far past it (many wrap-arounds of a ring).
EDGE_LENGTHS = [WINDOW - 2, WINDOW, SPAN - 1, SPAN, SPAN + 1, 45, 150]


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
    order = list(batches)
    oda = run_vllm(tmp, "oda", folder, [batches[name] for name in order],
                   oda={"head": head, "sinks": SINKS, "window": WINDOW}, one_process=False)
    results = dict(zip(order, oda))
    # prefix reuse: a request whose prompt extends an earlier ODA request's prompt and Local output
    first = results["local"]["outputs"][6]["tokens"]
    extended = long[6] + first + prompt(5, seed=99)
    follow = run_vllm(tmp, "oda_follow", folder, [[request(long[6], policy="local")], [request(extended,
                      policy="full", logprobs=1)]], oda={"head": head, "sinks": SINKS, "window": WINDOW},
                      enable_prefix_caching=True)
    # stock vLLM: the Full batch, seeded samples, and the extension read cold (its engine has no prefix cache)
    stock_sampled = [request(long[5], sampling=SAMPLING[0]), request(long[6], sampling=SAMPLING[1])]
    stock = run_vllm(tmp, "stock", folder, [batches["full"], stock_sampled, [request(extended, logprobs=1)]],
                     oda=None, enable_prefix_caching=False)
    return dict(model=model, head=head, long=long, batches=batches, stock=stock[0], stock_sampled=stock[1],
                oda=results, follow=follow, cold=stock[2])


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
    ours = gqa3["follow"][1]["outputs"][0]
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
                       oda={"sinks": SINKS, "window": WINDOW, "policy": "local"})
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
                       max_num_batched_tokens=32, enable_chunked_prefill=True)
    for req, ours in zip(batch, results[0]["outputs"]):
        policy = req["extra_args"]["oda_policy"]
        tokens, routing = hf_generate(model, head if policy == "head" else None, req["prompt"], 12, policy)
        assert ours["tokens"] == tokens, (family, len(req["prompt"]), policy)
        if policy == "head":
            assert ours["routing"]["decisions"] == routing.decisions[0].tolist()


def test_openai_server_with_oda(gqa3, tmp_path):
    """`oda serve` on loopback, driven through the official openai client: completions, streaming, chat, routing
    records in responses, on /v1/oda/routing and /metrics, and bad requests answered 400 while serving goes on."""
    import socket
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    folder = os.path.dirname(gqa3["head"])
    oda = os.path.join(os.path.dirname(VLLM_PYTHON), "oda")
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([oda, "serve", "--base", folder, "--head", gqa3["head"], "--sinks", str(SINKS),
                               "--window", str(WINDOW), "--port", str(port), "--", "--max-model-len", "1024",
                               "--block-size", "32", "--seed", "0"],
                              env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", **os.environ,
                                   "PYTHONPATH": REPO}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
                assert time.time() < deadline, "the server did not come up in 300 s"
                time.sleep(2)
        ids = gqa3["long"][5]
        proc = subprocess.run([VLLM_PYTHON, os.path.join(REPO, "tests", "vllm_client.py"), str(port), folder,
                               json.dumps(ids)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        seen = json.loads(proc.stdout)
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
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
    assert seen["after_bad"] == seen["completion"]["text"]
    metrics = dict(line.split() for line in seen["metrics"])
    assert int(metrics["oda_routed_steps_total"]) >= 9 + 9 + 5 + 4 * 5 + 9
    assert 0.0 <= float(metrics["oda_pooled_full_call_rate"]) <= 1.0


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
                       max_num_batched_tokens=48)[0]["outputs"]
    check_preempted_equals_unpressed(pressed, gqa3["oda"]["preempt_free"]["outputs"], 60)
    assert 0 < pressed[2]["routing"]["full_calls"] < pressed[2]["routing"]["decided_steps"], "the head never mixed"
    for ids, policy, ours in zip(PREEMPT_PROMPTS, ["full", "local", None, RandomPolicy(0.5, seed=3)], pressed):
        if policy is not None:
            tokens, _ = hf_generate(gqa3["model"], None, ids, 60, policy)
            assert ours["tokens"] == tokens


# ------------------------------------------------------------------------------------------------
# A window-global hybrid: Gemma 3 (sliding-window layers keep their native window; Local restricts the global ones)
# ------------------------------------------------------------------------------------------------
GEMMA_SLIDING = 8   # < sinks + window, so a sliding layer reads less than Local does


def build_gemma3(folder, seed: int = 5):
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=GEMMA_SLIDING, query_pre_attn_scalar=32, max_position_embeddings=1024, pad_token_id=0,
        eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, VOCAB)
    save_random_head(model, folder)
    return model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """One stock engine and one ODA engine (prefix caching on) for a tiny Gemma 3."""
    tmp, folder, model, head, long = served_model(tmp_path_factory, "vllm_gemma3", build_gemma3, prompt_seed=11)
    batches = {**edge_batches(long), "preempt_free": preemption_batches(GEMMA_PREEMPT_PROMPTS, 150)[0]}
    oda = run_vllm(tmp, "oda", folder, list(batches.values()), oda={"head": head, "sinks": SINKS, "window": WINDOW},
                   enable_prefix_caching=True, one_process=False)
    results = dict(zip(batches, oda))
    # a prompt that extends a Local request's prompt and output: only the prompt's blocks may be reused
    extended = long[6] + results["local"]["outputs"][6]["tokens"] + prompt(5, seed=98)
    follow = run_vllm(tmp, "oda_follow", folder, [[request(long[6], policy="local")],
                                                  [request(extended, policy="full", logprobs=1)]],
                      oda={"head": head, "sinks": SINKS, "window": WINDOW}, enable_prefix_caching=True)
    stock = run_vllm(tmp, "stock", folder, [batches["full"], [request(extended, logprobs=1)]], oda=None,
                     enable_prefix_caching=False)
    return dict(model=model, head=head, long=long, oda=results, follow=follow, stock=stock)


GEMMA_PREEMPT_PROMPTS = [prompt(100, seed=300 + i) for i in range(4)]


def test_gemma3_preempted_requests_continue_as_if_never_preempted(gemma3, tmp_path):
    """As for Llama, with sliding-window layers (they attend natively in every pass, the recomputed chunk too). 24 KV
    blocks (12 per group) for 4 requests of 250 tokens."""
    folder = os.path.dirname(gemma3["head"])
    pressed = run_vllm(tmp_path, "preempt", folder, preemption_batches(GEMMA_PREEMPT_PROMPTS, 150),
                       oda={"head": gemma3["head"], "sinks": SINKS, "window": WINDOW}, max_model_len=352,
                       num_gpu_blocks_override=24, enable_prefix_caching=True)[0]["outputs"]
    check_preempted_equals_unpressed(pressed, gemma3["oda"]["preempt_free"]["outputs"], 150)


def test_gemma3_always_full_equals_stock_vllm(gemma3):
    for ours, stock in zip(gemma3["oda"]["full"]["outputs"], gemma3["stock"][0]["outputs"]):
        assert ours["tokens"] == stock["tokens"]
        assert max(abs(a - b) for a, b in zip(ours["logprobs"], stock["logprobs"])) < 1e-4


def test_gemma3_always_local_equals_transformers_path_and_differs_from_full(gemma3):
    for ids, ours in zip(gemma3["long"], gemma3["oda"]["local"]["outputs"]):
        tokens, _ = hf_generate(gemma3["model"], None, ids, 12, "local")
        assert ours["tokens"] == tokens, f"prompt of {len(ids)} tokens"
        assert ours["routing"]["decided_steps"] == sum(len(ids) + t > SPAN for t in range(1, 12))
    local = [o["tokens"] for o in gemma3["oda"]["local"]["outputs"]]
    full = [o["tokens"] for o in gemma3["oda"]["full"]["outputs"]]
    assert local[-2:] != full[-2:], "Local equals Full far past the window: the global layers were not restricted"


def test_gemma3_head_decisions_and_tokens_match_transformers_path(gemma3):
    mixed = 0
    for ids, ours in zip(gemma3["long"], gemma3["oda"]["head"]["outputs"]):
        tokens, routing = hf_generate(gemma3["model"], gemma3["head"], ids, 12, "head", threshold=0.0)
        scores = routing.scores[0].tolist()
        assert not [q for q in scores if math.isfinite(q) and abs(q) < 1e-4], "scores too close to the threshold"
        assert ours["routing"]["decisions"] == routing.decisions[0].tolist()
        assert ours["tokens"] == tokens
        mixed += 0 < sum(ours["routing"]["decisions"]) < len(ours["routing"]["decisions"])
    assert mixed, "the head never mixed Full and Local: the test would not see a wrong retry"


def test_gemma3_prefix_caching_reuses_prompt_blocks_only(gemma3):
    ours = gemma3["follow"][1]["outputs"][0]
    cold = gemma3["stock"][1]["outputs"][0]
    assert ours["num_cached_tokens"] == len(gemma3["long"][6]) // 32 * 32
    assert ours["tokens"] == cold["tokens"]
    assert max(abs(a - b) for a, b in zip(ours["logprobs"], cold["logprobs"])) < 1e-4


def test_gemma3_prefix_caching_without_the_hybrid_kv_cache_manager_is_refused(gemma3, tmp_path):
    """With vLLM's hybrid KV cache manager off, sliding layers lose their prompt-only caching (measured before the
    check: an extension of a Local request reused 160 tokens, a block of Local decode KV). The engine must refuse."""
    folder = os.path.dirname(gemma3["head"])
    with pytest.raises(AssertionError, match="vLLM driver failed"):
        run_vllm(tmp_path, "no_hma", folder, [[request(gemma3["long"][0], policy="local")]],
                 oda={"head": gemma3["head"], "sinks": SINKS, "window": WINDOW}, enable_prefix_caching=True,
                 disable_hybrid_kv_cache_manager=True)
    assert "needs vLLM's hybrid KV cache manager" in (tmp_path / "no_hma.log").read_text()


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
                   "sinks": SINKS, "window": WINDOW}, enable_lora=True, max_lora_rank=8, max_loras=2)
    rows, single = out[0]["outputs"], out[1]["outputs"][0]
    assert rows[2]["tokens"] != rows[3]["tokens"], "the adapter changed nothing: the test would see nothing"
    assert rows[1]["tokens"] == rows[2]["tokens"]
    assert rows[1]["routing"]["full_calls"] == rows[1]["routing"]["routed_steps"] == 15
    assert rows[4]["tokens"] == single["tokens"]
    assert rows[4]["routing"]["decisions"] == single["routing"]["decisions"]
    assert 0 < rows[4]["routing"]["full_calls"] < rows[4]["routing"]["routed_steps"], "the head did not mix"


# -- Qwen3.5: Gated DeltaNet linear attention beside full attention ---------------------------------------------
# vLLM's CPU kernels for Gated DeltaNet run only in bfloat16 with head dim 128, so this model is bfloat16 and its
# checks against the Transformers path compare tokens and decisions, not logprobs to 1e-4.


def build_qwen3_5(folder, seed: int = 3):
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
        linear_num_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        tie_word_embeddings=False)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)   # bfloat16: sharper still, so rounding does not flip greedy tokens
    model.to(torch.bfloat16).save_pretrained(folder)
    save_word_tokenizer(folder, VOCAB)
    # Loaded back as a user would: `.to(bfloat16)` above also rounded the rotary inverse frequencies (a buffer the
    # checkpoint does not hold), so the object in memory is not the model vLLM serves.
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    save_random_head(model, folder)
    return model


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """One stock engine and one ODA engine for a tiny Qwen3.5 (2 Gated DeltaNet + 2 full-attention layers)."""
    tmp, folder, model, head, long = served_model(tmp_path_factory, "vllm_qwen3_5", build_qwen3_5, prompt_seed=23)
    batches = {**edge_batches(long),
               # the head asks for Full at every decided step: each such step runs Local, restores the recurrent
               # states and reruns Full, which must end where always-Full does
               "head_always": [request(ids, policy="head", threshold=-1e9, logprobs=1) for ids in long],
               "mixed": [request(long[6], policy="local"), request(long[5], policy="head", threshold=-1e9),
                         request(long[4], policy="head", threshold=0.0), request(long[3], policy="full")],
               "preempt_free": preemption_batches(QWEN3_5_PREEMPT_PROMPTS, 100)[0]}
    engine = dict(dtype="bfloat16", torchvision=True)
    oda = run_vllm(tmp, "oda", folder, list(batches.values()), oda={"head": head, "sinks": SINKS, "window": WINDOW},
                   one_process=False, **engine)
    stock = run_vllm(tmp, "stock", folder, [batches["full"]], oda=None, enable_prefix_caching=False, **engine)
    return dict(model=model, head=head, long=long, oda=dict(zip(batches, oda)), stock=stock[0], tmp=tmp,
                folder=folder)


# Qwen3.5's attention blocks hold 544 tokens here (vLLM sizes them to the recurrent states' pages), so preemption
# needs requests that cross a block: 4 of 600 tokens in 6 blocks.
# vLLM sizes a hybrid's attention blocks to the Gated DeltaNet state's page (288 tokens here), so 6 KV blocks give 3 per
# group: 250-token prompts start in one block each and need a second one at token 289, which forces preemption
# (prompts of 500 needed 2-3 blocks each and only queued, never preempted).
QWEN3_5_PREEMPT_PROMPTS = [prompt(250, seed=400 + i) for i in range(4)]


def test_qwen3_5_preempted_requests_recompute_their_routing(qwen3_5, tmp_path):
    """A recomputed chunk replays Local steps exactly: always-Local equals the request without memory pressure. With
    Full steps in the history, bfloat16 tells them apart: the Gated DeltaNet recomputes a chunk with its chunked
    kernel, not step by step, and stock vLLM's own always-Full output changes too after a preemption (measured: from
    output 75 and 88 of 100; the head's scores move by ~5e-4 from the resumed step on). So for the head (whose Full
    retry of a recomputed chunk reruns the whole row from its restored recurrent states) this checks the counts:
    every output after the first is a routed step, decided once."""
    pressed = run_vllm(tmp_path, "preempt", qwen3_5["folder"], preemption_batches(QWEN3_5_PREEMPT_PROMPTS, 100),
                       oda={"head": qwen3_5["head"], "sinks": SINKS, "window": WINDOW}, max_model_len=1024,
                       num_gpu_blocks_override=6, dtype="bfloat16", torchvision=True)[0]["outputs"]
    free = qwen3_5["oda"]["preempt_free"]["outputs"]
    local = PREEMPT_POLICIES.index("local")
    assert pressed[local]["tokens"] == free[local]["tokens"]
    assert pressed[local]["routing"]["recomputed_tokens"] > 0, "the Local request was not preempted"
    head = PREEMPT_POLICIES.index("head")
    assert pressed[head]["routing"]["recomputed_tokens"] > 0, "the head's request was not preempted"
    for ours in pressed:
        routing = ours["routing"]
        assert len(ours["tokens"]) == 100 and routing["routed_steps"] == len(routing["decisions"]) == 99
    assert 0 < pressed[head]["routing"]["full_calls"] < pressed[head]["routing"]["decided_steps"]


def test_qwen3_5_always_full_equals_stock_vllm(qwen3_5):
    for ours, stock in zip(qwen3_5["oda"]["full"]["outputs"], qwen3_5["stock"]["outputs"]):
        assert ours["tokens"] == stock["tokens"]
        assert max(abs(a - b) for a, b in zip(ours["logprobs"], stock["logprobs"])) < 1e-4


def test_qwen3_5_a_retried_step_restores_the_recurrent_states(qwen3_5):
    """Every decided step runs Local, then Full over the same rows: equal to always-Full only if the Gated DeltaNet
    states the Local pass advanced were put back before the Full pass (without it the tokens diverge)."""
    for ids, ours, stock in zip(qwen3_5["long"], qwen3_5["oda"]["head_always"]["outputs"],
                                qwen3_5["stock"]["outputs"]):
        assert ours["routing"]["full_calls"] == ours["routing"]["decided_steps"] == sum(
            len(ids) + t > SPAN for t in range(1, 12))
        assert ours["tokens"] == stock["tokens"], f"prompt of {len(ids)} tokens"
        # measured: 0.0 (without the restore: 0.03-1.1, and 3 of 7 token sequences diverge)
        assert max(abs(a - b) for a, b in zip(ours["logprobs"], stock["logprobs"])) < 1e-4


def test_qwen3_5_always_local_equals_transformers_path_and_differs_from_full(qwen3_5):
    for ids, ours in zip(qwen3_5["long"], qwen3_5["oda"]["local"]["outputs"]):
        tokens, _ = hf_generate(qwen3_5["model"], None, ids, 12, "local")
        assert ours["tokens"] == tokens, f"prompt of {len(ids)} tokens"
        assert ours["routing"]["full_calls"] == 0
    local = [o["tokens"] for o in qwen3_5["oda"]["local"]["outputs"]]
    full = [o["tokens"] for o in qwen3_5["oda"]["full"]["outputs"]]
    assert local[-2:] != full[-2:], "Local equals Full far past the window: the full-attention layers were not restricted"


def test_qwen3_5_head_decisions_and_tokens_match_transformers_path(qwen3_5):
    mixed = 0
    for ids, ours in zip(qwen3_5["long"], qwen3_5["oda"]["head"]["outputs"]):
        tokens, routing = hf_generate(qwen3_5["model"], qwen3_5["head"], ids, 12, "head", threshold=0.0)
        scores = routing.scores[0].tolist()
        close = [i for i, q in enumerate(scores) if math.isfinite(q) and abs(q) < 2e-2]  # bfloat16 states
        ours_decisions = [d for i, d in enumerate(ours["routing"]["decisions"]) if i not in close]
        assert ours_decisions == [d for i, d in enumerate(routing.decisions[0].tolist()) if i not in close]
        if not close:
            assert ours["tokens"] == tokens
        mixed += 0 < sum(ours["routing"]["decisions"]) < len(ours["routing"]["decisions"])
    assert mixed, "the head never mixed Full and Local: the test would not see a wrong retry"


def test_qwen3_5_mixed_policies_in_one_batch_equal_each_request_alone(qwen3_5):
    results = qwen3_5["oda"]
    mixed = results["mixed"]["outputs"]
    assert mixed[0]["tokens"] == results["local"]["outputs"][6]["tokens"]
    assert mixed[1]["tokens"] == results["head_always"]["outputs"][5]["tokens"]
    assert mixed[2]["routing"]["decisions"] == results["head"]["outputs"][4]["routing"]["decisions"]
    assert mixed[3]["tokens"] == results["full"]["outputs"][3]["tokens"]


def test_qwen3_5_with_chunked_prefill_beside_retried_decode_rows(qwen3_5, tmp_path):
    """A token budget of 32 per step: 70- and 150-token prompts are prefilled in chunks beside other rows' decode
    steps, whose recurrent states are saved and restored by batch row, and each Full-retried request is compared with
    the same prompt served always-Full in that batch. Here the retry is a sub-batch of its own, and bfloat16 matmuls
    round by batch shape (measured: logprobs 0.015 apart, and a near-tie flipped one sequence's 10th token), so the
    two must agree to bfloat16 rounding up to their first different token, which must not come early. The exact
    check is the unchunked test above, where both run in the same shapes (0.0 apart). (Local rows are not compared
    with the Transformers path here for the same reason.)"""
    prompts = [qwen3_5["long"][4], qwen3_5["long"][5], qwen3_5["long"][6]]
    batch = [request(ids, policy=policy, threshold=threshold, logprobs=1) for ids in prompts
             for policy, threshold in (("full", None), ("head", -1e9), ("local", None))]  # Local rows: other states
    results = run_vllm(tmp_path, "chunked", qwen3_5["folder"], [batch],
                       oda={"head": qwen3_5["head"], "sinks": SINKS, "window": WINDOW}, dtype="bfloat16",
                       torchvision=True, max_num_batched_tokens=32, enable_chunked_prefill=True)
    outputs = results[0]["outputs"]
    agreed = []
    for i, ids in enumerate(prompts):
        full, retried, local = outputs[3 * i: 3 * i + 3]
        assert retried["routing"]["full_calls"] == retried["routing"]["decided_steps"] > 0
        assert local["routing"]["full_calls"] == 0 and local["routing"]["decided_steps"] > 0
        same = next((t for t, (a, b) in enumerate(zip(retried["tokens"], full["tokens"])) if a != b), 12)
        agreed.append(same)
        assert max(abs(a - b) for a, b in zip(retried["logprobs"][:same], full["logprobs"][:same])) < 5e-2
    assert min(agreed) >= 6 and sum(n == 12 for n in agreed) >= 2, agreed


def test_qwen3_5_without_torchvision_names_the_fix():
    if _vllm_has_torchvision():
        pytest.skip("the vLLM environment has a working torchvision")
    probe = "import oda_hf.vllm.model as m; m.OdaQwen3_5ForCausalLM"
    proc = subprocess.run([VLLM_PYTHON, "-c", probe], capture_output=True, text=True, env={**os.environ,
                                                                                          "PYTHONPATH": REPO})
    assert proc.returncode != 0
    assert "needs a working torchvision" in proc.stderr and "pip install torchvision" in proc.stderr


HAND_CONFIG_PROBE = """
import json, os, sys
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from oda_hf.vllm.settings import check_engine_features
from oda_hf.vllm.validator import OdaRequestValidator
oda = {"head": sys.argv[2] or None, "sinks": 4, "window": 16}
def engine_config(**settings):
    return EngineArgs(model=sys.argv[1], hf_overrides={"architectures": ["OdaQwen3_5ForCausalLM"], "oda": oda},
                      dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True, **settings).create_engine_config()
config = engine_config()
try:
    OdaRequestValidator.validate_params(SamplingParams(extra_args={"oda_policy": "head"}))
    admitted = "admitted"
except ValueError as err:
    admitted = str(err)
check_engine_features(config)   # what the model checks at engine start, on vLLM's own config objects
try:
    check_engine_features(engine_config(kv_cache_dtype="fp8"))
    fp8 = "served"
except ValueError as err:
    fp8 = str(err)
print(json.dumps([config.cache_config.mamba_ssm_cache_dtype, sorted(config.model_config.hf_text_config.rope_parameters),
                  admitted, fp8]))
"""


@pytest.mark.parametrize("with_head", [False, True])
def test_an_engine_configured_by_hand_is_configured_as_engine_args_does(tmp_path, with_head):
    """`hf_overrides` naming an ODA class, without `engine_args` (README's hand-started server): vLLM's config hook of
    the base architecture runs (Qwen3.5: the checkpoint's recurrent-state dtype, M-RoPE fields dropped for the text
    model), and admission knows whether the engine has a head (a head request to a headless one is refused before
    it reaches a model step, where it would stop the engine). The engine-start check refuses a quantized KV cache
    from vLLM's own config: measured before, with kv_cache_dtype="fp8" on the CPU build, always-Local read the
    kernels' quantized bytes as numbers (tokens unlike stock vLLM's from the second on, exit 0)."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
        linear_num_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, mamba_ssm_dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    config.architectures = ["Qwen3_5ForCausalLM"]   # as a real checkpoint's text model carries them
    config.save_pretrained(tmp_path)
    path = [REPO] + ([] if _vllm_has_torchvision() else [os.path.join(REPO, "tests", "vllm_stubs")])
    # A fresh process knows nothing of an engine_args call in this one (which records the head in the environment).
    env = {key: value for key, value in os.environ.items() if key != "ODA_VLLM_SERVES_HEAD"}
    env["PYTHONPATH"] = os.pathsep.join(path)
    proc = subprocess.run([VLLM_PYTHON, "-c", HAND_CONFIG_PROBE, str(tmp_path), "/heads/h" if with_head else ""],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dtype, rope, admitted, fp8 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert dtype == "float32" and rope == ["partial_rotary_factor", "rope_theta", "rope_type"]
    assert "ODA does not serve with a quantized KV cache (kv_cache_dtype='fp8')" in fp8
    if with_head:
        assert admitted == "admitted"
    else:
        assert "needs the recall head" in admitted


def test_oda_serve_command_line_carries_the_engine_settings(qwen3_5):
    """`oda serve`'s server command line, parsed by vLLM's own server parser: Qwen3.5's settings from engine_args
    (prefix caching off) arrive; a flag the user passes after `--` wins."""
    snippet = """
import argparse, json, sys
from oda_hf.vllm.server import serve_argv
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = argparse.Namespace(base=sys.argv[1], head=sys.argv[1] + "/head", sinks=4, window=16, threshold=None,
                          policy=None, dtype="bfloat16", host="127.0.0.1", port=8000)
parser = make_arg_parser(FlexibleArgumentParser())
plain = parser.parse_args(serve_argv(args, [])[1:])
overridden = parser.parse_args(serve_argv(args, ["--enable-prefix-caching"])[1:])
print(json.dumps([plain.enable_prefix_caching, overridden.enable_prefix_caching, plain.worker_cls]))
"""
    proc = subprocess.run([VLLM_PYTHON, "-c", snippet, qwen3_5["folder"]], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [False, True, "oda_hf.vllm.worker.OdaCPUWorker"]
