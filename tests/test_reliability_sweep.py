"""Reliability round 3, last adversarial sweep: inputs the earlier tables missed. Each bad input ends in one line
``oda <command>: error: ...`` with exit status 2 (CLI) or a one-line ValueError/TypeError (Python); flags that
the run would silently ignore are refused; a fresh `oda train-head` never mixes its files with another run's."""

import json

import pytest
import torch

from oda_hf import RandomPolicy, RecallHead, RecallHeadConfig
from oda_hf.evaluation.suites import EvalExample
from oda_hf.validation import parse_policy_text, seed
from tiny_models import save_with_word_tokenizer, tiny_model
from cli_harness import run_oda as oda

WORDS = " ".join(f"w{i}" for i in range(3, 40))  # 37 prompt tokens
HUGE = str(2**70)


def record(i, **changes):
    return {"id": f"e{i}", "task": "t1", "prompt": WORDS, "answers": ["w5"], "max_new_tokens": 2,
            "metric": "string_match_part", **changes}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    base = tiny_model("qwen3")  # max_position_embeddings 512, vocabulary 97
    save_with_word_tokenizer(base, root / "base")
    torch.manual_seed(0)
    RecallHead(RecallHeadConfig.for_base(base, head_width=8)).save_pretrained(root / "head")
    for name, records in {"good": [record(0)], "empty_prompt": [record(0, prompt="")],
                          "blank_prompt": [record(0, prompt="   ")], "empty_answer": [record(0, answers=["w5", ""])]
                          }.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "docs.jsonl").write_text("".join(json.dumps({"input_ids": list(range(3, 40))}) + "\n" for _ in range(2)))
    return root




def assert_one_line_error(code, err, command, fragment):
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if f"oda {command}: error:" in line]
    assert len(errors) == 1, err
    assert fragment in errors[0], errors[0]


GEN = ["generate", "--base", "{root}/base", "--prompt", WORDS]
EVAL = ["eval", "--base", "{root}/base", "--data", "{root}/good.jsonl", "--out", "{root}/eval_{n}", "--no-progress",
        "--no-plots", "--window", "2"]
TRAIN = ["train-head", "--base", "{root}/base", "--data", "{root}/docs.jsonl", "--output", "{root}/train_{n}",
         "--sinks", "2", "--window", "3", "--seq-len", "16", "--max-steps", "1", "--warmup-steps", "0",
         "--head-width", "8", "--threads", "1"]

# (id, argv, message fragment)
BAD_INPUTS = [
    # A seed past 64 bits failed inside torch ("Overflow when unpacking long long").
    ("generate-seed-huge", GEN + ["--temperature", "1", "--seed", HUGE],
     "argument --seed: must be an integer >= 0 and <= 2**64 - 1"),
    ("generate-policy-seed-huge", GEN + ["--window", "2", "--policy", f"random:0.5:{HUGE}"],
     "`random:P:SEED` must be an integer >= 0 and <= 2**64 - 1"),
    ("eval-seeds-huge", EVAL + ["--policies", "random:0.5", "--seeds", HUGE],
     "argument --seeds: must be an integer >= 0 and <= 2**64 - 1"),
    # Flags that no part of the run reads were silently ignored (exit 0).
    ("generate-threshold-without-head", GEN + ["--window", "2", "--threshold", "5"],
     "--threshold 5 is the recall head's threshold, but no --head is given"),
    ("generate-threshold-with-policy-full", GEN + ["--head", "{root}/head", "--window", "2", "--policy", "full",
                                                   "--threshold", "0.5"],
     "--threshold 0.5 is the recall head's threshold, but --policy 'full' does not ask the head"),
    ("generate-threshold-beside-a-budget-threshold", GEN + ["--head", "{root}/head", "--window", "2", "--policy",
                                                            "budget:0.5:0.2", "--threshold", "0.3"],
     "--threshold 0.3 and --policy budget:0.5:0.2 give two thresholds"),
    ("eval-thresholds-without-oda", EVAL + ["--policies", "full", "--thresholds", "0.1"],
     "--thresholds sets the thresholds of oda"),
    ("eval-paper-sweep-without-oda", EVAL + ["--policies", "full", "local", "--paper-sweep"],
     "--paper-sweep sets the thresholds of oda"),
    ("eval-seeds-without-random", EVAL + ["--policies", "full", "--seeds", "5"],
     "--seeds seeds the random policies, but --policies runs none"),
    ("flops-history-without-batch", ["flops", "--history", "100"],
     "--history only applies to the batch table"),
    ("flops-batch-flags-without-batch", ["flops", "--rate", "0.5", "--mode", "rows", "--hardware", "a100-sxm-80gb"],
     "--rate, --mode, --hardware only apply to the batch table"),
    ("flops-sequence-flags-with-batch", ["flops", "--batch", "1", "--history", "100", "--continuation", "50"],
     "--continuation only applies to the sequence table"),
    # The output cap alone past the context: the advice was "shorten it to at most 0 tokens".
    ("generate-max-new-tokens-past-context", GEN + ["--window", "2", "--max-new-tokens", "1000"],
     "--max-new-tokens 1000 leaves no room for the prompt in the model's max_position_embeddings=512: lower "
     "--max-new-tokens to at most 475"),
    # An empty prompt reached generate() (RuntimeError: cannot reshape tensor of 0 elements).
    ("eval-empty-prompt", EVAL + ["--policies", "full", "--data", "{root}/empty_prompt.jsonl"],
     "example 'e0' (task 't1'): its prompt is empty (it tokenizes to no token)"),
    ("eval-blank-prompt", EVAL + ["--policies", "full", "--data", "{root}/blank_prompt.jsonl"],
     "its prompt is empty"),
    # An empty answer is a substring of every output: string_match scored 100 with exit 0.
    ("eval-empty-answer", EVAL + ["--policies", "full", "--data", "{root}/empty_answer.jsonl"],
     "'answers' holds an empty answer, which every output would match"),
    # torch.set_num_threads(100000): "can't start new thread" traceback after the data and model loaded.
    ("train-head-threads-huge", TRAIN + ["--threads", "100000"], "argument --threads: must be at most"),
    ("cache-supervision-threads-huge", ["cache-supervision", "--base", "{root}/base", "--data", "{root}/docs.jsonl",
                                        "--output", "{root}/cache_{n}", "--threads", "100000"],
     "argument --threads: must be at most"),
    ("calibrate-threads-huge", ["calibrate", "--base", "{root}/base", "--head", "{root}/head", "--data",
                                "{root}/good.jsonl", "--target-rate", "0.5", "--out", "{root}/cal_{n}", "--threads",
                                "100000"], "argument --threads: must be at most"),
    ("demo-threads-huge", ["demo", "--threads", "100000"], "argument --threads: must be at most"),
    # Options the demo did not read (exit 0): --head on the organism, --model smollm2 beside --organism.
    ("demo-head-with-the-organism", ["demo", "--model", "organism", "--head", "{root}/missing"],
     "--head is SmolLM2's recall head, but this demo runs the model organism"),
    ("demo-organism-with-smollm2", ["demo", "--model", "smollm2", "--organism", "{root}/organism"],
     "--organism runs the model organism but --model smollm2 asks for SmolLM2"),
    # 10**12 bootstrap resamples ran for hours (each resample is kept in memory).
    ("diagnose-bootstrap-huge", ["diagnose", "--base", "{root}/base", "--history", "full", "--data",
                                 "{root}/docs.jsonl", "--out", "{root}/diag_{n}", "--bootstrap", str(10**12)],
     "--bootstrap 1000000000000 is more resamples than the intervals need"),
]


@pytest.mark.parametrize("argv,fragment", [row[1:] for row in BAD_INPUTS], ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_is_one_line_with_exit_status_2(root, capsys, argv, fragment):
    n = len(list(root.iterdir()))
    argv = [a.replace("{root}", str(root)).replace("{n}", str(n)) for a in argv]
    assert_one_line_error(*oda(argv, capsys), argv[0], fragment)


API_ROWS = [
    ("RandomPolicy seed past 64 bits", lambda: RandomPolicy(0.5, 2**70), ValueError,
     "`RandomPolicy seed` must be an integer >= 0 and <= 2**64 - 1"),
    ("policy text seed past 64 bits", lambda: parse_policy_text(f"random:0.5:{2**64}"), ValueError,
     "must be an integer >= 0 and <= 2**64 - 1"),
    ("seed float", lambda: seed("seed", 1.0), TypeError, "`seed` must be an integer"),
    ("empty answer", lambda: EvalExample(id="a", task="t", answers=[""], max_new_tokens=1, metric="string_match_all",
                                         prompt="x"), ValueError, "holds an empty answer"),
]


@pytest.mark.parametrize("call,error,fragment", [row[1:] for row in API_ROWS], ids=[row[0] for row in API_ROWS])
def test_python_api_bad_values(call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value) and len(str(info.value).splitlines()) == 1


def test_seed_range_edges():
    assert seed("seed", 2**64 - 1) == 2**64 - 1
    assert RandomPolicy(0.5, 2**64 - 1).seed == 2**64 - 1
    assert parse_policy_text("random:0.5:0").seed == 0


def test_a_fresh_train_head_refuses_an_output_of_another_run(root, capsys):
    """Without --resume, a run into a folder holding another run's checkpoints (other settings) or a head that
    `oda train-head` did not write would overwrite it or leave the two runs' files mixed (exit 0 before). The same
    command again, as after a kill, still runs."""
    out = root / "train_fresh"
    argv = [a.replace("{root}", str(root)).replace("train_{n}", "train_fresh") for a in TRAIN]
    code, err = oda(argv, capsys)
    assert code == 0, err
    code, err = oda(argv, capsys)  # the same command again
    assert code == 0, err
    window = argv.index("--window") + 1
    other = argv[:window] + ["4"] + argv[window + 1:]
    assert_one_line_error(*oda(other, capsys), "train-head", f"--output {out} holds another training run (window: 3")
    steps = argv.index("--max-steps") + 1
    other_steps = argv[:steps] + ["2"] + argv[steps + 1:]
    assert_one_line_error(*oda(other_steps, capsys), "train-head",
                          "holds another training run (max_steps: 1 there, 2 now")
    head_folder = [a.replace(str(out), str(root / "head")) for a in argv]
    before = (root / "head" / "model.safetensors").read_bytes()
    assert_one_line_error(*oda(head_folder, capsys), "train-head", "holds a recall head without oda_training.json")
    assert (root / "head" / "model.safetensors").read_bytes() == before


def test_demo_with_a_head_for_another_base_is_one_line(root, capsys, monkeypatch):
    """`oda demo --model smollm2 --head <a head of another base>` ended in a ValueError traceback."""
    import oda_hf.known_models

    other = tiny_model("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    RecallHead(RecallHeadConfig.for_base(other, head_width=8)).save_pretrained(root / "other_head")
    monkeypatch.setattr(oda_hf.known_models, "fetch_smollm2", lambda say=None: str(root / "base"))
    code, err = oda(["demo", "--model", "smollm2", "--head", root / "other_head", "--output", root / "demo_out"], capsys)
    assert_one_line_error(code, err, "demo", f"--head {root / 'other_head'}: This recall head was trained for")


def test_generate_with_a_head_routes_with_it_and_reads_threshold(root, capsys):
    """--policy's documented default with --head is `head`: a head folder saved with policy 'local' once ran
    StreamingLLM with the head unused and --threshold ignored (exit 0); `budget:RATE` with --threshold was refused
    although the budget reads that threshold."""
    from oda_hf import OdaForCausalLM

    OdaForCausalLM.from_pretrained(root / "base", head=root / "head", policy="local").save_pretrained(
        root / "local_saved")
    gen = [a.replace("{root}", str(root)) for a in GEN] + ["--window", "2", "--max-new-tokens", "3"]
    code, err = oda(gen + ["--head", root / "local_saved", "--threshold", "0.5"], capsys)
    assert code == 0, err
    assert "policy=HeadPolicy(threshold=0.5)" in err
    code, err = oda(gen + ["--head", root / "head", "--policy", "budget:0.5", "--threshold", "0.3"], capsys)
    assert code == 0, err
    assert "BudgetPolicy(rate=0.5, threshold=0.3)" in err
