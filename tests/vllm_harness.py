"""What the vLLM plugin's test files share: the vLLM environment they need, tiny models with random heads, request
batches, `run_vllm` (one engine per call, through `tests/vllm_driver.py`) and the Transformers path to compare with.

vLLM pins an older transformers than oda_hf needs, so it lives in its own environment (`.venv-vllm`, made by
`.ci/run`). The tests run in oda_hf's environment: they build tiny random models, run every request batch on one
vLLM engine per configuration under the vLLM environment's Python, and compare with `OdaForCausalLM` here. Without
that environment the importing test file is skipped (and fails under CI, where it must exist).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
import transformers

from oda_hf import OdaForCausalLM, RecallHead, RecallHeadConfig
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
# No torch.compile warm-up (11-18 of the 44 s an in-process engine takes to start on an idle 2-core machine, 50-75 s
# under load): for the float32 engines other than each fixture's first ODA engine, which runs the compiled model as CPU
# users do. Eager float32 stock vLLM matches that compiled ODA engine's always-Full logprobs within 1.5e-6 (the tests
# ask 1e-4). The bfloat16 Qwen3.5 engines all stay compiled: there, eager and compiled differ (a logprob 1.2 apart).
EAGER = dict(enforce_eager=True)


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


def vllm_has_torchvision() -> bool:
    probe = "import torchvision, torch; torch.ops.torchvision.nms"
    return subprocess.run([VLLM_PYTHON, "-c", probe], capture_output=True).returncode == 0


def run_vllm(tmp_path, name: str, model_folder: str, batches: list, oda: dict | None, torchvision: bool = False,
             one_process: bool = True, sessions: list | None = None, python_path: tuple = (), env: dict | None = None,
             timeout: int = 900, **engine) -> list:
    """`torchvision`: the model's vLLM module imports torchvision (Qwen3.5); without a working one in the vLLM
    environment, the test stand-in `tests/vllm_stubs` is put on the path (see its README).

    `python_path`: more folders on the engine processes' path (e.g. a `sitecustomize.py` that changes them); `env`:
    more environment variables.

    `sessions`: streaming-input sessions instead of `batches` (see `vllm_driver.py`).

    `one_process`: the engine core and worker run inside the driver's process (half of each engine's start-up time
    on CI's machine). The first ODA engine of each model family passes False: engine core and worker in processes of
    their own, as `LLM` and `oda serve` run them for users."""
    spec = {"engine": {"model": model_folder, **ENGINE, **engine}, "oda": oda, "batches": batches,
            "one_process": one_process, **({"sessions": sessions} if sessions is not None else {})}
    spec_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    path = [*python_path, REPO]
    if torchvision and not vllm_has_torchvision():
        path.append(os.path.join(REPO, "tests", "vllm_stubs"))
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(path)}
    # In a session of its own: a hung engine is killed whole at the timeout, its engine core and workers with it
    # (subprocess.run kills the driver alone, and the orphans went on taking the CPU)
    proc = subprocess.Popen([VLLM_PYTHON, os.path.join(REPO, "tests", "vllm_driver.py"), str(spec_path),
                             str(out_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        (tmp_path / f"{name}.log").write_text(stdout + stderr)
        raise AssertionError(f"vLLM driver hung: killed after {timeout} s:\n{stderr[-6000:]}") from None
    (tmp_path / f"{name}.log").write_text(stdout + stderr)   # vLLM logs a worker's failure on stdout
    if proc.returncode != 0:
        raise AssertionError(f"vLLM driver failed ({proc.returncode}):\n{stderr[-6000:]}")
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


def extension(batches: list, name: str, row: int, before: list, after: list, **kwargs) -> dict:
    """A request whose prompt is `before` + the output of row `row` of the batch called `name` (served earlier on the
    same engine; `batches` lists the names in serving order) + `after` (see vllm_driver.py's "prompt_parts")."""
    req = request(None, **kwargs)
    del req["prompt"]
    req["prompt_parts"] = [before, {"output_of": [batches.index(name), row]}, after]
    return req


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
        # and the head's scores: a resumed step that read the wrong preceding hidden state scored -0.064 for -0.074,
        # the same decision (a mutation audit's survivor)
        assert all((a is None) == (b is None) and (a is None or abs(a - b) < 1e-4)
                   for a, b in zip(ours["routing"]["scores"], alone["routing"]["scores"]))
        assert ours["routing"]["routed_steps"] == max_tokens - 1
        assert alone["routing"]["recomputed_tokens"] == 0
    assert any(o["routing"]["recomputed_tokens"] for o in pressed), "no request was preempted: the test saw nothing"


# Window edges: routed steps at seq_len w, w+1, s+w, s+w+1 and far past it (many wrap-arounds of a ring).
EDGE_LENGTHS = [WINDOW - 2, WINDOW, SPAN - 1, SPAN, SPAN + 1, 45, 150]
