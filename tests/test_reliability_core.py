"""Reliability of the core: one validation layer (CLI and API say the same), one atomic writer, no silent
coercion, and a refused change leaves the model as it was."""

import argparse
import copy
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from oda_hf import HeadPolicy, OdaConfig, OdaForCausalLM, RandomPolicy, RecallHead, RecallHeadConfig, SchedulePolicy
from oda_hf.cli import main, parse_policy
from oda_hf.compat import cache_kwargs
from safetensors.torch import save_file

from oda_hf.files import (atomic_path, atomic_write, output_lock, publish_files, remove_stale_partials,
                           staging_folder, write_json)
from oda_hf.validation import argument, integer, number, parse_policy_text, probability, seed
from tiny_models import left_padded_prompts, save_with_word_tokenizer, tiny_model

# -- the validation layer ---------------------------------------------------------------------------------

GOOD_VALUES = [
    (integer, dict(minimum=1), 3, 3),
    (integer, dict(minimum=1), np.int64(3), 3),
    (integer, dict(minimum=0, maximum=5), torch.tensor(5), 5),
    (number, {}, 0.25, 0.25),
    (number, {}, np.float32(0.5), 0.5),
    (number, dict(minimum=0.0), 0, 0.0),
    (number, dict(finite=False), -10**400, -math.inf),
    (probability, {}, 1, 1.0),
]


@pytest.mark.parametrize("check,bounds,value,expected", GOOD_VALUES)
def test_valid_values_pass_unchanged(check, bounds, value, expected):
    result = check("x", value, **bounds)
    assert result == expected and type(result) is type(expected)


BAD_VALUES = [  # (check, bounds, value, error, message fragment)
    (integer, dict(minimum=1), 0, ValueError, "`x` must be an integer >= 1; got 0."),
    (integer, dict(minimum=1), -2, ValueError, "got -2"),
    (integer, dict(minimum=0, maximum=3), 4, ValueError, ">= 0 and <= 3; got 4"),
    (integer, {}, 2.9, TypeError, "must be an integer; got 2.9 (float)"),
    (integer, {}, 3.0, TypeError, "got 3.0 (float)"),
    (integer, {}, True, TypeError, "got True (bool)"),
    (integer, {}, "3", TypeError, "got '3' (str)"),
    (number, {}, math.nan, ValueError, "must be a finite number; got nan"),
    (number, {}, math.inf, ValueError, "got inf"),
    (number, dict(minimum=0.0), -1.0, ValueError, "must be a finite number >= 0; got -1"),
    (number, dict(minimum=0.0, exclusive_minimum=True), 0.0, ValueError, "> 0; got 0"),
    (number, {}, "0.5", TypeError, "got '0.5' (str)"),
    (number, {}, None, TypeError, "got None (NoneType)"),
    (number, {}, 10**400, ValueError, "must be a finite number; got an integer too large for a float"),
    (number, {}, False, TypeError, "(bool)"),
    (integer, {}, torch.tensor(True), TypeError, "got tensor(True) (Tensor)"),   # numpy/torch booleans: not 1/0
    (integer, {}, np.False_, TypeError, "must be an integer; got"),
    (number, {}, np.True_, TypeError, "must be a finite number; got"),
    (number, {}, torch.tensor(True), TypeError, "(Tensor)"),
    (probability, {}, 1.5, ValueError, ">= 0 and <= 1 (a probability); got 1.5"),
]


@pytest.mark.parametrize("check,bounds,value,error,fragment", BAD_VALUES)
def test_invalid_values_name_the_value(check, bounds, value, error, fragment):
    with pytest.raises(error) as info:
        check("x", value, **bounds)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text,expected", [("4", 4), (" 7 ", 7)])
def test_argument_parses_text(text, expected):
    assert argument(integer, "n", minimum=1)(text) == expected


@pytest.mark.parametrize("converter,text,fragment", [
    (argument(integer, "n", minimum=1), "0", "must be an integer >= 1; got 0."),
    (argument(integer, "n", minimum=1), "2.5", "must be an integer; got '2.5'"),
    (argument(integer, "n", minimum=1), "", "must be an integer; got ''"),
    (argument(number, "t", minimum=0.0), "nan", "must be a finite number >= 0; got nan"),
    (argument(number, "t", minimum=0.0), "-1", "got -1"),
    (argument(number, "t"), "inf", "got inf"),
    (argument(number, "t"), "abc", "must be a number; got 'abc'"),
])
def test_argument_errors_are_argparse_errors(converter, text, fragment):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        converter(text)
    assert fragment in str(info.value) and "`" not in str(info.value)


@pytest.mark.parametrize("text,kind,params", [
    ("head", "head", {}), ("full", "full", {}), ("local", "local", {}), (" local ", "local", {}),
    ("random:0.25", "random", dict(p=0.25, seed=42)), ("random:1:7", "random", dict(p=1.0, seed=7)),
    ("random:0.0e-999", "random", dict(p=0.0)),
    ("schedule:2:16", "schedule", dict(k=2, period=16)), ("schedule:0:1", "schedule", dict(k=0, period=1)),
])
def test_policy_text(text, kind, params):
    spec = parse_policy_text(text)
    assert spec.kind == kind and all(getattr(spec, key) == value for key, value in params.items())


@pytest.mark.parametrize("text,fragment", [
    ("head:", "unknown policy 'head:'"), ("full:1", "unknown policy"), ("sometimes", "unknown policy"),
    ("random::0.5", "must be a number; got ''"), ("random:0.5:", "must be an integer; got ''"),
    ("random:nan", "finite"), ("random:1.5", "<= 1"), ("random:0.5:-1", ">= 0"), ("random:0.5:1.5", "integer"),
    ("schedule:2.9:3", "must be an integer; got '2.9'"), ("schedule:2:3.5", "integer"),
    ("schedule:3:2", "<= 2"), ("schedule:1:0", "PERIOD` must be an integer >= 1"), ("schedule:1", "unknown"),
    ("", "unknown policy ''"), ("random:1e-400", "too small (it would be read as 0)"),   # was Local, silently
    ("random:\u0661e-400", "too small"),   # an Arabic-Indic 1, which float() reads as 1 too
])
def test_bad_policy_text(text, fragment):
    with pytest.raises(ValueError, match=None) as info:
        parse_policy_text(text)
    assert fragment in str(info.value)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_policy(text)  # the CLI's --policy refuses the same texts


@pytest.mark.parametrize("make,error,fragment", [
    (lambda: SchedulePolicy(2.9, 3.5), TypeError, "`SchedulePolicy period` must be an integer >= 1; got 3.5"),
    (lambda: SchedulePolicy(2.9, 4), TypeError, "`SchedulePolicy k` must be an integer"),
    (lambda: SchedulePolicy(5, 4), ValueError, "<= 4 (Full steps in every period of 4); got 5"),
    (lambda: RandomPolicy(math.nan), ValueError, "finite"),
    (lambda: RandomPolicy(True), TypeError, "(bool)"),
    (lambda: RandomPolicy(0.5, seed=1.5), TypeError, "seed` must be an integer"),
    (lambda: OdaConfig(window=2048.0), ValueError, "`window` must be an integer"),
    (lambda: OdaConfig(threshold=math.inf), ValueError, "finite"),
    (lambda: HeadPolicy(math.nan), ValueError, "`HeadPolicy threshold` must be a number; got nan"),
    (lambda: HeadPolicy("0.0"), TypeError, "(str)"),
    (lambda: HeadPolicy(True), TypeError, "(bool)"),
])
def test_policy_and_config_objects_refuse_instead_of_coercing(make, error, fragment):
    with pytest.raises(error) as info:
        make()
    assert fragment in str(info.value)


# -- a refused change leaves the model as it was; a cache keeps its geometry --------------------------------


def test_refused_set_routing_keeps_the_previous_routing():
    model = OdaForCausalLM(tiny_model("qwen3"), oda_config=OdaConfig(policy="local", window=8))
    with pytest.raises(ValueError, match="needs a recall head"):
        model.set_routing(policy="head", window=16)
    assert (model.oda_config.policy, model.oda_config.window) == ("local", 8)
    model.set_routing(policy="full")  # the next call works
    assert model.oda_config.policy == "full"


def test_a_cache_is_refused_under_another_geometry_and_continues_under_its_own():
    torch.manual_seed(0)
    model = OdaForCausalLM(tiny_model("qwen3"), oda_config=OdaConfig(policy="local", sinks=2, window=8))
    prompt = torch.randint(3, 90, (1, 20))
    first = model.generate(prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = first.past_key_values
    model.set_routing(window=16)
    follow_up = torch.cat([first.sequences, torch.randint(3, 90, (1, 2))], dim=1)
    with pytest.raises(ValueError, match=r"made for sinks=2, window=8, but the model now routes with sinks=2, "
                                         r"window=16\. Start a new cache"):
        model.generate(follow_up, past_key_values=cache, max_new_tokens=3, do_sample=False)
    model.set_routing(window=8)
    continued = model.generate(follow_up, past_key_values=cache, max_new_tokens=3, do_sample=False)
    fresh = model.generate(follow_up, max_new_tokens=3, do_sample=False)
    assert torch.equal(continued, fresh)


# -- `oda generate`: bad values end in one line and exit 2 ----------------------------------------------------


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("core") / "base"
    save_with_word_tokenizer(tiny_model("qwen3"), folder)  # max_position_embeddings 512
    return folder


LONG_PROMPT = " ".join(f"w{3 + i % 90}" for i in range(500))

GENERATE_MISTAKES = [  # (extra argv, message fragment)
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1; got 0."),
    (["--max-new-tokens", "-2"], "argument --max-new-tokens: must be an integer >= 1; got -2."),
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0; got -1."),
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0; got nan."),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0; got -1."),
    (["--window", "0"], "argument --window: must be an integer >= 1 and <= 16777216; got 0."),
    (["--sinks", "1.5"], "argument --sinks: must be an integer; got '1.5'."),
    (["--threshold", "inf"], "argument --threshold: must be a finite number; got inf."),
    (["--policy", "random::0.5"], "argument --policy: bad policy 'random::0.5'"),
    (["--policy", "head:"], "argument --policy: unknown policy 'head:'"),
    (["--policy", "schedule:2.9:3"], "argument --policy: bad policy 'schedule:2.9:3'"),
    (["--max-draft", "4"], "--max-draft only applies with --exact; add --exact or drop --max-draft."),
    (["--exact", "--max-draft", "0"], "argument --max-draft: must be an integer >= 1 and <= 1024; got 0."),
    (["--exact", "--verify-threshold", "nan"], "argument --verify-threshold: must be a number; got nan."),
    (["--exact", "--policy", "local"], "--exact: oda_mode='exact' verifies when the recall head asks"),
    (["--exact", "--policy", "local", "--verify-threshold=-inf"], "--exact: verify_threshold=-inf would verify every token"),
    (["--policy", "full", "--prompt", LONG_PROMPT, "--max-new-tokens", "20"],
     "the prompt has 500 tokens; with --max-new-tokens 20 that is 520 positions, past the model's "
     "max_position_embeddings=512. Shorten it to at most 492 tokens"),
]


@pytest.mark.parametrize("extra,fragment", GENERATE_MISTAKES, ids=[" ".join(e)[:40] for e, _ in GENERATE_MISTAKES])
def test_generate_mistakes_exit_2_with_one_line(extra, fragment, base_folder, capsys):
    argv = ["generate", "--base", str(base_folder), "--prompt", "w3 w4 w5"] + extra
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "oda generate: error: " + fragment in err, err


# -- one atomic writer ----------------------------------------------------------------------------------------


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "out.json"
    write_json(path, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write('{"v": 2, "half')
            raise RuntimeError("killed")
    assert path.read_text() == '{\n "v": 1\n}\n'
    assert os.listdir(tmp_path) == ["out.json"]  # no temporary left behind


def test_a_writer_killed_inside_atomic_path_leaves_only_a_staging_folder(tmp_path):
    """safetensors >= 0.7 writes through its own ``.tmpXXXXXX`` file beside the path it is given; a kill between its
    write and its rename must not leave that file in the output folder, where no cleanup knows its name (a CI failure
    of the kill -9 supervision test). The writer's temporaries land in atomic_path's staging folder."""
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal
        import torch
        from safetensors.torch import save_file
        from oda_hf.files import atomic_path
        with atomic_path({str(out / "shard.safetensors")!r}) as temporary:
            save_file({{"x": torch.zeros(4)}}, temporary)
            open(os.path.join(os.path.dirname(temporary), ".tmpAbCdEf"), "w").close()  # safetensors' own, mid-write
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == -signal.SIGKILL
    assert [name.split(".partial-")[0] for name in os.listdir(out)] == [".shard.safetensors"]  # one staging folder
    remove_stale_partials(out)
    assert os.listdir(out) == []
    with atomic_path(out / "shard.safetensors") as temporary:  # and a completed write leaves only its file
        save_file({"x": torch.zeros(4)}, temporary)
    assert os.listdir(out) == ["shard.safetensors"]


def test_remove_stale_partials_with_names_leaves_other_outputs_staging(tmp_path):
    """Found by a mutation audit: nothing failed when remove_stale_partials ignored `names`, deleting the staging
    folder of another output's save in progress beside this run's (as `oda train-head` calls it on its parent)."""
    other = staging_folder(tmp_path / "other-head")
    with open(os.path.join(other, "model.safetensors"), "w") as f:
        f.write("staged")
    mine = staging_folder(tmp_path / "my-run")   # this run's leftover
    remove_stale_partials(tmp_path, names=["my-run"])
    assert not os.path.exists(mine) and os.path.isfile(os.path.join(other, "model.safetensors"))


def test_publish_files_moves_the_marker_last(tmp_path):
    target = tmp_path / "head"
    target.mkdir()
    (target / "config.json").write_text("old config")
    (target / "model.safetensors").write_text("old weights")
    staging = staging_folder(target)
    for name, text in (("config.json", "new config"), ("model.safetensors", "new weights")):
        with open(os.path.join(staging, name), "w") as f:
            f.write(text)
    assert publish_files(staging, target, marker="config.json") == ["model.safetensors", "config.json"]
    assert (target / "config.json").read_text() == "new config"
    assert not os.path.exists(staging)


def test_output_lock_refuses_a_second_writer(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from oda_hf.files import output_lock
        with output_lock({str(tmp_path)!r}):
            print("locked", flush=True)
            time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"in use by process {holder.pid}: wait for it to finish"):
            with output_lock(tmp_path, "the results"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with output_lock(tmp_path):  # a killed holder leaves no stuck lock
        pass


def test_kill_9_during_atomic_writes_leaves_complete_files(tmp_path):
    """A writer killed at random moments: the file is always absent or one complete version."""
    script = textwrap.dedent(f"""
        from oda_hf.files import atomic_write
        i = 0
        while True:
            with atomic_write({str(tmp_path / "data.txt")!r}) as f:
                for _ in range(2000):
                    f.write(f"{{i}}\\n" * 50)
            i += 1
    """)
    for delay in (0.3, 0.5, 0.8):
        writer = subprocess.Popen([sys.executable, "-c", script])
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        path = tmp_path / "data.txt"
        if path.exists():
            lines = path.read_text().splitlines()
            assert len(lines) == 100_000 and len(set(lines)) == 1


def test_an_unreachable_hub_id_fails_before_the_tokenizer_loader_retries(tmp_path, monkeypatch):
    """generate, eval, calibrate, train-head and cache-supervision load the tokenizer first: the hub check must
    come before transformers' loader, which retries for about a minute."""
    import transformers

    from oda_hf.cli_common import UsageError, load_tokenizer
    from test_bad_inputs import unreachable_hub

    unreachable_hub(tmp_path, monkeypatch)

    def retrying_loader(*args, **kwargs):
        raise AssertionError("the tokenizer loader ran before the hub check")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", retrying_loader)
    with pytest.raises(UsageError, match=r"--base \(its tokenizer\): The tokenizer 'someone/missing' is not a local "
                                         r"folder, not in the local Hugging Face cache, and the hub .* cannot be reached"):
        load_tokenizer(None, "someone/missing")


@pytest.mark.parametrize("call,fragment", [
    (lambda m: m.generate(torch.randint(3, 90, (1, 8)), max_new_tokens=2, max_draft=3),
     "max_draft only applies with oda_mode='exact'"),
    (lambda m: m.generate(torch.randint(3, 90, (1, 8)), max_new_tokens=2, oda_fast=True, verify_threshold=0.5),
     "verify_threshold only applies with oda_mode='exact'"),
    (lambda m: m.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2), "input_ids has no token"),
    (lambda m: m.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2, oda_fast=True),
     "input_ids has no token"),
    (lambda m: OdaForCausalLM.from_pretrained(m.base_model, head=""), "`head` is an empty string"),
    (lambda m: OdaForCausalLM.from_pretrained(" ", policy="full"), "`base` is an empty string"),
])
def test_generate_and_loading_refuse_what_they_cannot_honour(call, fragment):
    model = OdaForCausalLM(tiny_model("qwen3"), oda_config=OdaConfig(policy="local", window=4))
    with pytest.raises(ValueError) as info:
        call(model)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_generate_exact_prints_full_output(base_folder, capsys):
    """`oda generate --exact` (fixed drafts, no head) prints what always-Full prints, with an exact summary."""
    common = ["generate", "--base", str(base_folder), "--prompt", " ".join(f"w{3 + i}" for i in range(40)),
              "--max-new-tokens", "12", "--window", "6", "--sinks", "2"]
    assert main(common + ["--policy", "full"]) == 0
    full = capsys.readouterr().out
    assert main(common + ["--policy", "local", "--exact", "--verify-threshold", "inf", "--max-draft", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out == full and "[oda] exact sinks=2 window=6 | exact: 12 tokens" in captured.err
    assert main(common + ["--policy", "local", "--exact", "--verify-threshold", "inf", "--fast"]) == 0
    captured = capsys.readouterr()  # the same on the static engine
    assert captured.out == full and "[oda] exact sinks=2 window=6 | exact: 12 tokens" in captured.err
    assert main(common + ["--policy", "full", "--fast"]) == 0
    captured = capsys.readouterr()
    assert captured.out == full and "[oda] policy=AlwaysFullPolicy() sinks=2 window=6" in captured.err  # engine's summary


def test_publish_files_swaps_a_folder_whole(tmp_path):
    """A folder published over an existing one is renamed aside and replaced, never deleted in place (a kill
    inside a recursive delete would leave a half-deleted folder whose manifest still vouches for its files)."""
    target = tmp_path / "out"
    (target / "1024").mkdir(parents=True)
    for name in ("a.jsonl", "b.jsonl", "manifest.json"):
        (target / "1024" / name).write_text("old")
    staging = staging_folder(target)
    os.makedirs(os.path.join(staging, "1024"))
    for name in ("a.jsonl", "manifest.json"):
        with open(os.path.join(staging, "1024", name), "w") as f:
            f.write("new")
    publish_files(staging, target)
    assert sorted(os.listdir(target / "1024")) == ["a.jsonl", "manifest.json"]
    assert (target / "1024" / "manifest.json").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # neither the staging folder nor the old one is left


def test_a_safetensors_file_written_through_atomic_path_follows_the_umask(tmp_path):
    """Found by an audit: supervision shards came out 0600 beside a 0644 manifest (safetensors renames its own
    mkstemp temporary onto the name it is given, replacing the mode set before it wrote)."""
    import safetensors.torch
    import torch

    from oda_hf.files import atomic_path

    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "a.safetensors") as temporary:
            safetensors.torch.save_file({"x": torch.zeros(2)}, temporary)
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "a.safetensors").st_mode & 0o777 == 0o644


def test_the_umask_is_read_without_being_changed(monkeypatch):
    """Reading it by setting it to 0 and back let a file another thread created in that instant come out 0666."""
    from oda_hf import files

    old = os.umask(0o027)
    try:
        if not os.path.exists("/proc/self/status"):
            pytest.skip("no /proc: the umask is read by setting it")
        monkeypatch.setattr(files.os, "umask", lambda mask: pytest.fail("the umask was changed to read it"))
        assert files.published_mode() == 0o640
    finally:
        monkeypatch.undo()
        os.umask(old)


def test_an_output_lock_is_gone_after_a_failed_block_too(tmp_path):
    """A command refused inside its lock left `.oda.lock` in the folder (oda text-model's 'nothing kept' kept it)."""
    from oda_hf.files import output_lock

    with pytest.raises(RuntimeError):
        with output_lock(tmp_path / "out"):
            raise RuntimeError("refused")
    assert not (tmp_path / "out" / ".oda.lock").exists()


# -- survivors of a mutation audit of the core path (cache, modeling, routing, policies, validation; 2026-11-29) --


def test_a_long_second_turn_widens_the_workspace_with_the_current_slot():
    """A call that continues a cache with many new prompt tokens must widen the Local workspace by the committed
    positions plus the current token's slot (without it the current token overwrote the last committed position:
    wrong tokens, exit 0). Within sinks + window Local reads what Full reads: the turn equals the stock model's."""
    base = tiny_model("llama")
    model = OdaForCausalLM(base, None, OdaConfig(sinks=2, window=64, policy="local"))
    g = torch.Generator().manual_seed(5)
    cache = model.new_cache()
    first = model.generate(input_ids=torch.randint(3, 90, (1, 3), generator=g), max_new_tokens=2, do_sample=False,
                           pad_token_id=0, past_key_values=cache)
    assert cache.global_layers[0].workspace_width < 12   # the first call sized the workspace for 5 positions
    turn = torch.cat([first, torch.randint(3, 90, (1, 25), generator=g)], dim=1)   # 30 positions, all within s + w
    out = model.generate(input_ids=turn, max_new_tokens=6, do_sample=False, pad_token_id=0, past_key_values=cache,
                         output_logits=True, return_dict_in_generate=True)
    stock = base.generate(input_ids=turn, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, stock.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(stock.logits, 1), atol=2e-5, rtol=2e-5)


def test_a_crop_past_the_shortest_rows_history_is_refused():
    """Cropping more positions than the shortest (left-padded) row holds is refused before anything changes (checked
    against the longest row's count, it failed later in torch with the cache half changed)."""
    model = OdaForCausalLM(tiny_model("qwen3"), None, OdaConfig(sinks=2, window=4, policy="local"))
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0   # row 1 holds 2 prompt positions, row 0 holds 8
    cache = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True).past_key_values
    assert cache.global_layers[0].valid_count.tolist() == [10, 4]
    with pytest.raises(ValueError, match="more than a row holds"):
        cache.crop(-6)
    assert cache.get_seq_length() == 10 and cache.global_layers[0].valid_count.tolist() == [10, 4]


def test_a_continuing_call_counts_the_routed_step_that_produced_eos():
    """A call that continues a cache with one uncached token runs no prefill: its output k comes from routed step
    k + 1, so a row whose first EOS is output k has taken k + 1 routed steps (every other EOS test had a prefill)."""
    model = OdaForCausalLM(tiny_model("llama"), None, OdaConfig(sinks=1, window=3, policy=RandomPolicy(0.5, seed=3)))
    ids, mask = left_padded_prompts(2, 6, pads=(2, 0))
    kwargs = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, **kwargs)
    cache = first.past_key_values
    assert cache.get_seq_length() == first.sequences.shape[1] - 1   # the last output is not cached: no prefill next
    turn = dict(input_ids=first.sequences, attention_mask=torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1),
                max_new_tokens=8, **kwargs)
    free = model.generate(**turn, **cache_kwargs(copy.deepcopy(cache)))
    new = free.sequences[:, first.sequences.shape[1]:]
    # an EOS row 0 emits first at output k that row 1 never emits: row 0 stops there, row 1 runs on
    k, eos = next((k, int(t)) for k, t in enumerate(new[0].tolist()) if int(t) not in new[1].tolist()
                  and int(t) not in new[0, :k].tolist())
    model.generate(**turn, eos_token_id=eos, **cache_kwargs(copy.deepcopy(cache)))
    routing = model.routing
    assert routing.routed_steps == 8   # every output of a continuing call comes from a routed step
    assert routing.steps_per_row.tolist() == [k + 1, 8]
    assert routing.finished_at[0].item() == k + 1


def test_padding_after_eos_inside_the_window_is_not_an_in_window_full_call():
    """Always-Full keeps deciding Full on the padding steps after a row's EOS; those steps are not the row's, so they
    are no in-window Full calls (counted, window_full_calls exceeded window_steps for a row that stopped inside
    sinks + window)."""
    model = OdaForCausalLM(tiny_model("qwen3"), None, OdaConfig(sinks=2, window=4, policy="full"))
    ids, mask = left_padded_prompts(2, 3, pads=(0, 0))   # histories 4, 5, 6 within s + w = 6 at steps 1..3
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    free = model.generate(**kwargs)[:, 3:]
    # row 0 emits `eos` first at output 1 (routed step 1, in the window); row 1 never emits it
    eos = int(free[0, 1])
    assert eos not in free[1].tolist() and eos != int(free[0, 0])
    model.generate(**kwargs, eos_token_id=eos)
    routing = model.routing
    assert routing.steps_per_row.tolist() == [1, 7]
    assert routing.window_steps_per_row.tolist() == [1, 3]
    assert routing.window_full_calls_per_row.tolist() == [1, 3]
    assert routing.decided_steps_per_row.tolist() == [0, 4]
    assert routing.full_call_rate == 1.0 and routing.paper_full_call_rate == 1.0


def test_a_head_policys_own_threshold_wins_over_the_routing_threshold():
    """`HeadPolicy(threshold=t)` given as the policy routes at t, not at the routing threshold (every test of an
    explicit HeadPolicy had used t = 0, the routing default)."""
    base = tiny_model("qwen3")
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    ids, mask = left_padded_prompts(2, 9, pads=(2, 0))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0)
    model = OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, policy="head"))
    model.generate(**kwargs)
    decided = model.routing.scores[~model.routing.in_window]
    threshold = float(decided.median())
    assert ((decided > 0) != (decided > threshold)).any()   # the two thresholds split these scores differently
    model.set_routing(policy=HeadPolicy(threshold))          # the routing threshold stays 0
    model.generate(**kwargs)
    routing = model.routing
    past = ~routing.in_window
    assert torch.equal(routing.decisions[past], routing.scores[past] > threshold)


def test_bad_numbers_and_policies_are_refused_by_name():
    with pytest.raises(ValueError, match="<= 1"):
        probability("p", 1.0 + 1e-10)
    with pytest.raises(argparse.ArgumentTypeError, match="must be an integer"):
        argument(integer, "window", minimum=1)("1_0")   # Python's int() reads it as 10
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policy_text("random:0.5:1:9")
    with pytest.raises(ValueError, match="2\\*\\*64 - 1"):   # refused here, not deep inside torch
        seed("seed", 2**64)
    for text in ("budget:0.3:1_0", "budget:0.3:nan", "budget:0.3:1e-400"):   # a bare float(): 10, nan, 0
        with pytest.raises(ValueError, match="bad policy"):
            parse_policy_text(text)


@pytest.mark.parametrize("make", [lambda: number("threshold", b"0.5"), lambda: probability("p", bytearray(b"1")),
                                  lambda: OdaConfig(threshold=b"0.25"), lambda: RandomPolicy(b"0.5")],
                         ids=["number", "probability", "OdaConfig", "RandomPolicy"])
def test_bytes_are_not_a_number(make):
    """float() parses bytes: a threshold of b"0.25" was read as 0.25 where the string "0.25" is refused (OdaConfig
    raises its checks' errors as ValueError, as for a string)."""
    with pytest.raises((TypeError, ValueError), match=r"must be a .*\((bytes|bytearray)\)"):
        make()
