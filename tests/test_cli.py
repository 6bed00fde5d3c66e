"""`oda generate` end to end on a tiny saved model with a word-level tokenizer."""

import pytest

from oda_hf import RecallHead, RecallHeadConfig
from oda_hf.cli import main, parse_policy
from oda_hf.policies import RandomPolicy
from tiny_models import save_with_word_tokenizer, tiny_model


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = tiny_model("qwen3")
    save_with_word_tokenizer(base, root / "base")
    RecallHead(RecallHeadConfig.for_base(base, head_width=8)).save_pretrained(root / "head")
    return root


def test_generate_prints_text_and_routing_summary(saved_model, capsys):
    prompt = " ".join(f"w{i}" for i in range(3, 40))
    code = main(["generate", "--base", str(saved_model / "base"), "--head", str(saved_model / "head"),
                 "--sinks", "2", "--window", "8", "--prompt", prompt, "--max-new-tokens", "7"])
    captured = capsys.readouterr()
    assert code == 0
    assert len(captured.out.split()) >= 1 and all(w.startswith("w") or w.startswith("<") for w in captured.out.split())
    assert "routed steps 6" in captured.err and "Full-call rate" in captured.err


def test_generate_within_the_window_says_no_rate(saved_model, capsys):
    """Every step within sinks + window: no step was decided, so there is no rate to print (it printed "nan%")."""
    code = main(["generate", "--base", str(saved_model / "base"), "--head", str(saved_model / "head"),
                 "--sinks", "2", "--window", "64", "--prompt", "w5 w6 w7", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 0 and "nan" not in err
    assert "(3 within sinks + window)" in err and "Full-call rate n/a past the window" in err


def test_generate_with_named_policy_and_no_head(saved_model, capsys):
    code = main(["generate", "--base", str(saved_model / "base"), "--policy", "schedule:1:3", "--sinks", "2",
                 "--window", "4", "--prompt", "w5 w6 w7 w8 w9 w10", "--max-new-tokens", "7"])
    assert code == 0 and "Full calls 2" in capsys.readouterr().err


def test_policy_parsing():
    assert parse_policy("local") == "local"
    assert isinstance(parse_policy("random:0.25:7"), RandomPolicy)
    assert parse_policy("schedule:2:16").rate == 0.125
    with pytest.raises(Exception, match="unknown policy"):
        parse_policy("sometimes")


def test_parser_and_help_import_no_torch():
    """`oda --help` stays instant: building every subcommand's parser imports neither torch nor transformers."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from oda_hf.cli import build_parser\n"
            "parser = build_parser()\n"
            "for command in ['generate', 'eval', 'diagnose', 'train-head', 'flops', 'demo']:\n"
            "    try:\n"
            "        parser.parse_args([command, '--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_lazy_package_exports_resolve():
    import oda_hf
    import oda_hf.evaluation
    import oda_hf.training

    for package in (oda_hf, oda_hf.evaluation, oda_hf.training):
        assert set(package.__all__) <= set(dir(package))
        for name in package.__all__:
            assert getattr(package, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        oda_hf.NotAName


class _Stop(Exception):
    pass


def test_generate_passes_its_options_to_the_model(saved_model, monkeypatch):
    """--dtype, --seed, --temperature, --exact --max-draft and --fast all reach the model's generate call."""
    import torch

    from oda_hf import OdaForCausalLM

    seen = {}

    def spy(self, *args, **kwargs):
        seen.update(kwargs, dtype=self.dtype, seed=torch.initial_seed())
        raise _Stop

    monkeypatch.setattr(OdaForCausalLM, "generate", spy)
    with pytest.raises(_Stop):
        main(["generate", "--base", str(saved_model / "base"), "--sinks", "2", "--window", "4", "--dtype", "bf16",
              "--prompt", "w5 w6 w7 w8 w9 w10", "--max-new-tokens", "7", "--temperature", "0.7", "--seed", "5",
              "--exact", "--verify-threshold", "inf", "--max-draft", "4", "--fast"])
    assert seen["dtype"] == torch.bfloat16 and seen["seed"] == 5
    assert seen["do_sample"] is True and seen["temperature"] == 0.7
    assert seen["oda_mode"] == "exact" and seen["max_draft"] == 4 and seen["oda_fast"] is True
