"""Task metrics: RULER's string match and LongBench v1's official scorers, per example in [0, 1].

RULER (``scripts/eval/synthetic/constants.py``): the prediction is stripped and control characters
become newlines; a reference counts as found when it occurs case-insensitively as a substring.

* ``string_match_all`` (niah*, vt, cwe, fwe): the fraction of the example's references found;
* ``string_match_part`` (qa): 1 if any reference is found.

LongBench v1 (``metrics.py`` / ``eval.py`` of THUDM/LongBench): an example scores the *maximum* of
the metric over its ground truths; a task scores the mean over examples (x100 in the reports).

* ``qa_f1_score``: token F1 after English normalization (lower-case, drop ASCII punctuation, drop
  the articles a/an/the, split on whitespace).
* ``qa_f1_zh_score``: token F1 over Chinese words; each token is lower-cased and stripped of ASCII
  and Chinese punctuation and whitespace, empty tokens dropped.
* ``rouge_score``: ROUGE-L F of the ``rouge`` package (PyPI ``rouge`` 1.0.1, what LongBench calls),
  reproduced here without the dependency. Note that package's conventions, kept on purpose: texts
  are split into "sentences" at every ``.``; summary-level union LCS; and *sets* of words
  (``exclusive=True``), so the lengths m, n count distinct words and the union LCS counts distinct
  word types. ``F = 2PR / (P + R + 1e-8)``. An empty text (no sentence) scores 0, as LongBench's
  ``try/except`` does. One difference: the package reconstructs the LCS recursively and can hit
  Python's recursion limit on very long single-sentence texts (then LongBench scores 0); this
  implementation is iterative and returns the true value.
* ``rouge_zh_score``: the same ROUGE-L on Chinese words joined by spaces.
* ``retrieval_zh_score``: the paragraph id of ``段落(\\d+)`` in the ground truth; the score is the
  fraction of the numbers in the prediction that equal it (0 when the prediction has no number).

Chinese word segmentation. LongBench segments with ``jieba`` (``jieba.cut(text, cut_all=False)``).
``jieba`` 0.42.1 is on PyPI, pure Python and ships its dictionary, so it works offline: install it
(``pip install jieba``) to reproduce LongBench exactly. Without it, the Chinese metrics fall back to
*character-level* tokens (every character is a token), which gives different F1/ROUGE values for
multi-character words; `zh_segmentation()` tells which one is in use and the reports print it.
Pass ``segmentation="char"`` or ``"jieba"`` to force one.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

# -- RULER ----------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's post-processing: strip, turn control characters into newlines, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _found(prediction: str, references: Sequence[str]) -> list[float]:
    prediction = ruler_postprocess(prediction).lower()
    return [1.0 if reference.lower() in prediction else 0.0 for reference in references]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references found in the prediction (case-insensitive substring)."""
    references = _as_references(references)
    return sum(_found(prediction, references)) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference is found in the prediction (case-insensitive substring), else 0.0."""
    return max(_found(prediction, _as_references(references)))


# -- LongBench: normalization and F1 ---------------------------------------------------------------

_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
_EN_EXCLUDE = set(string.punctuation)
_ZH_EXCLUDE = set(string.punctuation + _ZH_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD English normalization: lower, drop punctuation, drop articles, squeeze spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_EXCLUDE)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """LongBench Chinese normalization: lower, drop ASCII and Chinese punctuation, drop all whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ZH_EXCLUDE)
    return "".join(text.split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when nothing overlaps)."""
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


# -- Chinese segmentation ---------------------------------------------------------------------------

_SEGMENTATIONS = ("jieba", "char")


def _jieba():
    try:
        import jieba
    except ImportError:
        return None
    jieba.setLogLevel(logging.WARNING)  # it logs the dictionary build at INFO on first use
    return jieba


def zh_segmentation() -> str:
    """``"jieba"`` when jieba is importable (LongBench's segmentation), else ``"char"``."""
    return "jieba" if _jieba() is not None else "char"


def segment_zh(text: str, segmentation: str | None = None) -> list[str]:
    """Chinese words of `text`: ``jieba.cut(text, cut_all=False)``, or one token per character."""
    segmentation = segmentation or zh_segmentation()
    if segmentation not in _SEGMENTATIONS:
        raise ValueError(f"segmentation must be one of {_SEGMENTATIONS}; got {segmentation!r}.")
    if segmentation == "char":
        return list(text)
    jieba = _jieba()
    if jieba is None:
        raise ImportError("segmentation='jieba' needs the jieba package: pip install jieba")
    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str, segmentation: str | None = None) -> float:
    def tokens(text):
        normalized = (normalize_zh_answer(token) for token in segment_zh(text, segmentation))
        return [token for token in normalized if token]

    return token_f1(tokens(prediction), tokens(ground_truth))


# -- LongBench: ROUGE-L as the `rouge` package computes it -----------------------------------------


def _rouge_sentences(text: str) -> list[str]:
    # rouge.Rouge.get_scores: split at ".", keep non-empty pieces, squeeze whitespace inside each.
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _lcs_word_set(reference: list[str], evaluated: list[str]) -> set[str]:
    """Words of the LCS of two word lists, reconstructed with `rouge`'s tie-breaking."""
    n, m = len(reference), len(evaluated)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, previous, word = table[i], table[i - 1], reference[i - 1]
        for j in range(1, m + 1):
            row[j] = previous[j - 1] + 1 if word == evaluated[j - 1] else max(previous[j], row[j - 1])
    words, i, j = set(), n, m
    while i > 0 and j > 0:  # iterative version of rouge_score._recon_lcs
        if reference[i - 1] == evaluated[j - 1]:
            words.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l_f(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F of PyPI ``rouge`` 1.0.1 (summary level, distinct words); 0 for an empty text."""
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not hyp or not ref:
        return 0.0
    hyp_words = [[w for w in sentence.split(" ")] for sentence in hyp]
    ref_words = [[w for w in sentence.split(" ")] for sentence in ref]
    n = len({w for sentence in hyp_words for w in sentence})
    m = len({w for sentence in ref_words for w in sentence})
    union: set[str] = set()
    for reference in ref_words:
        for evaluated in hyp_words:
            union |= _lcs_word_set(reference, evaluated)
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def rouge_score(prediction: str, ground_truth: str) -> float:
    return rouge_l_f(prediction, ground_truth)


def rouge_zh_score(prediction: str, ground_truth: str, segmentation: str | None = None) -> float:
    return rouge_l_f(" ".join(segment_zh(prediction, segmentation)), " ".join(segment_zh(ground_truth, segmentation)))


def retrieval_zh_score(prediction: str, ground_truth: str) -> float:
    """Share of the prediction's numbers that equal the paragraph id ``段落N`` of the ground truth."""
    matches = re.findall(r"段落(\d+)", ground_truth)
    if not matches:
        raise ValueError(f"passage_retrieval_zh ground truth without '段落N': {ground_truth!r}")
    numbers = re.findall(r"\d+", prediction)
    return numbers.count(matches[0]) / len(numbers) if numbers else 0.0


# -- registry --------------------------------------------------------------------------------------


def _as_references(references) -> list[str]:
    if isinstance(references, str):
        references = [references]
    references = list(references)
    if not references:
        raise ValueError("An example needs at least one reference answer.")
    return references


def _best_over_references(metric: Callable[[str, str], float]) -> Callable[[str, Sequence[str]], float]:
    def score(prediction: str, references: Sequence[str]) -> float:
        return max(metric(prediction, reference) for reference in _as_references(references))

    score.__name__ = metric.__name__
    score.__doc__ = f"max over references of `{metric.__name__}` (LongBench's scorer)."
    return score


#: name -> f(prediction, references) -> score in [0, 1].
METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1_score": _best_over_references(qa_f1_score),
    "qa_f1_zh_score": _best_over_references(qa_f1_zh_score),
    "rouge_score": _best_over_references(rouge_score),
    "rouge_zh_score": _best_over_references(rouge_zh_score),
    "retrieval_zh_score": _best_over_references(retrieval_zh_score),
}

RULER_TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)
#: The ten LongBench v1 tasks of the paper's table, in its column order, with their official metric.
LONGBENCH_METRICS = {
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score",
    "2wikimqa": "qa_f1_score",
    "hotpotqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "dureader": "rouge_zh_score",
    "qmsum": "rouge_score",
    "vcsum": "rouge_zh_score",
    "passage_retrieval_zh": "retrieval_zh_score",
}
LONGBENCH_TASKS = tuple(LONGBENCH_METRICS)
CHINESE_METRICS = ("qa_f1_zh_score", "rouge_zh_score")


def ruler_metric(task: str) -> str:
    """RULER's metric for a task name: string_match_part for qa tasks, string_match_all otherwise."""
    return "string_match_part" if task.startswith("qa") else "string_match_all"


def default_metric(task: str) -> str | None:
    """The official metric of a known RULER or LongBench task name, else None."""
    if task in LONGBENCH_METRICS:
        return LONGBENCH_METRICS[task]
    if task in RULER_TASKS or task.startswith(("niah", "qa_")):
        return ruler_metric(task)
    return None


def score_example(metric: str, prediction: str, references: Sequence[str]) -> float:
    """Score one prediction in [0, 1] with the named metric."""
    if metric not in METRICS:
        raise ValueError(f"Unknown metric {metric!r}; expected one of {sorted(METRICS)}.")
    return float(METRICS[metric](prediction, references))


#: Bump when a metric's implementation changes the scores it gives: records scored by another version are rescored.
SCORER_VERSION = 1


def scorer_identity(metric: str) -> str:
    """What an example's score depends on besides the output and the answers: the metric, this module's scorer
    version and, for the Chinese metrics, the word segmentation in use (jieba or characters)."""
    identity = f"{metric}/v{SCORER_VERSION}"
    return f"{identity}/{zh_segmentation()}" if metric in CHINESE_METRICS else identity
