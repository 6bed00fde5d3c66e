"""Generation evaluation: every policy decodes every example greedily from the prompt's Full prefill.

Each (example, policy) pair decodes with batch size one, so every policy follows its own generated
trajectory and keeps its own selected history. The prefill is Full for every policy, so it runs
once per prompt (`SharedPrefill`) and each policy continues from its own copy of that cache; the
results equal one separate `generate()` call per pair. One JSONL record is appended per pair; a rerun
skips the pairs already in the file (key: example id, policy name).

The matched Random control (paper Appendix B.5) needs ODA's observed Full-call rate per task, so
it runs after the ODA runs at its threshold: on task d it calls Full with probability
``rho_d = F_d / N_d`` of ODA on d (unrounded), once per seed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..head import head_fingerprint
from ..compat import cache_kwargs
from ..policies import BudgetPolicy, RandomPolicy, SchedulePolicy
from .metrics import score_example, scorer_identity
from .suites import EvalExample

logger = logging.getLogger(__name__)

#: The paper's ODA threshold sweep (Appendix B.5).
PAPER_THRESHOLDS = (-0.01, -0.005, -0.001, 0.0, 0.001, 0.005, 0.01, 0.05)
#: The paper's Random-control seeds.
PAPER_SEEDS = (42, 43, 44)
KINDS = ("full", "local", "oda", "random", "schedule", "budget")


def _fmt(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class PolicySpec:
    """A named routing policy of the evaluation.

    kinds: ``full`` (native attention), ``local`` (StreamingLLM: always Local), ``oda`` (the head
    at `threshold`), ``random`` (Full with probability `p`, or, with ``matched=True``, with ODA's
    observed per-task rate at `threshold`; seeded), ``schedule`` (Full on the first `k` of every
    `period` routed steps), ``budget`` (the head at `threshold` under a Full-call budget `p` that holds for
    every request: `BudgetPolicy`).
    """

    kind: str
    threshold: float | None = None
    seed: int | None = None
    p: float | None = None
    matched: bool = False
    k: int | None = None
    period: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Unknown policy kind {self.kind!r}; expected one of {KINDS}.")
        if self.kind == "oda" and self.threshold is None:
            raise ValueError("An ODA policy needs a threshold.")
        if self.kind == "random":
            if self.seed is None:
                raise ValueError("A Random policy needs a seed.")
            if self.matched == (self.p is not None):
                raise ValueError("A Random policy has either a fixed probability p or matched=True (with threshold).")
            if self.matched and self.threshold is None:
                raise ValueError("A matched Random policy needs the ODA threshold whose rates it matches.")
            if self.p is not None:
                RandomPolicy(self.p, self.seed)  # validates p
        if self.kind == "schedule":
            SchedulePolicy(self.k, self.period)  # validates k and period
        if self.kind == "budget":
            if self.threshold is None:
                raise ValueError("A budget policy needs the head's threshold.")
            BudgetPolicy(self.p, self.threshold)  # validates the rate

    @property
    def group(self) -> str:
        """The name without the seed: Random runs with different seeds share a group."""
        if self.kind == "full":
            return "full"
        if self.kind == "local":
            return "streamingllm"
        if self.kind == "oda":
            return f"oda@{_fmt(self.threshold)}"
        if self.kind == "schedule":
            return f"schedule:{self.k}/{self.period}"
        if self.kind == "budget":
            return f"budget@p{_fmt(self.p)}(oda@{_fmt(self.threshold)})"
        return f"random~oda@{_fmt(self.threshold)}" if self.matched else f"random@p{_fmt(self.p)}"

    @property
    def name(self) -> str:
        return f"{self.group}/seed{self.seed}" if self.kind == "random" else self.group

    def routing(self, p: float | None = None, example_id: str | None = None) -> dict:
        """Keyword arguments for `OdaForCausalLM.set_routing` (`p`: the matched Random probability).

        A Random policy draws from `example_seed` (its seed and `example_id`), so the prompts of one seed take
        independent draws; the same seed for every prompt would give every prompt the same Full steps, and a task's
        realized rate would then be one sample of a few draws rather than an average over its prompts."""
        if self.kind == "full":
            return {"policy": "full"}
        if self.kind == "local":
            return {"policy": "local"}
        if self.kind == "oda":
            return {"policy": "head", "threshold": float(self.threshold)}
        if self.kind == "schedule":
            return {"policy": SchedulePolicy(self.k, self.period)}
        if self.kind == "budget":
            return {"policy": BudgetPolicy(self.p, self.threshold)}
        probability = self.p if not self.matched else p
        if probability is None:
            raise ValueError(f"{self.name}: the matched probability is not known yet.")
        if example_id is None:
            raise ValueError(f"{self.name}: a Random policy draws per example; pass the example's id.")
        return {"policy": RandomPolicy(probability, example_seed(self.seed, example_id))}

    def describe(self) -> dict:
        return {"policy": self.name, "group": self.group, "kind": self.kind, "threshold": self.threshold,
                "seed": self.seed, "schedule": None if self.kind != "schedule" else [self.k, self.period]}


# Recorded with every Random record: records drawn another way (one generator seed for all prompts, as before) are not
# reused beside these.
RANDOM_DRAWS = "per-example"


def example_seed(seed: int, example_id: str) -> int:
    """The generator seed of a Random policy's `seed` on the example `example_id`: 63 bits of SHA-256 of both,
    stable across processes and platforms (unlike Python's `hash`)."""
    digest = hashlib.sha256(f"{int(seed)}/{example_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def full() -> PolicySpec:
    return PolicySpec("full")


def streaming_llm() -> PolicySpec:
    return PolicySpec("local")


def oda(threshold: float = 0.0) -> PolicySpec:
    return PolicySpec("oda", threshold=float(threshold))


def random_matched(threshold: float, seed: int) -> PolicySpec:
    return PolicySpec("random", threshold=float(threshold), seed=int(seed), matched=True)


def random_fixed(p: float, seed: int) -> PolicySpec:
    return PolicySpec("random", p=float(p), seed=int(seed))


def schedule(k: int, period: int) -> PolicySpec:
    return PolicySpec("schedule", k=int(k), period=int(period))


def budget(rate: float, threshold: float) -> PolicySpec:
    return PolicySpec("budget", threshold=float(threshold), p=float(rate))


def paper_policies(thresholds: Sequence[float] = PAPER_THRESHOLDS, seeds: Sequence[int] = PAPER_SEEDS,
                   random: bool = True) -> list[PolicySpec]:
    """Full, StreamingLLM, ODA at each threshold and (optionally) the matched Random control."""
    specs = [full(), streaming_llm()] + [oda(t) for t in thresholds]
    if random:
        specs += [random_matched(t, s) for t in thresholds for s in seeds]
    return specs


# -- the results file ------------------------------------------------------------------------------


def read_appended_jsonl(path: str | os.PathLike, repair: bool = True, kind: str = "record",
                        required: Sequence[str] = ()) -> list[dict]:
    """The JSON objects of an append-only JSONL file, in order, each with the string fields `required`.

    A run killed mid-write leaves a partial last line: with `repair` it is cut off (logged), so that item is simply
    redone; with ``repair=False`` (read-only use) it is skipped. An unreadable line elsewhere, or an object without
    the `required` fields, is not an interrupted write: it is an error naming the line."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    records, good_end = [], 0  # good_end: byte offset after the last readable line
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                if number < len(lines) and any(rest.strip() for rest in lines[number:]):
                    raise ValueError(
                        f"{path}:{number}: unreadable {kind} in the middle of the file (not an interrupted "
                        "write). Fix or delete that line, or write to a new output file.") from None
                break
            if not (isinstance(record, dict) and all(isinstance(record.get(key), str) for key in required)):
                fields = ", ".join(map(repr, required))
                raise ValueError(f"{path}:{number}: not a {kind} (a JSON object with {fields}). "
                                 "Fix or delete that line, or write to a new output file.")
            records.append(record)
        good_end += len(line) + 1
    good_end = min(good_end, len(data))
    if good_end == len(data) and data.endswith(b"\n") or not data:
        return records
    if not repair:
        logger.warning(f"{path}: the last line is incomplete (interrupted write?); it is ignored.")
        return records
    with open(path, "r+b") as f:
        f.truncate(good_end)
        if good_end and not data[:good_end].endswith(b"\n"):
            f.seek(good_end)
            f.write(b"\n")  # the last record was complete but its line end was not written
    if good_end < len(data):
        logger.warning(f"{path}: removed an incomplete last line ({len(data) - good_end} bytes, an "
                       f"interrupted write); that {kind} will be computed again.")
    return records


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line and sync it: an item on disk is never redone, so make sure it is really there."""
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


class ResultsFile:
    """Append-only JSONL of records keyed by (example id, policy name); a rerun skips finished keys.

    A run killed mid-write leaves a partial last line: opening the file cuts it off (logged), so
    that pair is simply redone. With ``repair=False`` (read-only use) it is skipped instead. An
    unreadable line elsewhere is not an interrupted write: it is an error. Writers hold the output folder's
    `files.output_lock` (the CLI does), so two runs never append to one file.
    """

    def __init__(self, path: str | os.PathLike, repair: bool = True):
        self.path = os.fspath(path)
        self.records: dict[tuple[str, str], dict] = {}   # the newest record of each pair
        self.versions: dict[tuple[str, str], list[dict]] = {}   # every record of each pair, oldest first
        for record in read_appended_jsonl(self.path, repair, "record", ("id", "policy")):
            self._keep(record)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.records

    def add(self, record: dict) -> None:
        append_jsonl(self.path, record)
        self._keep(record)

    def _keep(self, record: dict) -> None:
        key = (record["id"], record["policy"])
        self.records[key] = record
        self.versions.setdefault(key, []).append(record)

    def current(self) -> list[dict]:
        """The records to report: `current_records` of the newest ones, with every version at hand."""
        check_report_fields(self.records.values(), self.path)
        return current_records(self.records.values(), self.versions)


#: What the report reads of every record (`oda eval` writes them all).
REPORT_FIELDS = ("task", "group", "kind", "score", "routed_steps", "full_calls")


def check_report_fields(records: Iterable[dict], where: str) -> None:
    """ValueError naming the first record that lacks a field the report reads (not a record `oda eval` wrote)."""
    for record in records:
        missing = [key for key in REPORT_FIELDS if key not in record]
        if missing:
            raise ValueError(f"{where}: the record ({record['id']}, {record['policy']}) has no {', '.join(missing)}; "
                             "it was not written by oda eval: remove it, or evaluate into a new folder (--out).")


# -- what a run's results depend on -------------------------------------------------------------------

MANIFEST_FORMAT = 1




def prompt_fingerprint(input_ids: Sequence[int]) -> str:
    """SHA-256 of a prompt's token ids: a record is only reused for the same prompt."""
    return hashlib.sha256(json.dumps([int(i) for i in input_ids]).encode()).hexdigest()


def run_settings(model, chat_template: bool = False) -> dict:
    """The settings that change every record of a run (policy, output cap and prompt are per record)."""
    from ..head import base_config_fingerprint, base_fingerprint

    return {
        # The weights identify the model, not the path it was loaded from (a moved folder is the same model).
        "model": base_fingerprint(getattr(model, "base_model", model)),
        "base_config_sha256": base_config_fingerprint(model),   # the same weights under another RoPE or window
        "dtype": str(model.dtype).removeprefix("torch."),
        "head_sha256": head_fingerprint(getattr(model, "recall_head", None)),
        "sinks": model.oda_config.sinks, "window": model.oda_config.window,
        "chat_template": bool(chat_template),
    }


#: What greedy decoding reads from a generation config besides the output cap (named, not every field: the others'
#: defaults change with transformers versions, and a new default would refuse a folder that nothing changed).
GREEDY_GENERATION_KEYS = (
    "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "min_length", "min_new_tokens",
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "exponential_decay_length_penalty", "renormalize_logits", "remove_invalid_values",
    "guidance_scale", "watermarking_config", "stop_strings", "token_healing", "max_time",
)


#: Generation-config keys whose processors count from the start of a `generate()` call (the first output token, or
#: the call's max_length): a shared prefill's first token comes from a call of its own, and the policy's continuation
#: starts one token later, so with any of them set every policy runs its own prefill (measured: forced_eos_token_id
#: made every shared output empty; begin_suppress_tokens suppressed again at the second token).
CALL_START_GENERATION_KEYS = ("forced_eos_token_id", "begin_suppress_tokens", "exponential_decay_length_penalty")


def generation_fingerprint(model, tokenizer) -> str:
    """SHA-256 of what greedy decoding reads from the model's generation config (`greedy_config`, its
    `GREEDY_GENERATION_KEYS`): another generation_config.json gives other outputs from the same weights."""
    config = greedy_config(model, tokenizer, 1)
    fields = {key: getattr(config, key, None) for key in GREEDY_GENERATION_KEYS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=_config_value).encode()).hexdigest()


def _config_value(value):
    """A JSON form of a generation-config value JSON lacks (a watermarking config: its fields, not its address)."""
    return value.to_dict() if hasattr(value, "to_dict") else str(value)


#: Settings recorded since a later oda_hf: a manifest or record written before lacks them, and they are not compared
#: with it (`check_manifest` warns that a change of them would go unseen).
LATER_KEYS = ("base_config_sha256", "generation_sha256")


def record_settings(settings: dict, spec: PolicySpec, example: EvalExample, input_ids: Sequence[int],
                    p: float | None = None) -> dict:
    """Everything one record's result depends on: the run's settings, its policy, output cap and prompt."""
    record = {**settings, "policy": spec.name, "threshold": spec.threshold, "seed": spec.seed,
              "p": p if spec.kind == "random" and spec.matched else spec.p,
              "max_new_tokens": example.max_new_tokens, "prompt_sha256": prompt_fingerprint(input_ids)}
    if spec.kind == "random":
        record["random_draws"] = RANDOM_DRAWS
    return record


def _differences(old: dict, new: dict, keys: Iterable[str] | None = None) -> list[str]:
    keys = sorted(set(old) | set(new)) if keys is None else keys
    return [f"{key}: {old.get(key)!r} there, {new.get(key)!r} now" for key in keys if old.get(key) != new.get(key)
            and not (key in LATER_KEYS and (key not in old or key not in new))]


def read_manifest_settings(path: str | os.PathLike) -> dict:
    """The ``settings`` of the manifest at `path`; a ValueError naming the file if it is not one."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): delete it or write to a new output folder.") from None
    except OSError as err:  # e.g. a folder of that name
        raise ValueError(f"{path} cannot be read ({err.strerror or err}): delete it or write to a new output "
                         "folder.") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict):
        raise ValueError(f"{path} is not a manifest of `evaluate` (no 'settings' object): delete it or write to a new "
                         "output folder.")
    return saved["settings"]


def record_last_run(path: str | os.PathLike, example_ids: Sequence[str], primary_threshold: float | None) -> None:
    """Note in the manifest at `path` which examples the last run reported and its main table's ODA threshold:
    ``--report-only`` rebuilds that table from them (a folder can hold examples of earlier runs, and ODA thresholds
    the last run did not put first)."""
    from ..files import write_json

    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["last_run"] = {"examples": list(dict.fromkeys(example_ids)), "primary_threshold": primary_threshold}
    write_json(path, manifest, indent=1)


def read_last_run(path: str | os.PathLike) -> dict | None:
    """The manifest's ``last_run`` (`record_last_run`), or None (none recorded, or no manifest)."""
    try:
        with open(os.fspath(path), encoding="utf-8") as f:
            last = json.load(f).get("last_run")
    except (OSError, ValueError, AttributeError):
        return None
    return last if isinstance(last, dict) and isinstance(last.get("examples"), list) else None


def check_manifest(path: str | os.PathLike, settings: dict, results_path: str | os.PathLike) -> dict | None:
    """Error naming the differing keys if an existing manifest at `path` has other settings; its settings (None:
    no manifest)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return None
    saved = read_manifest_settings(path)
    differences = _differences(saved, settings)
    if differences:
        raise ValueError(
            f"{results_path} was generated with other settings ({path}): " + "; ".join(differences)
            + ". Records of different settings must not mix: write to a new output folder (--out).")
    warn_unrecorded(path, [saved], settings)
    return saved


def warn_unrecorded(path, saved: Iterable[dict], settings: dict, what: str = "its records are reused") -> None:
    """Warn once if settings `saved` with records reused now lack `LATER_KEYS` that `settings` holds."""
    unrecorded = sorted({key for old in saved for key in LATER_KEYS if key in settings and key not in old})
    if unrecorded:
        logger.warning(f"{path} was written before oda_hf recorded {', '.join(unrecorded)}: {what} without checking "
                       "those (a change of the base's config.json or generation_config.json since they were made "
                       "would go unseen).")


def write_manifest(path: str | os.PathLike, settings: dict, results_path: str | os.PathLike) -> None:
    """Write the run's manifest (settings and library versions), atomically."""
    import transformers

    from .. import __version__

    path = os.fspath(path)
    manifest = {"format": MANIFEST_FORMAT, "results": os.path.basename(os.fspath(results_path)), "settings": settings,
                "versions": {"oda_hf": __version__, "transformers": transformers.__version__,
                             "torch": torch.__version__}}
    from ..files import write_json

    write_json(path, manifest, indent=1)


def _manifest_of(results_path: str, manifest_name: str | None) -> str:
    if manifest_name is None:
        return os.path.splitext(results_path)[0] + ".manifest.json"  # as `evaluate` names it by default
    return os.path.join(os.path.dirname(results_path), manifest_name)


def merge_results(output_path: str | os.PathLike, sources: Sequence[str | os.PathLike],
                  manifest_name: str | None = None) -> int:
    """Append to `output_path` the records of other runs' results files that it does not hold yet.

    For one evaluation split over processes or machines (e.g. by ``--tasks``) into several output
    folders. Every source's manifest must have the destination's settings (same model weights, head,
    dtype, geometry, chat template), so records of different settings never mix; within a source the
    newest record of a pair is taken, and a pair the destination already holds is kept as it is, except
    a matched Random record drawn at a rate that is no longer ODA's (see `_finished`): the source's
    record at the current rate supersedes it.
    `manifest_name`: the manifests' file name beside each results file (``oda eval`` writes
    ``manifest.json``); by default ``<results stem>.manifest.json``. Returns the number of records added.
    """
    output_path = os.fspath(output_path)
    manifest_path = _manifest_of(output_path, manifest_name)
    if not os.path.exists(manifest_path):
        raise ValueError(f"{output_path} has no manifest ({manifest_path}): merge into the folder of a finished run.")
    settings = read_manifest_settings(manifest_path)
    results, added = ResultsFile(output_path), 0
    contested: dict[tuple[str, str], list[dict]] = {}  # matched Random pairs drawn at different rates
    loaded = []
    for source in map(os.fspath, sources):
        if os.path.abspath(source) == os.path.abspath(output_path):
            continue
        source_manifest = _manifest_of(source, manifest_name)
        if not os.path.exists(source_manifest):
            raise ValueError(f"{source} has no manifest, so its settings are unknown: it cannot be merged.")
        source_settings = check_manifest(source_manifest, settings, source)
        warn_unrecorded(manifest_path, [settings], source_settings, f"{source}'s records are merged into it")
        loaded.append((source, ResultsFile(source, repair=False)))
        check_report_fields(loaded[-1][1].records.values(), source)
    # Before anything is appended: an example id must be the same prompt and output cap in every file, and be
    # scored alike (task, metric, answers, scorer): the same output scored against other answers would sit beside it.
    prompts: dict[str, dict] = {}
    scoring: dict[str, tuple[str, dict]] = {}
    for path, records in [(output_path, results.records.values())] + [(s, f.records.values()) for s, f in loaded]:
        for record in records:
            first = prompts.setdefault(record["id"], record.get("settings") or {})
            if record.get("settings") and first:
                check_same_prompt([record], {key: first.get(key) for key in PROMPT_KEYS}, path)
            identity = {key: record.get(key) for key in SCORING_KEYS}
            where, seen = scoring.setdefault(record["id"], (path, identity))
            if identity != seen:
                differing = ", ".join(key for key in SCORING_KEYS if identity[key] != seen[key])
                raise ValueError(f"{path} scores example {record['id']} otherwise than {where} ({differing}): merged, "
                                 "one output would count as right in one policy and wrong in another. Rerun `oda eval` "
                                 "on the current data into each folder first (it rescores the stored outputs), then "
                                 "merge.")
    for source, file in loaded:
        # of each pair, what the source's own report reads (a matched Random record drawn at a stale rate gives way
        # to an earlier one at the current rate; only the newest was merged, and the others were lost); every
        # version of a matched pair stays a candidate for the merged rate below
        reported = {(r["id"], r["policy"]): r for r in file.current()}
        for key, newest in file.records.items():
            record = reported.get(key, newest)
            if is_matched_random(record):
                contested.setdefault(key, []).extend(v for v in file.versions[key] if v is not record)
            held = results.records.get(key)
            if held is None:
                results.add(record)
                added += 1
            elif record.get("kind") == "random" and draws_per_example(record) and not draws_per_example(held):
                results.add(record)  # the example's own draws supersede the draws shared by every prompt
                added += 1
            elif (is_matched_random(record) and record.get("p") != held.get("p")
                  and (draws_per_example(record) or not draws_per_example(held))):
                contested.setdefault(key, []).append(record)
    # Of a matched Random pair drawn at several rates, the valid record is the one at ODA's per-task rate over
    # the merged records (how `evaluate` draws it); without one, the held record stays (a rerun redraws it).
    rates = current_matched_rates(results.records.values()) if contested else {}
    for key, candidates in contested.items():
        held = results.records[key]
        rate = matched_rate_of(held, rates)
        if held.get("p") != rate:
            valid = next((r for r in reversed(candidates) if r.get("p") == rate
                          and (draws_per_example(r) or not draws_per_example(held))), None)
            if valid is not None:
                results.add(valid)
                added += 1
    return added


def _finished(results: ResultsFile, example: EvalExample, spec: PolicySpec, p: float | None) -> bool:
    """Whether the record of (example, spec) is on file and still valid.

    A matched Random record is only valid for the rate it was drawn with: ODA's per-task rate
    moves when the run covers more prompts (a larger ``--limit``), so a record made with another
    rate is generated again; the new record is appended and supersedes the old one on reading.
    """
    record = results.records.get((example.id, spec.name))
    if record is None:
        return False
    if spec.kind == "random" and spec.matched and record.get("p") != p:
        logger.info(f"({example.id}, {spec.name}) was drawn with p={record.get('p')!r}, ODA's rate is now {p!r} "
                    "(the run covers other prompts): generating it again.")
        return False
    if spec.kind == "random" and not draws_per_example(record):
        logger.info(f"({example.id}, {spec.name}) was drawn with one generator seed for every prompt (older oda_hf): "
                    "generating it again with the example's own draws.")
        return False
    return True


def draws_per_example(record: dict) -> bool:
    """Whether a Random `record` took its example's own draws (`example_seed`), not the draws shared by every prompt
    that older versions used; such an old record is generated again, and the new one supersedes it."""
    return (record.get("settings") or {}).get("random_draws") == RANDOM_DRAWS


def check_records(results: ResultsFile, settings: dict, examples: Sequence[EvalExample],
                  policies: Sequence[PolicySpec], tokenizer, chat_template: bool, adopt_unlabeled: bool = False) -> None:
    """Every record this run would reuse must have been made with this run's settings (error naming the keys).

    `adopt_unlabeled`: records without settings (older oda_hf) are trusted to have this run's settings.
    """
    adopted = rescored = 0
    named = {spec.name for spec in policies}
    by_example: dict[str, list[dict]] = {}
    for (example_id, _), record in results.records.items():
        by_example.setdefault(example_id, []).append(record)
    for example in examples:
        held = by_example.get(example.id, [])
        done = [(spec, results.records[(example.id, spec.name)]) for spec in policies
                if (example.id, spec.name) in results]
        if not held:
            continue
        input_ids = encode_prompt(example, tokenizer, chat_template)
        check_same_prompt(held, {"max_new_tokens": example.max_new_tokens,
                                 "prompt_sha256": prompt_fingerprint(input_ids)}, results.path)
        for spec, record in done:
            where = f"{results.path} already holds ({example.id}, {spec.name})"
            if "settings" not in record:
                if adopt_unlabeled:
                    adopted += 1
                    rescored += _rescore(results, record, example)
                    continue
                raise ValueError(f"{where} without its settings (written by an older oda_hf), so it cannot be "
                                 "reused safely. Write to a new output folder (--out), or, if you know it was made "
                                 "with this run's settings, pass adopt_unlabeled=True (--adopt-unlabeled-records).")
            expected = record_settings(settings, spec, example, input_ids)
            # p and the Random draws are checked by `_finished`: a record with another of them is generated again.
            differences = _differences(record["settings"], expected,
                                       [k for k in expected if k not in ("p", "random_draws")])
            if differences:
                raise ValueError(f"{where} generated with other settings: " + "; ".join(differences)
                                 + ". Records of different settings must not mix: write to a new output folder "
                                 "(--out).")
            rescored += _rescore(results, record, example)
        # The example's records of policies this run does not name are rescored too: left as they were, a report
        # would put one output scored against the old answers beside the same output scored against the new ones.
        for record in held:
            if record["policy"] not in named:
                rescored += _rescore(results, record, example)
    if rescored:
        logger.warning(f"{results.path}: rescored {rescored} records from their stored outputs (the answers, task, "
                       "metric or scorer changed since they were generated).")
    if adopted:
        logger.warning(f"{results.path}: reusing {adopted} records without settings as made with this run's settings "
                       "(adopt_unlabeled).")


#: What makes two records of one example id records of the same item, whatever their policies.
PROMPT_KEYS = ("prompt_sha256", "max_new_tokens")
#: A record's fields its score depends on besides its output (`scoring_identity`).
SCORING_KEYS = ("task", "metric", "answers", "scorer")


def check_same_prompt(records: Iterable[dict], prompt: dict, where: str) -> None:
    """ValueError if a record (any policy) was made for another prompt or output cap than `prompt` (`PROMPT_KEYS`):
    one example id must mean one item in a results file, or a report would put policies run on different prompts
    side by side. Records without settings (older oda_hf) are not checked here."""
    for record in records:
        differences = _differences(record.get("settings") or prompt, prompt, PROMPT_KEYS)
        if differences:
            raise ValueError(f"{where} holds ({record['id']}, {record['policy']}) made for another prompt or output "
                             f"cap than this one: " + "; ".join(differences) + ". One example id must be one prompt "
                             "in an output folder: write to a new output folder (--out).")


def check_same_scoring(records: Iterable[dict]) -> None:
    """ValueError if two records of one example were scored otherwise (task, metric, answers, or two scorer versions;
    older records name no scorer): reported side by side, one output would count as right under one policy and wrong
    under another (records a run did not regenerate after the data's answers changed)."""
    seen: dict[str, dict] = {}
    for record in records:
        first = seen.setdefault(record["id"], record)
        differing = [key for key in SCORING_KEYS if record.get(key) != first.get(key)
                     and not (key == "scorer" and None in (record.get(key), first.get(key)))]
        if differing:
            raise ValueError(f"example {record['id']} is scored otherwise ({', '.join(differing)}) in its "
                             f"{first['policy']} record than in its {record['policy']} record, so they cannot be "
                             "reported side by side. Rerun `oda eval` on the current data into this folder (any policy "
                             "of the folder: it rescores every stored output of the examples it runs), then report.")


def scoring_identity(example: EvalExample) -> dict:
    """What a record's score (and its place in the report) depends on besides the generation: the example's task,
    metric, reference answers and the scorer's version. A record that differs only here is rescored, not redone."""
    return {"task": example.task, "metric": example.metric, "answers": list(example.answers),
            "scorer": scorer_identity(example.metric)}


def _rescore(results: ResultsFile, record: dict, example: EvalExample) -> int:
    """Append `record` rescored for `example` if its scoring identity is not the example's; returns 1 if it was.

    The output of a generation does not depend on the answers or the metric, so the rescored record equals what a
    fresh run would write (the appended line supersedes the old one on reading)."""
    identity = scoring_identity(example)
    if all(record.get(key) == value for key, value in identity.items()):
        return 0
    if not isinstance(record.get("output"), str):
        raise ValueError(f"{results.path}: the record ({example.id}, {record.get('policy')}) has no stored output to "
                         "rescore with the new answers or metric: write to a new output folder (--out).")
    results.add({**record, **identity, "score": score_example(example.metric, record["output"], example.answers)})
    return 1


def check_chat_template(examples: Sequence[EvalExample], chat_template: bool) -> None:
    """Refuse prompts written for the other protocol: `oda ruler` records whether it measured each prompt's length
    with the chat template (``meta["chat_template"]``); read the other way, a prompt is another protocol, of another
    length."""
    for example in examples:
        written = example.meta.get("chat_template") if isinstance(example.meta, dict) else None
        if isinstance(written, bool) and written != chat_template:
            raise ValueError(
                f"example {example.id!r} (task {example.task!r}) was written {'with' if written else 'without'} the "
                f"chat template, but this run {'applies' if chat_template else 'does not apply'} it: "
                f"{'add' if written else 'drop'} --chat-template (Python: chat_template={written}), or write the "
                "suite again.")


def check_tokenizer_template(tokenizer, chat_template: bool) -> None:
    """Refuse chat_template=True with a tokenizer that has no chat template (None: checked where text is encoded)."""
    if chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_template=True, but the tokenizer has no chat template.")


def check_prompt(model, example: EvalExample, input_ids: Sequence[int]) -> None:
    """Refuse a prompt the model cannot read: one whose tokens plus its output cap pass the model's
    ``max_position_embeddings`` (transformers only warns, then the positions past it are garbage; `oda generate` and
    `oda ruler` refuse the same), or with token ids outside its vocabulary."""
    if not input_ids:  # e.g. "" or whitespace with no answer prefix: generate() would fail deep in attention
        raise ValueError(f"example {example.id!r} (task {example.task!r}): its prompt is empty (it tokenizes to no "
                         "token); give it text or token ids, or leave it out.")
    config = model.config
    config = getattr(config, "get_text_config", lambda: config)()
    limit = getattr(config, "max_position_embeddings", None)
    cap = example.max_new_tokens
    if isinstance(limit, int) and len(input_ids) + cap > limit:
        raise ValueError(f"example {example.id!r} (task {example.task!r}): its prompt has {len(input_ids)} tokens; "
                         f"with its output cap of {cap} that is {len(input_ids) + cap} positions, past the model's "
                         f"max_position_embeddings={limit}. Shorten it (LongBench: --max-input-tokens "
                         f"{max(limit - cap, 1)}), lower --max-new-tokens, or leave it out.")
    vocabulary = model.get_input_embeddings().num_embeddings
    if input_ids and max(input_ids) >= vocabulary:
        raise ValueError(f"example {example.id!r}: token id {max(input_ids)} is outside the model's vocabulary of "
                         f"{vocabulary} ids; give ids in [0, {vocabulary - 1}] (or a text prompt).")


# -- one generation ---------------------------------------------------------------------------------


def encode_prompt(example: EvalExample, tokenizer, chat_template: bool = False) -> list[int]:
    """Token ids of the example's prompt (+ answer prefix), optionally inside the chat template.

    The chat template is applied with ``enable_thinking=False`` (the paper disables thinking);
    the answer prefix goes after the assistant header, as RULER does.
    """
    if example.input_ids is not None:
        if chat_template:
            raise ValueError(f"example {example.id!r} is given as token ids: a chat template cannot be applied.")
        if example.answer_prefix:
            return list(example.input_ids) + tokenizer(example.answer_prefix, add_special_tokens=False)["input_ids"]
        return list(example.input_ids)
    if tokenizer is None:
        raise ValueError(f"example {example.id!r} has a text prompt: the evaluation needs a tokenizer.")
    if not chat_template:
        return tokenizer(example.prompt + example.answer_prefix)["input_ids"]
    check_tokenizer_template(tokenizer, chat_template)
    text = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    return tokenizer(text + example.answer_prefix, add_special_tokens=False)["input_ids"]


def eos_token_ids(model, tokenizer) -> list[int]:
    """The model's EOS ids (generation config), else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def hit_output_cap(new_ids: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int]) -> bool:
    """The generation used all `max_new_tokens` without emitting an EOS token."""
    return len(new_ids) >= max_new_tokens and not set(new_ids) & set(eos_ids)


def greedy_config(model, tokenizer, max_new_tokens: int):
    """A copy of the model's generation config for plain greedy decoding with this output cap."""
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.num_beams = False, 1
    config.temperature = config.top_p = config.top_k = config.min_p = None  # sampling-only knobs
    config.max_new_tokens, config.max_length = max_new_tokens, None
    eos = eos_token_ids(model, tokenizer)
    config.eos_token_id = eos or None
    if config.pad_token_id is None:
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        config.pad_token_id = pad if pad is not None else (eos[0] if eos else 0)
    return config


class SharedPrefill:
    """One Full prefill of a prompt, reused by every policy of that prompt.

    Every policy's prefill is Full, so it is the same computation for all of them: it runs once
    (ODA's own prefill, through `generate()` for the first output token, so that token passes the
    same logits processors), and each policy continues decoding from its own copy of the cache.
    `take()` hands out copies; the last user may take the original. While a policy decodes, the
    prompt's KV is held twice (the original and the policy's copy).
    """

    def __init__(self, model, tokenizer, input_ids: Sequence[int], max_new_tokens: int):
        self.input_ids = list(input_ids)
        self.max_new_tokens = max_new_tokens
        # The capacity a plain generate() would allocate (max_length - 1), so buffers and results match it.
        self._cache = model.new_cache(max_cache_len=len(self.input_ids) + max_new_tokens - 1)
        saved = model.oda_config
        try:
            model.set_routing(policy="full")  # the prefill never routes; any policy would do
            ids = torch.tensor([self.input_ids], dtype=torch.long, device=model.device)
            config = greedy_config(model, tokenizer, 1)
            if config.min_new_tokens:   # EOS is barred from the one token either way; > 1 would warn of a conflict
                config.min_new_tokens = 1
            output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                    **cache_kwargs(self._cache))
        finally:
            model.oda_config = saved
        self.first_token = int(output[0, -1])

    def take(self, last: bool = False):
        """(cache, selected hidden state) for one policy: a copy, or the original when `last`."""
        if self._cache is None:
            raise RuntimeError("This shared prefill was already handed out as the last one.")
        cache = self._cache if last else copy.deepcopy(self._cache)
        if last:
            self._cache = None
        return cache, cache.selected_hidden


def _min_new_tokens(model, already: int) -> int | None:
    """The model's `min_new_tokens` minus the `already` generated tokens (None when unset)."""
    wanted = model.generation_config.min_new_tokens
    return None if wanted is None else max(wanted - already, 0)


@torch.no_grad()
def generate_record(model, tokenizer, example: EvalExample, spec: PolicySpec, input_ids: Sequence[int],
                    p: float | None = None, prefill: SharedPrefill | None = None, last: bool = False,
                    settings: dict | None = None) -> dict:
    """Run one greedy generation with `spec`'s routing and return its record.

    With `prefill` (of these `input_ids`), decoding continues from its Full prefill instead of
    running its own; the outputs and routing are those of a separate `generate()` call.
    `last`: this is the prefill's last user (it may consume the original cache). `settings`: the
    run's `run_settings` (computed here when not given), stored in the record with its own.
    """
    settings = run_settings(model) if settings is None else settings
    saved = model.oda_config
    eos = eos_token_ids(model, tokenizer)
    try:
        model.set_routing(**spec.routing(p, example.id))
        config = greedy_config(model, tokenizer, example.max_new_tokens)
        if prefill is None:
            ids = torch.tensor([list(input_ids)], dtype=torch.long, device=model.device)
            output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            new_ids = output[0, ids.shape[1]:].tolist()
        else:
            if prefill.input_ids != list(input_ids) or prefill.max_new_tokens != example.max_new_tokens:
                raise ValueError(f"example {example.id!r}: the shared prefill is of another prompt or output cap.")
            cache, hidden = prefill.take(last)
            model.begin_request(cache, hidden)  # routing starts after the prefill, as in generate()
            new_ids = [prefill.first_token]
            if prefill.first_token not in eos and example.max_new_tokens > 1:
                ids = torch.tensor([list(input_ids) + new_ids], dtype=torch.long, device=model.device)
                config.max_new_tokens = example.max_new_tokens - 1
                config.min_new_tokens = _min_new_tokens(model, 1)
                output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                        **cache_kwargs(cache))
                new_ids = output[0, len(input_ids):].tolist()
    finally:
        model.oda_config = saved
    routing = model.routing
    steps = int(routing.steps_per_row[0])
    decisions = routing.decisions[0, :steps].tolist()
    head_scores = routing.scores[0, :steps].tolist() if spec.kind == "oda" else None
    text = tokenizer.decode(new_ids, skip_special_tokens=True) if tokenizer is not None else ""
    record = {
        "id": example.id, "task": example.task, **spec.describe(),
        "p": p if spec.kind == "random" and spec.matched else spec.p,
        "metric": example.metric, "answers": example.answers, "scorer": scorer_identity(example.metric),
        "output": text, "output_ids": new_ids,
        "score": score_example(example.metric, text, example.answers),
        "decisions": [int(d) for d in decisions], "routed_steps": steps, "full_calls": int(sum(decisions)),
        # Steps within sinks + window (not decided; Local == Full there) and the Full calls among them.
        "window_steps": int(routing.window_steps_per_row[0]),
        "window_full_calls": int(routing.window_full_calls_per_row[0]),
        "hit_cap": hit_output_cap(new_ids, example.max_new_tokens, eos),
        "num_input_tokens": len(input_ids), "num_output_tokens": len(new_ids),
        "max_new_tokens": example.max_new_tokens,
        "settings": record_settings(settings, spec, example, input_ids, p),
    }
    if head_scores is not None:
        record["head_scores"] = [round(s, 6) if math.isfinite(s) else None for s in head_scores]
    return record


# -- the evaluation loop -------------------------------------------------------------------------------


def decided_counts(record: dict) -> tuple[int, int]:
    """``(Full calls, steps)`` of a record past the window (records written before window steps were counted
    separately have no ``window_steps``: every step was decided then)."""
    return (record["full_calls"] - record.get("window_full_calls", 0),
            record["routed_steps"] - record.get("window_steps", 0))


def matched_rates(oda_records: Iterable[dict], threshold: float) -> dict[str, float]:
    """The matched Random control's probability per task: ODA's rate over `oda_records` (ODA at `threshold`),
    0 on a task where ODA made no routed step past the window."""
    rates = task_rates(oda_records)
    for task, rate in rates.items():
        if not math.isfinite(rate):
            logger.warning(f"ODA@{threshold:g} made no routed step on task {task}: its Random control uses p=0.")
            rates[task] = 0.0
    return rates


def is_matched_random(record: dict) -> bool:
    """Whether a record is of a Random policy matched to ODA's rate (its p depends on the ODA records)."""
    return record.get("kind") == "random" and record.get("threshold") is not None


def current_matched_rates(records: Iterable[dict]) -> dict[float, dict[str, float]]:
    """Threshold -> task -> the matched Random probability implied by the ODA records among `records`."""
    records = list(records)
    return {threshold: matched_rates([r for r in records if r["policy"] == oda(threshold).name], threshold)
            for threshold in {r["threshold"] for r in records if is_matched_random(r)}}


def current_records(records: Iterable[dict], versions: dict[tuple[str, str], list[dict]] | None = None) -> list[dict]:
    """`records` without the matched Random records drawn at a rate that is not ODA's per-task rate over them (left
    by a run over fewer prompts and not redrawn yet): reported, they would pose as the control of another ODA run;
    and without a Random policy's records of shared draws where it has records of per-example draws.

    `versions` (`ResultsFile.versions`): every record of each pair. A stale matched record is then replaced by the
    pair's newest earlier record at the current rate, if there is one (a rerun over fewer prompts into the same
    folder redraws the control at their rate, and that must not hide the records drawn for all of them)."""
    records = list(records)
    # A Random policy's records drawn one way (the example's own draws) supersede those of other examples drawn the
    # older way (one generator seed for every prompt): reported together, one row would average two protocols.
    per_example = {r["policy"] for r in records if r.get("kind") == "random" and draws_per_example(r)}
    shared = [r for r in records if r.get("kind") == "random" and r["policy"] in per_example
              and not draws_per_example(r)]
    if shared:
        logger.warning(f"{len(shared)} Random records of draws shared by every prompt (older oda_hf) left out beside "
                       f"their policies' records of per-example draws (e.g. {shared[0]['id']}, {shared[0]['policy']}): "
                       "rerun `oda eval` over those prompts to draw them again.")
        left_out = {id(r) for r in shared}
        records = [r for r in records if id(r) not in left_out]
    rates = current_matched_rates(records)
    kept = []
    for record in records:
        if not is_matched_random(record) or record["p"] == (rate := matched_rate_of(record, rates)):
            kept.append(record)
            continue
        earlier = [v for v in (versions or {}).get((record["id"], record["policy"]), [])
                   if v.get("p") == rate and (draws_per_example(v) or not draws_per_example(record))]
        if earlier:
            kept.append(earlier[-1])
    check_same_scoring(kept)   # (an earlier version brought back is checked too: a rerun rescored the newest only)
    return kept


def matched_rate_of(record: dict, rates: dict[float, dict[str, float]]) -> float:
    """The probability a matched Random `record` should have been drawn with, from `current_matched_rates`."""
    return rates[record["threshold"]].get(record["task"], 0.0)


def task_rates(records: Iterable[dict]) -> dict[str, float]:
    """Per-task Full-call rate ``F_d / N_d`` over the steps past the window (NaN for a task without such steps)."""
    full_calls, steps = {}, {}
    for r in records:
        calls, decided = decided_counts(r)
        full_calls[r["task"]] = full_calls.get(r["task"], 0) + calls
        steps[r["task"]] = steps.get(r["task"], 0) + decided
    return {task: full_calls[task] / steps[task] if steps[task] else float("nan") for task in steps}


def evaluate(model, tokenizer, examples: Sequence[EvalExample], policies: Sequence[PolicySpec],
             output_path: str | os.PathLike, *, chat_template: bool = False, progress: bool = True,
             share_prefill: bool = True, manifest_path: str | os.PathLike | None = None,
             adopt_unlabeled: bool = False) -> list[dict]:
    """Run every policy on every example (resumable) and return their records.

    Records already in `output_path` are reused, not regenerated. Matched Random policies run after
    the ODA policy they match, with its per-task rates over these examples. `share_prefill`: one
    Full prefill per prompt for all its policies (same results; ``False`` runs one prefill per
    policy and holds the prompt's KV only once, for prompts whose KV fits in memory only once; also what runs when
    the generation config sets one of `CALL_START_GENERATION_KEYS`).

    Every record carries the settings it was made with (`record_settings`), and the run's settings
    go to a manifest (default: `output_path` with the suffix ``.manifest.json``). A rerun whose
    settings differ from the manifest's or from a record it would reuse is an error naming the
    differing keys. `adopt_unlabeled`: reuse records of older versions that carry no settings,
    trusting that they were made with this run's settings.
    """
    if not examples:
        raise ValueError("The suite is empty: nothing to evaluate.")
    for example in examples:  # fields may have been changed after construction: check again what generation uses
        if isinstance(example.max_new_tokens, bool) or not isinstance(example.max_new_tokens, int) \
                or example.max_new_tokens < 1:
            raise ValueError(f"example {example.id!r}: max_new_tokens must be a positive integer; got "
                             f"{example.max_new_tokens!r}.")
    check_chat_template(examples, chat_template)
    check_tokenizer_template(tokenizer, chat_template)   # before the manifest is written: it would refuse the fix
    names = [spec.name for spec in policies]
    if len(set(names)) != len(names):
        raise ValueError(f"Policy names must be unique; got {names}.")
    needs_head = any(spec.kind == "oda" for spec in policies)
    if needs_head and getattr(model, "recall_head", None) is None:
        raise ValueError("ODA policies need a recall head: load the model with head=... (or drop the ODA policies).")
    for spec in policies:
        if spec.kind == "random" and spec.matched and oda(spec.threshold).name not in names:
            raise ValueError(f"{spec.name} matches ODA at threshold {spec.threshold}: add that ODA policy too.")
    settings = {**run_settings(model, chat_template), "generation_sha256": generation_fingerprint(model, tokenizer)}
    if manifest_path is None:
        manifest_path = os.path.splitext(os.fspath(output_path))[0] + ".manifest.json"
    check_manifest(manifest_path, settings, output_path)
    results = ResultsFile(output_path)
    check_records(results, settings, examples, policies, tokenizer, chat_template, adopt_unlabeled)
    if not os.path.exists(manifest_path):
        write_manifest(manifest_path, settings, output_path)
    direct = [s for s in policies if not (s.kind == "random" and s.matched)]
    matched = [s for s in policies if s.kind == "random" and s.matched]
    counted_from_start = [key for key in CALL_START_GENERATION_KEYS
                          if getattr(model.generation_config, key, None) not in (None, [], ())]   # token id 0 counts
    if share_prefill and counted_from_start:
        logger.info("One prefill per policy: the generation config sets %s, which counts from a generate() call's "
                    "start (a shared prefill's continuation would start later).", ", ".join(counted_from_start))
        share_prefill = False

    def run(jobs, description):
        jobs = [(example, spec, p) for example, spec, p in jobs if not _finished(results, example, spec, p)]
        remaining: dict[str, int] = {}  # jobs left per example: the last one may consume the shared prefill
        for example, _, _ in jobs:
            remaining[example.id] = remaining.get(example.id, 0) + 1
        current, input_ids, prefill = None, None, None  # only the current example: long prompts are large
        for example, spec, p in tqdm(jobs, desc=description, disable=not progress or not jobs):
            if example.id != current:
                current, prefill = example.id, None
                input_ids = encode_prompt(example, tokenizer, chat_template)
                check_prompt(model, example, input_ids)
                if share_prefill and remaining[example.id] > 1:  # a single job just runs generate()
                    prefill = SharedPrefill(model, tokenizer, input_ids, example.max_new_tokens)
            remaining[example.id] -= 1
            results.add(generate_record(model, tokenizer, example, spec, input_ids, p, prefill=prefill,
                                        last=remaining[example.id] == 0, settings=settings))

    # Example-major order, so a prompt is tokenized and prefilled once for all policies.
    run([(e, s, None) for e in examples for s in direct], "generate")
    if matched:
        rates = {threshold: matched_rates([results.records[(e.id, oda(threshold).name)] for e in examples], threshold)
                 for threshold in {s.threshold for s in matched}}
        run([(e, s, rates[s.threshold][e.task]) for e in examples for s in matched], "random control")
    return [results.records[(e.id, s.name)] for s in policies for e in examples]
