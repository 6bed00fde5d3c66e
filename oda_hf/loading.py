"""What `from_pretrained` is given: a local folder or a hub id, checked before any download or allocation.

Errors name the folder or file and what is wrong with it: a missing folder is reported as missing
(not as a malformed repo id), an unreachable hub fails at once instead of after a minute of retries,
and a recall-head folder must hold a recall head's config and weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from urllib.parse import urlparse

from huggingface_hub import constants, try_to_load_from_cache
from safetensors import SafetensorError
from transformers.utils import SAFE_WEIGHTS_NAME

HEAD_MODEL_TYPE = "oda_recall_head"
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def looks_like_path(name: str) -> bool:
    """Whether `name` can only be meant as a local path (hub ids are ``name`` or ``owner/name``).

    ``runs/head`` stays ambiguous (a hub id too), even when ``./runs`` exists: the hub decides.
    """
    return name.startswith((".", "/", "~")) or (os.sep != "/" and os.sep in name) or name.count("/") > 1


def resolve_local_folder(name: str | os.PathLike, what: str, revision: str | None = None) -> str | None:
    """The local folder `name` names, or None for a hub id that may be fetched.

    Raises FileNotFoundError for a missing path, NotADirectoryError for a file, and OSError when a
    hub id is neither cached nor reachable (instead of retrying for a minute).
    """
    name = os.fspath(name)
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return expanded
    if os.path.exists(expanded):
        raise NotADirectoryError(f"The {what} {name!r} is a file; give the folder that holds its config.json.")
    if looks_like_path(name):
        resolved = os.path.abspath(expanded)
        where = "" if resolved == name else f" (resolved to {resolved})"
        raise FileNotFoundError(
            f"The {what} folder {name!r} does not exist{where}. Check the path; a hub id looks like 'owner/name'."
        )
    _check_hub_reachable(name, what, revision)
    return None


def _check_hub_reachable(repo_id: str, what: str, revision: str | None) -> None:
    if constants.is_offline_mode():
        return  # transformers answers from the cache at once
    with contextlib.suppress(ValueError):  # not a valid repo id: the hub client gives its own error
        if isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str):
            return
    if any(os.environ.get(variable) for variable in _PROXY_VARIABLES):
        return  # the proxy resolves the host, not us
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        raise OSError(
            f"The {what} {repo_id!r} is not a local folder, not in the local Hugging Face cache, and the hub "
            f"({host}) cannot be reached: {err}. Check the spelling, give a local folder, or connect to the "
            "network (HF_HUB_OFFLINE=1 uses only the cache)."
        ) from None


HUB_KWARGS = ("revision", "token", "cache_dir", "force_download", "local_files_only", "proxies", "subfolder")


def resolve_head_folder(name: str | os.PathLike, hub_kwargs: dict) -> str:
    """The local folder holding recall head `name` (downloaded from the hub if needed), checked."""
    from transformers.utils import cached_file

    hub_kwargs = {key: value for key, value in hub_kwargs.items() if key in HUB_KWARGS}
    folder = resolve_local_folder(name, "recall head", hub_kwargs.get("revision"))
    if folder is not None:
        folder = os.path.join(folder, hub_kwargs.get("subfolder") or "")
    else:
        config_path = cached_file(os.fspath(name), "config.json", **hub_kwargs)
        cached_file(os.fspath(name), SAFE_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        folder = os.path.dirname(config_path)
    check_head_folder(folder)
    return folder


def read_model_type(name: str | os.PathLike, hub_kwargs: dict) -> tuple[str | None, dict]:
    """``(model_type, config dict)`` of a local folder or hub id; ``(None, {})`` when it has no readable config."""
    from transformers.utils import cached_file

    hub_kwargs = {key: value for key, value in hub_kwargs.items() if key in HUB_KWARGS}
    folder = resolve_local_folder(name, "base model", hub_kwargs.get("revision"))
    if folder is not None:
        path = os.path.join(folder, hub_kwargs.get("subfolder") or "", "config.json")
        path = path if os.path.isfile(path) else None
    else:
        try:
            path = cached_file(os.fspath(name), "config.json", _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False, **hub_kwargs)
        except OSError:
            return None, {}  # AutoModelForCausalLM.from_pretrained reports it
    if path is None:
        return None, {}
    values = read_config_json(os.path.dirname(path))
    return values.get("model_type"), values


def read_config_json(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no config.json: it is not a folder written by save_pretrained.")
    try:
        with open(path) as f:
            values = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}).") from err
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object; got {type(values).__name__}.")
    return values


def check_head_folder(folder: str) -> None:
    """Raise unless `folder` holds a recall head: its config (with the required fields) and its weights."""
    values = read_config_json(folder)
    config_path = os.path.join(folder, "config.json")
    model_type = values.get("model_type")
    if model_type != HEAD_MODEL_TYPE:
        raise ValueError(
            f"{folder} is not a recall head: {config_path} has model_type={model_type!r}, not {HEAD_MODEL_TYPE!r} "
            "(is it the base model's folder?). Give head=<a folder written by RecallHead/OdaForCausalLM."
            "save_pretrained>, or pass the base model as the first argument."
        )
    missing = [key for key in ("hidden_size",) if key not in values]
    if missing:
        raise ValueError(f"{config_path} lacks {missing}: the head's width cannot be known. Re-save the head.")
    weights = os.path.join(folder, SAFE_WEIGHTS_NAME)
    if not os.path.isfile(weights):
        raise FileNotFoundError(
            f"{folder} has no {SAFE_WEIGHTS_NAME}: the recall head's weights are missing (an untrained head would "
            "route at random). Copy the file from where the head was saved."
        )
    check_safetensors_file(weights)


def check_safetensors_file(path: str) -> None:
    """Raise if `path` is not a readable safetensors file (truncated downloads, random bytes, LFS pointers)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as weights:  # opening validates the header and the data size
            weights.keys()
    except (SafetensorError, OSError, ValueError) as err:
        size = os.path.getsize(path)
        raise OSError(
            f"{path} is not a valid safetensors file ({size} bytes: {err}). It may be truncated or a Git LFS "
            "pointer; download or save it again."
        ) from err
