"""`oda` user errors end as one line, ``oda <command>: error: ...``, with exit status 2 and no traceback."""

import json
import os
import subprocess
import sys

import pytest
import torch

from oda_hf import RecallHead, RecallHeadConfig
from tiny_models import save_with_word_tokenizer, tiny_model
from cli_harness import run_oda as oda

WORDS = " ".join(f"w{i}" for i in range(3, 40))  # 37 prompt tokens


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("badcli")
    base = tiny_model("qwen3")
    save_with_word_tokenizer(base, root / "base")
    base.save_pretrained(root / "base_no_tokenizer")
    RecallHead(RecallHeadConfig.for_base(base, head_width=8)).save_pretrained(root / "head")
    (root / "broken.jsonl").write_text('{"id": "a", "task": "qa", "prompt": "w3 w4"\n')
    (root / "text.jsonl").write_text("".join(json.dumps({"text": WORDS}) + "\n" for _ in range(3)))
    (root / "empty_out").mkdir()
    return root




# (id, argv with {root} placeholders, message fragment)
BAD_INPUTS = [
    ("dtype-unknown", ["generate", "--base", "{root}/base", "--dtype", "bf17", "--prompt", "w3"],
     "unknown dtype 'bf17'; use one of auto, float32, fp32"),
    ("eval-dtype-unknown", ["eval", "--base", "{root}/base", "--dtype", "int8", "--data", "{root}/text.jsonl",
                            "--out", "{root}/o"], "unknown dtype 'int8'"),
    ("eval-data-missing", ["eval", "--base", "{root}/base", "--data", "{root}/nope.jsonl", "--out", "{root}/o1",
                           "--policies", "full"], "--data {root}/nope.jsonl: no such file or directory"),
    ("eval-data-malformed", ["eval", "--base", "{root}/base", "--data", "{root}/broken.jsonl", "--out", "{root}/o2",
                             "--policies", "full", "--no-progress"], "--data: {root}/broken.jsonl:1: not valid JSON"),
    ("eval-chat-template-missing", ["eval", "--base", "{root}/base", "--data", "{root}/text.jsonl", "--out",
                                    "{root}/o3", "--policies", "full", "--chat-template"],
     "--chat-template: the tokenizer of {root}/base has no chat template"),
    ("eval-report-only-unread", ["eval", "--out", "{root}/empty_out", "--report-only", "--tasks", "qa", "--sinks",
                                 "0"], "--sinks, --tasks: --report-only rebuilds the report from the records"),
    ("eval-merge-unread", ["eval", "--out", "{root}/empty_out", "--merge", "{root}/empty_out", "--limit", "2"],
     "--limit: --merge rebuilds the report"),
    ("train-from-cache-tokenizer", ["train-head", "--base", "{root}/base", "--from-cache", "{root}/nope", "--tokenizer",
                                    "{root}/base", "--output", "{root}/t9"],
     "--tokenizer {root}/base tokenizes the text records of --data, but --from-cache trains on cached hidden states"),
    ("eval-report-only-empty", ["eval", "--out", "{root}/empty_out", "--report-only"],
     "results.jsonl does not exist; run without --report-only"),
    ("eval-random-p", ["eval", "--base", "{root}/base", "--data", "{root}/text.jsonl", "--out", "{root}/o4",
                       "--policies", "random:2"], "bad policy 'random:2'"),
    ("diagnose-data-missing", ["diagnose", "--base", "{root}/base", "--history", "full", "--data",
                               "{root}/nope.jsonl", "--out", "{root}/o5"], "--data {root}/nope.jsonl: no such file"),
    ("diagnose-selected-without-head", ["diagnose", "--base", "{root}/base", "--data", "{root}/text.jsonl",
                                        "--out", "{root}/o6"], "--history selected commits the head's choice"),
    ("diagnose-threshold-unread", ["diagnose", "--base", "{root}/base", "--history", "full", "--threshold", "5",
                                   "--data", "{root}/text.jsonl", "--out", "{root}/o7"],
     "--threshold 5 picks the branch --history selected commits, but --history full always commits Full"),
    ("diagnose-report-only-unread", ["diagnose", "--out", "{root}/o8", "--report-only", "--positions", "4"],
     "--positions: --report-only rebuilds the report from"),
    ("diagnose-report-only-history", ["diagnose", "--out", "{root}/o8", "--report-only", "--history", "full"],
     "--history: --report-only rebuilds the report from"),
    ("train-data-missing", ["train-head", "--base", "{root}/base", "--data", "{root}/nope.jsonl", "--output",
                            "{root}/t1"], "--data {root}/nope.jsonl: no such file or directory"),
    ("train-window-zero", ["train-head", "--base", "{root}/base", "--data", "{root}/text.jsonl", "--output",
                           "{root}/t2", "--window", "0"], "must be an integer >= 1 and <= 16777216"),
    ("train-text-without-tokenizer", ["train-head", "--base", "{root}/base_no_tokenizer", "--data",
                                      "{root}/text.jsonl", "--output", "{root}/t3", "--sinks", "2", "--window", "3"],
     "text records need a tokenizer (--tokenizer)"),
    ("train-tokenizer-missing", ["train-head", "--base", "{root}/base", "--tokenizer", "{root}/nope",
                                 "--data", "{root}/text.jsonl", "--output", "{root}/t4"],
     "--tokenizer {root}/nope: no such folder"),
    ("train-resume-nothing", ["train-head", "--base", "{root}/base", "--data", "{root}/text.jsonl", "--output",
                              "{root}/empty_out", "--resume"], "--resume: no complete checkpoint-* folder"),
    ("generate-base-missing", ["generate", "--base", "{root}/nope", "--prompt", "w3"],
     "--base (its tokenizer) {root}/nope: no such folder; give a local folder or a hub id"),
    ("generate-head-missing", ["generate", "--base", "{root}/base", "--head", "{root}/nope", "--prompt", "w3"],
     "--head {root}/nope: no such folder"),
    ("generate-base-not-a-model", ["generate", "--base", "{root}/empty_out", "--tokenizer", "{root}/base",
                                   "--prompt", "w3"], "loading the model (--base/--head): "),
    ("train-base-not-a-model", ["train-head", "--base", "{root}/empty_out", "--tokenizer", "{root}/base", "--data",
                                "{root}/text.jsonl", "--output", "{root}/t5", "--sinks", "2", "--window", "3"],
     "--base: "),
    ("generate-local-equals-full", ["generate", "--base", "{root}/base", "--policy", "local", "--prompt", WORDS,
                                    "--max-new-tokens", "4"],
     "--policy local: this request never goes past position 40, within s + w = 4 + 2048 (the default window)"),
    ("generate-schedule-equals-full", ["generate", "--base", "{root}/base", "--policy", "schedule:1:2", "--window",
                                       "40", "--prompt", WORDS, "--max-new-tokens", "4"],
     "--policy schedule: this request never goes past position 40, within s + w = 4 + 40 (--window)"),
    ("generate-empty-prompt", ["generate", "--base", "{root}/base", "--window", "2", "--prompt", ""],
     "the prompt is empty"),
    ("flops-continuation", ["flops", "--continuation", "1"], "argument --continuation: must be an integer >= 2"),
    ("demo-organism-missing", ["demo", "--organism", "{root}/nope"], "--organism: No model organism at"),
    ("demo-unknown-task", ["demo", "--tasks", "vt,nope"], "--tasks: unknown demo tasks ['nope']"),
]


@pytest.mark.parametrize("argv,fragment", [row[1:] for row in BAD_INPUTS], ids=[row[0] for row in BAD_INPUTS])
def test_user_error_is_one_line_with_exit_status_2(files, capsys, argv, fragment):
    argv = [a.replace("{root}", str(files)) for a in argv]
    code, err = oda(argv, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if f"oda {argv[0]}: error:" in line]
    assert len(errors) == 1, err
    assert fragment.replace("{root}", str(files)) in errors[0]


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "fp16", "FP32", "float32", "auto"])
def test_dtype_spellings_accepted(spelling):
    from oda_hf.cli import build_parser

    args = build_parser().parse_args(["generate", "--base", "b", "--dtype", spelling])
    assert args.dtype in ("bfloat16", "float16", "float32", "auto")
    assert args.dtype == {"bf16": "bfloat16", "fp16": "float16", "FP32": "float32"}.get(spelling, spelling)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_generate_with_a_head_in_half_precision(files, capsys, dtype):
    """The short dtype names load the base in half precision; the head stays FP32."""
    code, err = oda(["generate", "--base", files / "base", "--head", files / "head", "--dtype", dtype, "--sinks", "2",
                     "--window", "8", "--prompt", WORDS, "--max-new-tokens", "5"], capsys)
    assert code == 0, err
    assert "routed steps 4" in err


def test_head_policy_on_a_short_request_says_local_equals_full(files, capsys):
    code, err = oda(["generate", "--base", files / "base", "--head", files / "head", "--prompt", "w3 w4 w5",
                     "--max-new-tokens", "3"], capsys)
    assert code == 0, err
    assert "[oda] note: this request never goes past position 5, within s + w" in err


def test_local_policy_runs_once_the_request_passes_s_plus_w(files, capsys):
    # 37 prompt tokens + 4 new: the last query position is 40 > s + w = 4 + 35.
    code, err = oda(["generate", "--base", files / "base", "--policy", "local", "--window", "35", "--prompt", WORDS,
                     "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    assert "routed steps 3 (2 within sinks + window), Full calls 0" in err  # histories 38, 39 <= 39


def test_train_head_tokenizer_defaults_to_base(files, capsys):
    """Text records are tokenized with --base's tokenizer when --tokenizer is not given."""
    threads = torch.get_num_threads()
    try:
        code, err = oda(["train-head", "--base", files / "base", "--data", files / "text.jsonl", "--output",
                         files / "trained", "--sinks", "2", "--window", "3", "--seq-len", "40", "--max-steps", "1",
                         "--warmup-steps", "0", "--head-width", "8", "--dtype", "fp32", "--threads", "1"], capsys)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    assert "3 documents -> 3 rows" in err
    assert os.path.isfile(files / "trained" / "model.safetensors")


def test_a_real_process_exits_2_without_traceback(files):
    """The installed entry point behaves like the in-process `main` (status 2, one error line, no traceback)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    for argv, fragment in [(["train-head", "--base", "b", "--data", str(files / "nope.jsonl"), "--output", "o"],
                            "oda train-head: error: --data"),
                           (["generate", "--base", "b", "--dtype", "bf17"], "oda generate: error: argument --dtype")]:
        done = subprocess.run([sys.executable, "-m", "oda_hf.cli", *argv], capture_output=True, text=True, env=env,
                              timeout=120)
        assert done.returncode == 2, done.stderr
        assert fragment in done.stderr and "Traceback" not in done.stderr


def test_eval_policies_whose_names_collide_are_refused():
    """Records are keyed by policy name, which keeps 6 significant digits: `--thresholds 0.1 0.1000001` ran one of the
    two and dropped the other without a word. The same value twice still runs once."""
    from oda_hf.cli_common import UsageError
    from oda_hf.evaluation.cli import build_policies

    assert [s.name for s in build_policies(["oda", "random", "oda"], [0.1, 0.1], [42, 42])] == \
        ["oda@0.1", "random~oda@0.1/seed42"]
    assert [s.name for s in build_policies(["oda", "random:-0"], [0.0, -0.0], [42])] == \
        ["oda@0", "random@p0/seed42"]   # -0 named itself "oda@-0" and ran a second time
    with pytest.raises(UsageError, match="must be a number; got '0_1'"):   # float() ran it as p = 1
        build_policies(["random:0_1"], [0.0], [42])
    from argparse import Namespace

    from oda_hf.evaluation.cli import _primary_threshold
    primary = _primary_threshold(Namespace(primary_threshold=-0.0, policies=["oda"]), [0.0])
    assert str(primary) == "0.0"   # -0 picked "oda@-0", which no record is named: no main-table ODA, no trajectories
    with pytest.raises(UsageError, match=r"'oda@0.1' \(threshold 0.1 and 0.1000001\)"):
        build_policies(["oda"], [0.1, 0.1000001], [42])
    with pytest.raises(UsageError, match=r"'random@p0.25/seed42' \(p 0.25 and 0.2500001\)"):
        build_policies(["random:0.25", "random:0.2500001"], [0.0], [42])


def test_a_refused_calibration_leaves_its_folder_open_to_the_corrected_command(files, capsys):
    """A run refused before any record (--chat-template the tokenizer lacks) records no inputs that would refuse the
    corrected command ("made with other inputs") for a folder holding nothing."""
    dev = files / "dev.jsonl"
    dev.write_text("".join(json.dumps({"id": f"e{i}", "task": "t1", "prompt": " ".join(f"w{3 + (i + j) % 30}"
                                                                                       for j in range(14)),
                                       "answers": ["w5"], "max_new_tokens": 3, "metric": "string_match_all"}) + "\n"
                           for i in range(2)))
    out = files / "calibration"
    argv = ["calibrate", "--base", f"{files}/base", "--head", f"{files}/head", "--sinks", "2", "--window", "8",
            "--no-write", "--no-progress", "--data", str(dev), "--grid", "0", "--refine-steps", "0",
            "--target-rate", "1", "--out", str(out)]
    code, err = oda(argv + ["--chat-template"], capsys)
    assert code == 2 and "has no chat template" in err and not (out / "calibration_inputs.json").exists()
    code, err = oda(argv, capsys)
    assert code == 0, err
    assert json.loads((out / "calibration_inputs.json").read_text())["chat_template"] is False

