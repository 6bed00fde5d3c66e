"""Cached paired supervision: run the frozen backbone once per training row, train the head for many epochs.

    cache = cache_supervision(oda_model, rows, "cache/", tau_hist=0.001)     # resumable, tqdm progress
    trainer = OdaCacheTrainer(model=oda_model, args=OdaTrainingArguments(...), cache=cache)
    trainer.train()

    oda cache-supervision --base B --data D.jsonl --tokenizer B --output cache/ --window 256 --seq-len 2048
    oda train-head --base B --from-cache cache/ --output head/ --epochs 20
    oda train-head --base B --from-cache cache/ more/ --output head/ --epochs 20   # several caches as one

What is stored, per packed row (a row is what `OdaDataCollator` turns into one batch row), at its
eligible positions only: the head inputs ``H`` (after the ``tau_hist`` rule), ``E``, ``L`` and the
access gain ``g``. Targets ``T(g - lambda)`` are computed at train time, so one cache serves every
lambda; ``tau_hist`` changes ``H`` and is part of the cache identity, as are the base model, ``s``, ``w``,
``seq_len`` and the packed rows themselves (`manifest.json`).

Layout: ``shard-XXXXX-of-YYYYY.safetensors`` files of `rows_per_shard` consecutive rows (tensors
``prev_hidden``/``input_embeds``/``local_hidden`` ``[N, d]``, ``gains`` ``[N]`` float32, ``columns`` ``[N]``
the eligible column in its row, ``row_offsets`` ``[rows + 1]``) and ``manifest.json`` (settings + the
finished shards). A shard is written under a temporary name and renamed, then recorded in the manifest,
so an interrupted run leaves only whole shards; a rerun skips them.

Size: ``3 d`` values per position (+ 8 bytes of gain and column), i.e. ``3 * 576 * 4 + 8 = 6,920`` bytes
(6.9 MB per 1K positions) at ``d = 576`` in float32. ``dtype=bfloat16``/``float16`` halves that, but the
head then trains on rounded inputs: it no longer equals training with recomputation.

Training: `SupervisionCacheDataset` has one item per packed row and `CachedSupervisionCollator`
concatenates the rows of a microbatch, so a microbatch of the cached path holds exactly the positions
of the same rows' recomputed microbatch. With the same rows, seed, batch size and accumulation, the
Trainer draws the same rows in the same order and both reductions (``micro``: mean of microbatch means;
``step``) give the same updates as `OdaTrainer` recomputing supervision: bit for bit with one row per
microbatch (the cache runs each row alone, as recomputation then does); with several rows per
microbatch, recomputation pads them into one backbone pass that rounds differently (~1e-7 in H/E/L).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import safetensors.torch
import torch
from safetensors import safe_open
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from transformers.utils import logging

from ..files import atomic_path, output_lock, remove_stale_partials, write_json
from ..head import base_config_fingerprint
from ..head import base_fingerprint as weights_fingerprint
from ..modeling import OdaForCausalLM
from .data import OdaDataCollator
from .losses import regression_target, token_losses
from .paired import LM_CHUNK, paired_supervision
from .trainer import HeadTrainingModule, OdaTrainer, OdaTrainingArguments, eval_sets
from ..validation import MAX_SPAN, integer, number

logger = logging.get_logger(__name__)

MANIFEST_NAME = "manifest.json"
CACHE_FORMAT = "oda-supervision-cache/1"
INPUT_TENSORS = ("prev_hidden", "input_embeds", "local_hidden")
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Manifest keys that must agree for a cache to be resumed or trained from.
IDENTITY_KEYS = ("base_fingerprint", "sinks", "window", "tau_hist", "seq_len", "data_sha256", "rows",
                 "rows_per_shard", "dtype", "hidden_size", "eligibility", "base_config_sha256")
#: The eligibility rule the cached rows follow (`layout.build_layout`); caches without it (older oda_hf) made a masked
#: prompt's last token eligible too, so rows of the two rules are never resumed into or trained on together.
ELIGIBILITY = "labelled current and next token"


def rows_sha256(rows: Sequence[dict]) -> str:
    """Content hash of packed rows (token ids, position ids, labels): the cache's data identity."""
    digest = hashlib.sha256()
    for row in rows:
        for key in ("input_ids", "position_ids", "labels", "attention_mask"):
            values = row.get(key)
            digest.update(f"{key}:{'-' if values is None else ','.join(map(str, values))};".encode())
        digest.update(b"\n")
    return digest.hexdigest()


def base_fingerprint(model, dtype: torch.dtype | None = None) -> str:
    """The base's weights fingerprint (`oda_hf.head.base_fingerprint`) combined with the dtype it runs in.

    The head trains on this model's hidden states, so another base, or the same one in another dtype,
    must not reuse them; where the model was loaded from does not matter.
    """
    base = model.base_model if isinstance(model, OdaForCausalLM) else model
    return hashlib.sha256(f"{weights_fingerprint(base)}|{dtype or base.dtype}".encode()).hexdigest()


def _shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.safetensors"


def _read_manifest(path: str) -> dict:
    """The manifest at `path`, checked field by field: a hand-edited or corrupt one is a one-line ValueError
    naming the field, not a KeyError in the middle of training (or a shard path outside the folder)."""
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): delete the cache folder and cache again.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{path} is not an oda supervision cache ({CACHE_FORMAT}); got format {got!r}. Use an "
                         "empty --output folder, or give the folder `oda cache-supervision` wrote.")
    try:
        for key, minimum, maximum in (("sinks", 0, MAX_SPAN), ("window", 1, MAX_SPAN), ("rows", 1, None),
                                      ("rows_per_shard", 1, None), ("hidden_size", 1, None)):
            integer(f"{MANIFEST_NAME}: {key}", manifest.get(key), minimum=minimum, maximum=maximum)
        if manifest.get("seq_len") is not None:
            integer(f"{MANIFEST_NAME}: seq_len", manifest["seq_len"], minimum=2)
        number(f"{MANIFEST_NAME}: tau_hist", manifest.get("tau_hist"))
        if manifest.get("dtype") not in STORAGE_DTYPES:
            raise ValueError(f"`{MANIFEST_NAME}: dtype` must be one of {sorted(STORAGE_DTYPES)}; got "
                             f"{manifest.get('dtype')!r}.")
        shards = manifest.get("shards")
        if not isinstance(shards, list) or not all(isinstance(shard, dict) for shard in shards):
            raise ValueError(f"`{MANIFEST_NAME}: shards` must be a list of objects; got {shards!r:.80}.")
        count = -(-manifest["rows"] // manifest["rows_per_shard"])
        for shard in shards:
            index = integer(f"{MANIFEST_NAME}: shard index", shard.get("index"), minimum=0, maximum=count - 1)
            if shard.get("file") != _shard_name(index, count):
                raise ValueError(f"`{MANIFEST_NAME}: shard {index} file` must be {_shard_name(index, count)!r}; got "
                                 f"{shard.get('file')!r}.")
            for key in ("first_row", "rows", "positions", "bytes"):
                integer(f"{MANIFEST_NAME}: shard {index} {key}", shard.get(key), minimum=0)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path} is damaged: {err} Delete the cache folder and cache again.") from None
    return manifest


def _check_identity(path: str, existing: dict, wanted: dict) -> None:
    if existing.get("format") != CACHE_FORMAT:
        raise ValueError(f"{path} is not an oda supervision cache ({CACHE_FORMAT}); got format "
                         f"{existing.get('format')!r}. Use an empty --output folder.")
    differing = [f"{key}: cache {existing.get(key)!r}, this run {wanted[key]!r}"
                 for key in IDENTITY_KEYS if existing.get(key) != wanted[key]]
    if differing:
        raise ValueError(f"{path} holds supervision cached with other settings ({'; '.join(differing)}). "
                         "Resume with the same base (weights and config), data, sinks, window, tau_hist, seq_len, "
                         "rows per shard and dtype, or write to a new output folder (a cache an older oda_hf wrote, "
                         "without an eligibility rule, cannot be resumed: cache into a new folder).")


def cache_supervision(model: OdaForCausalLM, rows: Sequence[dict], output_dir: str | os.PathLike, *,
                      sinks: int | None = None, window: int | None = None, tau_hist: float = 0.001,
                      seq_len: int | None = None, rows_per_shard: int = 16, dtype: str = "float32",
                      pad_token_id: int = 0, lm_chunk: int = LM_CHUNK, base_name: str | None = None,
                      progress: bool = True) -> "SupervisionCache":
    """Paired supervision of every packed row, one backbone pass per row, into `output_dir` (resumable).

    `rows` are packed rows as `pack_documents` makes them; `seq_len` (their packing length) is recorded.
    """
    if not isinstance(dtype, str) or dtype not in STORAGE_DTYPES:
        raise ValueError(f"Unknown storage dtype {dtype!r}; use one of {sorted(STORAGE_DTYPES)} (float32 keeps "
                         "training from the cache equal to training with recomputation).")
    rows_per_shard = integer("rows_per_shard", rows_per_shard, minimum=1)
    # A NaN or infinite tau_hist would be stored in the manifest, and no training run could match it.
    tau_hist = number("tau_hist", tau_hist, meaning="the history threshold")
    if seq_len is not None:
        seq_len = integer("seq_len", seq_len, minimum=2, maximum=MAX_SPAN)
    lm_chunk = integer("lm_chunk", lm_chunk, minimum=1)
    if not rows:
        raise ValueError("No packed row to cache: the training data is empty (or every document was too short).")
    output_dir = os.fspath(output_dir)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"{output_dir} is a file: write the supervision cache to a folder.")
    sinks = model.oda_config.sinks if sinks is None else integer("sinks", sinks, minimum=0, maximum=MAX_SPAN)
    window = model.oda_config.window if window is None else integer("window", window, minimum=1, maximum=MAX_SPAN)
    hidden_size = model.config.get_text_config(decoder=True).hidden_size
    num_shards = -(-len(rows) // rows_per_shard)
    manifest = {
        "format": CACHE_FORMAT, "base": base_name or getattr(model.base_model.config, "_name_or_path", None),
        "base_fingerprint": base_fingerprint(model), "sinks": sinks, "window": window, "tau_hist": float(tau_hist),
        "seq_len": seq_len, "data_sha256": rows_sha256(rows), "rows": len(rows), "rows_per_shard": rows_per_shard,
        "dtype": dtype, "hidden_size": hidden_size, "eligibility": ELIGIBILITY,
        "base_config_sha256": base_config_fingerprint(model), "shards": [],
    }
    # One writer per cache folder; the lock is held until the last shard is recorded.
    with output_lock(output_dir, "this supervision cache"):
        remove_stale_partials(output_dir)  # temporaries of a killed run: nothing reads them
        _write_shards(model, rows, output_dir, manifest, num_shards, sinks=sinks, window=window, tau_hist=tau_hist,
                      rows_per_shard=rows_per_shard, dtype=dtype, pad_token_id=pad_token_id, lm_chunk=lm_chunk,
                      progress=progress)
    return SupervisionCache(output_dir)


def _shard_intact(folder: str, shard: dict) -> bool:
    """Whether a shard's file is there with the size its manifest entry records (else it is written again)."""
    path = os.path.join(folder, shard["file"])
    return os.path.isfile(path) and os.path.getsize(path) == shard["bytes"]


def _write_shards(model, rows, output_dir: str, manifest: dict, num_shards: int, *, sinks: int, window: int,
                  tau_hist: float, rows_per_shard: int, dtype: str, pad_token_id: int, lm_chunk: int,
                  progress: bool) -> None:
    path = os.path.join(output_dir, MANIFEST_NAME)
    if os.path.exists(path):
        existing = _read_manifest(path)
        _check_identity(path, existing, manifest)
        # A shard counts once the manifest records it and its file is there, whole (written atomically before).
        manifest["shards"] = [s for s in existing["shards"] if _shard_intact(output_dir, s)]
    write_json(path, manifest)

    done = {s["index"] for s in manifest["shards"]}
    collator = OdaDataCollator(pad_token_id=pad_token_id)
    storage = STORAGE_DTYPES[dtype]
    bar = tqdm(total=len(rows), desc="paired supervision", unit="row", disable=not progress,
               initial=sum(s["rows"] for s in manifest["shards"]))
    for index in range(num_shards):
        if index in done:
            continue
        first, stop = index * rows_per_shard, min(len(rows), (index + 1) * rows_per_shard)
        parts = {key: [] for key in INPUT_TENSORS + ("gains", "columns")}
        offsets = [0]
        for row in rows[first:stop]:
            batch = collator([row])
            paired = paired_supervision(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                        batch.get("labels"), sinks=sinks, window=window, tau_hist=tau_hist,
                                        lm_chunk=lm_chunk)
            for key in INPUT_TENSORS:
                parts[key].append(getattr(paired, key).to(device="cpu", dtype=storage))
            parts["gains"].append(paired.gains.float().cpu())
            parts["columns"].append(paired.cols.to(device="cpu", dtype=torch.int32))
            offsets.append(offsets[-1] + paired.num_eligible)
            bar.update(1)
        tensors = {key: torch.cat(values).contiguous() for key, values in parts.items()}
        tensors["row_offsets"] = torch.tensor(offsets, dtype=torch.int64)
        name = _shard_name(index, num_shards)
        with atomic_path(os.path.join(output_dir, name)) as temporary:
            # One metadata key: safetensors writes the metadata map in hash order, so two keys would make
            # the same shard differ in bytes from run to run.
            safetensors.torch.save_file(tensors, temporary, metadata={"rows": f"{first}:{stop}"})
        manifest["shards"].append({"index": index, "file": name, "first_row": first, "rows": stop - first,
                                   "positions": offsets[-1], "bytes": os.path.getsize(os.path.join(output_dir, name))})
        manifest["shards"].sort(key=lambda s: s["index"])
        write_json(path, manifest)
    bar.close()


class _CacheSettings:
    """What a cache and a combination of caches answer alike, from `manifest`, `num_positions` and `num_bytes`."""

    manifest: dict

    @property
    def sinks(self) -> int:
        return self.manifest["sinks"]

    @property
    def window(self) -> int:
        return self.manifest["window"]

    @property
    def tau_hist(self) -> float:
        return self.manifest["tau_hist"]

    @property
    def seq_len(self) -> int | None:
        """The rows' length (None for combined caches whose lengths differ)."""
        return self.manifest["seq_len"]

    def __len__(self) -> int:
        return self.manifest["rows"]

    def bytes_per_1k_positions(self) -> float:
        return 1000 * self.num_bytes / max(self.num_positions, 1)


class SupervisionCache(_CacheSettings):
    """A finished cache folder: its manifest and random access to each row's positions."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        manifest_path = os.path.join(self.path, MANIFEST_NAME)
        if not os.path.isfile(manifest_path):
            raise FileNotFoundError(f"{self.path} holds no {MANIFEST_NAME}: write a cache with "
                                    "`oda cache-supervision` (or cache_supervision()) first.")
        self.manifest = _read_manifest(manifest_path)
        self.shards = sorted(self.manifest["shards"], key=lambda s: s["index"])
        covered = sum(s["rows"] for s in self.shards)
        if covered != self.manifest["rows"]:
            raise ValueError(f"{self.path} is incomplete: {covered} of {self.manifest['rows']} rows cached. Rerun "
                             "the same `oda cache-supervision` command to finish it (finished shards are kept).")
        missing = [s["file"] for s in self.shards if not _shard_intact(self.path, s)]
        if missing:
            raise ValueError(f"{self.path} is missing {len(missing)} shard file(s) its manifest records, or holds them "
                             f"with another size (damaged; e.g. {missing[0]}): rerun the same `oda cache-supervision` "
                             "command to write them again.")
        self._first_rows = [s["first_row"] for s in self.shards]
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    def __getstate__(self):  # safetensors handles do not pickle (DataLoader workers reopen them)
        state = dict(self.__dict__)
        state["_handles"], state["_offsets"] = {}, {}
        return state

    @property
    def num_positions(self) -> int:
        return sum(s["positions"] for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards)

    def _shard(self, shard: int):
        if shard not in self._handles:
            handle = safe_open(os.path.join(self.path, self.shards[shard]["file"]), framework="pt", device="cpu")
            self._handles[shard] = handle
            self._offsets[shard] = handle.get_tensor("row_offsets")
        return self._handles[shard], self._offsets[shard]

    def row(self, i: int) -> dict:
        """``prev_hidden``/``input_embeds``/``local_hidden`` (float32 ``[n, d]``) and ``gains`` ``[n]`` of row `i`."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for a cache of {len(self)} rows.")
        shard = bisect.bisect_right(self._first_rows, i) - 1
        handle, offsets = self._shard(shard)
        local = i - self._first_rows[shard]
        start, stop = int(offsets[local]), int(offsets[local + 1])
        item = {key: handle.get_slice(key)[start:stop].float() for key in INPUT_TENSORS}
        item["gains"] = handle.get_slice("gains")[start:stop].float()
        return item

    def check_compatible(self, model: OdaForCausalLM, *, sinks: int, window: int, tau_hist: float) -> None:
        """Raise if the cache was made for another base model or other s / w / tau_hist."""
        wanted = {"sinks": sinks, "window": window, "tau_hist": float(tau_hist)}
        differing = [f"{key}: cache {self.manifest[key]!r}, training {value!r}" for key, value in wanted.items()
                     if self.manifest[key] != value]
        if differing:
            raise ValueError(f"The supervision cache {self.path} does not fit this training ({'; '.join(differing)}): "
                             "sinks, window and tau_hist are fixed when caching. Train with the cache's values or "
                             "cache again with the new ones.")
        if base_fingerprint(model) != self.manifest["base_fingerprint"]:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):   # the same weights run in another dtype?
                if base_fingerprint(model, dtype) == self.manifest["base_fingerprint"]:
                    made, now = (str(d).removeprefix("torch.") for d in (dtype, model.dtype))
                    raise ValueError(f"The supervision cache {self.path} was made with this base model running in "
                                     f"{made}, and this run loads it in {now}: its hidden states are that dtype's. "
                                     f"Load the base in {made} (--dtype), or cache again.")
            raise ValueError(f"The supervision cache {self.path} was made with another base model "
                             f"({self.manifest.get('base')!r}): its hidden states do not belong to this one.")
        recorded = self.manifest.get("base_config_sha256")   # (older caches did not record it)
        if recorded is not None and recorded != base_config_fingerprint(model):
            raise ValueError(f"The supervision cache {self.path} was made with this base's weights under another "
                             "configuration (RoPE scaling, sliding window, attention or norm settings): its hidden "
                             "states and gains are not what this model computes. Cache again with this model.")
        if self.manifest.get("eligibility") != ELIGIBILITY:
            logger.warning(f"The supervision cache {self.path} was made by an older oda_hf, which also trained the "
                           "last token of a masked prompt (never a routed step at inference) and gave the next "
                           "position its Local H: cache the data again for rows of the current rule (docs/method.md).")


#: Manifest keys that caches trained on together must share (their rows may differ, and their seq_len and dtype).
SHARED_KEYS = ("base_fingerprint", "sinks", "window", "tau_hist", "hidden_size", "eligibility", "base_config_sha256")


class CombinedSupervisionCache(_CacheSettings):
    """Several finished caches trained on as one: the rows of the first, then those of the next, and so on.

    Supervision already computed stays useful when training data grows: cache the new documents on their own and
    train on both. The caches must share the base model and s / w / tau_hist; the same rows twice is refused.
    """

    def __init__(self, caches: Sequence[SupervisionCache | str | os.PathLike]):
        self.caches = [c if isinstance(c, SupervisionCache) else SupervisionCache(c) for c in caches]
        if not self.caches:
            raise ValueError("CombinedSupervisionCache needs at least one cache.")
        first = self.caches[0]
        seen = {}
        for cache in self.caches:
            differing = [key for key in SHARED_KEYS if cache.manifest.get(key) != first.manifest.get(key)]
            if differing:
                raise ValueError(f"The supervision caches {first.path} and {cache.path} differ in "
                                 f"{', '.join(differing)}: caches trained on together need one base model and the "
                                 "same sinks, window and tau_hist.")
            rows = cache.manifest["data_sha256"]
            if rows in seen:
                raise ValueError(f"The supervision caches {seen[rows]} and {cache.path} hold the same rows: give each "
                                 "cache once (repeat data with --epochs instead).")
            seen[rows] = cache.path
        self.path = ", ".join(cache.path for cache in self.caches)
        self.manifest = {key: first.manifest.get(key) for key in ("base", *SHARED_KEYS)}
        lengths = {cache.seq_len for cache in self.caches}
        self.manifest["seq_len"] = lengths.pop() if len(lengths) == 1 else None
        self.manifest["rows"] = sum(len(cache) for cache in self.caches)
        self._first_rows = [0]
        for cache in self.caches[:-1]:
            self._first_rows.append(self._first_rows[-1] + len(cache))

    @property
    def num_positions(self) -> int:
        return sum(cache.num_positions for cache in self.caches)

    @property
    def num_bytes(self) -> int:
        return sum(cache.num_bytes for cache in self.caches)

    def row(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows of {len(self.caches)} caches.")
        which = bisect.bisect_right(self._first_rows, i) - 1
        return self.caches[which].row(i - self._first_rows[which])

    def check_compatible(self, model: OdaForCausalLM, *, sinks: int, window: int, tau_hist: float) -> None:
        for cache in self.caches:
            cache.check_compatible(model, sinks=sinks, window=window, tau_hist=tau_hist)


def open_cache(cache) -> SupervisionCache | CombinedSupervisionCache:
    """A cache as given (`SupervisionCache` or `CombinedSupervisionCache`), a folder, or a list of folders."""
    if isinstance(cache, (SupervisionCache, CombinedSupervisionCache)):
        return cache
    if isinstance(cache, (list, tuple)):
        return SupervisionCache(cache[0]) if len(cache) == 1 else CombinedSupervisionCache(cache)
    return SupervisionCache(cache)


class SupervisionCacheDataset(Dataset):
    """One item per cached packed row (see the module docstring for why rows, not positions)."""

    def __init__(self, cache: SupervisionCache | CombinedSupervisionCache | str | os.PathLike | Sequence):
        self.cache = open_cache(cache)

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i: int) -> dict:
        return self.cache.row(i)


@dataclass
class CachedSupervisionCollator:
    """Concatenates the cached positions of a microbatch's rows."""

    def __call__(self, features: list[dict]) -> dict:
        if not features:
            raise ValueError("Cannot collate an empty list of rows.")
        return {key: torch.cat([f[key] for f in features]) for key in INPUT_TENSORS + ("gains",)}


class CachedHeadTrainingModule(HeadTrainingModule):
    """`HeadTrainingModule` whose forward takes cached head inputs and gains instead of tokens."""

    main_input_name = "gains"

    def forward(self, prev_hidden, input_embeds, local_hidden, gains) -> dict:
        with torch.autocast(device_type=gains.device.type, enabled=False):
            scores = self.oda.recall_head(prev_hidden, input_embeds, local_hidden)
            targets = regression_target(gains, self.oda_lambda)
            losses = token_losses(scores, targets)
        return {"losses": losses, "scores": scores.detach(), "targets": targets, "gains": gains}


class OdaCacheTrainer(OdaTrainer):
    """`OdaTrainer` over a supervision cache: same optimizer, schedule, reductions, checkpoints and resume.

    The backbone is not run (it is only checked against the cache's fingerprint). `train_dataset`
    defaults to the whole cache.
    """

    training_module_class = CachedHeadTrainingModule
    model_inputs = INPUT_TENSORS + ("gains",)

    def __init__(self, model: OdaForCausalLM, args: OdaTrainingArguments,
                 cache: SupervisionCache | CombinedSupervisionCache | str | os.PathLike | Sequence, **kwargs):
        self.cache = open_cache(cache)
        sinks = model.oda_config.sinks if args.oda_sinks is None else args.oda_sinks
        window = model.oda_config.window if args.oda_window is None else args.oda_window
        self.cache.check_compatible(model, sinks=sinks, window=window, tau_hist=args.oda_tau_hist)
        self._check_eval_caches(kwargs.get("eval_dataset"), model, sinks, window, args.oda_tau_hist)
        # A train_dataset given is what the head learns from: checked and recorded as the cache is (one of another
        # window trained with exit 0 while the run and the saved head said the cache's window).
        trained = _cache_of(kwargs.setdefault("train_dataset", SupervisionCacheDataset(self.cache)))
        if trained is None:
            raise ValueError(
                f"OdaCacheTrainer trains on supervision-cache rows; got a train_dataset of type "
                f"{type(kwargs['train_dataset']).__name__}. Pass SupervisionCacheDataset(cache) (or a torch Subset of "
                "one), or leave train_dataset out to train on the whole cache; train on token rows with OdaTrainer.")
        if trained is not self.cache:
            trained.check_compatible(model, sinks=sinks, window=window, tau_hist=args.oda_tau_hist)
        kwargs.setdefault("data_collator", CachedSupervisionCollator())
        # Which rows the head learns from: resuming on other caches (other documents or --seq-len) is another run.
        caches = getattr(trained, "caches", [trained])
        kwargs.setdefault("supervision_settings", {"seq_len": trained.manifest.get("seq_len"),
                                                   "cache_rows_sha256": [c.manifest["data_sha256"] for c in caches],
                                                   "cache_dtypes": [c.manifest["dtype"] for c in caches]})
        super().__init__(model=model, args=args, **kwargs)

    def count_eligible(self, batch: dict) -> int:
        return int(batch["gains"].numel())

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        self._check_eval_caches(eval_dataset, self.oda_model, self.oda_sinks, self.oda_window, self.args.oda_tau_hist)
        return super().evaluate(eval_dataset, *args, **kwargs)

    @staticmethod
    def _check_eval_caches(evaluation, model, sinks: int, window: int, tau_hist: float) -> None:
        """Eval caches must fit the model as the training cache does (one of another base or window gave an eval
        loss, exit 0)."""
        for dataset in eval_sets(evaluation).values():
            if isinstance(dataset, SupervisionCacheDataset):
                dataset.cache.check_compatible(model, sinks=sinks, window=window, tau_hist=tau_hist)


def _cache_of(dataset) -> SupervisionCache | CombinedSupervisionCache | None:
    """The cache whose rows `dataset` holds: a `SupervisionCacheDataset`'s, through torch ``Subset``s (None else)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    return dataset.cache if isinstance(dataset, SupervisionCacheDataset) else None


# -- command line ------------------------------------------------------------------------------------
