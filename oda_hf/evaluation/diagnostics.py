"""Fixed-reference diagnostics (paper Section 3.3, Appendix B.6): does the head rank access gain?

For a held-out reference sequence x_1..x_T and each eligible position t (1-based, ``t > s + w``,
with x_{t+1} known), both current candidates are computed from the *same* pre-step history:

    g_t = log pF(x_{t+1}) - log pL(x_{t+1})

together with the head score q_t and Local-branch confidence features (entropy, max probability,
top-1 minus top-2 probability margin, top-2 log-ratio).

History. ``history="selected"`` (the paper's protocol): after the Full prefill of x_1..x_{t0-1},
the reference tokens advance ODA's selected history - at each t only the branch the head picks
(q > theta or q not finite) is committed; the reference token itself never depends on the action.
``history="full"``: the Full candidate is always committed (a Full trunk, as in training).

How both candidates come out of one pre-step cache through the public API: the request runs with
two identical rows and a policy that selects Full for row 0 and Local for row 1. The routed step
then computes Local (both rows), the head, and Full (both rows) from the same pre-step history,
commits row 0's Full and row 1's Local candidate, and returns Full logits in row 0 and Local logits
in row 1. `OdaCache.reorder_cache` (the beam-search reorder) then copies the branch to keep into
both rows. This is a deliberately simple, step-by-step computation (two rows, one step per
position); oda_hf.training has the efficient paired computation for training.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ..compat import cache_kwargs
from ..files import read_jsonl_objects
from ..policies import RoutingPolicy
from . import stats

#: Ranking methods and their labels. Confidence baselines are signed so that lower-confidence
#: positions rank first: entropy, -max prob, -(top-1 minus top-2 prob), -(top-1/top-2 log-ratio).
METHODS = {
    "head": "Head (q)",
    "entropy": "Local entropy",
    "neg_max_prob": "Neg. max prob",
    "neg_margin": "Neg. margin",
    "neg_top2_logratio": "Neg. top-2 log-ratio",
}
SUBSETS = ("all", "local_correct", "local_incorrect")
SUBSET_TITLES = {"all": "All", "local_correct": "Local correct", "local_incorrect": "Local incorrect"}
EPSILONS = (0.0, 1e-4, 1e-3, 1e-2, 0.1)
DEFAULT_BUDGETS = tuple(round(0.05 * i, 2) for i in range(21))
PAPER_BOOTSTRAP_SEED = 20260910


class _BothCandidates(RoutingPolicy):
    """Two identical rows: row 0 commits Full, row 1 commits Local; the head runs every step."""

    name = "reference-pair"

    def __init__(self):
        self.run_head = True  # score with the head whenever the model has one
        self.last_scores: torch.Tensor | None = None

    def decide(self, scores, step, batch_size, device):
        if batch_size != 2:
            raise RuntimeError("The reference-pair policy runs on exactly two identical rows.")
        self.last_scores = scores
        return torch.tensor([True, False], device=device)


@dataclass
class ReferencePositions:
    """Per-position diagnostics of one reference sequence (arrays aligned by position)."""

    doc_id: str
    history: str
    positions: np.ndarray  # 1-based position t of the current token x_t
    targets: np.ndarray  # x_{t+1}
    full_logp: np.ndarray
    local_logp: np.ndarray
    head_scores: np.ndarray  # NaN without a head
    selected_full: np.ndarray  # bool: the branch committed to the history at t
    local_top1: np.ndarray
    full_top1: np.ndarray
    entropy: np.ndarray
    max_prob: np.ndarray
    margin: np.ndarray
    top2_logratio: np.ndarray
    meta: dict = field(default_factory=dict)

    ARRAYS = ("positions", "targets", "full_logp", "local_logp", "head_scores", "selected_full", "local_top1",
              "full_top1", "entropy", "max_prob", "margin", "top2_logratio")

    @property
    def gains(self) -> np.ndarray:
        return self.full_logp - self.local_logp

    @property
    def local_correct(self) -> np.ndarray:
        return self.local_top1 == self.targets

    @property
    def full_correct(self) -> np.ndarray:
        return self.full_top1 == self.targets

    def __len__(self) -> int:
        return len(self.positions)

    def to_dict(self) -> dict:
        out = {"id": self.doc_id, "history": self.history, "meta": self.meta}
        for name in self.ARRAYS:
            values = getattr(self, name).tolist()
            out[name] = [None if isinstance(v, float) and math.isnan(v) else v for v in values]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ReferencePositions":
        arrays = {}
        for name in cls.ARRAYS:
            values = data[name]
            if name in ("positions", "targets", "local_top1", "full_top1"):
                arrays[name] = np.asarray(values, dtype=np.int64)
            elif name == "selected_full":
                arrays[name] = np.asarray(values, dtype=bool)
            else:
                arrays[name] = np.asarray([np.nan if v is None else v for v in values], dtype=float)
        return cls(doc_id=data["id"], history=data["history"], meta=data.get("meta", {}), **arrays)


@torch.no_grad()
def reference_gains(model, input_ids, *, start: int | None = None, count: int | None = None,
                    history: str = "selected", threshold: float | None = None, doc_id: str = "",
                    progress: bool = False) -> ReferencePositions:
    """Gains, head scores and Local confidence at eligible positions of one reference sequence.

    Args:
        model: an `OdaForCausalLM` (its sinks/window define eligibility: position > s + w).
        input_ids: the reference token ids (1D, or ``[1, T]``).
        start: first 1-based position t to score (default and minimum: s + w + 1).
        count: number of positions to score from `start` (default: up to T - 1, the last with a next token).
        history: ``"selected"`` (the head's branch is committed, the paper's protocol; needs a head)
            or ``"full"`` (the Full candidate is always committed).
        threshold: the head's theta for ``history="selected"`` (default: the model's).
    """
    if history not in ("selected", "full"):
        raise ValueError(f"history must be 'selected' or 'full'; got {history!r}.")
    if history == "selected" and model.recall_head is None:
        raise ValueError("history='selected' commits the head's choice and needs a recall head; use history='full'.")
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().cpu()
    config = model.oda_config
    base_config = getattr(model.config, "get_text_config", lambda: model.config)()
    limit = getattr(base_config, "max_position_embeddings", None)
    if isinstance(limit, int) and len(ids) > limit:
        raise ValueError(f"reference {doc_id!r} has {len(ids)} tokens, more than the model's "
                         f"max_position_embeddings={limit}; shorten it to at most {limit} tokens.")
    vocabulary = model.get_input_embeddings().num_embeddings
    if len(ids) and int(ids.max()) >= vocabulary:
        raise ValueError(f"reference {doc_id!r}: token id {int(ids.max())} is outside the model's vocabulary of "
                         f"{vocabulary} ids.")
    first = config.sinks + config.window + 1
    given = start is not None
    start = first if start is None else int(start)
    if start < first:
        raise ValueError(f"Position {start} is not eligible: Local and Full coincide up to s + w = {first - 1}.")
    last = len(ids) - 1  # x_{t+1} must exist
    if given and start > last:   # (without a start, a sequence too short to score is counted in the report)
        raise ValueError(f"reference {doc_id!r}: start {start} is past its last position with a next token "
                         f"({last}; it has {len(ids)} tokens).")
    if count is not None:
        last = min(last, start + int(count) - 1)
    theta = config.threshold if threshold is None else float(threshold)
    rows: dict[str, list] = {name: [] for name in ReferencePositions.ARRAYS}
    if last >= start:
        policy = _BothCandidates()
        saved = model.oda_config
        device = model.device
        try:
            model.set_routing(policy=policy)
            cache = model.new_cache()
            model(input_ids=ids[: start - 1].to(device)[None].repeat(2, 1), **cache_kwargs(cache))  # Full prefill
            for t in tqdm(range(start, last + 1), desc=f"reference {doc_id}".strip(), disable=not progress,
                          leave=False):
                step = ids[t - 1].to(device).view(1, 1).repeat(2, 1)  # x_t (0-based index t - 1)
                logits = model(input_ids=step, **cache_kwargs(cache)).logits[:, -1].double()
                logp = torch.log_softmax(logits, dim=-1)
                full_logp, local_logp = logp[0].cpu(), logp[1].cpu()
                target = int(ids[t])  # x_{t+1}
                q = float(policy.last_scores[0]) if policy.last_scores is not None else float("nan")
                keep_full = history == "full" or not math.isfinite(q) or q > theta
                cache.reorder_cache(torch.tensor([0, 0] if keep_full else [1, 1], device=device))
                local_probs = local_logp.exp()
                top2 = torch.topk(local_logp, 2)
                p1, p2 = math.exp(top2.values[0]), math.exp(top2.values[1])
                rows["positions"].append(t)
                rows["targets"].append(target)
                rows["full_logp"].append(float(full_logp[target]))
                rows["local_logp"].append(float(local_logp[target]))
                rows["head_scores"].append(q)
                rows["selected_full"].append(keep_full)
                rows["local_top1"].append(int(top2.indices[0]))
                rows["full_top1"].append(int(full_logp.argmax()))
                rows["entropy"].append(float(-(local_probs * local_logp).nansum()))
                rows["max_prob"].append(p1)
                rows["margin"].append(p1 - p2)
                rows["top2_logratio"].append(float(top2.values[0] - top2.values[1]))
        finally:
            model.oda_config = saved
    arrays = {
        name: np.asarray(values, dtype=np.int64 if name in ("positions", "targets", "local_top1", "full_top1")
                         else bool if name == "selected_full" else float)
        for name, values in rows.items()
    }
    # The threshold chose the committed branch only under the selected history (always Full reads no threshold).
    meta = {"sinks": config.sinks, "window": config.window, "threshold": theta if history == "selected" else None,
            "length": len(ids)}
    return ReferencePositions(doc_id=doc_id, history=history, meta=meta, **arrays)


# -- collection over documents -------------------------------------------------------------------------


def _optional_count(record: dict, key: str, minimum: int, where: str) -> int | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key!r} must be an integer >= {minimum}; got {value!r}.")
    return value


def load_reference_sequences(path: str | os.PathLike, tokenizer=None) -> list[dict]:
    """JSONL of reference sequences: ``{"id", "input_ids" | "text"[, "start", "count"]}``."""
    documents = []
    for number, record in read_jsonl_objects(path):
        where = f"{path}:{number}"
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ValueError(f"{where}: 'input_ids' must be a non-empty list of token ids (integers >= 0).")
        elif "text" in record:
            if not isinstance(record["text"], str):
                raise ValueError(f"{where}: 'text' must be a string; got {type(record['text']).__name__}.")
            if tokenizer is None:
                raise ValueError(f"{where}: a 'text' reference needs a tokenizer.")
            ids = tokenizer(record["text"])["input_ids"]
        else:
            raise ValueError(f"{where}: a reference needs 'input_ids' or 'text'.")
        identifier = record.get("id", number)
        if isinstance(identifier, bool) or not isinstance(identifier, (str, int)):
            raise ValueError(f"{where}: 'id' must be a string or an integer; got {identifier!r}.")
        documents.append({"id": str(identifier), "input_ids": ids,
                          "start": _optional_count(record, "start", 1, where),
                          "count": _optional_count(record, "count", 1, where)})
    if not documents:
        raise ValueError(f"{path}: no reference sequence (the file is empty); give one JSON object per line.")
    ids = [d["id"] for d in documents]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: reference ids must be unique.")
    return documents


def _position_settings(model, model_settings: dict, document: dict, history: str, count: int | None,
                       threshold: float | None) -> dict:
    """Everything one document's positions depend on: the model (`runner.run_settings`: weights, head, dtype,
    geometry), the protocol, the positions asked for and the sequence itself."""
    from .runner import prompt_fingerprint

    theta = model.oda_config.threshold if threshold is None else float(threshold)
    return {**model_settings, "history": history, "threshold": theta if history == "selected" else None,
            "start": document.get("start"),
            "count": document.get("count") if document.get("count") is not None else count,
            "input_sha256": prompt_fingerprint(document["input_ids"])}


#: Per-document settings; every other setting (model, head, geometry, history, threshold) is the whole file's.
DOCUMENT_KEYS = ("start", "count", "input_sha256")


def _check_one_run(records: Sequence[dict], settings: dict, path) -> None:
    """ValueError if a positions record (any document) was computed with other model-level settings than `settings`:
    pooled into one analysis, documents of different models, heads or geometries would pass for one run."""
    from .runner import _differences

    keys = [key for key in settings if key not in DOCUMENT_KEYS]
    for data in records:
        differences = _differences(data.get("settings") or settings, settings, keys)
        if differences:
            raise ValueError(f"{path} holds document {data['id']!r} computed with other settings: "
                             + "; ".join(differences) + ". One output folder holds one run: use a new one (--out).")


def collect_reference_gains(model, documents: Sequence[dict], *, output_path: str | os.PathLike | None = None,
                            history: str = "selected", count: int | None = None, threshold: float | None = None,
                            progress: bool = True) -> list[ReferencePositions]:
    """`reference_gains` for every document (dicts from `load_reference_sequences`).

    With `output_path`, one JSON line per document is appended and documents already there are
    not recomputed (resumable) when they were computed with the same settings (`_position_settings`; otherwise an
    error naming the differences). A document's own ``start``/``count`` override the defaults.
    """
    from .runner import _differences, append_jsonl, read_appended_jsonl, run_settings, warn_unrecorded

    model_settings = run_settings(model)
    done: dict[str, dict] = {}
    if output_path is not None:
        for data in read_appended_jsonl(output_path, repair=True, kind="positions record", required=("id",)):
            done[data["id"]] = data
        if documents:
            _check_one_run(list(done.values()), _position_settings(model, model_settings, documents[0], history,
                                                                   count, threshold), output_path)
    results, reused = [], []
    for document in tqdm(documents, desc="reference sequences", disable=not progress):
        settings = _position_settings(model, model_settings, document, history, count, threshold)
        data = done.get(document["id"])
        if data is not None:
            saved = data.get("settings")
            reused.append(saved or {})
            if saved is None:  # written before positions carried their settings: compare what they have
                meta = data.get("meta", {})
                saved = {**settings, "history": data.get("history"), "sinks": meta.get("sinks"),
                         "window": meta.get("window"),
                         "threshold": meta.get("threshold") if data.get("history") == "selected" else None}
            differences = _differences(saved, settings)
            if differences:
                raise ValueError(f"{output_path} holds document {document['id']!r} computed with other settings: "
                                 + "; ".join(differences) + ". Use a new output folder (--out).")
            try:
                results.append(ReferencePositions.from_dict(data))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{output_path}: the record of document {document['id']!r} is damaged ({err!r}); "
                                 "delete that line or use a new output folder.") from None
            continue
        record = reference_gains(model, document["input_ids"], start=document.get("start"),
                                 count=settings["count"], history=history, threshold=threshold,
                                 doc_id=document["id"])
        if output_path is not None:
            append_jsonl(output_path, {**record.to_dict(), "settings": settings})
        results.append(record)
    if reused:
        warn_unrecorded(output_path, reused, model_settings)
    return results


# -- analysis --------------------------------------------------------------------------------------------


@dataclass
class Pooled:
    """All positions of all documents, plus each document's row indices (for the bootstrap)."""

    gains: np.ndarray
    rankings: dict[str, np.ndarray]
    local_correct: np.ndarray
    full_correct: np.ndarray
    documents: list[np.ndarray]

    @classmethod
    def of(cls, records: Sequence[ReferencePositions]) -> "Pooled":
        def cat(name):
            return np.concatenate([getattr(r, name) for r in records]) if records else np.zeros(0)

        # A confidence baseline's infinities are ordered (-inf: Local certain, least in need of Full): clipped to
        # the finite range, since the rankings' rule counts any non-finite score as +inf (the head's: Full on them)
        rankings = {name: np.clip(values, -np.finfo(float).max, np.finfo(float).max) for name, values in
                    {"entropy": cat("entropy"), "neg_max_prob": -cat("max_prob"), "neg_margin": -cat("margin"),
                     "neg_top2_logratio": -cat("top2_logratio")}.items()}
        head = cat("head_scores")
        if len(head) and np.isfinite(head).any():
            rankings = {"head": head, **rankings}
        sizes = [len(r) for r in records]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        documents = [np.arange(offsets[i], offsets[i + 1]) for i in range(len(records)) if sizes[i]]
        return cls(cat("gains"), rankings, cat("local_correct").astype(bool), cat("full_correct").astype(bool),
                   documents)

    def subset(self, name: str) -> np.ndarray:
        return {"all": np.ones(len(self.gains), dtype=bool), "local_correct": self.local_correct,
                "local_incorrect": ~self.local_correct}[name]


def analyze(records: Sequence[ReferencePositions], *, budgets: Sequence[float] = DEFAULT_BUDGETS,
            main_budget: float = 0.4, n_resamples: int = 2000, seed: int = PAPER_BOOTSTRAP_SEED,
            epsilons: Sequence[float] = EPSILONS, level: float = 0.95, progress: bool = True) -> dict:
    """AUROC/AP for ``g > 0``, budget curves and gain decomposition per subset, with paired
    document-bootstrap intervals (the same resamples for every method; selection is repeated
    within each resample)."""
    if len({r.history for r in records}) > 1:
        raise ValueError("The records mix histories ('selected' and 'full'): analyze one protocol at a time.")
    pooled = Pooled.of(records)
    if len(pooled.gains) == 0:
        raise ValueError("No eligible reference position: sequences must be longer than s + w + 1 tokens.")
    budgets = sorted(set(float(b) for b in budgets) | {float(main_budget)})
    main_index = budgets.index(float(main_budget))
    methods = list(pooled.rankings)
    gains, labels = pooled.gains, pooled.gains > 0

    def measures(rows: np.ndarray) -> dict[str, np.ndarray]:
        """Every statistic on the positions `rows` (indices into the pooled arrays, repeats allowed)."""
        out = {}
        for subset in SUBSETS:
            chosen = rows[pooled.subset(subset)[rows]]
            g = gains[chosen]
            for method in methods:
                score = pooled.rankings[method][chosen]
                out[f"{subset}/{method}/auroc"] = stats.auroc(score, labels[chosen])
                out[f"{subset}/{method}/ap"] = stats.average_precision(score, labels[chosen])
                out[f"{subset}/{method}/curve"] = stats.net_gain_curve(score, g, budgets)
            out[f"{subset}/oracle/curve"] = stats.net_gain_curve(g, g, budgets)
            out[f"{subset}/random/curve"] = np.array([stats.random_expectation(g, b) for b in budgets])
        return out

    point = measures(np.arange(len(gains)))
    drawn = stats.paired_bootstrap(pooled.documents, measures, n_resamples, seed, progress) if n_resamples else {}
    samples = {key: drawn.get(key, np.empty((0,) + np.shape(value))) for key, value in point.items()}

    def interval(values: np.ndarray) -> list:
        if values.size == 0 or np.all(np.isnan(values)):
            return [float("nan"), float("nan")] if values.ndim <= 1 else [[float("nan")] * values.shape[1]] * 2
        low, high = stats.percentile_interval(values, level)
        return [np.asarray(low).tolist(), np.asarray(high).tolist()]

    result = {"documents": len(pooled.documents), "positions": int(len(gains)), "history": records[0].history,
              "documents_without_positions": sum(1 for record in records if not len(record)),
              "sinks": records[0].meta.get("sinks"), "window": records[0].meta.get("window"),
              "threshold": records[0].meta.get("threshold"), "methods": methods, "budgets": budgets,
              "main_budget": float(main_budget), "n_resamples": n_resamples, "seed": seed, "level": level,
              "subsets": {}}
    for subset in SUBSETS:
        mask = pooled.subset(subset)
        g = gains[mask]
        entry = {"positions": int(mask.sum()), "positive_fraction": float((g > 0).mean()) if len(g) else float("nan"),
                 "methods": {}, "differences": {},
                 # the resamples each interval rests on (NaN elsewhere): AUROC needs both signs, AP a positive
                 "resamples_with_both_classes": int(np.sum(~np.isnan(samples[f"{subset}/{methods[0]}/auroc"]))),
                 "resamples_with_positives": int(np.sum(~np.isnan(samples[f"{subset}/{methods[0]}/ap"])))}
        for method in methods + ["oracle", "random"]:
            curve = point[f"{subset}/{method}/curve"].tolist()
            curve_ci = interval(samples[f"{subset}/{method}/curve"])
            item = {"curve": curve, "curve_ci": curve_ci, "net_gain": curve[main_index],
                    "net_gain_ci": [bound[main_index] if isinstance(bound, list) else bound for bound in curve_ci]}
            if method in methods:
                for measure in ("auroc", "ap"):
                    item[measure] = point[f"{subset}/{method}/{measure}"]
                    item[f"{measure}_ci"] = interval(samples[f"{subset}/{method}/{measure}"])
            if method == "random":
                item["decomposition"] = {"calls": stats.budget_count(main_budget, len(g))}
            else:
                ranking = g if method == "oracle" else pooled.rankings[method][mask]
                item["decomposition"] = stats.gain_decomposition(ranking, g, main_budget) if len(g) else {}
            entry["methods"][method] = item
        # Paired differences: the head (or the first ranking) against every other ranking and Random.
        reference = methods[0]
        for other in methods[1:] + ["random"]:
            diff = {}
            for measure in ("auroc", "ap") if other != "random" else ():
                a, b = samples[f"{subset}/{reference}/{measure}"], samples[f"{subset}/{other}/{measure}"]
                diff[measure] = entry["methods"][reference][measure] - entry["methods"][other][measure]
                diff[f"{measure}_ci"] = interval(a - b)
            a = samples[f"{subset}/{reference}/curve"][:, main_index]
            b = samples[f"{subset}/{other}/curve"][:, main_index]
            diff["net_gain"] = entry["methods"][reference]["net_gain"] - entry["methods"][other]["net_gain"]
            diff["net_gain_ci"] = interval(a - b)
            entry["differences"][f"{reference}-{other}"] = diff
        result["subsets"][subset] = entry
    result["sign_counts"] = {f"{eps:g}": stats.sign_counts(gains, eps) for eps in epsilons}
    lc, fc = pooled.local_correct, pooled.full_correct
    result["correctness"] = {"both": int((lc & fc).sum()), "only_local": int((lc & ~fc).sum()),
                             "only_full": int((~lc & fc).sum()), "neither": int((~lc & ~fc).sum())}
    return result


# -- report ------------------------------------------------------------------------------------------------


def _ci(value, bounds, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    low, high = bounds
    if low is None or (isinstance(low, float) and math.isnan(low)):
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def markdown(result: dict) -> str:
    """The diagnostics tables (paper Tables 'benefit-sign discrimination', 'gain decomposition',
    'gain sensitivity') plus budget curves and correctness counts."""
    methods, level = result["methods"], int(round(100 * result["level"]))
    budget = result["main_budget"]
    lines = ["# Fixed-reference diagnostics", "",
             f"{result['documents']} reference sequences, {result['positions']} eligible positions "
             + (f"({result['documents_without_positions']} more sequences had none: at most s + w + 1 tokens) "
                if result.get("documents_without_positions") else "")
             + f"(s={result['sinks']}, w={result['window']}); history: {result['history']}"
             + (f" (head threshold {result['threshold']:g})" if result["history"] == "selected" else "")
             + f". Gain g_t = log pF(x_t+1) − log pL(x_t+1); positive benefit is g_t > 0. Intervals: {level}% "
             f"paired document-bootstrap, {result['n_resamples']} resamples, seed {result['seed']}.", "",
             "## Benefit-sign discrimination (AUROC)", "",
             "| Subset | Positions | g > 0 | " + " | ".join(f"{METHODS[m]} AUROC" for m in methods) + " |",
             "|---|---|---|" + "---|" * len(methods)]
    for subset in SUBSETS:
        entry = result["subsets"][subset]
        cells = [_ci(entry["methods"][m]["auroc"], entry["methods"][m]["auroc_ci"]) for m in methods]
        positive = "n/a" if math.isnan(entry["positive_fraction"]) else f"{100 * entry['positive_fraction']:.1f}%"
        lines.append(f"| {SUBSET_TITLES[subset]} | {entry['positions']} | {positive} | "
                     + " | ".join(cells) + " |")
    for measure, key, held in (("AUROC", "resamples_with_both_classes", "positions of both signs"),
                               ("AP", "resamples_with_positives", "a position with g > 0")):
        short = [f"{SUBSET_TITLES[subset]} {entry[key]}" for subset, entry in result["subsets"].items()
                 if 0 < entry.get(key, result["n_resamples"]) < result["n_resamples"]]   # (0: its interval is n/a)
        if short:
            lines += ["", f"{measure} intervals are over the resamples that hold {held}, fewer than "
                      f"{result['n_resamples']} in: {', '.join(short)}."]
    lines += ["", "## Average precision", "", "| Subset | " + " | ".join(f"{METHODS[m]} AP" for m in methods) + " |",
              "|---|" + "---|" * len(methods)]
    for subset in SUBSETS:
        entry = result["subsets"][subset]
        lines.append(f"| {SUBSET_TITLES[subset]} | "
                     + " | ".join(_ci(entry["methods"][m]["ap"], entry["methods"][m]["ap_ci"]) for m in methods) + " |")
    lines += ["", f"## Gain decomposition at a {100 * budget:g}% budget", "",
              "Each subset is ranked on its own; K = floor(b·|S|) calls. Positive gain and negative cost are sums in "
              "nats over the selected positions; mean net gain is normalized by the subset's positions.", "",
              "| Subset | Ranking | Calls | Positive gain | Negative cost | Mean net gain |", "|---|---|---|---|---|---|"]
    for subset in SUBSETS:
        entry = result["subsets"][subset]
        for method in methods + ["random", "oracle"]:
            item = entry["methods"][method]
            title = {"random": "Random (expectation)", "oracle": "Oracle"}.get(method, METHODS.get(method, method))
            d = item["decomposition"]
            positive = f"{d['positive_gain']:.3f}" if "positive_gain" in d else "-"
            negative = f"{d['negative_cost']:.3f}" if "negative_cost" in d else "-"
            lines.append(f"| {SUBSET_TITLES[subset]} | {title} | {d.get('calls', '-')} | {positive} | {negative} | "
                         f"{_ci(item['net_gain'], item['net_gain_ci'], 4)} |")
    lines += ["", f"## Paired differences (at {100 * budget:g}% for net gain)", "",
              "| Subset | Comparison | ΔAUROC | ΔAP | ΔNet gain |", "|---|---|---|---|---|"]
    for subset in SUBSETS:
        for name, diff in result["subsets"][subset]["differences"].items():
            a, b = name.split("-", 1)
            title = f"{METHODS.get(a, a)} − {METHODS.get(b, 'Random (expectation)' if b == 'random' else b)}"
            lines.append(f"| {SUBSET_TITLES[subset]} | {title} | "
                         f"{_ci(diff['auroc'], diff['auroc_ci']) if 'auroc' in diff else '-'} | "
                         f"{_ci(diff['ap'], diff['ap_ci']) if 'ap' in diff else '-'} | "
                         f"{_ci(diff['net_gain'], diff['net_gain_ci'], 4)} |")
    lines += ["", "## Net gain per reference position by budget (all positions)", "",
              "| Budget | " + " | ".join(METHODS[m] for m in methods) + " | Random (expectation) | Oracle |",
              "|---|" + "---|" * (len(methods) + 2)]
    entry = result["subsets"]["all"]
    for i, b in enumerate(result["budgets"]):
        cells = [f"{entry['methods'][m]['curve'][i]:.4f}" for m in methods + ["random", "oracle"]]
        lines.append(f"| {100 * b:g}% | " + " | ".join(cells) + " |")
    lines += ["", "## Gain sign counts", "", "| ε (nats) | g < −ε | abs(g) ≤ ε | g > ε |", "|---|---|---|---|"]
    for eps, counts in result["sign_counts"].items():
        lines.append(f"| {eps} | {counts['negative']} | {counts['neutral']} | {counts['positive']} |")
    c = result["correctness"]
    lines += ["", "## Top-1 correctness of the two branches", "",
              "| Both correct | Only Local | Only Full | Neither |", "|---|---|---|---|",
              f"| {c['both']} | {c['only_local']} | {c['only_full']} | {c['neither']} |", ""]
    return "\n".join(lines)


def plot_budget_curves(result: dict, path: str | os.PathLike, subset: str = "all") -> None:
    """Paper Figure 4a: selected signed gain per reference position against the offline budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entry = result["subsets"][subset]
    x = 100 * np.asarray(result["budgets"])
    colors = {"head": "#d6336c", "entropy": "#f59f00", "neg_max_prob": "#37b24d", "neg_margin": "#7048e8",
              "neg_top2_logratio": "#0ca678", "random": "#1c7ed6", "oracle": "black"}
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method in result["methods"] + ["random", "oracle"]:
        item = entry["methods"][method]
        label = {"random": "Random (expectation)", "oracle": "Oracle"}.get(method, METHODS.get(method, method))
        style = {"random": "--", "oracle": ":"}.get(method, "-")
        ax.plot(x, item["curve"], style, color=colors.get(method), label=label,
                linewidth=2 if method == "head" else 1.2)
        low, high = (np.asarray(b, dtype=float) for b in item["curve_ci"])
        if low.shape == x.shape and not np.all(np.isnan(low)):
            ax.fill_between(x, low, high, color=colors.get(method), alpha=0.12, linewidth=0)
    ax.axvline(100 * result["main_budget"], color="gray", linewidth=0.8, alpha=0.6)
    ax.axhline(0, color="gray", linewidth=0.6)
    ax.set_xlabel("Offline budget (% of positions selected)")
    ax.set_ylabel("Net gain per reference position (nats)")
    ax.set_title(f"{SUBSET_TITLES[subset]} positions (n={entry['positions']})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    from .report import save_figure

    save_figure(fig, path, dpi=120)
    plt.close(fig)


def write_diagnostics(result: dict, out_dir: str | os.PathLike, plots: bool = True) -> dict[str, str]:
    """``diagnostics.md``, ``diagnostics.json`` and (optionally) ``budget_curve.png`` in `out_dir`."""
    from ..files import write_json, write_text

    os.makedirs(out_dir, exist_ok=True)
    paths = {"markdown": os.path.join(out_dir, "diagnostics.md"), "json": os.path.join(out_dir, "diagnostics.json")}
    write_text(paths["markdown"], markdown(result))
    write_json(paths["json"], result, indent=1, default=float)
    if plots:
        paths["budget_curve"] = os.path.join(out_dir, "budget_curve.png")
        plot_budget_curves(result, paths["budget_curve"])
    return paths


def load_positions(path: str | os.PathLike) -> list[ReferencePositions]:
    """Read a per-document positions file written by `collect_reference_gains` (a partial last line of a killed
    run is skipped; the newest record of a document is taken)."""
    from .runner import read_appended_jsonl

    records, raw = {}, {}
    for number, data in enumerate(read_appended_jsonl(path, repair=False, kind="positions record",
                                                      required=("id", "history")), start=1):
        try:
            records[data["id"]] = ReferencePositions.from_dict(data)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: record {number} ({data['id']!r}) is damaged ({err!r}); delete that line or "
                             "run again into a new output folder.") from None
        raw[data["id"]] = data
    labelled = [data for data in raw.values() if data.get("settings")]
    if labelled:
        _check_one_run(labelled, labelled[0]["settings"], path)
    return list(records.values())
