"""Ranking statistics of the fixed-reference diagnostics (paper Appendix B.6), in numpy.

* `auroc`: probability that a random positive outranks a random negative, ties counting one half
  (Mann-Whitney U with average ranks); NaN when a class is missing. Everywhere, a NaN score ranks
  as +inf, like the head policy, which calls Full on a non-finite score.
* `average_precision`: scikit-learn's step-wise AP, ``sum_k (R_k - R_{k-1}) P_k`` over the distinct
  score thresholds (tied scores enter together); NaN without positives.
* `net_gain`: at offline budget b over population S, select the top ``K = floor(b |S|)`` positions
  by score and return ``(1/|S|) sum of their gains`` (negative gains included). Ties in score are
  broken by position order (earlier first), so the selection is deterministic.
* `random_expectation`: ``(K/|S|) * mean(g)``; the Oracle is `net_gain` ranked by the gains.
* `paired_bootstrap`: resample documents with replacement (the same resample for every method),
  recompute each statistic within the resample, and report percentile intervals.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np

from ..policies import rate_fraction


def _rankdata(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties receiving their average rank."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    boundaries = np.concatenate([[True], sorted_values[1:] != sorted_values[:-1], [True]])
    starts = np.flatnonzero(boundaries)
    average = (starts[:-1] + starts[1:] - 1) / 2.0 + 1.0  # mean of 1-based ranks start..end-1
    ranks = np.empty(len(values))
    ranks[order] = np.repeat(average, np.diff(starts))
    return ranks


def _finite_first(scores) -> np.ndarray:
    """Non-finite scores (NaN, -inf as well as +inf) count as +inf: the head policy calls Full on any of them."""
    scores = np.asarray(scores, dtype=float)
    return np.where(np.isfinite(scores), scores, np.inf)


def auroc(scores, labels) -> float:
    scores, labels = _finite_first(scores), np.asarray(labels, dtype=bool)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    ranks = _rankdata(scores)
    u = ranks[labels].sum() - positives * (positives + 1) / 2.0
    return float(u / (positives * negatives))


def average_precision(scores, labels) -> float:
    scores, labels = _finite_first(scores), np.asarray(labels, dtype=bool)
    positives = int(labels.sum())
    if positives == 0:
        return float("nan")
    order = np.argsort(-scores, kind="mergesort")
    sorted_scores, sorted_labels = scores[order], labels[order]
    # Last index of each group of tied scores = one threshold.
    last = np.flatnonzero(np.concatenate([sorted_scores[1:] != sorted_scores[:-1], [True]]))
    true_positives = np.cumsum(sorted_labels)[last]
    precision = true_positives / (last + 1)
    recall = true_positives / positives
    return float(np.sum(np.diff(np.concatenate([[0.0], recall])) * precision))


def budget_count(budget: float, population: int) -> int:
    """``K = floor(b * |S|)`` in integers for the fraction the budget stands for (`policies.rate_fraction`): in floats
    0.29 * 100 is 28.999999999999996, and the tolerance that once fixed it gave a budget of 0.2499999999 one of 4
    positions (a realised 0.25)."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"A budget is a fraction in [0, 1]; got {budget}.")
    numerator, denominator = rate_fraction(float(budget))
    return numerator * population // denominator


def _selection_order(scores: np.ndarray) -> np.ndarray:
    """Descending score, ties by position; NaN scores rank first."""
    return np.argsort(-_finite_first(scores), kind="mergesort")


def net_gain(scores, gains, budget: float) -> float:
    scores, gains = np.asarray(scores, dtype=float), np.asarray(gains, dtype=float)
    n = len(gains)
    if n == 0:
        return float("nan")
    k = budget_count(budget, n)
    return float(gains[_selection_order(scores)[:k]].sum() / n)


def net_gain_curve(scores, gains, budgets: Sequence[float]) -> np.ndarray:
    """`net_gain` at every budget, from one sort."""
    scores, gains = np.asarray(scores, dtype=float), np.asarray(gains, dtype=float)
    n = len(gains)
    if n == 0:
        return np.full(len(budgets), np.nan)
    cumulative = np.concatenate([[0.0], np.cumsum(gains[_selection_order(scores)])])
    return np.array([cumulative[budget_count(b, n)] / n for b in budgets])


def oracle_net_gain(gains, budget: float) -> float:
    return net_gain(gains, gains, budget)


def random_expectation(gains, budget: float) -> float:
    gains = np.asarray(gains, dtype=float)
    n = len(gains)
    if n == 0:
        return float("nan")
    return budget_count(budget, n) / n * float(gains.mean())


def gain_decomposition(scores, gains, budget: float) -> dict:
    """Calls K, positive gain and negative cost (sums in nats) of the selected positions, net gain."""
    scores, gains = np.asarray(scores, dtype=float), np.asarray(gains, dtype=float)
    k = budget_count(budget, len(gains))
    chosen = gains[_selection_order(scores)[:k]]
    return {"calls": k, "positive_gain": float(chosen[chosen > 0].sum()) + 0.0,
            "negative_cost": float(-chosen[chosen < 0].sum()) + 0.0,  # + 0.0 turns an empty sum's -0.0 into 0.0
            "net_gain": float(chosen.sum() / len(gains)) if len(gains) else float("nan")}


def sign_counts(gains, eps: float) -> dict:
    """Counts of g < -eps, |g| <= eps and g > eps."""
    gains = np.asarray(gains, dtype=float)
    return {"negative": int((gains < -eps).sum()), "neutral": int((np.abs(gains) <= eps).sum()),
            "positive": int((gains > eps).sum())}


def paired_bootstrap(documents: Sequence[np.ndarray], measure: Callable[[np.ndarray], dict],
                     n_resamples: int = 2000, seed: int = 0, progress: bool = False) -> dict[str, np.ndarray]:
    """Paired document bootstrap.

    `documents[d]` holds the row indices (into pooled per-position arrays) of document d. Each
    resample draws ``len(documents)`` documents with replacement and calls `measure` once with the
    concatenated rows of the drawn documents (repeats included), so every statistic it returns -
    one per method - is computed on the same resample. Returns ``{name: array [n_resamples, ...]}``;
    the same `seed` gives the same resamples.
    """
    if not documents:
        raise ValueError("The bootstrap needs at least one document.")
    from tqdm.auto import tqdm

    rng = np.random.default_rng(seed)
    samples: dict[str, list] = {}
    for _ in tqdm(range(n_resamples), desc="bootstrap", disable=not progress, leave=False):
        drawn = rng.integers(0, len(documents), size=len(documents))
        for name, value in measure(np.concatenate([documents[d] for d in drawn])).items():
            samples.setdefault(name, []).append(value)
    return {name: np.asarray(values, dtype=float) for name, values in samples.items()}


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of bootstrap samples along axis 0 (NaN samples ignored)."""
    tail = 100 * (1 - level) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (e.g. AUROC of a one-class subset)
        low, high = np.nanpercentile(samples, [tail, 100 - tail], axis=0)
    return low, high
