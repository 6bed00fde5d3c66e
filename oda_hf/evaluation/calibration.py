"""Calibrate the recall head's routing threshold on dev prompts and save it with the head.

    oda calibrate --base B --head HEAD_DIR --data dev.jsonl --target-rate 0.25 --out runs/calib \
        [--test-data test.jsonl] [--chat-template]
    oda calibrate --base B --head HEAD_DIR --data dev.jsonl --within-full 1.0 --out runs/calib

Two rules:

* ``--target-rate R`` (a Full-call budget): the threshold whose pooled dev Full-call rate is the
  highest not above ``R``. Rates are measured by real greedy generation at each threshold, because
  routing changes the trajectory (other tokens, another selected history, hence other head scores):
  head scores recorded along one trajectory do not give the rate of another threshold. Generation runs
  first at every threshold of a grid, then bisects between the chosen threshold and the next lower one
  (whose rate is above ``R``) for ``refine_steps`` more runs. The pooled rate need not be monotone in the
  threshold, so the choice is always over every threshold actually run.
* ``--within-full P``: the lowest pooled rate whose dev macro score is within ``P`` points of Full's
  (`choose_threshold`, the model organism's rule); this runs Full too.

The chosen threshold goes into the head folder's ``oda_config.json`` (the routing default that
``OdaForCausalLM.from_pretrained(base, head=folder)`` loads) and the whole sweep into ``calibration.json``
beside it and in the output folder. With test prompts, ODA at the chosen threshold is then run on
them and the realised test rate reported (test prompts never influence the choice). Every generation
is a record in the output folder's JSONL files (`runner.evaluate`), so an interrupted calibration
resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from ..config import CALIBRATION_NAME
from ..files import write_json
from .report import summarize
from ..validation import integer, number
from .runner import evaluate, full, oda

#: Head scores are ``T(g - lambda)``-scaled NLL gains: dense near 0, retrieval steps well above.
DEFAULT_GRID = (-1.0, -0.5, -0.25, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
DEV_RECORDS, TEST_RECORDS = "calibration_records.jsonl", "test_records.jsonl"
INPUTS_NAME = "calibration_inputs.json"


def within_full_met(entry: dict, full_score: float, tolerance: float) -> bool:
    """Whether a sweep entry's macro score is within `tolerance` of Full's (the within-Full rule). Compared to 1e-9
    points: macro scores are sums of floats (three cwe scores of 0.2 average 20.000000000000004 points), and a
    score exactly `tolerance` below Full's was refused."""
    return entry["macro_score"] >= full_score - tolerance - 1e-9


def choose_threshold(sweep: list[dict], full_score: float, tolerance: float) -> dict:
    """The sweep entry with the lowest pooled rate whose score is >= Full's - `tolerance` (ties: the
    lower threshold). Falls back to the best-scoring entry if none is that close."""
    close = [s for s in sweep if within_full_met(s, full_score, tolerance)]
    if close:
        return min(close, key=lambda s: (s["pooled_full_call_rate"], s["threshold"]))
    return max(sweep, key=lambda s: (s["macro_score"], -s["pooled_full_call_rate"]))


def choose_for_rate(sweep: list[dict], target_rate: float) -> dict | None:
    """The entry with the highest pooled rate ``<= target_rate`` (ties: the lower threshold); None if none."""
    within = [s for s in sweep if s["pooled_full_call_rate"] <= target_rate]
    if not within:
        return None
    return max(within, key=lambda s: (s["pooled_full_call_rate"], -s["threshold"]))


def _check_rate(target_rate: float) -> None:
    if not (isinstance(target_rate, (int, float)) and math.isfinite(target_rate) and 0 <= target_rate <= 1):
        raise ValueError(f"target_rate is a fraction of routed steps that call Full: a number in [0, 1]; got "
                         f"{target_rate!r} (e.g. 0.25 for a quarter).")


def _sweep_entries(records: list[dict], stage: dict[float, str]) -> list[dict]:
    entries = []
    for group in summarize(records).values():
        if group.kind == "oda":
            entries.append({"threshold": group.threshold, "stage": stage.get(group.threshold, "grid"),
                            "pooled_full_call_rate": group.pooled_rate.mean,
                            "task_averaged_full_call_rate": group.task_averaged_rate.mean,
                            "macro_score": group.score.mean, "full_calls": group.full_calls,
                            # the pooled rate's denominator: routed steps past sinks + window (ODA makes no Full
                            # call within them)
                            "routed_steps": group.routed_steps,
                            "decided_steps": group.routed_steps - group.window_steps})
    return sorted(entries, key=lambda s: s["threshold"])


def _rounded(value: float) -> float:
    return float(f"{value:.6g}")  # policy names print thresholds with 6 significant digits


def calibrate(model, tokenizer, dev_examples: Sequence, output_dir: str | os.PathLike, *,
              target_rate: float | None = None, within_full: float | None = None,
              grid: Sequence[float] = DEFAULT_GRID, refine_steps: int = 4, chat_template: bool = False,
              test_examples: Sequence | None = None, provenance: dict | None = None, progress: bool = True) -> dict:
    """Choose a threshold on `dev_examples` by one of the two rules (see the module docstring).

    Returns the calibration result (also written to ``output_dir/calibration.json``); `save_calibration`
    writes it into a head folder. `provenance` (e.g. data hashes) is stored in the result.
    """
    if (target_rate is None) == (within_full is None):
        raise ValueError("Give exactly one rule: target_rate (a Full-call budget in [0, 1]) or within_full "
                         "(allowed dev score loss against Full, in points).")
    if target_rate is not None:
        _check_rate(target_rate)
    else:
        number("within_full", within_full, minimum=0, meaning="a score tolerance in points")
    grid = sorted({_rounded(number("grid threshold", t)) for t in grid})
    if not grid:
        raise ValueError("The threshold grid must be a non-empty list of finite numbers; got none.")
    integer("refine_steps", refine_steps, minimum=0)
    if not dev_examples:
        raise ValueError("No dev prompt to calibrate on.")
    recorded = _check_same_inputs(output_dir, provenance or {})
    dev_path = os.path.join(output_dir, DEV_RECORDS)
    run = dict(chat_template=chat_template, progress=progress)
    stage = {t: "grid" for t in grid}
    policies = ([full()] if within_full is not None else []) + [oda(t) for t in grid]
    try:
        records = evaluate(model, tokenizer, dev_examples, policies, dev_path, **run)
    except BaseException:
        # Refused before any record (a chat template the tokenizer lacks...): the inputs this run recorded would
        # refuse the corrected command ("made with other inputs") for a folder that holds nothing.
        if recorded is not None and not (os.path.exists(dev_path) and os.path.getsize(dev_path)):
            os.remove(recorded)
        raise
    result = {"split": "dev", "examples": len(dev_examples), "grid": grid, **(provenance or {})}

    if within_full is not None:
        full_score = summarize(records)["full"].score.mean
        sweep = _sweep_entries(records, stage)
        chosen = choose_threshold(sweep, full_score, within_full)
        result.update(rule="within_full", within_full=within_full, full_macro_score=full_score,
                      rule_met=within_full_met(chosen, full_score, within_full))
    else:
        sweep = _sweep_entries(records, stage)
        if choose_for_rate(sweep, target_rate) is None:
            lowest = min(sweep, key=lambda s: s["pooled_full_call_rate"])
            raise ValueError(f"No threshold on the grid keeps the pooled dev Full-call rate <= {target_rate:g}: the "
                             f"lowest is {lowest['pooled_full_call_rate']:.3f} at threshold {lowest['threshold']:g}. "
                             "Add higher thresholds to the grid.")
        for _ in range(refine_steps):
            chosen = choose_for_rate(sweep, target_rate)
            below = [s for s in sweep if s["threshold"] < chosen["threshold"]]
            if chosen["pooled_full_call_rate"] == target_rate or not below:
                break  # exact, or the budget does not bind within the grid
            mid = _rounded((max(below, key=lambda s: s["threshold"])["threshold"] + chosen["threshold"]) / 2)
            if mid in {s["threshold"] for s in sweep}:
                break  # bracket as narrow as the printed precision
            stage[mid] = "refine"
            policies.append(oda(mid))
            records = evaluate(model, tokenizer, dev_examples, policies, dev_path, **run)  # reuses finished runs
            sweep = _sweep_entries(records, stage)
        chosen = choose_for_rate(sweep, target_rate)
        result.update(rule="target_rate", target_rate=target_rate, refine_steps=refine_steps)
    result.update(sweep=sweep, chosen=chosen)

    if test_examples:
        test_records = evaluate(model, tokenizer, test_examples, [oda(chosen["threshold"])],
                                os.path.join(output_dir, TEST_RECORDS), **run)
        test = _sweep_entries(test_records, {})[0]
        result["test"] = {"examples": len(test_examples), "threshold": chosen["threshold"],
                          "pooled_full_call_rate": test["pooled_full_call_rate"],
                          "task_averaged_full_call_rate": test["task_averaged_full_call_rate"],
                          "macro_score": test["macro_score"]}
    write_json(os.path.join(output_dir, CALIBRATION_NAME), result, indent=1)
    return result


def _check_same_inputs(output_dir: str | os.PathLike, provenance: dict) -> str | None:
    """Records are reused by (example id, policy): refuse a folder whose records came from other data. Records the
    inputs; returns the inputs file's path when this call created it (None when it was there)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, INPUTS_NAME)
    created = not os.path.exists(path)
    if not created:
        try:
            with open(path, encoding="utf-8") as f:
                before = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err}): delete it or use a new output folder.") from None
        if not isinstance(before, dict):
            raise ValueError(f"{path} is not a calibration inputs file (a JSON object): delete it or use a new "
                             "output folder.")
        # What made the records: the dev prompts' content (not their file's name) and the routing; the test
        # prompts only where both runs name some (a run that adds --test-data keeps its dev records).
        differing = [k for k in DEV_RECORD_KEYS if before.get(k) != provenance.get(k)]
        differing += [k for k in TEST_RECORD_KEYS if before.get(k) is not None and provenance.get(k) is not None
                      and before[k] != provenance[k]]
        if differing:
            raise ValueError(f"{output_dir} holds calibration records made with other inputs ({sorted(differing)} "
                             "differ): use a new output folder.")
        provenance = {**before, **provenance}
    write_json(path, provenance, indent=1)
    return path if created else None


#: The calibration inputs that determine the dev records, and the test records.
DEV_RECORD_KEYS = ("dev_sha256", "sinks", "window", "chat_template")
TEST_RECORD_KEYS = ("test_sha256",)


def save_calibration(head_dir: str | os.PathLike, oda_config, result: dict) -> str:
    """Write the chosen threshold into ``head_dir/oda_config.json`` (routing default: the head at that
    threshold) and the result beside it as ``calibration.json``; returns the config's path."""
    from ..config import ODA_CONFIG_NAME, OdaConfig

    if not os.path.isdir(head_dir):
        raise FileNotFoundError(f"{head_dir} is not a local head folder: the calibrated threshold is saved into the "
                                "head's folder (download the head first, or skip writing).")
    OdaConfig.from_kwargs(oda_config, threshold=float(result["chosen"]["threshold"]), policy="head") \
        .save_pretrained(head_dir)
    write_json(os.path.join(head_dir, CALIBRATION_NAME), result, indent=1)
    return os.path.join(head_dir, ODA_CONFIG_NAME)

