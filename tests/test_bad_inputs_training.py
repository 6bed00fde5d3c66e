"""Bad inputs to head training (`oda train-head`, `OdaTrainer`, packing): each row is an input and the error it
must give (type and a message fragment that names the problem)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from oda_hf.training import OdaTrainer, OdaTrainingArguments, PackedDataset, pack_documents
from oda_hf.cli_common import UsageError
from oda_hf.training.cli import add_cli
from tiny_models import VOCAB, tiny_model

S, W = 2, 3  # s + w + 2 = 7 tokens: the shortest segment with an eligible position


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _documents(path, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    path.write_text("".join(json.dumps({"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()}) + "\n"
                            for n in lengths))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A base model folder, training data, and an output folder with one checkpoint (step 1)."""
    root = tmp_path_factory.mktemp("train")
    tiny_model("qwen3").save_pretrained(root / "base")
    data = _documents(root / "data.jsonl", [20, 17, 25])
    args = _parse(_common(root, data, root / "out") + ["--max-steps", "1"])
    assert args.func(args) == 0
    return root


def _common(root, data, out):
    return ["train-head", "--base", str(root / "base"), "--data", str(data), "--output", str(out), "--sinks", str(S),
            "--window", str(W), "--seq-len", "32", "--save-steps", "1", "--warmup-steps", "0", "--head-width", "8",
            "--dtype", "float32", "--loss-reduction", "step", "--logging-steps", "1"]


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def _replace(argv, option, value):
    argv = list(argv)
    argv[argv.index(option) + 1] = value
    return argv


def _text_file(text):
    def write(root, tmp):
        (tmp / "data.jsonl").write_text(text)
        return tmp / "data.jsonl"
    return write


_empty, _blank = _text_file(""), _text_file("\n  \n")


def _short(root, tmp):
    return _documents(tmp / "short.jsonl", [4, 6, 5])


def _good(root, tmp):
    return root / "data.jsonl"


def _copy_run(root, tmp, drop=()):
    out = tmp / "out"
    shutil.copytree(root / "out", out)
    for name in drop:
        (out / "checkpoint-1" / name).unlink()
    return out


# (description, data, changed or added options, prepare output: None = fresh folder, expected type, message fragment)
CLI_ROWS = [
    ("empty data file", _empty, {}, None, UsageError, "is empty (or holds only blank lines)"),
    ("only blank lines", _blank, {}, None, UsageError, "is empty (or holds only blank lines)"),
    ("seq-len below s + w + 2", _good, {"--seq-len": "6"}, None, UsageError,
     "--seq-len 6 is shorter than s + w + 2 = 7 tokens"),
    ("every document short", _short, {}, None, UsageError, "every document is shorter than s + w + 2 = 7 tokens"),
    ("positions past the context", lambda root, tmp: _documents(tmp / "long.jsonl", [600]), {"--seq-len": "1000"},
     None, UsageError, "--seq-len: packed rows hold pieces of documents up to 600 tokens long, past the base model's "
     "context of 512 tokens"),   # trained on once, with exit 0
    ("resume without checkpoint", _good, {"--resume": None}, None, UsageError, "no complete checkpoint-* folder"),
    ("resume, only checkpoint incomplete", _good, {"--resume": None},
     lambda root, tmp: _copy_run(root, tmp, drop=["model.safetensors"]), UsageError, "no complete checkpoint-* folder"),
    ("resume, other window", _good, {"--resume": None, "--window": "4"}, _copy_run, UsageError,
     "window: 3 in the checkpoint, 4 now"),
    ("resume, other sinks", _good, {"--resume": None, "--sinks": "1"}, _copy_run, UsageError,
     "sinks: 2 in the checkpoint, 1 now"),
    ("resume, other lambda", _good, {"--resume": None, "--lambda": "0.1"}, _copy_run, UsageError,
     "oda_lambda: 0.0 in the checkpoint, 0.1 now"),
    ("resume, other tau-hist", _good, {"--resume": None, "--tau-hist": "0.01"}, _copy_run, UsageError,
     "tau_hist: 0.001 in the checkpoint, 0.01 now"),
    ("resume, other loss reduction", _good, {"--resume": None, "--loss-reduction": "micro"}, _copy_run, UsageError,
     "loss_reduction: 'step' in the checkpoint, 'micro' now"),
    ("resume, other seq-len", _good, {"--resume": None, "--seq-len": "24"}, _copy_run, UsageError,
     "seq_len: 32 in the checkpoint, 24 now"),
    ("resume, other head width", _good, {"--resume": None, "--head-width": "16"}, _copy_run, UsageError,
     "holds a head with head_width=8, but --head-width asks for 16"),
    ("resume, checkpoint without settings", _good, {"--resume": None},
     lambda root, tmp: _copy_run(root, tmp, drop=["oda_training.json"]), UsageError, "records no training settings"),
]


@pytest.mark.parametrize("description, data, changes, prepare, error, fragment", CLI_ROWS,
                         ids=[row[0] for row in CLI_ROWS])
def test_train_head_cli_bad_input(trained, tmp_path, description, data, changes, prepare, error, fragment):
    out = prepare(trained, tmp_path) if prepare is not None else tmp_path / "fresh"
    argv = _common(trained, data(trained, tmp_path), out) + ["--max-steps", "2"]
    for option, value in changes.items():
        if value is None:
            argv.append(option)
        elif option in argv:
            argv = _replace(argv, option, value)
        else:
            argv += [option, value]
    args = _parse(argv)
    with pytest.raises(error) as raised:
        args.func(args)
    assert fragment in str(raised.value)


def test_changed_settings_resume_only_when_allowed_and_recorded(trained, tmp_path):
    out = _copy_run(trained, tmp_path)
    argv = _replace(_common(trained, trained / "data.jsonl", out), "--window", "4") + ["--max-steps", "2", "--resume"]
    args = _parse(argv + ["--allow-changed-settings"])
    assert args.func(args) == 0
    recorded = json.loads((out / "oda_training.json").read_text())
    assert recorded["settings"]["window"] == 4
    assert recorded["history"] == [{"until_step": 1, "settings": {**recorded["settings"], "window": 3}}]
    assert json.loads((out / "checkpoint-2" / "oda_training.json").read_text())["history"] == recorded["history"]


def _oda_model():
    base = tiny_model("qwen3")
    torch.manual_seed(1)
    return OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                          OdaConfig(sinks=S, window=W, policy="head"))


API_ROWS = [
    ("packing length below min_length", lambda tmp: pack_documents([{"input_ids": list(range(1, 20))}], seq_len=5,
                                                                   min_length=7),
     ValueError, "seq_len=5 is shorter than min_length=7"),
    ("resume=True without a checkpoint", lambda tmp: OdaTrainer(
        model=_oda_model(), args=OdaTrainingArguments(output_dir=str(tmp / "none"), max_steps=1, use_cpu=True,
                                                      report_to="none"),
        train_dataset=PackedDataset([{"input_ids": list(range(1, 15))}])).train(resume_from_checkpoint=True),
     ValueError, "no complete checkpoint in"),
    ("resume from an incomplete checkpoint", lambda tmp: OdaTrainer(
        model=_oda_model(), args=OdaTrainingArguments(output_dir=str(tmp), max_steps=1, use_cpu=True, report_to="none"),
        train_dataset=PackedDataset([{"input_ids": list(range(1, 15))}])).train(
            resume_from_checkpoint=str((tmp / "checkpoint-1").mkdir() or tmp / "checkpoint-1")),
     ValueError, "checkpoint-1 is not a complete checkpoint"),
]


@pytest.mark.parametrize("description, call, error, fragment", API_ROWS, ids=[row[0] for row in API_ROWS])
def test_training_api_bad_input(tmp_path, description, call, error, fragment):
    with pytest.raises(error, match=fragment):
        call(tmp_path)
