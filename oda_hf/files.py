"""The one way oda_hf writes a file that something later reads: complete or not at all.

A file is written under a temporary name in its own folder, flushed to disk, then renamed over the final
name (`os.replace` is atomic on POSIX), so a kill -9 at any moment leaves either the old file, the new
one, or a stray ``.*.partial-*`` temporary that nothing reads. Folders of several files (a saved head:
``config.json`` + ``model.safetensors``) are published by `publish_files` with a *marker* file moved last
and removed first, so a reader that requires the marker never sees a mix of old and new. `output_lock`
keeps two processes from writing into the same output folder. No torch import here.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence

__all__ = ["read_jsonl_objects", "atomic_path", "atomic_write", "write_json", "write_text", "publish_files", "output_lock",
           "OutputLocked"]


def _fsync_folder(folder: str) -> None:
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some file systems refuse fsync on folders; the rename is still atomic
            os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask. Linux shows it in /proc; elsewhere it is set and restored, and a file another thread creates
    in that instant gets mode 0666."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def published_mode() -> int:
    """The mode of a published file: 0666 less the umask (what `open` gives; mkstemp's temporaries are 0600)."""
    return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside `path`; when the block ends normally it is synced and renamed to `path`.

    For writers that want a file name (safetensors, matplotlib, zip extraction). On an exception the
    temporary is removed and `path` is untouched. The temporary lives in a private ``.<name>.partial-*``
    folder, so the writer's own temporaries land there too (safetensors >= 0.7 writes through a ``.tmpXXXXXX``
    file beside its target): a kill -9 leaves one staging folder that `remove_stale_partials` clears, never a
    stray file in the output folder."""
    path = os.fspath(path)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=folder or ".")
    # The file keeps its own name: writers such as matplotlib choose the format from the extension.
    temporary = os.path.join(staging, os.path.basename(path))
    try:
        with open(temporary, "wb"):
            pass
        yield temporary
        # A published file follows the umask, set after the writer: safetensors renames its own 0600 temporary
        # (mkstemp's mode) onto this name, which replaced the mode set before.
        os.chmod(temporary, published_mode())
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _fsync_folder(folder)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8"):
    """``with atomic_write(path) as f: f.write(...)``: `path` appears only once the block completed."""
    if "b" in mode:
        encoding = None
    with atomic_path(path) as temporary, open(temporary, mode, encoding=encoding) as f:
        yield f


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def write_json(path: str | os.PathLike, value, indent: int | None = 1, **dump_kwargs) -> None:
    with atomic_write(path) as f:
        json.dump(value, f, indent=indent, **dump_kwargs)
        f.write("\n")


def publish_files(staging: str | os.PathLike, target: str | os.PathLike, marker: str | None = None,
                  replaces: Sequence[str] = ()) -> list[str]:
    """Move every file of the folder `staging` into `target` (created if needed), then remove `staging`.

    `marker` (e.g. ``config.json``): the file a reader requires. It is removed from `target` before the
    other files move and moved in last, so `target` holds either the complete old set, no marker (a reader
    refuses it), or the complete new set. `replaces`: glob patterns (``model*.safetensors``) of files in
    `target` that belong to the old set: those the new set does not hold are removed after the marker, so no
    file of an older save (a stale shard, a calibration of other weights) stays beside the new ones. Returns
    the names moved."""
    staging, target = os.fspath(staging), os.path.abspath(os.fspath(target))
    os.makedirs(target, exist_ok=True)
    names = sorted(os.listdir(staging))
    if marker is not None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(target, marker))
        _fsync_folder(target)
        names = [name for name in names if name != marker] + ([marker] if marker in names else [])
    stale = [name for name in os.listdir(target) if name not in names and name != marker
             and any(fnmatch.fnmatchcase(name, pattern) for pattern in replaces)
             and os.path.isfile(os.path.join(target, name))]
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(target, name))
    if stale:
        _fsync_folder(target)
    for name in names:
        source = os.path.join(staging, name)
        if os.path.isdir(source):
            destination = os.path.join(target, name)
            if os.path.isdir(destination):
                # Swap, never delete in place: a kill inside rmtree leaves a half-deleted folder whose own manifest
                # may survive and vouch for files that are gone. The old folder goes aside (beside `target`, under a
                # `.<target>.partial-` name that `remove_stale_partials` clears) and is deleted after the swap.
                aside = os.path.join(os.path.dirname(target),
                                     f".{os.path.basename(target)}.partial-old-{name}-{os.getpid()}")
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(destination, aside)
                os.replace(source, destination)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(source, destination)
            continue
        with open(source, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(source, os.path.join(target, name))
        if name == marker:
            _fsync_folder(target)
    _fsync_folder(target)
    shutil.rmtree(staging, ignore_errors=True)
    return names


def staging_folder(target: str | os.PathLike) -> str:
    """A fresh empty folder beside `target` (same file system, so `publish_files` renames)."""
    target = os.path.abspath(os.fspath(target))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)


def read_jsonl_objects(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a JSONL file. Invalid JSON, a line that is not a JSON
    object and bytes that are not UTF-8 raise a one-line ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        number = 0
        try:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not valid JSON ({err}).") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{number}: each line must be a JSON object; got "
                                     f"{type(record).__name__}.")
                yield number, record
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}:{number + 1}: not UTF-8 text ({err.reason}); give a JSONL file.") from None


class OutputLocked(ValueError):
    """Another process holds the lock of an output folder."""


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, what: str = "this output folder") -> Iterator[None]:
    """Hold an exclusive lock on `folder` (a ``.oda.lock`` file in it) for the block; refuse at once if another
    process holds it. The OS drops the lock when the holder dies, so a killed run never leaves it stuck."""
    import fcntl

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    handle = open(os.path.join(folder, ".oda.lock"), "a+")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise OutputLocked(f"{folder} is in use by {holder}: wait for it to finish, or write {what} to another "
                               "folder.") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            # Gone when the holder finishes, or fails, so it never travels with an uploaded folder; a killed holder's
            # stays and is reused (the OS released its lock).
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, ".oda.lock"))
    finally:
        handle.close()


def remove_stale_partials(folder: str | os.PathLike, names: Sequence[str] | None = None) -> None:
    """Delete ``.*.partial-*`` leftovers of a killed writer in `folder` (only those whose final name is in
    `names`, when given). Safe to call only while holding the folder's `output_lock`."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return
    for entry in os.listdir(folder):
        if entry.startswith(".") and ".partial-" in entry:
            final = entry[1:].split(".partial-", 1)[0]
            if names is None or final in names:
                path = os.path.join(folder, entry)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
