"""Package a trained organism into `oda_hf/organism/assets/` with model cards from its evaluation.

    python -m oda_hf.organism.ship --backbone <train_backbone output> --head <train_head output> \
        --evaluation <organism.evaluate output>

Copies only what loading needs (safetensors, configs, tokenizer, organism.json), then writes each
model card from the templates in `model_cards/`, filling every number from the evaluation's
``summary.json`` and the backbone's ``organism.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from ..model_card import render_template, write_head_model_card

BACKBONE_FILES = ("config.json", "generation_config.json", "model.safetensors", "organism.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json")
HEAD_FILES = ("config.json", "model.safetensors", "oda_config.json", "calibration.json")
SHIPPED_BACKBONE_NAME = "organism"  # the short name: resolves wherever the package is installed
KIND_LABELS = (("full", "Full"), ("local", "StreamingLLM (always-Local)"), ("oda", "ODA (threshold {theta:g})"),
               ("random", "Random at ODA's per-task rate (seeds 42/43/44)"))


def score_table(summary: dict) -> str:
    lines = ["| method | macro score | pooled Full-call rate | task-averaged rate |", "|---|---:|---:|---:|"]
    groups = [v for v in summary.values() if isinstance(v, dict) and "kind" in v]
    for kind, label in KIND_LABELS:
        for s in (g for g in groups if g["kind"] == kind):
            std = f" ± {s['macro_score_std']:.1f}" if s.get("macro_score_std") is not None else ""
            lines.append(f"| {label.format(theta=summary.get('threshold', 0.0))} | {s['macro_score']:.1f}{std} | "
                         f"{s['pooled_full_call_rate']:.1%} | {s['task_averaged_full_call_rate']:.1%} |")
    return "\n".join(lines)


def _copy(src: str, dst: str, names) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in names:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
        elif os.path.exists(os.path.join(dst, name)):  # an earlier shipment's (e.g. a calibration of other weights)
            os.remove(os.path.join(dst, name))


def ship(backbone: str, head: str, evaluation: str, assets: str) -> None:
    from ..head import RecallHead

    with open(os.path.join(evaluation, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(backbone, "organism.json")) as f:
        info = json.load(f)
    with open(os.path.join(backbone, "config.json")) as f:
        config = json.load(f)
    _copy(backbone, os.path.join(assets, "backbone"), BACKBONE_FILES)
    _copy(evaluation, os.path.join(assets, "evaluation"), ("summary.json", "report.md"))
    _copy(head, os.path.join(assets, "head"), HEAD_FILES)
    # The head recorded the folder it was trained against (a machine path): name the shipped backbone instead.
    head_config_path = os.path.join(assets, "head", "config.json")
    with open(head_config_path) as f:
        head_config = json.load(f)
    head_config["base_model_name_or_path"] = SHIPPED_BACKBONE_NAME
    with open(head_config_path, "w") as f:
        json.dump(head_config, f, indent=2, sort_keys=True)
    table = score_table(summary)
    lengths = "/".join(str(n) for n in summary["lengths"])
    from transformers import AutoModelForCausalLM

    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(backbone).parameters())
    card = render_template("organism_backbone.md", {
        "parameters": f"{parameters:,}", "layers": config["num_hidden_layers"], "hidden": config["hidden_size"],
        "sinks": summary["sinks"], "window": summary["window"], "seed": info.get("seed"),
        "train_sha256": info.get("train_data_sha256", "n/a"), "test_sha256": info.get("test_sha256", "n/a"),
        "examples": summary["examples"], "lengths": lengths, "score_table": table,
        "train_minutes": f"{info.get('train_seconds', float('nan')) / 60:.0f}", "steps": info.get("steps"),
        "limitations": _recipe(info.get("train_config", {})),
    })
    with open(os.path.join(assets, "backbone", "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    head_model = RecallHead.from_pretrained(os.path.join(assets, "head"))
    training = ("Trained with `python -m oda_hf.organism.train_head`: the public `oda train-head` on organism "
                f"training-split sequences only (corpus seed {info.get('seed')}), lambda = {head_model.config.oda_lambda}, "
                f"tau_hist = {head_model.config.tau_hist}.")
    calibration_path = os.path.join(assets, "head", "calibration.json")
    if os.path.exists(calibration_path):
        with open(calibration_path) as f:
            calibration = json.load(f)
        sweep = ", ".join(f"{s['threshold']:g}: {s['macro_score']:.1f} at {s['pooled_full_call_rate']:.0%}"
                          for s in calibration["sweep"])
        training += (f" Its routing threshold theta = {calibration['chosen']['threshold']:g} (saved in "
                     f"`oda_config.json`) was chosen on the dev split ({calibration['examples']} prompts, "
                     f"`python -m oda_hf.organism.calibrate`): the lowest pooled Full-call rate within "
                     f"{calibration['tolerance']:g} point of Full's dev score {calibration['full_macro_score']:.1f} "
                     f"(theta: dev score at rate: {sweep}).")
    evaluation_text = (f"Held-out test split, every task family, {summary['examples']} prompts of {lengths} tokens "
                       f"(`python -m oda_hf.organism.evaluate`):\n\n{table}")
    write_head_model_card(head_model, os.path.join(assets, "head"),
                          extra={"training": training, "evaluation": evaluation_text,
                                 "base_model": SHIPPED_BACKBONE_NAME})


def _recipe(train_config: dict) -> str:
    """The training recipe's consequences for Local decoding, derived from the recorded config."""
    stages = train_config.get("curriculum", [])
    local_view = max((st.get("local_view", 0.0) for st in stages), default=0.0)
    copy = max((st.get("copy_fraction", 0.0) for st in stages), default=0.0)
    parts = []
    if copy:
        parts.append(f"Early batches mix in up to {copy:.0%} copy drills (random words, then the same words "
                     "again), which make the retrieval circuit form quickly.")
    if local_view:
        parts.append(f"Up to {local_view:.0%} of each later batch's examples see their answer with a Local view "
                     "(Full prefill, then sinks + window, as StreamingLLM decodes), with loss only on the tokens "
                     "the window holds (the restated question, formatting, end of text): Local decoding is "
                     "trained to be right where it can be, and only retrieval needs Full.")
    if train_config.get("filler_coef", 1.0) == 0.0:
        parts.append("The filler itself gets no loss (`filler_coef = 0`): only answers are ever decoded.")
    else:
        parts.append(f"Filler loss weight {train_config.get('filler_coef')}.")
    return " ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("--evaluation", required=True)
    parser.add_argument("--assets", default=os.path.join(os.path.dirname(__file__), "assets"))
    args = parser.parse_args(argv)
    ship(args.backbone, args.head, args.evaluation, args.assets)
    print(f"organism packaged into {args.assets}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
