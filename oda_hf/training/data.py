"""Training data for the recall head: documents -> packed rows -> padded batches.

Rows are packed greedily from whole documents; every document (or each ``seq_len`` piece of a longer
one) is its own segment with ``position_ids`` restarting at 0, and segments never attend to each other
(`layout.py`). A piece shorter than ``min_length`` tokens can hold no eligible position
(``s + w + 2`` tokens are needed for one) and is dropped rather than packed as dead weight. A document whose
``labels`` mask some positions (a prompt with a teacher-forced answer) is never split: its supervised tokens need the
context before them, and the tail piece that holds them is often too short to keep. Other documents may be split,
and the commands say how many were and how many tokens that dropped (`PackingStats.split_warning`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from ..files import read_jsonl_objects
from .layout import IGNORE_INDEX


def min_document_length(sinks: int, window: int) -> int:
    """Shortest segment with an eligible position: ``x_t`` at ``t = s + w + 1`` needs ``x_{t+1}``."""
    return sinks + window + 2


def _token_list(values, where: str) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                         for v in values):
        raise ValueError(f"{where}: 'input_ids' must be a list of non-negative integers.")
    return list(values)


def _label_list(values, where: str) -> list[int]:
    # A string or a list of floats would pass list() and fail later inside torch, far from the record.
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and (v >= 0 or v == IGNORE_INDEX) for v in values):
        raise ValueError(f"{where}: 'labels' must be a list of token ids (integers >= 0) or {IGNORE_INDEX} for masked "
                         "positions.")
    return list(values)


def _document(record: dict, tokenizer, where: str) -> dict:
    if "input_ids" in record:
        doc = {"input_ids": _token_list(record["input_ids"], where)}
        if record.get("labels") is not None:
            labels = _label_list(record["labels"], where)
            if len(labels) != len(doc["input_ids"]):
                raise ValueError(f"{where}: 'labels' and 'input_ids' differ in length.")
            doc["labels"] = labels
        return doc
    if "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError(f"{where}: 'text' must be a string; got {type(record['text']).__name__}.")
        if tokenizer is None:
            raise ValueError(f"{where}: text records need a tokenizer (--tokenizer).")
        return {"input_ids": list(tokenizer(record["text"])["input_ids"])}
    raise ValueError(f"{where}: each record needs 'input_ids' (token ids) or 'text'; got keys {sorted(record)}.")


def read_documents(path: str, tokenizer=None) -> Iterator[dict]:
    """Documents from a JSON-lines file of ``{"input_ids": [...]}`` / ``{"text": ...}`` records or a
    ``datasets.save_to_disk`` folder (its ``train`` split if it holds several)."""
    if os.path.isdir(path):
        try:
            import datasets
        except ImportError as err:
            raise ImportError(f"{path} is a folder: reading a datasets.save_to_disk folder needs `pip install "
                              "datasets`. Or give a JSON-lines file.") from err
        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise ValueError(f"{path} holds splits {list(data)}; expected a 'train' split.")
            data = data["train"]
        for i, record in enumerate(data):
            yield _document(record, tokenizer, f"{path} row {i}")
        return
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Training data {path!r} not found (a .jsonl file or a datasets.save_to_disk folder).")
    for line_number, record in read_jsonl_objects(path):
        yield _document(record, tokenizer, f"{path}:{line_number}")


def check_token_ids(rows: list[dict], vocab_size: int) -> None:
    """Raise ValueError if a packed row holds a token id (or label) outside the base model's vocabulary: the
    embedding lookup would fail mid-training (or, on GPU, read out of bounds)."""
    for i, row in enumerate(rows):
        for key in ("input_ids", "labels"):
            values = row.get(key) or []
            largest = max(values, default=-1)
            if largest >= vocab_size:
                raise ValueError(f"packed row {i} holds {key} {largest}, outside the base model's vocabulary of "
                                 f"{vocab_size} tokens: the data was tokenized for another model.")


def check_positions(rows: list[dict], context: int | None) -> None:
    """Raise ValueError if a packed row holds a position past the base model's context (`context`, its
    ``max_position_embeddings``; None: unknown): the hidden states there are garbage, and so would be the
    supervision."""
    longest = max((max(row["position_ids"], default=-1) + 1 for row in rows), default=0)
    if context is not None and longest > context:
        raise ValueError(f"packed rows hold pieces of documents up to {longest} tokens long, past the base model's "
                         f"context of {context} tokens (max_position_embeddings): positions past it give garbage "
                         f"hidden states. Pack with --seq-len {context} or less.")


@dataclass
class PackingStats:
    documents: int = 0
    rows: int = 0
    segments: int = 0
    dropped_pieces: int = 0
    dropped_tokens: int = 0
    split_documents: int = 0  # documents longer than seq_len, packed as pieces
    longest_document: int = 0
    tokens: int = 0
    with_labels: bool = False

    def split_warning(self, seq_len: int, min_length: int) -> str | None:
        """What splitting cost, for the commands to print (None: nothing was split)."""
        if not self.split_documents:
            return None
        return (f"{self.split_documents} of {self.documents} documents are longer than --seq-len {seq_len} (the "
                f"longest: {self.longest_document} tokens) and were split: each piece trains without the ones before "
                f"it, and {self.dropped_tokens} tokens in last pieces shorter than {min_length} were dropped. If a "
                f"document ends with what the head must learn from (an answer after a long prompt, as in RULER "
                f"training documents), pack with --seq-len {self.longest_document}.")


def pack_documents(documents: Iterable[dict], seq_len: int, min_length: int = 2) -> tuple[list[dict], PackingStats]:
    """Greedy packing into rows of at most `seq_len` tokens (see the module docstring)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer >= 2; got {seq_len!r}.")
    if min_length > seq_len:
        raise ValueError(f"seq_len={seq_len} is shorter than min_length={min_length} (s + w + 2 for training): no row "
                         "could hold an eligible position. Use a longer seq_len or a smaller window.")
    stats = PackingStats()
    rows, current = [], {"input_ids": [], "position_ids": [], "labels": []}
    docs = list(documents)
    stats.with_labels = any("labels" in d for d in docs)
    masked = [len(d["input_ids"]) for d in docs if IGNORE_INDEX in d.get("labels", ())]
    if max(masked, default=0) > seq_len:
        longer = sum(n > seq_len for n in masked)
        raise ValueError(
            f"{longer} of {len(masked)} documents with masked labels (a prompt and its supervised answer) are longer "
            f"than seq_len={seq_len} (the longest: {max(masked)} tokens): split into pieces, their supervised tokens "
            f"would train without the context before them, or be dropped with a short last piece. Pack with "
            f"--seq-len {max(masked)} or more (documents keep their own length; rows just hold fewer of them).")

    def flush():
        if current["input_ids"]:
            rows.append({k: list(v) for k, v in current.items() if k != "labels" or stats.with_labels})
            stats.rows += 1
            for v in current.values():
                v.clear()

    for doc in docs:
        stats.documents += 1
        ids = doc["input_ids"]
        labels = doc.get("labels", ids)
        stats.longest_document = max(stats.longest_document, len(ids))
        stats.split_documents += len(ids) > seq_len
        for start in range(0, len(ids), seq_len):
            piece = ids[start:start + seq_len]
            if len(piece) < min_length:
                stats.dropped_pieces += 1
                stats.dropped_tokens += len(piece)
                continue
            if len(current["input_ids"]) + len(piece) > seq_len:
                flush()
            current["input_ids"].extend(piece)
            current["position_ids"].extend(range(len(piece)))
            current["labels"].extend(labels[start:start + seq_len])
            stats.segments += 1
            stats.tokens += len(piece)
    flush()
    return rows, stats


class PackedDataset(Dataset):
    """Rows of ``input_ids``/``position_ids`` (and ``labels`` if any document had them)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


@dataclass
class OdaDataCollator:
    """Right-pads rows to the longest in the batch; returns ``input_ids``, ``attention_mask``, ``position_ids``
    (restarting per packed segment; derived from the mask when rows have none) and ``labels`` if rows have them."""

    pad_token_id: int = 0

    def __call__(self, features: list[dict]) -> dict:
        if not features:
            raise ValueError("Cannot collate an empty list of rows.")
        length = max(len(f["input_ids"]) for f in features)
        batch = {"input_ids": torch.full((len(features), length), self.pad_token_id, dtype=torch.long),
                 "attention_mask": torch.zeros(len(features), length, dtype=torch.long),
                 "position_ids": torch.zeros(len(features), length, dtype=torch.long)}
        has_labels = any(f.get("labels") is not None for f in features)
        if has_labels:
            batch["labels"] = torch.full((len(features), length), IGNORE_INDEX, dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            batch["input_ids"][i, :n] = torch.as_tensor(f["input_ids"])
            mask = f.get("attention_mask")
            batch["attention_mask"][i, :n] = torch.as_tensor(mask) if mask is not None else 1
            positions = f.get("position_ids")
            batch["position_ids"][i, :n] = torch.as_tensor(positions) if positions is not None \
                else (batch["attention_mask"][i, :n].cumsum(0) - 1).clamp(min=0)
            if has_labels:
                batch["labels"][i, :n] = torch.as_tensor(f["labels"] if f.get("labels") is not None else f["input_ids"])
        return batch
