"""Plumbing shared by every `oda` subcommand: user errors and argument types.

Kept free of torch/transformers imports so that building the parser (``oda --help``) stays fast.
A subcommand raises `UsageError` for anything the user can fix; `oda_hf.cli.main` prints it as one
line, ``oda <command>: error: <message>``, and exits with status 2, as argparse does for bad flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

#: Accepted ``--dtype`` spellings -> the torch attribute name ("auto" keeps the checkpoint's dtype).
DTYPE_NAMES = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


class UsageError(Exception):
    """A command-line mistake the user can fix; the message says what is wrong and what to do."""


def dtype_name(text: str) -> str:
    """argparse type for ``--dtype``: a canonical name from `DTYPE_NAMES` (torch is not imported here)."""
    name = DTYPE_NAMES.get(text.strip().lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; use one of {', '.join(DTYPE_NAMES)}")
    return name


def thread_count(text: str) -> int:
    """argparse type for ``--threads``: an integer from 1 to this machine's CPU count. More threads give torch
    nothing, and a huge count fails deep inside it ("can't start new thread") after the model has loaded."""
    from .validation import argument, integer

    value = argument(integer, "threads", minimum=1)(text)
    cpus = os.cpu_count() or 1
    if value > cpus:
        raise argparse.ArgumentTypeError(f"must be at most {cpus}, the number of CPUs of this machine; got {value}.")
    return value


def torch_dtype(name: str):
    """The ``dtype=`` value for `from_pretrained` from a `dtype_name` result."""
    if name == "auto":
        return "auto"
    import torch

    return getattr(torch, name)


def require_paths(flag: str, paths: str | Sequence[str] | None) -> None:
    """Fail before any model loads if a local input named by `flag` does not exist."""
    for path in [paths] if isinstance(paths, str) else (paths or []):
        if not os.path.exists(path):
            raise UsageError(f"{flag} {path}: no such file or directory.")


def require_model_source(flag: str, name: str | None) -> None:
    """A `name` written as a local path (absolute, ``./``, ``../``, ``~``) must exist; otherwise transformers
    reports it as a malformed hub id. Hub ids (``org/name``) pass through."""
    if name and (os.path.isabs(name) or name.startswith((".", "~"))) and not os.path.exists(os.path.expanduser(name)):
        raise UsageError(f"{flag} {name}: no such folder; give a local folder or a hub id.")


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors can span many lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


@contextmanager
def user_input(what: str, fix: str | None = None) -> Iterator[None]:
    """Report errors raised while reading a user-named input (a file, a model folder or id) as `UsageError`.

    Only wrap the code that reads that input: missing or unreadable files (`OSError`) and malformed
    content (`ValueError`) become ``"<what>: <first line of the error>[ (<fix>)]"``.
    """
    try:
        yield
    except (OSError, ValueError) as err:
        raise UsageError(f"{what}: {first_line(err)}" + (f" ({fix})" if fix else "")) from err


def load_tokenizer(tokenizer: str | None, base: str):
    """The ``--tokenizer`` given, else ``--base``'s tokenizer, refusing an empty one: for a model folder without
    tokenizer files transformers builds a tokenizer with no vocabulary, which turns every text into <= 1 token."""
    from transformers import AutoTokenizer

    name, flag = (tokenizer, "--tokenizer") if tokenizer else (base, "--base (its tokenizer)")

    from .loading import resolve_local_folder

    require_model_source(flag, name)
    with user_input(flag, "give --tokenizer with a tokenizer folder or hub id"):
        # The hub check first: an id that is neither cached nor reachable fails at once, not after a minute of
        # the tokenizer loader's retries.
        resolve_local_folder(name, "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(name)
    if len(tokenizer) <= 1:
        raise UsageError(f"{flag}: {name} holds no tokenizer (its vocabulary is empty); give --tokenizer with a "
                         "tokenizer folder or hub id.")
    return tokenizer


def data_tokenizer(tokenizer: str | None, base: str):
    """Tokenizer for training records: `tokenizer`, else `base`'s own. Token-id data needs none, so a base folder
    without tokenizer files is fine (None) until a text record asks for one (its error names --tokenizer)."""
    if tokenizer:
        return load_tokenizer(tokenizer, base)
    try:
        return load_tokenizer(None, base)
    except UsageError as err:
        print(f"[oda] no tokenizer from {err}; token-id records need none, text records need --tokenizer.",
              file=sys.stderr)
        return None


def context_limit(config) -> int | None:
    """The model's ``max_position_embeddings`` (of its text config for multimodal configs), or None."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text_config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_context(config, prompt_tokens: int, max_new_tokens: int, what: str = "the prompt") -> None:
    """Refuse a request past the model's context (transformers only warns, and the output past it is garbage)."""
    limit = context_limit(config)
    if limit is not None and prompt_tokens + max_new_tokens > limit and max_new_tokens >= limit:
        # No prompt fits ("shorten it to at most 0 tokens" would be no advice): the output cap is the mistake.
        raise UsageError(f"--max-new-tokens {max_new_tokens} leaves no room for {what} in the model's "
                         f"max_position_embeddings={limit}: lower --max-new-tokens to at most "
                         f"{max(limit - prompt_tokens, 1)}.")
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise UsageError(
            f"{what} has {prompt_tokens} tokens; with --max-new-tokens {max_new_tokens} that is "
            f"{prompt_tokens + max_new_tokens} positions, past the model's max_position_embeddings={limit}. "
            f"Shorten it to at most {max(limit - max_new_tokens, 0)} tokens or lower --max-new-tokens.")
