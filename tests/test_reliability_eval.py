"""Reliability of `oda eval`, `oda calibrate`, `oda diagnose` and `oda ruler`: every bad input ends in one line
``oda <command>: error: ...`` with exit status 2 (never a traceback, never a silent default); a rerun after the
answers or the metric changed rescores instead of reusing stale scores; reports survive odd task names; an
output folder has one writer; a killed `oda ruler` leaves nothing that `oda eval` would read as complete."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from oda_hf import RecallHead, RecallHeadConfig
from oda_hf.evaluation import report, ruler_synth, suites
from oda_hf.files import output_lock
from tiny_models import save_with_word_tokenizer, tiny_model
from cli_harness import run_oda as oda

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def words(start, n):
    return " ".join(f"w{3 + (start + i) % 90}" for i in range(n))


def record(i, **changes):
    base = {"id": f"e{i}", "task": "t1", "prompt": words(i, 14), "answers": ["w5"], "max_new_tokens": 3,
            "metric": "string_match_all"}
    return {**base, **changes}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    base = tiny_model("qwen3")  # max_position_embeddings 512, vocabulary 97
    save_with_word_tokenizer(base, root / "base")
    torch.manual_seed(0)
    RecallHead(RecallHeadConfig.for_base(base, head_width=8)).save_pretrained(root / "head")
    write_jsonl(root / "good.jsonl", [record(i) for i in range(2)])
    (root / "empty.jsonl").write_text("")
    (root / "nojsonl").mkdir()
    (root / "afile").write_text("not a folder")
    bad = {
        "prompt_int": record(0, prompt=5), "answers_str": record(0, answers="w5 w6"),
        "no_answers": {k: v for k, v in record(0).items() if k != "answers"}, "id_list": record(0, id=[1]),
        "cap_text": record(0, max_new_tokens="x"), "cap_zero": record(0, max_new_tokens=0),
        "metric_unknown": record(0, metric="bleu"), "ids_negative": record(0, prompt=[5, -1]),
        "ids_outside": record(0, prompt=[5, 500]), "too_long": record(0, prompt=words(0, 600)),
        # fits alone, not with its output cap: the generated positions would pass the context
        "too_long_with_cap": record(0, prompt=words(0, 500), max_new_tokens=20),
        "task_int": record(0, task=3),
        # `oda ruler` records whether a prompt's length was measured with the chat template
        "chat_written": record(0, chat_template=True),
    }
    for name, value in bad.items():
        write_jsonl(root / f"{name}.jsonl", [value])
    (root / "ruler_str").mkdir()
    write_jsonl(root / "ruler_str" / "niah_single_1.jsonl", [{"index": 0, "input": words(0, 20), "outputs": "w5 w6"}])
    (root / "lb").mkdir()
    write_jsonl(root / "lb" / "hotpotqa.jsonl", [{"input": "w3", "context": words(0, 20), "answers": "w5",
                                                  "_id": "a"}])
    # A suite of `oda ruler`, then two damaged copies: without its manifest, and with a file cut short.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    ruler_synth.write_suite(ruler_synth.generate_suite(tokenizer, tasks=["niah_single_1"], lengths=[200], n=3,
                                                       chat_template=False), root / "gen")
    shutil.copytree(root / "gen", root / "gen_nomanifest")
    (root / "gen_nomanifest" / "200" / "manifest.json").unlink()
    shutil.copytree(root / "gen", root / "gen_short")
    cut = root / "gen_short" / "200" / "niah_single_1.jsonl"
    cut.write_text("".join(cut.read_text().splitlines(keepends=True)[:2]))
    # --out folders with a damaged manifest / results / calibration inputs / positions.
    for name, text in (("manifest_bad", "{not json"), ("manifest_list", "[1, 2]")):
        (root / name).mkdir()
        (root / name / "manifest.json").write_text(text)
    (root / "results_bad").mkdir()
    (root / "results_bad" / "results.jsonl").write_text('{"id": "e0", "policy"\n{"id": "e1", "policy": "full"}\n')
    (root / "results_list").mkdir()
    (root / "results_list" / "results.jsonl").write_text("[1, 2]\n")
    (root / "results_partial").mkdir()
    (root / "results_partial" / "results.jsonl").write_text('{"id": "a", "policy": "full", "task": "t1"}\n')
    (root / "calib_bad").mkdir()
    (root / "calib_bad" / "calibration_inputs.json").write_text("{oops")
    (root / "positions_bad").mkdir()
    (root / "positions_bad" / "positions.jsonl").write_text('{"id": "r0", "history": "full"}\n')
    # Reference sequences for `oda diagnose`.
    ids = [3 + i % 90 for i in range(40)]
    write_jsonl(root / "refs.jsonl", [{"id": "r0", "input_ids": ids}])
    write_jsonl(root / "refs_float.jsonl", [{"id": "r0", "input_ids": [3.5] * 20}])
    write_jsonl(root / "refs_text.jsonl", [{"id": "r0", "text": 5}])
    write_jsonl(root / "refs_long.jsonl", [{"id": "r0", "input_ids": [3 + i % 90 for i in range(600)]}])
    write_jsonl(root / "refs_513.jsonl", [{"id": "r0", "input_ids": [3 + i % 90 for i in range(513)]}])  # limit + 1
    write_jsonl(root / "refs_start.jsonl", [{"id": "r0", "input_ids": ids, "start": 0}])
    write_jsonl(root / "refs_short.jsonl", [{"id": "r0", "input_ids": ids[:6]}])
    (root / "refs_empty.jsonl").write_text("\n")
    from test_ruler_synth import tiny_tokenizer

    tiny_tokenizer().save_pretrained(root / "rtok")
    return root




EVAL = ["eval", "--base", "{root}/base", "--head", "{root}/head", "--window", "8", "--no-progress", "--no-plots",
        "--policies", "full", "local", "--out", "{root}/out_{n}"]
GOOD = ["--data", "{root}/good.jsonl"]
ODA = ["--policies", "full", "oda", "--thresholds", "0"]
CAL = ["calibrate", "--base", "{root}/base", "--head", "{root}/head", "--window", "8", "--no-write", "--no-progress",
       "--out", "{root}/cal_{n}"]
CAL_RATE = ["--data", "{root}/good.jsonl", "--target-rate", "0.5"]
DIAG = ["diagnose", "--base", "{root}/base", "--history", "full", "--window", "8", "--sinks", "2", "--no-progress",
        "--no-plots", "--bootstrap", "5", "--out", "{root}/diag_{n}"]
REFS = ["--data", "{root}/refs.jsonl"]
RULER = ["ruler", "--tokenizer", "{root}/rtok", "--no-progress", "--out", "{root}/ruler_{n}"]
LEN = ["--lengths", "1024"]

# (id, argv, message fragment). argparse rows say `argument --flag: ...`; the others name the file or value.
BAD = [
    # -- oda eval: flags -------------------------------------------------------------------------------------------
    ("eval-max-new-tokens-0", EVAL + GOOD + ["--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1; got 0"),
    ("eval-max-new-tokens-neg", EVAL + GOOD + ["--max-new-tokens", "-2"], "--max-new-tokens: must be an integer >= 1; got -2"),
    ("eval-ruler-max-new-tokens-0", EVAL + ["--suite", "ruler", "--data", "{root}/ruler_str", "--max-new-tokens", "0"],
     "--max-new-tokens: must be an integer >= 1; got 0"),
    ("eval-max-input-tokens-0", EVAL + ["--suite", "longbench", "--data", "{root}/lb", "--max-input-tokens", "0"],
     "--max-input-tokens: must be an integer >= 2; got 0"),
    ("eval-max-input-tokens-1", EVAL + ["--suite", "longbench", "--data", "{root}/lb", "--max-input-tokens", "1"],
     "--max-input-tokens: must be an integer >= 2; got 1"),
    ("eval-max-input-tokens-jsonl", EVAL + GOOD + ["--max-input-tokens", "64"],
     "--max-input-tokens truncates LongBench prompts; it does nothing with --suite jsonl"),
    ("eval-limit-0", EVAL + GOOD + ["--limit", "0"], "--limit: must be an integer >= 1; got 0"),
    ("eval-limit-text", EVAL + GOOD + ["--limit", "two"], "--limit: must be an integer; got 'two'"),
    ("eval-thresholds-nan", EVAL + GOOD + ["--thresholds", "nan"], "--thresholds: must be a finite number; got nan"),
    ("eval-thresholds-inf", EVAL + GOOD + ["--thresholds", "inf"], "--thresholds: must be a finite number; got inf"),
    ("eval-primary-nan", EVAL + GOOD + ["--primary-threshold", "nan"], "--primary-threshold: must be a finite number"),
    ("eval-seeds-neg", EVAL + GOOD + ["--seeds", "-1"], "--seeds: must be an integer >= 0; got -1"),
    ("eval-trajectories-neg", EVAL + GOOD + ["--trajectories", "-1"], "--trajectories: must be an integer >= 0"),
    ("eval-sinks-neg", EVAL + GOOD + ["--sinks", "-1"], "--sinks: must be an integer >= 0; got -1"),
    ("eval-window-0", EVAL + GOOD + ["--window", "0"], "--window: must be an integer >= 1; got 0"),
    ("eval-random-nan", EVAL + GOOD + ["--policies", "random:nan"], "bad policy 'random:nan'"),
    ("eval-random-empty", EVAL + GOOD + ["--policies", "random:"], "unknown policy 'random:'"),
    ("eval-schedule-k-above", EVAL + GOOD + ["--policies", "schedule:3:2"], "bad policy 'schedule:3:2'"),
    ("eval-schedule-fraction", EVAL + GOOD + ["--policies", "schedule:2.9:3"], "bad policy 'schedule:2.9:3'"),
    ("eval-schedule-underscore", EVAL + GOOD + ["--policies", "schedule:1:1_0"], "bad policy 'schedule:1:1_0'"),
    ("eval-random-underscore", EVAL + GOOD + ["--policies", "random:0_1"], "bad policy 'random:0_1'"),
    ("eval-random-underflow", EVAL + GOOD + ["--policies", "random:1e-400"], "bad policy 'random:1e-400'"),
    ("eval-thresholds-underflow", EVAL + GOOD + ["--thresholds", "1e-400"], "too small (it would be read as 0)"),
    ("eval-primary-not-run", EVAL + GOOD + ODA + ["--primary-threshold", "0.7"],
     "--primary-threshold 0.7 is not among the ODA thresholds of this run (0)"),
    ("eval-primary-without-oda", EVAL + GOOD + ["--primary-threshold", "0"], "--policies runs no ODA"),
    ("eval-primary-budget-only", EVAL + GOOD + ["--policies", "budget:0.25", "--primary-threshold", "0"],
     "--policies runs no ODA"),   # refused only after generating every record
    ("eval-sweep-and-thresholds", EVAL + GOOD + ["--paper-sweep", "--thresholds", "0"], "drop --thresholds"),
    ("eval-trajectories-without-oda", EVAL + GOOD + ["--trajectories", "1"], "--trajectories renders ODA runs"),
    ("eval-out-is-a-file", EVAL + GOOD + ["--out", "{root}/afile"], "--out {root}/afile is a file"),
    # -- oda eval: data ---------------------------------------------------------------------------------------------
    ("eval-data-empty", EVAL + ["--data", "{root}/empty.jsonl"], "--data: {root}/empty.jsonl: no records (the file is empty)"),
    ("eval-data-dir-without-jsonl", EVAL + ["--data", "{root}/nojsonl"], "No .jsonl file under {root}/nojsonl"),
    ("eval-prompt-int", EVAL + ["--data", "{root}/prompt_int.jsonl"],
     "prompt_int.jsonl:1: 'prompt' must be a string or a list of token ids; got 5 (int)"),
    ("eval-answers-string", EVAL + ["--data", "{root}/answers_str.jsonl"],
     "answers_str.jsonl:1: example 'e0' (task 't1'): 'answers' must be a list of strings; got the string 'w5 w6'"),
    ("eval-answers-missing", EVAL + ["--data", "{root}/no_answers.jsonl"], "missing field(s) ['answers']"),
    ("eval-id-list", EVAL + ["--data", "{root}/id_list.jsonl"], "'id' must be a string or an integer; got [1]"),
    ("eval-task-int", EVAL + ["--data", "{root}/task_int.jsonl"], "'task' must be a non-empty string; got 3"),
    ("eval-cap-text", EVAL + ["--data", "{root}/cap_text.jsonl"], "max_new_tokens must be a positive integer; got 'x'"),
    ("eval-cap-zero", EVAL + ["--data", "{root}/cap_zero.jsonl"], "max_new_tokens must be a positive integer; got 0"),
    ("eval-metric-unknown", EVAL + ["--data", "{root}/metric_unknown.jsonl"], "unknown metric 'bleu'"),
    ("eval-ids-negative", EVAL + ["--data", "{root}/ids_negative.jsonl"], "input_ids must be a non-empty list of token ids"),
    ("eval-ids-outside-vocab", EVAL + ["--data", "{root}/ids_outside.jsonl"],
     "token id 500 is outside the model's vocabulary of 97 ids"),
    ("eval-prompt-too-long", EVAL + ["--data", "{root}/too_long.jsonl"],
     "its prompt has 600 tokens; with its output cap of"),
    ("eval-prompt-and-cap-too-long", EVAL + ["--data", "{root}/too_long_with_cap.jsonl"],
     "its prompt has 500 tokens; with its output cap of 20 that is 520 positions, past the model's "
     "max_position_embeddings=512. Shorten it (LongBench: --max-input-tokens 492)"),
    ("eval-chat-template-mismatch", EVAL + ["--data", "{root}/chat_written.jsonl"],
     "example 'e0' (task 't1') was written with the chat template, but this run does not apply it: add "
     "--chat-template"),
    ("eval-unknown-task", EVAL + GOOD + ["--tasks", "nope"], "Task(s) ['nope'] not found in the suite"),
    ("eval-ruler-outputs-string", EVAL + ["--suite", "ruler", "--data", "{root}/ruler_str"],
     "niah_single_1.jsonl:1: 'outputs' must be a list of strings; got the string 'w5 w6'"),
    ("eval-longbench-answers-string", EVAL + ["--suite", "longbench", "--data", "{root}/lb"],
     "hotpotqa.jsonl:1: 'answers' must be a list of strings; got the string 'w5'"),
    ("eval-generated-without-manifest", EVAL + ["--data", "{root}/gen_nomanifest/200"],
     "was written by `oda ruler`, but {root}/gen_nomanifest/200/manifest.json is missing"),
    ("eval-generated-cut-short", EVAL + ["--data", "{root}/gen_short/200"],
     "niah_single_1.jsonl holds 2 records, but {root}/gen_short/200/manifest.json says 3"),
    ("eval-manifest-corrupt", EVAL + GOOD + ["--out", "{root}/manifest_bad"], "manifest.json is not valid JSON"),
    ("eval-manifest-list", EVAL + GOOD + ["--out", "{root}/manifest_list"], "is not a manifest of `evaluate`"),
    ("eval-report-only-corrupt", ["eval", "--out", "{root}/results_bad", "--report-only", "--no-plots"],
     "results.jsonl:1: unreadable record in the middle of the file"),
    ("eval-report-only-not-records", ["eval", "--out", "{root}/results_list", "--report-only", "--no-plots"],
     "results.jsonl:1: not a record"),
    ("eval-report-only-partial-record", ["eval", "--out", "{root}/results_partial", "--report-only", "--no-plots"],
     "results.jsonl: the record (a, full) has no group, kind, score, routed_steps, full_calls; it was not written"),
    # -- oda calibrate ----------------------------------------------------------------------------------------------
    ("calibrate-rate-nan", CAL + ["--data", "{root}/good.jsonl", "--target-rate", "nan"],
     "--target-rate: must be a finite number >= 0 and <= 1 (a probability); got nan"),
    ("calibrate-rate-above-1", CAL + ["--data", "{root}/good.jsonl", "--target-rate", "25"], "got 25"),
    ("calibrate-within-neg", CAL + ["--data", "{root}/good.jsonl", "--within-full", "-1"],
     "--within-full: must be a finite number >= 0; got -1"),
    ("calibrate-grid-inf", CAL + CAL_RATE + ["--grid", "0", "inf"], "--grid: must be a finite number; got inf"),
    ("calibrate-refine-neg", CAL + CAL_RATE + ["--refine-steps", "-1"], "--refine-steps: must be an integer >= 0"),
    ("calibrate-threads-0", CAL + CAL_RATE + ["--threads", "0"], "--threads: must be an integer >= 1; got 0"),
    ("calibrate-limit-0", CAL + CAL_RATE + ["--limit", "0"], "--limit: must be an integer >= 1; got 0"),
    ("calibrate-max-new-tokens-0", CAL + CAL_RATE + ["--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1"),
    ("calibrate-sinks-neg", CAL + CAL_RATE + ["--sinks", "-3"], "--sinks: must be an integer >= 0; got -3"),
    ("calibrate-data-empty", CAL + ["--data", "{root}/empty.jsonl", "--target-rate", "0.5"],
     "--data: {root}/empty.jsonl: no records"),
    ("calibrate-answers-string", CAL + ["--data", "{root}/answers_str.jsonl", "--target-rate", "0.5"],
     "'answers' must be a list of strings"),
    ("calibrate-prompt-too-long", CAL + ["--data", "{root}/too_long.jsonl", "--target-rate", "0.5"],
     "past the model's max_position_embeddings=512"),
    ("calibrate-out-is-a-file", CAL + CAL_RATE + ["--out", "{root}/afile"], "--out {root}/afile is a file"),
    ("calibrate-inputs-corrupt", CAL + CAL_RATE + ["--out", "{root}/calib_bad"],
     "calibration_inputs.json is not valid JSON"),
    # -- oda diagnose -----------------------------------------------------------------------------------------------
    ("diagnose-positions-0", DIAG + REFS + ["--positions", "0"], "--positions: must be an integer >= 1; got 0"),
    ("diagnose-budget-above-1", DIAG + REFS + ["--budget", "1.5"], "--budget: must be a finite number >= 0 and <= 1"),
    ("diagnose-budget-nan", DIAG + REFS + ["--budget", "nan"], "--budget: must be a finite number"),
    ("diagnose-budgets-neg", DIAG + REFS + ["--budgets", "0.1", "-0.1"], "--budgets: must be a finite number >= 0"),
    ("diagnose-bootstrap-neg", DIAG + REFS + ["--bootstrap", "-1"], "--bootstrap: must be an integer >= 0; got -1"),
    ("diagnose-seed-neg", DIAG + REFS + ["--seed", "-1"], "--seed: must be an integer >= 0; got -1"),
    ("diagnose-threshold-inf", DIAG + REFS + ["--threshold", "inf"], "--threshold: must be a finite number; got inf"),
    ("diagnose-data-empty", DIAG + ["--data", "{root}/refs_empty.jsonl"], "no reference sequence (the file is empty)"),
    ("diagnose-data-folder", DIAG + ["--data", "{root}/nojsonl"], "--data {root}/nojsonl is a folder"),
    ("diagnose-ids-float", DIAG + ["--data", "{root}/refs_float.jsonl"],
     "refs_float.jsonl:1: 'input_ids' must be a non-empty list of token ids"),
    ("diagnose-text-int", DIAG + ["--data", "{root}/refs_text.jsonl"], "refs_text.jsonl:1: 'text' must be a string"),
    ("diagnose-start-0", DIAG + ["--data", "{root}/refs_start.jsonl"], "'start' must be an integer >= 1; got 0"),
    ("diagnose-too-long", DIAG + ["--data", "{root}/refs_long.jsonl"],
     "reference 'r0' has 600 tokens, more than the model's max_position_embeddings=512"),
    ("diagnose-too-long-by-one", DIAG + ["--data", "{root}/refs_513.jsonl"],
     "reference 'r0' has 513 tokens, more than the model's max_position_embeddings=512; shorten it to at most 512"),
    ("diagnose-too-short", DIAG + ["--data", "{root}/refs_short.jsonl"], "No eligible reference position"),
    ("diagnose-out-is-a-file", DIAG + REFS + ["--out", "{root}/afile"], "--out {root}/afile is a file"),
    ("diagnose-report-only-damaged", ["diagnose", "--out", "{root}/positions_bad", "--report-only", "--no-plots"],
     "positions.jsonl: record 1 ('r0') is damaged"),
    # -- oda ruler --------------------------------------------------------------------------------------------------
    ("ruler-lengths-0", RULER + ["--lengths", "0"], "--lengths: must be an integer >= 1; got 0"),
    ("ruler-lengths-neg", RULER + ["--lengths", "-5"], "--lengths: must be an integer >= 1; got -5"),
    ("ruler-n-0", RULER + LEN + ["--n", "0"], "--n: must be an integer >= 1; got 0"),
    ("ruler-seed-neg", RULER + LEN + ["--seed", "-1"], "--seed: must be an integer >= 0; got -1"),
    ("ruler-max-positions-0", RULER + LEN + ["--max-positions", "0"], "--max-positions: must be an integer >= 1"),
    ("ruler-tolerance-0", RULER + LEN + ["--tolerance", "0"], "--tolerance: must be a finite number > 0 and <= 1"),
    ("ruler-tolerance-nan", RULER + LEN + ["--tolerance", "nan"], "--tolerance: must be a finite number"),
    ("ruler-tolerance-1", RULER + LEN + ["--tolerance", "1"], "tolerance must be in (0, 1); got 1.0"),
    ("ruler-unknown-task", RULER + LEN + ["--tasks", "nope"], "Unknown RULER task(s) ['nope']"),
    ("ruler-out-is-a-file", RULER + LEN + ["--out", "{root}/afile"], "--out {root}/afile is a file"),
]


@pytest.mark.parametrize("argv,fragment", [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_bad_input_is_one_line_with_exit_status_2(root, capsys, argv, fragment):
    number = [row[1] for row in BAD].index(argv)
    argv = [a.replace("{root}", str(root)).replace("{n}", str(number)) for a in argv]
    code, err = oda(argv, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if f"oda {argv[0]}: error:" in line]
    assert len(errors) == 1, err
    assert fragment.replace("{root}", str(root)) in errors[0], errors[0]


@pytest.mark.parametrize("writer", ["eval", "calibrate", "diagnose", "ruler"])
def test_an_output_folder_has_one_writer(root, capsys, writer):
    """A second run into a folder whose lock is held stops at once (exit 2) and writes nothing."""
    argv = {"eval": EVAL + GOOD, "calibrate": CAL + CAL_RATE, "diagnose": DIAG + REFS, "ruler": RULER + LEN}[writer]
    argv = [a.replace("{root}", str(root)).replace("{n}", "locked") for a in argv]
    out = argv[argv.index("--out") + 1]
    with output_lock(out, "the test"):
        code, err = oda(argv, capsys)
    assert code == 2 and "is in use by process" in err and "Traceback" not in err
    assert os.listdir(out) == []  # nothing written (the lock file goes with its holder)


def test_changed_answers_and_metric_are_rescored_as_a_fresh_run(root, capsys, tmp_path):
    """A rerun whose records match the generation but not the answers/metric rescores them from the stored output
    (nothing is generated again): the results and the report equal those of a fresh run."""
    data = write_jsonl(tmp_path / "data.jsonl", [record(i, answers=["w5"]) for i in range(3)])
    run = ["eval", "--base", root / "base", "--window", "8", "--no-progress", "--no-plots", "--policies", "full",
           "local", "--data", data]
    assert oda(run + ["--out", tmp_path / "a"], capsys)[0] == 0
    first = [json.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
    # Make the first example's answer its Full output's first word, and score the second with string_match_part.
    answer = first[0]["output"].split()[0]
    changed = [record(0, answers=[answer]), record(1, answers=["w5", first[2]["output"].split()[0]],
                                                  metric="string_match_part"), record(2, answers=["w5"])]
    write_jsonl(data, changed)
    assert oda(run + ["--out", tmp_path / "a"], capsys)[0] == 0
    assert oda(run + ["--out", tmp_path / "fresh"], capsys)[0] == 0
    lines = (tmp_path / "a" / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(first) + 4  # two examples x two policies rescored, none regenerated

    def latest(folder):
        records = {}
        for line in (folder / "results.jsonl").read_text().splitlines():
            r = json.loads(line)
            records[(r["id"], r["policy"])] = r
        return records

    rescored, fresh = latest(tmp_path / "a"), latest(tmp_path / "fresh")
    assert rescored == fresh
    assert rescored[("e0", "full")]["score"] == 1.0 and first[0]["score"] == 0.0
    assert (tmp_path / "a" / "report.md").read_bytes() == (tmp_path / "fresh" / "report.md").read_bytes()


def test_a_rerun_of_one_policy_rescores_the_other_policies_too(root, capsys, tmp_path):
    """After the answers change, a rerun naming one policy of the folder rescores every stored output of its examples:
    the Local records it does not name had kept the old answers, and the report (and --report-only) put Full scored
    against the new answers beside Local scored against the old ones, exit 0."""
    data = write_jsonl(tmp_path / "data.jsonl", [record(i, answers=["w5"]) for i in range(2)])
    run = ["eval", "--base", root / "base", "--window", "8", "--no-progress", "--no-plots", "--data", data]
    assert oda(run + ["--policies", "full", "local", "--out", tmp_path / "a"], capsys)[0] == 0
    first = [json.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
    write_jsonl(data, [record(i, answers=[next(r for r in first if r["id"] == f"e{i}")["output"].split()[0]])
                       for i in range(2)])   # every policy's first output word (the prefill's token)
    assert oda(run + ["--policies", "full", "--out", tmp_path / "a"], capsys)[0] == 0
    assert oda(run + ["--policies", "full", "local", "--out", tmp_path / "fresh"], capsys)[0] == 0
    assert oda(["eval", "--out", tmp_path / "a", "--report-only", "--no-plots"], capsys)[0] == 0   # every policy
    assert (tmp_path / "a" / "report.md").read_bytes() == (tmp_path / "fresh" / "report.md").read_bytes()
    scores = {(r["id"], r["kind"]): r["score"] for r in map(json.loads, (tmp_path / "a" / "results.jsonl")
                                                              .read_text().splitlines())}
    assert scores[("e0", "local")] == scores[("e1", "local")] == 1.0


def test_records_of_one_example_scored_otherwise_are_not_reported_together(tmp_path, capsys):
    """A folder whose records of one example carry other answers (written before the rescoring above) is refused by
    --report-only, naming the example and the fix, instead of reported with mixed scores."""
    out = tmp_path / "mixed"
    out.mkdir()
    base = {"id": "e0", "task": "t", "group": "full", "kind": "full", "threshold": None, "metric": "string_match_all",
            "scorer": "string_match_all/v1", "score": 1.0, "full_calls": 3, "routed_steps": 3, "window_steps": 0,
            "window_full_calls": 0, "hit_cap": False, "output": "w5", "answers": ["w5"], "policy": "full"}
    stale = {**base, "policy": "local", "group": "local", "kind": "local", "answers": ["w9"], "score": 0.0,
             "scorer": None}
    write_jsonl(out / "results.jsonl", [base, stale])
    code, err = oda(["eval", "--out", out, "--report-only", "--no-plots"], capsys)
    assert code == 2 and "example e0 is scored otherwise (answers)" in err and "Rerun `oda eval`" in err
    assert not (out / "report.md").exists()


def test_report_escapes_task_names_in_tables(tmp_path):
    def rec(task, policy="full"):
        return {"id": f"{task}-0", "task": task, "policy": policy, "group": policy, "kind": policy, "threshold": None,
                "metric": "string_match_all", "score": 1.0, "full_calls": 3, "routed_steps": 3, "window_steps": 0,
                "window_full_calls": 0, "hit_cap": False}

    text = report.markdown_report([rec("a|b"), rec("two\nlines"), rec("plain")])
    table = [line for line in text.splitlines() if line.startswith("| ") and "Task" not in line][:3]
    assert len(table) == 3  # no row was split by the newline
    for line in text.splitlines():
        if line.startswith("|") and ("a" in line and "b" in line):
            assert line.replace("\\|", "").count("|") == text.splitlines()[text.splitlines().index(
                next(h for h in text.splitlines() if h.startswith("| Task")))].count("|")
    assert "a\\|b" in text and "two lines" in text
    # A `$` in a task name or an output token is text, not matplotlib mathtext (which raised on "$\\foo$").
    report.plot_per_task([rec("$\\foo$"), rec("a|b")], tmp_path / "per_task.png")
    from oda_hf.evaluation import trajectory

    trajectory.render_png(["$\\foo$", " $$"], [0], tmp_path / "t.png", title="$\\foo$")
    assert (tmp_path / "per_task.png").stat().st_size and (tmp_path / "t.png").stat().st_size


def test_primary_threshold_must_have_been_run():
    records = [{"id": "x", "task": "t", "policy": "oda@0", "group": "oda@0", "kind": "oda", "threshold": 0.0,
                "metric": "string_match_all", "score": 1.0, "full_calls": 1, "routed_steps": 2, "hit_cap": False}]
    with pytest.raises(ValueError, match=r"primary threshold 0.7 was not run \(ODA thresholds in the records: 0\)"):
        report.markdown_report(records, primary_threshold=0.7)
    assert "ODA (θ=0)" in report.markdown_report(records, primary_threshold=0.0)


@pytest.mark.parametrize("loader,field", [("ruler", "outputs"), ("longbench", "answers"), ("jsonl", "answers")])
def test_a_single_answer_string_is_refused_not_split_into_characters(root, loader, field):
    load = {"ruler": lambda: suites.load_ruler(root / "ruler_str"),
            "longbench": lambda: suites.load_longbench(root / "lb"),
            "jsonl": lambda: suites.load_examples(root / "answers_str.jsonl")}[loader]
    with pytest.raises(ValueError, match=rf"\.jsonl:1: .*'{field}' must be a list of strings; got the string"):
        load()
    with pytest.raises(ValueError, match="must be a list of strings"):
        suites.EvalExample(id="a", task="t", answers="w5 w6", max_new_tokens=1, metric="string_match_all", prompt="x")


def test_zero_caps_are_errors_not_defaults(root, tmp_path):
    ruler = write_jsonl(tmp_path / "niah_single_1.jsonl", [{"index": 0, "input": "w3 w4", "outputs": ["w5"]}])
    assert suites.load_ruler(ruler)[0].max_new_tokens == 128  # RULER's cap when none is given
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer; got 0"):
        suites.load_ruler(ruler, max_new_tokens=0)
    (tmp_path / "lb").mkdir()
    longbench = write_jsonl(tmp_path / "lb" / "hotpotqa.jsonl", [{"input": "w3", "context": "w4", "answers": ["w5"]}])
    assert suites.load_longbench(longbench)[0].max_new_tokens == 32
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer; got 0"):
        suites.load_longbench(longbench, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"max_length \(--max-input-tokens\)` must be an integer >= 2; got 0"):
        suites.load_longbench(longbench, max_length=0, tokenizer=object())
    with pytest.raises(ValueError, match="limit"):
        suites.select_examples([], None, 0)


def _ruler_command(root, out):
    return [sys.executable, "-m", "oda_hf.cli", "ruler", "--tokenizer", str(root / "rtok"), "--lengths", "1024",
            "2048", "--n", "3", "--max-positions", "4096", "--no-progress", "--out", str(out)]


def _contents(folder):
    return {os.path.relpath(os.path.join(d, name), folder): open(os.path.join(d, name), "rb").read()
            for d, _, names in os.walk(folder) for name in names if name != ".oda.lock"}


def test_ruler_killed_at_any_point_then_rerun_gives_the_same_bytes(root, tmp_path):
    """kill -9 `oda ruler` while it writes (the moment its staging folder appears, plus 0-40 ms: writing files,
    publishing them), then once more at a random moment; after each kill `oda eval`'s loader either refuses a length
    folder or reads all of it, and the same command then writes exactly the bytes of an uninterrupted run."""
    env = {**os.environ, "PYTHONPATH": REPO}
    subprocess.run(_ruler_command(root, tmp_path / "reference"), check=True, env=env, capture_output=True)
    reference = _contents(tmp_path / "reference")
    assert "manifest.json" in reference and "1024/manifest.json" in reference
    expected = {e.id for e in suites.load_examples(tmp_path / "reference" / "1024")}
    out, rng, killed_writing = tmp_path / "out", random.Random(0), 0
    # Up to 3 kills while it writes (a fast machine may finish first: try again, up to 12 runs), then one at a
    # random moment.
    attempts, delay_cap = [True] * 12 + [False], 0.04
    for writing in attempts:
        if writing and killed_writing >= 3:
            continue
        process = subprocess.Popen(_ruler_command(root, out), env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        if writing:  # wait until it writes: the staging folder beside --out
            while process.poll() is None and not any(".partial-" in n for n in os.listdir(tmp_path)):
                time.sleep(0.002)
            time.sleep(rng.uniform(0, delay_cap))
        else:
            time.sleep(rng.uniform(0.5, 3.0))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            killed_writing += writing
        elif writing:
            delay_cap /= 4  # it finished before the kill: aim earlier next time
        process.wait()
        for length in ("1024", "2048"):  # what `oda eval --data OUT/<length>` reads: all of it, or a refusal
            if (out / length).is_dir():
                try:
                    ids = {e.id.replace("/2048/", "/1024/") for e in suites.load_examples(out / length)}
                except (ValueError, FileNotFoundError):
                    continue
                assert ids == expected
    assert killed_writing
    subprocess.run(_ruler_command(root, out), check=True, env=env, capture_output=True)
    assert _contents(out) == reference
    assert not [name for name in os.listdir(tmp_path) if ".partial-" in name]  # stale staging folders removed


def test_a_rerun_after_the_base_config_or_generation_config_changed_is_refused(root, capsys, tmp_path):
    """Found by an audit: records were identified by the base's weights alone, so after an edit of its config.json
    (RoPE) or generation_config.json (a repetition penalty) a rerun reused every record (35 of 36 differed from a fresh
    run), exit 0. A folder written before those were recorded is still reused, with a warning."""
    base = tmp_path / "base"
    shutil.copytree(root / "base", base)
    data = write_jsonl(tmp_path / "data.jsonl", [record(i) for i in range(2)])
    run = ["eval", "--base", base, "--window", "8", "--no-progress", "--no-plots", "--policies", "full", "local",
           "--data", data, "--out", tmp_path / "a"]
    assert oda(run, capsys)[0] == 0
    for name, key, value, setting in (("config.json", "rope_theta", 1234.0, "base_config_sha256"),
                                      ("generation_config.json", "repetition_penalty", 1.5, "generation_sha256")):
        original = (base / name).read_text() if (base / name).exists() else None
        config = json.loads(original or "{}")
        if key == "rope_theta" and "rope_parameters" in config:
            config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": value}
        else:
            config[key] = value
        (base / name).write_text(json.dumps(config))
        code, err = oda(run, capsys)
        assert code == 2 and "generated with other settings" in err and setting in err, err
        if original is None:
            (base / name).unlink()
        else:
            (base / name).write_text(original)
    # A folder of an earlier oda_hf: its manifest and records lack both settings.
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    for key in ("base_config_sha256", "generation_sha256"):
        del manifest["settings"][key]
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
    records = [json.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
    for r in records:
        r["settings"] = {k: v for k, v in r["settings"].items() if k not in ("base_config_sha256", "generation_sha256")}
    (tmp_path / "a" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert oda(run, capsys)[0] == 0
    assert len((tmp_path / "a" / "results.jsonl").read_text().splitlines()) == len(records)   # reused, none redone
