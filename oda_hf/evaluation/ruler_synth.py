"""The RULER synthetic suite, generated offline: 11 task families, exact token lengths, seeded splits.

Task definitions follow NVIDIA/RULER (``scripts/synthetic.yaml`` and ``scripts/data/synthetic/``):
prompt templates, answer prefixes, output caps (``tokens_to_generate``) and metrics
(``string_match_all`` for all eleven). The tasks:

* ``niah_single_1/2/3``, ``niah_multikey_1/2/3``, ``niah_multivalue``, ``niah_multiquery``: needles
  "One of the special magic {numbers|uuids} for {key} is: {value}." in a haystack; keys are
  adjective-noun words (wonderwords' lists, as RULER) or UUIDs, values 7-digit numbers or UUIDs.
  Haystacks per RULER: ``noise`` (single_1), prose (single_2/3, multikey_1, multivalue, multiquery:
  RULER's "essay"; here the `haystack` argument: ``kjv``, ``noise`` or ``python-docs``), distractor needles
  (multikey_2/3).
* ``vt``: variable tracking, one chain of 4 hops (``VAR X = 12345``, ``VAR Y = VAR X``, ...) in
  noise, with one short solved example in front (RULER's few-shot example).
* ``cwe``: common-words extraction: a numbered word list where 10 words repeat 30 times and the
  others 3 times (6 and 1 below RULER's 4096-token setting), with one solved example in front.
* ``fwe``: frequent-words extraction: coded 6-letter words with Zipf (alpha=2) counts; the top
  word is replaced by the noise ``...``; the answer is the next three.

RULER's ``qa_1``/``qa_2`` (SQuAD, HotpotQA) need external data sets and are left out.

Differences from RULER's generator, on purpose:

* ``length`` is the prompt's exact token count as the evaluation encodes it
  (`runner.encode_prompt`: chat template + answer prefix), hit within `tolerance` (2%) by a
  search over the haystack size; RULER's ``max_seq_length`` also counts the output cap.
  The cwe small/large setting switches where RULER's does: ``length + 120 < 4096`` is small.
* Needle depths are spread evenly over [0, 100]% across the `n` prompts of a task and length (the
  queried needle; RULER draws them at random); other needles sit at random depths of RULER's
  40-point grid. Depth = the share of haystack units (lines, sentences) before the needle.
* Each prompt draws from its own RNG, seeded by a hash of (seed, split, task, length, index), so
  train/dev/test (and every length) are disjoint seed namespaces; prose haystacks come from
  split-specific texts (`haystacks`). A prose haystack starts at a random word of its split's text.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import random
import shutil
import string
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources

from .haystacks import (
    HAYSTACKS,
    NOISE_LINE,
    NOISE_SENTENCES,
    PROSE_HAYSTACKS,
    SPLITS,
    check_haystack,
    check_split,
    prose_fingerprint,
    prose_words,
)
from ..known_models import base_argument
from ..validation import argument, integer, number
from .metrics import default_metric
from .suites import EvalExample, ruler_max_new_tokens, write_examples

logger = logging.getLogger(__name__)

GENERATOR = "oda-ruler-synth/1"
#: Seed namespace (kept across generator versions, so fixes that do not touch a task keep its prompts).
SEED_NAMESPACE = "oda-ruler"
DEFAULT_TOLERANCE = 0.02
#: RULER's insertion grid: 40 depths evenly over [0, 100]%.
DEPTH_GRID = tuple(round(100 * i / 39) for i in range(40))
#: Draws of the distractor needles tried when one draw misses the length by more than `CLOSE_ENOUGH`.
FILLER_VARIANTS = 16
CLOSE_ENOUGH = 0.0025


@dataclass(frozen=True)
class NiahTask:
    haystack: str  # "essay" (the chosen prose/noise), "noise" or "needle" (distractor needles)
    key_type: str  # "words" | "uuids"
    value_type: str  # "numbers" | "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


@dataclass(frozen=True)
class VariableTrackingTask:
    num_chains: int = 1
    num_hops: int = 4


@dataclass(frozen=True)
class CommonWordsTask:
    freq_common: int = 30
    freq_uncommon: int = 3
    num_common: int = 10


@dataclass(frozen=True)
class FrequentWordsTask:
    alpha: float = 2.0
    word_length: int = 6


#: RULER's scripts/synthetic.yaml, without qa_1/qa_2.
TASKS = {
    "niah_single_1": NiahTask("noise", "words", "numbers"),
    "niah_single_2": NiahTask("essay", "words", "numbers"),
    "niah_single_3": NiahTask("essay", "words", "uuids"),
    "niah_multikey_1": NiahTask("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahTask("needle", "words", "numbers"),
    "niah_multikey_3": NiahTask("needle", "uuids", "uuids"),
    "niah_multivalue": NiahTask("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahTask("essay", "words", "numbers", num_queries=4),
    "vt": VariableTrackingTask(num_chains=1, num_hops=4),
    "cwe": CommonWordsTask(freq_common=30, freq_uncommon=3, num_common=10),
    "fwe": FrequentWordsTask(alpha=2.0),
}
TASK_NAMES = tuple(TASKS)

# -- RULER's templates (scripts/data/synthetic/constants.py) ------------------------------------------
# niah: RULER rewrites the plural template to the singular when one value is asked for
# ("Some" -> "A", "are all"/"are" -> "is", "numbers" -> "number"); both forms are spelled out here.
NIAH_TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {kind} afterwards.\n{context}\n"
                 "What are all the special magic {kind} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
NIAH_TEMPLATE_SINGLE = ("A special magic {kind} is hidden within the following text. Make sure to memorize it. "
                        "I will quiz you about the {kind} afterwards.\n{context}\n"
                        "What is the special magic {kind} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX_SINGLE = " The special magic {kind} for {query} mentioned in the provided text is"
NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."

VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, "
                    "{num_v} variables are assigned the value {query}, they are: ")
#: Noise sentences around the few-shot chain (RULER fits that example to ~500 tokens).
VT_EXAMPLE_NOISE_SENTENCES = 80

CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
#: RULER uses the small setting when max_seq_length (prompt + output cap) is below 4096.
CWE_SMALL_BELOW = 4096

FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass
class Draft:
    """One prompt before tokenization."""

    prompt: str
    answer_prefix: str
    answers: list[str]
    meta: dict = field(default_factory=dict)


# -- word lists --------------------------------------------------------------------------------------


def _wonderwords(name: str) -> tuple[str, ...]:
    try:
        import wonderwords
    except ImportError as err:
        raise ImportError("The RULER generator draws words from wonderwords' lists, as RULER does: "
                          "pip install 'wonderwords>=2.2,<4'") from err
    text = resources.files(wonderwords).joinpath("assets", name).read_text(encoding="utf-8")
    return tuple(sorted({line.strip() for line in text.splitlines() if line.strip()}))


_WORDS: dict[str, tuple[str, ...]] = {}


def word_list(name: str) -> tuple[str, ...]:
    """'nouns', 'adjectives', 'verbs' (wonderwords' lists, sorted, deduplicated) or 'cwe' (all three)."""
    if name not in _WORDS:
        if name == "cwe":
            _WORDS[name] = tuple(sorted(set(word_list("nouns") + word_list("adjectives") + word_list("verbs"))))
        else:
            files = {"nouns": "nounlist.txt", "adjectives": "adjectivelist.txt", "verbs": "verblist.txt"}
            _WORDS[name] = _wonderwords(files[name])
    return _WORDS[name]


def wonderwords_version() -> str:
    from importlib.metadata import version

    return version("wonderwords")


# -- seeds -------------------------------------------------------------------------------------------


def example_seed(seed: int, split: str, task: str, length: int, index: int) -> int:
    """A 64-bit seed of its own for every prompt; splits, tasks and lengths are disjoint namespaces."""
    key = f"{SEED_NAMESPACE}|seed={seed}|split={split}|task={task}|length={length}|index={index}"
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def spread_depth(index: int, n: int) -> int:
    """Depth (percent) of prompt `index` of `n`: evenly over [0, 100]."""
    return 50 if n == 1 else round(100 * index / (n - 1))


# -- random values as RULER draws them ------------------------------------------------------------


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(word_list('adjectives'))}-{rng.choice(word_list('nouns'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"Unknown needle type {kind!r}.")


def _distinct(rng: random.Random, kind: str, count: int, exclude: set[str]) -> list[str]:
    values: list[str] = []
    while len(values) < count:
        value = _random_value(rng, kind)
        if value not in exclude:
            exclude.add(value)
            values.append(value)
    return values


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


# -- haystack units -------------------------------------------------------------------------------


def _noise_lines(sentences: int) -> list[str]:
    """`sentences` noise sentences as RULER's lines of five (the last line may be shorter)."""
    full, rest = divmod(sentences, len(NOISE_SENTENCES))
    lines = [NOISE_LINE] * full
    if rest:
        lines.append(" ".join(NOISE_SENTENCES[:rest]))
    return lines


def _prose_sentences(words: Sequence[str], start: int, count: int) -> list[str]:
    """`count` words from `start` (wrapping around the text), cut into sentences after . ! or ?."""
    picked = [words[(start + i) % len(words)] for i in range(count)]
    sentences, current = [], []
    for word in picked:
        current.append(word)
        if word.endswith((".", "!", "?")):
            sentences.append(" ".join(current))
            current = []
    if current:
        sentences.append(" ".join(current))
    return sentences


def _sentence_start(words: Sequence[str], index: int) -> int:
    """The first sentence start at or after word `index` (wrapping around), so a haystack opens cleanly."""
    for step in range(len(words)):
        i = (index + step) % len(words)
        if i == 0 or words[i - 1].endswith((".", "!", "?")):
            return i
    return 0


def _insert(units: list[str], needles: Sequence[tuple[int, str]]) -> tuple[list[str], list[int]]:
    """Insert (depth percent, text) needles between units; returns the units and each needle's slot."""
    positions = [int(len(units) * depth / 100) for depth, _ in needles]
    order = sorted(range(len(needles)), key=lambda i: (positions[i], i))
    out, slots, previous = [], [0] * len(needles), 0
    for i in order:
        out.extend(units[previous:positions[i]])
        previous = positions[i]
        slots[i] = len(out)
        out.append(needles[i][1])
    out.extend(units[previous:])
    return out, slots


# -- task builders -----------------------------------------------------------------------------------
# Each draws everything that does not depend on the haystack size once, and returns
# (build(size, variant) -> Draft, the smallest size, the number of filler variants).


_Builder = tuple[Callable[..., Draft], int, int]


@dataclass
class _Context:
    task: str
    split: str
    length: int
    index: int
    n: int
    haystack: str
    seed: int  # this example's seed


def _niah(spec: NiahTask, ctx: _Context) -> _Builder:
    rng = random.Random(ctx.seed)
    num_keys = max(spec.num_keys, spec.num_queries)
    used: set[str] = set()
    keys = _distinct(rng, spec.key_type, num_keys, used)
    values = [_distinct(rng, spec.value_type, spec.num_values, used) for _ in keys]
    queried = rng.sample(range(num_keys), spec.num_queries)
    answers = [v for i in queried for v in values[i]]
    single = spec.num_queries * spec.num_values == 1
    kind = spec.value_type[:-1] if single else spec.value_type
    needles = [(k, v, NIAH_NEEDLE.format(kind=spec.value_type, key=keys[k], value=v))
               for k in range(num_keys) for v in values[k]]
    rng.shuffle(needles)
    # The first needle of a queried key goes to this prompt's spread depth, the others to distinct
    # depths of RULER's grid (RULER samples the grid without replacement).
    primary = next(i for i, (k, _, _) in enumerate(needles) if k == queried[0])
    primary_depth = spread_depth(ctx.index, ctx.n)
    others = iter(rng.sample([d for d in DEPTH_GRID if d != primary_depth], len(needles) - 1))
    depths = [primary_depth if i == primary else next(others) for i in range(len(needles))]
    query = _join_keys([keys[i] for i in queried])
    template, prefix = (NIAH_TEMPLATE_SINGLE, NIAH_ANSWER_PREFIX_SINGLE) if single else \
        (NIAH_TEMPLATE, NIAH_ANSWER_PREFIX)
    haystack = ctx.haystack if spec.haystack == "essay" else spec.haystack
    prose = prose_words(haystack, ctx.split) if haystack in PROSE_HAYSTACKS else None
    start = _sentence_start(prose, rng.randrange(len(prose))) if prose is not None else 0
    filler_seed = rng.getrandbits(64)

    def build(size: int, variant: int = 0) -> Draft:
        if haystack == "needle":  # distractors: the same kind of needle with fresh keys and values
            filler = random.Random(filler_seed + variant)
            taken = set(used)
            units = [NIAH_NEEDLE.format(kind=spec.value_type, key=key, value=_random_value(filler, spec.value_type))
                     for key in _distinct(filler, spec.key_type, size, taken)]
            separator = "\n"
        elif haystack == "noise":
            units, separator = _noise_lines(size), "\n"
        else:
            units, separator = _prose_sentences(prose, start, size), " "
        parts, _ = _insert(units, [(d, text) for d, (_, _, text) in zip(depths, needles)])
        context = separator.join(parts)
        return Draft(template.format(kind=kind, context=context, query=query),
                     prefix.format(kind=kind, query=query), list(answers),
                     {"depth": depths[primary], "needle_depths": depths, "haystack": haystack,
                      "haystack_units": size,
                      **({"haystack_start_word": start, "haystack_sha256": prose_fingerprint(haystack, ctx.split)}
                         if prose is not None else {}),
                      **({"filler_variant": variant} if haystack == "needle" else {})})

    # A distractor needle is one coarse unit (~75 tokens with UUIDs); other draws of the distractors
    # tokenize to slightly different lengths, so the length search may pick the closest of a few.
    return build, 0, FILLER_VARIANTS if haystack == "needle" else 1


def _vt_chain(rng: random.Random, hops: int, letters: int) -> tuple[list[str], str, list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    return names, value, chain


def _vt_text(chains: list[list[str]], depths: list[list[float]], sentences: int, value: str, hops: int) -> tuple[str, str]:
    units = _noise_lines(sentences)
    flat = [(100 * d, line) for chain, ds in zip(chains, depths) for d, line in zip(ds, chain)]
    parts, _ = _insert(units, flat)
    prompt = VT_TEMPLATE.format(context="\n".join(parts), query=value)
    return prompt, VT_ANSWER_PREFIX.format(num_v=hops + 1, query=value)


def _vt(spec: VariableTrackingTask, ctx: _Context) -> _Builder:
    rng = random.Random(ctx.seed)

    def chains_and_depths(letters):
        chains, names, values, depths = [], [], [], []
        for _ in range(spec.num_chains):
            chain_names, value, chain = _vt_chain(rng, spec.num_hops, letters)
            chains.append(chain)
            names.append(chain_names)
            values.append(value)
            depths.append(sorted(rng.random() for _ in chain))  # RULER: random sorted positions
        return chains, names, values, depths

    # The solved example in front: 3-letter names, as RULER's few-shot example.
    example_chains, example_names, example_values, example_depths = chains_and_depths(3)
    example_prompt, example_prefix = _vt_text(example_chains, example_depths, VT_EXAMPLE_NOISE_SENTENCES,
                                              example_values[0], spec.num_hops)
    example = f"{example_prompt}{example_prefix}{' '.join(example_names[0])}\n"
    chains, names, values, depths = chains_and_depths(5)

    def build(size: int, variant: int = 0) -> Draft:
        prompt, prefix = _vt_text(chains, depths, size, values[0], spec.num_hops)
        return Draft(f"{example}\n{prompt}", prefix, list(names[0]),
                     {"depth": round(100 * depths[0][0]), "needle_depths": [round(100 * d) for d in depths[0]],
                      "haystack": "noise", "haystack_units": size})

    return build, 0, 1


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _cwe(spec: CommonWordsTask, ctx: _Context) -> _Builder:
    rng = random.Random(ctx.seed)
    pool = list(word_list("cwe"))
    small = ctx.length + ruler_max_new_tokens("cwe") < CWE_SMALL_BELOW
    example_counts, counts = ((3, 1), (6, 1)) if small else ((10, 3), (spec.freq_common, spec.freq_uncommon))
    example_words = rng.sample(pool, 20 if small else 40)
    example_list = example_words[:spec.num_common] * example_counts[0] + \
        example_words[spec.num_common:] * example_counts[1]
    rng.shuffle(example_list)
    example = CWE_TEMPLATE.format(context=_numbered(example_list)) + CWE_ANSWER_PREFIX + " " + \
        _numbered(example_words[:spec.num_common])
    order = rng.sample(pool, len(pool))  # the first `size` words of one permutation: size-monotone
    common = order[:spec.num_common]
    shuffle_seed = rng.getrandbits(64)

    def build(size: int, variant: int = 0) -> Draft:
        if size > len(order):
            raise ValueError(f"cwe at {ctx.length} tokens needs more than the {len(order)} distinct words of the "
                             "word list (RULER falls back to an English word list that is not available offline); "
                             "use a shorter length.")
        words = order[:size]
        listed = words[:spec.num_common] * counts[0] + words[spec.num_common:] * counts[1]
        random.Random(shuffle_seed).shuffle(listed)
        prompt = f"{example}\n{CWE_TEMPLATE.format(context=_numbered(listed))}"
        return Draft(prompt, CWE_ANSWER_PREFIX, list(common),
                     {"haystack": "words", "haystack_units": size, "setting": "small" if small else "large"})

    return build, spec.num_common, 1


@functools.lru_cache(maxsize=None)
def _zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha) for alpha > 1 (partial sum + Euler-Maclaurin tail), as scipy.special.zeta."""
    if alpha <= 1:
        raise ValueError(f"fwe needs alpha > 1; got {alpha}.")
    head = math.fsum(k ** -alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + terms ** -alpha / 2 + alpha * terms ** (-alpha - 1) / 12


def _fwe(spec: FrequentWordsTask, ctx: _Context) -> _Builder:
    rng = random.Random(ctx.seed)
    vocab_size = max(ctx.length // 50, 8)  # RULER: prompt budget // 50
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=spec.word_length)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the most frequent "word" is noise
    zeta = _zeta(spec.alpha)
    shuffle_seed = rng.getrandbits(64)

    def build(size: int, variant: int = 0) -> Draft:
        words = [w for k, w in enumerate(ranked, start=1) for _ in range(int(size * k ** -spec.alpha / zeta))]
        random.Random(shuffle_seed).shuffle(words)
        return Draft(FWE_TEMPLATE.format(context=" ".join(words)), FWE_ANSWER_PREFIX, ranked[1:4],
                     {"haystack": "coded words", "haystack_units": size})

    # Below ~80 words the top counts can tie; RULER's budgets are far above that.
    return build, 80, 1


_BUILDERS = {NiahTask: _niah, VariableTrackingTask: _vt, CommonWordsTask: _cwe, FrequentWordsTask: _fwe}


# -- length fitting ---------------------------------------------------------------------------------


class _Fit:
    """Largest-or-closest haystack size whose prompt has `target` tokens; sizes are cached."""

    def __init__(self, build: Callable[[int], Draft], count: Callable[[Draft], int]):
        self.build, self.count, self.tokens = build, count, {}

    def __call__(self, size: int) -> int:
        if size not in self.tokens:
            self.tokens[size] = self.count(self.build(size))
        return self.tokens[size]

    def search(self, target: int, floor: int, hint: int | None) -> int:
        if self(floor) > target:
            raise _TooShort(self(floor))
        if hint is None or hint <= floor:
            probe = floor + 64
            per_unit = max((self(probe) - self(floor)) / 64, 1e-3)
            hint = floor + int((target - self(floor)) / per_unit)
        size = max(floor, hint)
        # Bracket: lo fits (<= target), hi does not.
        step = max(1, size // 64)
        if self(size) <= target:
            lo, hi = size, size + step
            while self(hi) <= target:
                lo, step = hi, step * 2
                hi = lo + step
        else:
            hi = size
            lo = max(floor, hi - step)
            while self(lo) > target:
                hi, step = lo, step * 2
                lo = max(floor, lo - step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self(mid) <= target:
                lo = mid
            else:
                hi = mid
        return min((lo, hi), key=lambda s: (abs(self(s) - target), s))


def _fit_length(build, floor: int, variants: int, length: int, hint: int | None, count) -> tuple[int, int, int]:
    """(size, tokens, variant) closest to `length`, trying filler variants until one is close enough."""
    best = None
    for variant in range(variants):
        fit = _Fit(functools.partial(build, variant=variant), count)
        size = fit.search(length, floor, hint)
        if best is None or abs(fit(size) - length) < abs(best[1] - length):
            best = (size, fit(size), variant)
        if abs(best[1] - length) <= CLOSE_ENOUGH * length:
            break
    return best


class _TooShort(Exception):
    def __init__(self, tokens: int):
        self.tokens = tokens


# -- the suite ----------------------------------------------------------------------------------


def check_tasks(tasks: Sequence[str] | None) -> list[str]:
    if tasks is None:
        return list(TASK_NAMES)
    if isinstance(tasks, str):
        tasks = [tasks]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        left_out = [t for t in unknown if t in ("qa_1", "qa_2")]
        note = " (qa_1/qa_2 need SQuAD/HotpotQA, which cannot be generated offline)" if left_out else ""
        raise ValueError(f"Unknown RULER task(s) {unknown}{note}; valid tasks: {', '.join(TASK_NAMES)}.")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"Task list has duplicates: {list(tasks)}.")
    return list(tasks)


def prompt_token_count(tokenizer, draft: Draft, chat_template: bool = True) -> int:
    """Tokens of the prompt exactly as `oda eval` encodes it (chat template, then the answer prefix)."""
    from .runner import encode_prompt

    example = EvalExample(id="length-probe", task="probe", answers=["-"], max_new_tokens=1, metric="string_match_all",
                          prompt=draft.prompt, answer_prefix=draft.answer_prefix)
    return len(encode_prompt(example, tokenizer, chat_template=chat_template))


def generate_suite(tokenizer, tasks: Sequence[str] | None = None, lengths: Sequence[int] = (4096,), split: str = "test",
                   n: int = 10, haystack: str = "kjv", seed: int = 0, max_position_embeddings: int | None = None,
                   chat_template: bool = True, tolerance: float = DEFAULT_TOLERANCE,
                   progress: bool = False) -> list[EvalExample]:
    """RULER's synthetic prompts for every (length, task, index), `n` per task and length.

    `lengths` are prompt token counts after the chat template (if `chat_template`) and the answer
    prefix, as ``oda eval --suite jsonl [--chat-template]`` encodes them; each prompt is within
    `tolerance` of its length. `max_position_embeddings` (the model's) rejects lengths that leave
    no room for the task's output cap. Same arguments -> identical examples.
    """
    tasks = check_tasks(tasks)
    check_split(split)
    check_haystack(haystack)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (prompts per task and length) must be a positive integer; got {n!r}.")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1); got {tolerance!r}.")
    integer("seed", seed, minimum=0)
    if max_position_embeddings is not None:
        integer("max_position_embeddings", max_position_embeddings, minimum=1)
    lengths = list(lengths)
    if not lengths:
        raise ValueError("Give at least one length.")
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"Lengths must be positive integers (prompt tokens); got {length!r}.")
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"Lengths have duplicates: {lengths}.")
    if max_position_embeddings is not None:
        for task in tasks:
            cap = ruler_max_new_tokens(task)
            too_long = [length for length in lengths if length + cap > max_position_embeddings]
            if too_long:
                raise ValueError(
                    f"Length(s) {too_long} + the {cap}-token output cap of {task} exceed the model's "
                    f"max_position_embeddings={max_position_embeddings}; the longest usable length for {task} is "
                    f"{max_position_embeddings - cap}.")
    if chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("The tokenizer has no chat template: pass chat_template=False (--no-chat-template) to "
                         "generate plain prompts, and evaluate them without --chat-template.")

    from tqdm.auto import tqdm

    examples = []
    bar = tqdm(total=len(lengths) * len(tasks) * n, desc="RULER prompts", unit="prompt", disable=not progress)
    for length in lengths:
        for task in tasks:
            spec, hint = TASKS[task], None
            for index in range(n):
                ctx = _Context(task, split, length, index, n, haystack, example_seed(seed, split, task, length, index))
                build, floor, variants = _BUILDERS[type(spec)](spec, ctx)
                try:
                    size, tokens, variant = _fit_length(build, floor, variants, length, hint,
                                                        lambda draft: prompt_token_count(tokenizer, draft, chat_template))
                except _TooShort as short:
                    raise ValueError(f"{task} needs at least {short.tokens} prompt tokens (template, needles, "
                                     f"examples); length {length} is too small for it.") from None
                hint, draft = size, build(size, variant)
                if abs(tokens - length) > tolerance * length:
                    raise ValueError(
                        f"{task} at length {length}: the closest prompt has {tokens} tokens "
                        f"({abs(tokens - length) / length:.1%} off, above the {tolerance:.0%} tolerance): one "
                        f"haystack unit is too coarse at this length. Use a longer length or a larger tolerance.")
                cap = ruler_max_new_tokens(task)
                if max_position_embeddings is not None and tokens + cap > max_position_embeddings:
                    # the prompt may be up to `tolerance` longer than `length`, which the check above allowed for
                    raise ValueError(
                        f"{task} at length {length}: the prompt has {tokens} tokens, and with the {cap}-token output "
                        f"cap it passes the model's max_position_embeddings={max_position_embeddings}; use a "
                        f"length of at most {max_position_embeddings - cap - (tokens - length)}.")
                meta = {"split": split, "length": length, "tokens": tokens, "index": index, "seed": seed,
                        "example_seed": ctx.seed, "generator": GENERATOR, "chat_template": chat_template, **draft.meta}
                examples.append(EvalExample(
                    id=f"{task}/{length}/{split}/{index}", task=task, answers=draft.answers,
                    max_new_tokens=cap, metric=default_metric(task), prompt=draft.prompt,
                    answer_prefix=draft.answer_prefix, meta=meta))
                bar.update()
    bar.close()
    return examples


def write_suite(examples: Sequence[EvalExample], out: str | os.PathLike, manifest: dict | None = None) -> list[str]:
    """One folder per length, one ``<task>.jsonl`` per task: ``oda eval --data OUT/<length>`` runs one length.

    Every length folder holds a ``manifest.json`` with each file's record count (`suites.check_generated_file`
    refuses a file it does not vouch for), and OUT a ``manifest.json`` of the whole suite. Everything is written
    into a staging folder first and then published with OUT's manifest moved last (`files.publish_files`): a killed
    run leaves no file that looks complete. A length folder is replaced as a whole."""
    from ..files import publish_files, staging_folder, write_json
    from .suites import SUITE_MANIFEST

    out = os.fspath(out)
    groups: dict[tuple[int, str], list[EvalExample]] = {}
    for example in examples:
        groups.setdefault((example.meta["length"], example.task), []).append(example)
    settings = {**(manifest or {}), "generator": GENERATOR}
    staging = staging_folder(out)
    try:
        counts: dict[int, dict[str, int]] = {}
        for (length, task), group in sorted(groups.items()):
            folder = os.path.join(staging, str(length))
            os.makedirs(folder, exist_ok=True)
            name = f"{task}.jsonl"
            counts.setdefault(length, {})[name] = write_examples(group, os.path.join(folder, name))
        for length, records in counts.items():
            write_json(os.path.join(staging, str(length), SUITE_MANIFEST),
                       {**settings, "length": length, "examples": sum(records.values()), "records": records}, indent=2)
        deviations = [abs(e.meta["tokens"] - e.meta["length"]) / e.meta["length"] for e in examples]
        files = {f"{length}/{name}": count for length, records in sorted(counts.items())
                 for name, count in sorted(records.items())}
        write_json(os.path.join(staging, SUITE_MANIFEST),
                   {**settings, "examples": len(examples), "max_length_deviation": max(deviations, default=0.0),
                    "files": sorted(files), "records": files}, indent=2)
        publish_files(staging, out, marker=SUITE_MANIFEST)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [os.path.join(out, *name.split("/")) for name in files]


# -- CLI ------------------------------------------------------------------------------------------


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "ruler", help="generate RULER's synthetic suite offline (11 tasks) at exact token lengths",
        description="Writes OUT/<length>/<task>.jsonl for `oda eval --suite jsonl --chat-template --data OUT/<length>`.")
    parser.add_argument("--tokenizer", type=base_argument, required=True, help="tokenizer folder or id (its chat template is applied)")
    parser.add_argument("--lengths", nargs="+", type=argument(integer, "lengths", minimum=1), required=True,
                        help="prompt token counts (after chat template and answer prefix)")
    parser.add_argument("--split", choices=SPLITS, default="test", help="seed namespace and prose text (default test)")
    parser.add_argument("--n", type=argument(integer, "n", minimum=1), default=10,
                        help="prompts per task and length (default 10)")
    parser.add_argument("--haystack", choices=HAYSTACKS, default="kjv",
                        help="haystack of RULER's essay tasks: kjv (King James Bible, shipped), noise, or python-docs "
                             "(Debian's python3.X-doc, read from the system) (default kjv)")
    parser.add_argument("--tasks", nargs="+", default=None, help=f"subset of: {' '.join(TASK_NAMES)}")
    parser.add_argument("--seed", type=argument(integer, "seed", minimum=0), default=0)
    parser.add_argument("--max-positions", type=argument(integer, "max-positions", minimum=1), default=None,
                        help="model's max_position_embeddings (default: read from the tokenizer folder's config.json)")
    parser.add_argument("--no-chat-template", action="store_true", help="plain prompts (evaluate without --chat-template)")
    parser.add_argument("--tolerance", type=argument(number, "tolerance", minimum=0, exclusive_minimum=True, maximum=1),
                        default=DEFAULT_TOLERANCE, help="relative length tolerance, in (0, 1) (default 0.02)")
    parser.add_argument("--out", required=True,
                        help="output directory (a length folder written before is replaced as a whole)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run_ruler)


def _max_positions(path: str) -> int | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None
    config = getattr(config, "get_text_config", lambda: config)()
    return getattr(config, "max_position_embeddings", None)


def run_ruler(args) -> int:
    from ..cli_common import UsageError, load_tokenizer
    from .cli import locked_output

    with locked_output(args.out, "this RULER suite"):
        return _run_ruler(args, UsageError, load_tokenizer)


def _run_ruler(args, UsageError, load_tokenizer) -> int:
    from ..files import remove_stale_partials

    out = os.path.abspath(args.out)
    # Staging folders of killed runs into this --out (we hold its lock, so none is in use).
    remove_stale_partials(os.path.dirname(out), [os.path.basename(out)])
    max_positions = args.max_positions if args.max_positions is not None else _max_positions(args.tokenizer)
    if max_positions is None:
        logger.warning("No model config found next to the tokenizer: lengths are not checked against the model's "
                       "max_position_embeddings (pass --max-positions).")
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer)
    started = time.perf_counter()
    try:
        examples = generate_suite(tokenizer, args.tasks, args.lengths, args.split, args.n, args.haystack, args.seed,
                                  max_positions, chat_template=not args.no_chat_template, tolerance=args.tolerance,
                                  progress=not args.no_progress)
    except (ValueError, ImportError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    seconds = time.perf_counter() - started
    # No timing in the manifest: the same command writes the same bytes (a rerun after a kill included).
    from ..known_models import short_name_of

    tokenizer_name = short_name_of(args.tokenizer) or args.tokenizer  # a fetched base by name, not this machine's path
    manifest = {"tokenizer": tokenizer_name, "lengths": args.lengths, "split": args.split, "n": args.n,
                "haystack": args.haystack, "tasks": args.tasks or list(TASK_NAMES), "seed": args.seed,
                "max_position_embeddings": max_positions, "chat_template": not args.no_chat_template,
                "tolerance": args.tolerance, "wonderwords": wonderwords_version()}
    paths = write_suite(examples, args.out, manifest)
    worst = max(abs(e.meta["tokens"] - e.meta["length"]) / e.meta["length"] for e in examples)
    print(f"[oda ruler] {len(examples)} prompts in {len(paths)} files under {args.out} ({seconds:.1f} s; "
          f"max length deviation {worst:.2%})", file=sys.stderr)
    return 0
