"""The organism shipped inside the package: loads offline, parts fit, cards carry the evaluation's numbers."""

import json
import os

import torch

from oda_hf.organism.corpus import VOCAB, vocab_sha256
from oda_hf.organism.demo import load_organism, run_demo, shipped_organism_dir
from oda_hf.organism.ship import score_table

ASSETS = shipped_organism_dir()


def test_shipped_artifacts_fit_each_other_and_stay_small():
    model, tokenizer, info = load_organism()  # local files only
    config = model.config
    assert config.vocab_size == len(VOCAB) == len(tokenizer)
    assert tokenizer.convert_ids_to_tokens(list(range(len(VOCAB)))) == list(VOCAB)
    head = model.recall_head.config
    assert (head.hidden_size, head.base_vocab_size) == (config.hidden_size, config.vocab_size)
    assert (model.oda_config.sinks, model.oda_config.window) == (head.sinks, head.window) == (4, 64)
    assert info["seed"] == 0 and info["vocab_sha256"] == vocab_sha256()  # tokenizer and corpus agree
    total = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(ASSETS) for f in files)
    assert total <= 50 * 2**20


def test_model_cards_carry_the_evaluation_numbers():
    with open(os.path.join(ASSETS, "evaluation", "summary.json")) as f:
        summary = json.load(f)
    table = score_table(summary)
    for card in ("backbone", "head"):
        with open(os.path.join(ASSETS, card, "README.md")) as f:
            assert table in f.read(), card


def test_shipped_threshold_is_the_dev_calibrated_one_the_evaluation_used():
    model, _, _ = load_organism()
    with open(os.path.join(ASSETS, "evaluation", "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(ASSETS, "head", "calibration.json")) as f:
        calibration = json.load(f)
    assert calibration["split"] == "dev" and calibration["chosen"]["threshold"] == model.oda_config.threshold
    assert summary["threshold"] == model.oda_config.threshold and f"oda@{summary['threshold']:g}" in summary


def test_shipped_demo_short_variant(tmp_path):
    torch.set_num_threads(1)
    result = run_demo(output=str(tmp_path), prompts=(("niah_single_2", 512),), verbose=False)
    assert set(result["scores"]) == {"Full", "StreamingLLM", "ODA"}
    assert (tmp_path / "trajectory.html").exists() and (tmp_path / "trajectory.png").exists()


def test_head_card_quotes_the_shipped_calibration_sweep():
    """The head card's dev sweep (theta: score at pooled Full-call rate) is calibration.json's, entry by entry."""
    with open(os.path.join(ASSETS, "head", "calibration.json")) as f:
        calibration = json.load(f)
    with open(os.path.join(ASSETS, "head", "README.md")) as f:
        card = " ".join(f.read().split())
    assert len(calibration["sweep"]) >= 2
    for entry in calibration["sweep"]:
        percent = round(100 * entry["pooled_full_call_rate"])
        assert f"{entry['threshold']:g}: {entry['macro_score']:.1f} at {percent}%" in card, entry
    assert f"theta = {calibration['chosen']['threshold']:g}" in card
