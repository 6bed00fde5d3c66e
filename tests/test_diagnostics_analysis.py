"""Fixed-reference diagnostics analysis on hand-made positions: every reported number checked against values worked
out by hand (subsets, baselines' signs, decompositions, paired differences, counts), the selection's tie order, the
NaN-ignoring intervals, the selected history's routing rule and the trajectory's hover scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from oda_hf.evaluation import diagnostics, stats, trajectory
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

NAN = math.nan
# Ten positions of one document. Gains g > 0 at 0, 3, 6, 8; exact zeros at 1, 4, 9 (bit-identical branches).
GAINS = [1.0, 0.0, -1.0, 2.0, 0.0, -2.0, 0.5, -0.5, 3.0, 0.0]
# Local correct at 0, 1, 2, 7 (g 1, 0, -1, -0.5); Full correct at 0, 1, 3.
LOCAL_TOP1 = [0, 0, 0, 1, 1, 1, 1, 0, 1, 1]
FULL_TOP1 = [0, 0, 1, 0, 1, 1, 1, 1, 1, 1]
# The head: NaN at 0 (ranks first, as the routing rule calls Full on it); 0.6 at the zero-gain position 1.
HEAD = [NAN, 0.6, -0.4, 0.7, 0.2, -0.9, 0.1, 0.3, 0.9, -0.1]
# Confidence features: every g > 0 position is the least confident (high entropy, low max prob / margin / ratio).
ENTROPY = [2.5, 1.0, 0.5, 2.8, 1.2, 0.3, 2.1, 0.9, 3.0, 1.1]
MAX_PROB = [0.3, 0.8, 0.9, 0.25, 0.7, 0.95, 0.35, 0.85, 0.2, 0.75]
MARGIN = [0.1, 0.6, 0.8, 0.05, 0.5, 0.9, 0.15, 0.7, 0.02, 0.55]
TOP2_LOGRATIO = [0.2, 1.5, 2.5, 0.1, 1.2, 3.0, 0.3, 2.0, 0.05, 1.3]


def hand_record() -> diagnostics.ReferencePositions:
    n = len(GAINS)
    local_logp = np.full(n, -2.0)
    return diagnostics.ReferencePositions(
        doc_id="d0", history="full", positions=np.arange(7, 7 + n), targets=np.zeros(n, dtype=np.int64),
        full_logp=local_logp + np.array(GAINS), local_logp=local_logp, head_scores=np.array(HEAD),
        selected_full=np.ones(n, dtype=bool), local_top1=np.array(LOCAL_TOP1), full_top1=np.array(FULL_TOP1),
        entropy=np.array(ENTROPY), max_prob=np.array(MAX_PROB), margin=np.array(MARGIN),
        top2_logratio=np.array(TOP2_LOGRATIO))


@pytest.fixture(scope="module")
def result():
    # One document: every bootstrap resample is that document, so each interval collapses onto its point value.
    return diagnostics.analyze([hand_record()], budgets=[0.0, 1.0], main_budget=0.4, n_resamples=5, seed=0,
                               epsilons=(0.0, 0.5), progress=False)


def test_a_nan_head_score_keeps_the_head_and_ranks_first(result):
    """One NaN head score leaves the head a method; the NaN position ranks first, labels are g > 0 (zeros negative)."""
    assert result["methods"] == ["head", "entropy", "neg_max_prob", "neg_margin", "neg_top2_logratio"]
    head = result["subsets"]["all"]["methods"]["head"]
    # positives NaN, 0.7, 0.9 beat all 6 negatives; 0.1 beats -0.4, -0.9, -0.1: 21 of 24 pairs (g >= 0: 18 of 21)
    assert head["auroc"] == pytest.approx(21 / 24)
    # K = floor(0.4 * 10) = 4: NaN (g 1), 0.9 (g 3), 0.7 (g 2), 0.6 (g 0) -> 6 / 10
    assert head["net_gain"] == pytest.approx(0.6)
    assert head["decomposition"] == pytest.approx({"calls": 4, "positive_gain": 6.0, "negative_cost": 0.0,
                                                   "net_gain": 0.6})


@pytest.mark.parametrize("method", ["entropy", "neg_max_prob", "neg_margin", "neg_top2_logratio"])
def test_confidence_baselines_rank_low_confidence_first(result, method):
    """Entropy ranks high values first and max prob, margin and top-2 log-ratio low values first."""
    for subset in ("all", "local_correct", "local_incorrect"):
        assert result["subsets"][subset]["methods"][method]["auroc"] == 1.0
    # every baseline picks the four g > 0 positions: 1 + 2 + 0.5 + 3 = 6.5 over 10
    assert result["subsets"]["all"]["methods"][method]["net_gain"] == pytest.approx(0.65)


def test_subsets_use_their_own_positions(result):
    """Local correct/incorrect rows: own positions, g > 0 share, head AUROC and net gain, Random, Oracle, calls."""
    want = {  # subset: positions, positive fraction, head AUROC, head net gain, Random, Oracle decomposition
        # g 1, 2, 0.5, 3 of 0, 3, 6, 8 (mean 0.3); Oracle K = 4: 3 + 2 + 1 + 0.5
        "all": (10, 0.4, 21 / 24, 0.6, 0.4 * 0.3, (4, 6.5, 0.0, 0.65)),
        # 0, 1, 2, 7: g 1, 0, -1, -0.5 (mean -0.125); K = 1: the head's NaN, g 1; Random 1/4 * -0.125
        "local_correct": (4, 0.25, 1.0, 0.25, -0.125 / 4, (1, 1.0, 0.0, 0.25)),
        # 3, 4, 5, 6, 8, 9: g 2, 0, -2, 0.5, 3, 0 (mean 3.5/6); K = 2: head 0.9 (g 3), 0.7 (g 2); 0.1 beats 2 of 3
        "local_incorrect": (6, 0.5, 8 / 9, 5 / 6, 2 / 6 * 3.5 / 6, (2, 5.0, 0.0, 5 / 6)),
    }
    for subset, (positions, positive, auroc, net, random, oracle) in want.items():
        entry = result["subsets"][subset]
        assert entry["positions"] == positions and entry["positive_fraction"] == pytest.approx(positive)
        assert entry["methods"]["head"]["auroc"] == pytest.approx(auroc)
        assert entry["methods"]["head"]["net_gain"] == pytest.approx(net)
        assert entry["methods"]["head"]["decomposition"]["calls"] == oracle[0]
        assert entry["methods"]["random"]["net_gain"] == pytest.approx(random)
        d = entry["methods"]["oracle"]["decomposition"]
        assert (d["calls"], d["positive_gain"], d["negative_cost"]) == pytest.approx(oracle[:3])
        assert d["net_gain"] == pytest.approx(oracle[3]) == entry["methods"]["oracle"]["net_gain"]


def test_paired_differences_are_head_minus_other(result):
    """The difference intervals are over head − other per resample (here every resample is the one document)."""
    diffs = result["subsets"]["all"]["differences"]
    entropy = diffs["head-entropy"]
    assert entropy["auroc"] == pytest.approx(21 / 24 - 1.0) and entropy["net_gain"] == pytest.approx(0.6 - 0.65)
    assert entropy["auroc_ci"] == pytest.approx([21 / 24 - 1.0] * 2)
    assert entropy["net_gain_ci"] == pytest.approx([0.6 - 0.65] * 2)
    assert diffs["head-random"]["net_gain_ci"] == pytest.approx([0.6 - 0.12] * 2)


def test_correctness_and_sign_counts(result):
    """Only Local = Local right and Full wrong; the ε neutral band includes |g| = ε (exact zeros at ε = 0)."""
    assert result["correctness"] == {"both": 2, "only_local": 2, "only_full": 1, "neither": 5}
    assert result["sign_counts"]["0"] == {"negative": 3, "neutral": 3, "positive": 4}
    assert result["sign_counts"]["0.5"] == {"negative": 2, "neutral": 5, "positive": 3}
    assert stats.sign_counts([0.0, -0.0, 1e-3, -1.0], 0.0) == {"negative": 1, "neutral": 2, "positive": 1}


def test_tied_scores_are_selected_in_position_order():
    """Ties in score go to the earlier position, also past numpy's 16-element insertion-sort cutoff."""
    scores, gains = np.tile([0.0, 1.0], 50), np.arange(100.0)
    # K = 25 of the 50 tied top scores: positions 1, 3, ..., 49, summing to 25 ** 2 = 625
    assert stats.net_gain(scores, gains, 0.25) == pytest.approx(6.25)
    assert stats.net_gain_curve(scores, gains, [0.25]).tolist() == pytest.approx([6.25])
    assert stats.gain_decomposition(scores, gains, 0.25)["positive_gain"] == pytest.approx(625.0)


def test_percentile_interval_ignores_nan_samples():
    """A resample without an AUROC (NaN) is left out of the interval instead of making it NaN."""
    low, high = stats.percentile_interval(np.array([NAN] + list(range(41)), dtype=float), 0.95)
    assert (float(low), float(high)) == pytest.approx((1.0, 39.0))  # 2.5% and 97.5% of 0..40


def test_selected_history_commits_full_on_a_nan_score_and_local_on_a_tie():
    """history='selected' follows the routing rule: Full when q > θ or q is not finite, Local when q == θ."""
    base = tiny_model("qwen3")
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    model = OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, policy="head", threshold=0.5))
    ids = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.recall_head.score.weight.zero_()  # q = the score's bias at every position
    for bias, full in ((NAN, True), (0.5, False)):
        with torch.no_grad():
            model.recall_head.score.bias.fill_(bias)
        record = diagnostics.reference_gains(model, ids, history="selected")
        assert len(record) == 3 and np.array_equal(record.head_scores, [bias] * 3, equal_nan=True)
        assert record.selected_full.tolist() == [full] * 3


class WordTokenizer:
    """id 2 is <eos> (special); id i >= 4 is the word w{i}."""

    all_special_ids = [0, 1, 2, 3]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join("<eos>" if i == 2 else f"w{i}" for i in ids)


def test_render_record_pairs_each_token_with_its_steps_score():
    """Output token k >= 1 carries routed step k's decision and head score, the EOS left out."""
    record = {"id": "q/0", "task": "q", "policy": "oda@0", "output_ids": [7, 8, 9, 2], "decisions": [1, 0, 1],
              "head_scores": [0.9, -0.2, 0.7], "answers": []}
    items = trajectory.render_record(record, WordTokenizer())
    assert [(i.text, i.role, i.step, i.score) for i in items] == [
        ("w7", "prefill", None, None), (" w8", "full", 1, 0.9), (" w9", "local", 2, -0.2)]
