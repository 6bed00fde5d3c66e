"""A seeded synthetic long-context language with RULER-style tasks (the ODA "model organism").

The language has two layers:

* **Filler** with only local structure: either RULER's repeated "noise" sentences or short
  "essay" sentences from a small stationary grammar. Every filler token is predictable from the
  last few sentences, so Local attention (sinks + a recent window) predicts it as well as Full.
* **Long-range content** modelled on RULER's 13 tasks (needles, variable chains, word lists,
  facts). Every information-bearing span ends at least ``min_gap`` tokens (default: the Local
  window ``w``) before the question, so only Full attention can answer.

All text is lowercase words separated by single spaces over a closed vocabulary (`VOCAB`), so
one word is one token of the organism tokenizer and positions are known exactly. A prompt of
length ``L`` has exactly ``L`` tokens including the leading ``<bos>``.

Every prompt ends with ``answer :``. The trained target first restates the question (the
restatement is visible to Local in the recent window) and then gives the retrieved values, so the
first output token (produced by Full prefill) is never the answer and every retrieved token is
produced by a routed decoding step.

Splits. Example ``i`` of split ``S`` is generated from a seed derived by SHA-256 from
``(seed, S, task, length, i, attempt)``: the three splits use disjoint seed streams. On top,
the held-out splits have a fixed size (``heldout_size`` per task and length) and precedence
``test > dev > train``: a dev example whose content hash is in the test set, and a train example
whose hash is in the dev or test set, is rejected and redrawn with the next ``attempt``
(deterministically). The content hash is ``sha256(prompt + "\\n" + target)``.

Randomness uses `random.Random` seeded with integers and only ``randrange``/``choice``/
``shuffle``/``sample``, whose outputs are stable across Python 3 releases.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from itertools import product

# --------------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = SPECIAL_TOKENS

TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
SPLITS = ("train", "dev", "test")
HELDOUT_PRECEDENCE = ("test", "dev")  # a split rejects the hashes of every split listed before it

# Token kinds. Prompt tokens: FILLER (predictable text and templates) or CONTENT (random payload: keys,
# values, list words). Target tokens: ANSWER where the token must be retrieved from far back, FILLER
# where it restates the question (visible in the recent window) or is formatting.
FILLER, CONTENT, ANSWER = 0, 1, 2

_PUNCT = (".", ",", ":", "?", "-", "=")
_NOISE = "the grass is green . the sky is blue . the sun is yellow . here we go . there and back again ."

# Essay grammar (stationary, local): agents do things with objects in places.
_AGENTS = ("dog", "cat", "bird", "horse", "farmer", "child", "teacher", "sailor", "fox", "baker", "miller", "hunter")
_OBJECTS = ("apple", "ball", "book", "stone", "boat", "letter", "lamp", "song", "bread", "coin", "basket", "rope")
_PLACES = ("garden", "forest", "river", "village", "market", "house", "field", "hill", "road", "castle", "bridge",
           "harbor")
_ADJECTIVES = ("old", "young", "small", "big", "red", "green", "quiet", "happy", "tired", "brave", "gray", "tall")
_VERBS_T = ("finds", "takes", "carries", "sees", "likes", "gives", "holds", "drops", "paints", "sells")
_VERBS_I = ("sleeps", "runs", "sings", "walks", "waits", "rests", "smiles", "works")
_ADVERBS = ("slowly", "quickly", "often", "again", "today", "quietly")
_PREPS = ("in", "near", "behind", "across")

# qa_1 relations: "the capital of <entity> is <value> ."
_RELATIONS = ("capital", "ruler", "symbol", "flower", "metal", "festival", "river", "song")

# Task templates; {slots} are filled with generated words.
_TEMPLATES = {
    "niah_preamble": "some special magic {kind}s are hidden in the following text . remember them . "
                     "i will ask about them later .",
    "niah_needle": "one of the special magic {kind}s for {key} is {value} .",
    "niah_question": "question : what is the special magic {kind} for {key} ? answer :",
    "niah_target": "the special magic {kind} for {key} is {value}",
    "mv_question": "question : what are all the special magic {kind}s for {key} ? answer :",
    "mv_target": "the special magic {kind}s for {key} are {values}",
    "mq_question": "question : what are the special magic {kind}s for {keys} ? answer :",
    "mq_target": "the special magic {kind}s are : {pairs}",
    "vt_preamble": "memorize and track the chain of variable assignments hidden in the following text .",
    "vt_first": "var {var} = {value} .",
    "vt_hop": "var {var} = var {prev} .",
    "vt_question": "question : find all variables that are assigned the value {value} . answer :",
    "vt_target": "the variables are {vars}",
    "cwe_preamble": "below is a list of words . some of them appear more often than others . "
                    "remember the most common words . the list :",
    "cwe_question": "question : what are the five most common words in the list ? answer :",
    "cwe_target": "the five most common words are {words}",
    "fwe_preamble": "read the following coded text and track the frequency of each coded word . the coded text :",
    "fwe_question": "question : what are the three most frequent coded words in the coded text ? answer :",
    "fwe_target": "the three most frequent coded words are {words}",
    "qa_preamble": "answer the question based on the facts stated in the following text .",
    "qa1_fact": "the {relation} of {entity} is {value} .",
    "qa1_question": "question : what is the {relation} of {entity} ? answer :",
    "qa1_target": "the {relation} of {entity} is {value}",
    "qa2_fact_home": "{person} lives in {place} .",
    "qa2_fact_land": "{place} lies in {land} .",
    "qa2_question": "question : in which land does {person} live ? answer :",
    "qa2_target": "{person} lives in {place} , {place} lies in {land}",
}

_HEX = tuple(f"{i:02x}" for i in range(256))  # uuid pieces; "10".."99" double as number pieces
_DEC = tuple(f"{i}" for i in range(10, 100))
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
N_NAMES = 640


def _template_words() -> set[str]:
    words = set()
    for template in _TEMPLATES.values():
        for word in template.replace("{kind}s", "{kind}").split():
            if not word.startswith("{"):
                words.add(word)
    words.update(("number", "numbers", "uuid", "uuids", "and"))
    return words


def _build_names(reserved: set[str]) -> tuple[str, ...]:
    """`N_NAMES` pronounceable CVCV names (keys, entities, variables, list words), chosen by hash."""
    candidates = ["".join(p) for p in product(_CONSONANTS, _VOWELS, _CONSONANTS, _VOWELS)]
    candidates = [c for c in candidates if c not in reserved]
    candidates.sort(key=lambda c: hashlib.sha256(c.encode()).hexdigest())
    return tuple(sorted(candidates[:N_NAMES]))


_WORDS = (set(_NOISE.split()) | set(_AGENTS) | set(_OBJECTS) | set(_PLACES) | set(_ADJECTIVES) | set(_VERBS_T)
          | set(_VERBS_I) | set(_ADVERBS) | set(_PREPS) | set(_RELATIONS) | set(_PUNCT) | _template_words())
NAMES = _build_names(_WORDS | set(_HEX))

#: The closed vocabulary: special tokens first, then every other word sorted. Token id = index.
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(sorted(_WORDS | set(NAMES) | set(_HEX)))
TOKEN_TO_ID = {token: i for i, token in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (TOKEN_TO_ID[t] for t in SPECIAL_TOKENS)


def vocab_sha256() -> str:
    return hashlib.sha256("\n".join(VOCAB).encode()).hexdigest()


def encode_words(words) -> list[int]:
    """Token ids of a word list or space-separated text (no ``<bos>``); unknown words -> ``<unk>``."""
    if isinstance(words, str):
        words = words.split()
    return [TOKEN_TO_ID.get(w, UNK_ID) for w in words]


# --------------------------------------------------------------------------------------------------
# Examples
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One task instance.

    Positions are token indices of the tokenized prompt *including* the leading ``<bos>`` (index 0),
    i.e. exactly what the model sees. ``length == len(prompt.split()) + 1``.
    """

    task: str
    split: str
    index: int
    length: int
    prompt: str  # space-separated words, without <bos>
    target: str  # the trained continuation, without <eos>
    answers: tuple[str, ...]  # references for the RULER string-match metric
    needle_spans: tuple[tuple[int, int], ...]  # [start, end) of every information-bearing span
    question_start: int  # token index of the first question token
    prompt_kinds: tuple[int, ...] = field(repr=False)  # FILLER/CONTENT per prompt token (incl. <bos>)
    target_kinds: tuple[int, ...] = field(repr=False, default=())  # per target token: ANSWER if retrieved
    attempt: int = 0

    @property
    def content_hash(self) -> str:
        return example_hash(self.prompt, self.target)

    @property
    def metric(self) -> str:
        return TASK_METRIC[self.task]

    def prompt_ids(self) -> list[int]:
        return [BOS_ID] + encode_words(self.prompt)

    def target_ids(self) -> list[int]:
        return encode_words(self.target) + [EOS_ID]

    def min_needle_distance(self) -> int:
        """Smallest ``question_start - last needle token``; >= w means Local cannot see any needle."""
        return min(self.question_start - (end - 1) for _, end in self.needle_spans)


def example_hash(prompt: str, target: str) -> str:
    return hashlib.sha256((prompt + "\n" + target).encode()).hexdigest()


@dataclass
class TrainingSequence:
    """Prompt + target + ``<eos>`` with two loss views (all lists have the sequence's length).

    ``labels`` is the HF convention (-100 everywhere except the target tokens and ``<eos>``);
    ``weights[i]`` weights the loss of predicting ``input_ids[i]`` from ``input_ids[:i]``:
    1 on the target, ``filler_weight`` on predictable prompt text, ``content_weight`` on random
    payload (keys, values, list words), 0 on ``<bos>``. ``retrieved[i]`` is 1 on the target tokens
    that must be retrieved from beyond the Local window (the answer values).
    """

    input_ids: list[int]
    labels: list[int]
    weights: list[float]
    retrieved: list[int]
    task: str
    content_hash: str
    prompt_length: int  # tokens before the first target token (the Full-prefilled part at decode time)


def training_sequence(example: Example, filler_weight: float = 0.1, content_weight: float = 0.0) -> TrainingSequence:
    prompt_ids, target_ids = example.prompt_ids(), example.target_ids()
    kind_weight = {FILLER: filler_weight, CONTENT: content_weight}
    weights = [0.0] + [kind_weight[k] for k in example.prompt_kinds[1:]] + [1.0] * len(target_ids)
    labels = [-100] * len(prompt_ids) + list(target_ids)
    retrieved = [0] * len(prompt_ids) + [int(k == ANSWER) for k in example.target_kinds] + [0]
    return TrainingSequence(prompt_ids + target_ids, labels, weights, retrieved, example.task, example.content_hash,
                            len(prompt_ids))


def copy_sequence(seed: int, length: int) -> TrainingSequence:
    """A training-only induction drill: ``<bos>`` + random key/value words + the same words again.

    The loss covers the repetition only. Dense copying makes the "find the earlier occurrence and
    continue it" circuit form quickly, which needle retrieval then reuses. Never in dev/test.
    """
    rng = random.Random(seed)
    n = length // 2  # the repetition (length - 1 - n words) is never longer than the original
    pool = NAMES + _HEX
    first = [rng.choice(pool) for _ in range(n)]
    words = first + first[: length - 1 - n]
    ids = [BOS_ID] + encode_words(words)
    prompt_length = 1 + n
    labels = [-100] * prompt_length + ids[prompt_length:]
    weights = [0.0] * prompt_length + [1.0] * (length - prompt_length)
    return TrainingSequence(ids, labels, weights, [0] * length, "copy", example_hash(" ".join(words), "copy"),
                            prompt_length)


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


class _Text:
    """Words with a kind per word."""

    def __init__(self):
        self.words: list[str] = []
        self.kinds: list[int] = []

    def add(self, template: str, content: tuple[str, ...] = (), **slots) -> tuple[int, int]:
        """Append a template; slot values named in `content` are CONTENT, everything else FILLER."""
        start = len(self.words)
        for piece in template.split():
            if piece.startswith("{") and piece.endswith("}"):
                name = piece[1:-1]
                value = slots[name]
                kind = CONTENT if name in content else FILLER
                for w in value.split():
                    self.words.append(w)
                    self.kinds.append(kind)
            else:
                self.words.append(piece.format(**slots))
                self.kinds.append(FILLER)
        return start, len(self.words)

    def extend(self, words, kinds) -> None:
        self.words.extend(words)
        self.kinds.extend(kinds)

    def __len__(self):
        return len(self.words)


def _number(rng: random.Random) -> str:
    return " ".join(rng.choice(_DEC) for _ in range(3))


def _uuid(rng: random.Random) -> str:
    a, b, c, d = (rng.choice(_HEX) for _ in range(4))
    return f"{a} {b} - {c} {d}"


def _distinct(rng: random.Random, make, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        value = make(rng)
        if value not in out:
            out.append(value)
    return out


# Fixed local regularities of the essay grammar (deterministic functions of word indices).
_AGENT_ADJ = {a: (_ADJECTIVES[i % 12], _ADJECTIVES[(i + 5) % 12]) for i, a in enumerate(_AGENTS)}
_AGENT_VT = {a: tuple(_VERBS_T[(i + k) % len(_VERBS_T)] for k in (0, 3, 7)) for i, a in enumerate(_AGENTS)}
_AGENT_VI = {a: tuple(_VERBS_I[(i + k) % len(_VERBS_I)] for k in (0, 3)) for i, a in enumerate(_AGENTS)}
_VERB_OBJ = {v: tuple(_OBJECTS[(2 * i + k) % 12] for k in (0, 1, 5)) for i, v in enumerate(_VERBS_T)}
_OBJ_PLACE = {o: (_PLACES[i], _PLACES[(i + 4) % 12]) for i, o in enumerate(_OBJECTS)}


def _essay_sentence(rng: random.Random) -> list[str]:
    agent = rng.choice(_AGENTS)
    form = rng.randrange(4)
    if form == 1:
        return ["the", rng.choice(_AGENT_ADJ[agent]), agent, rng.choice(_AGENT_VI[agent]), rng.choice(_ADVERBS), "."]
    verb = rng.choice(_AGENT_VT[agent])
    obj = rng.choice(_VERB_OBJ[verb])
    place = rng.choice(_OBJ_PLACE[obj])
    if form == 0:
        return ["the", rng.choice(_AGENT_ADJ[agent]), agent, verb, "the", obj, rng.choice(_PREPS), "the", place, "."]
    if form == 2:
        return [rng.choice(_PREPS), "the", place, "the", agent, verb, "the", obj, "."]
    other = rng.choice(_AGENTS)
    return ["the", agent, verb, "the", obj, "and", "the", other, rng.choice(_AGENT_VI[other]), "."]


def _filler(rng: random.Random, kind: str, n_words: int) -> tuple[list[str], list[int]]:
    """`n_words` filler words (the last sentence may be cut) and the sentence-start offsets."""
    words: list[str] = []
    bounds: list[int] = []
    noise = _NOISE.split()
    noise_starts = [0] + [i + 1 for i, w in enumerate(noise) if w == "."][:-1]
    while len(words) < n_words:
        if kind == "noise":
            bounds.extend(len(words) + s for s in noise_starts)
            words.extend(noise)
        elif kind == "essay":
            bounds.append(len(words))
            words.extend(_essay_sentence(rng))
        else:
            raise ValueError(kind)
    bounds = [b for b in bounds if b < n_words] + [n_words]
    return words[:n_words], bounds


def filler_text(seed: int, n_words: int, kind: str = "essay") -> str:
    """Plain filler (no task content), for filler-only language-model loss or Local/Full checks."""
    return " ".join(_filler(random.Random(seed), kind, n_words)[0])


def _haystack(rng, kind: str, n_words: int, inserts: list[list[tuple[str, int]]], min_gap: int, ordered: bool):
    """Filler of `kind` with `inserts` (lists of (word, kind)) placed at sentence starts.

    Every insert ends at least `min_gap` filler words before the end of the haystack. With
    `ordered`, inserts keep their given order; otherwise their order is shuffled. Returns
    (words, kinds, spans) with spans relative to the haystack start, in insert order.
    """
    total = sum(len(x) for x in inserts)
    n_filler = n_words - total
    if n_filler < min_gap:
        raise ValueError("context too short for the inserts and the gap")
    filler, bounds = _filler(rng, kind, n_filler)
    slots = [b for b in bounds if b <= n_filler - min_gap]
    offsets = sorted(rng.choice(slots) for _ in inserts)
    order = list(range(len(inserts)))
    if not ordered:
        rng.shuffle(order)
    words, kinds, spans = [], [], [None] * len(inserts)
    cursor = 0
    for offset, i in zip(offsets, order):
        words += filler[cursor:offset]
        kinds += [FILLER] * (offset - cursor)
        cursor = offset
        spans[i] = (len(words), len(words) + len(inserts[i]))
        words += [w for w, _ in inserts[i]]
        kinds += [k for _, k in inserts[i]]
    words += filler[cursor:]
    kinds += [FILLER] * (len(filler) - cursor)
    return words, kinds, spans


def _segment(template: str, content: tuple[str, ...] = (), **slots) -> list[tuple[str, int]]:
    text = _Text()
    text.add(template, content, **slots)
    return list(zip(text.words, text.kinds))


# --------------------------------------------------------------------------------------------------
# Task generators: each returns (preamble _Text, body words, body kinds, spans in body, question _Text,
# target, answers). The caller assembles and checks the exact length.
# --------------------------------------------------------------------------------------------------

_NIAH = {
    # task: (haystack, key type, value type, n keys, n values, n queries)
    "niah_single_1": ("noise", "word", "number", 1, 1, 1),
    "niah_single_2": ("essay", "word", "number", 1, 1, 1),
    "niah_single_3": ("essay", "word", "uuid", 1, 1, 1),
    "niah_multikey_1": ("essay", "word", "number", 4, 1, 1),
    "niah_multikey_2": ("needle", "word", "number", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuid", "uuid", 1, 1, 1),
    "niah_multivalue": ("essay", "word", "number", 1, 4, 1),
    "niah_multiquery": ("essay", "word", "number", 4, 1, 4),
}


def _niah(task, rng, body_len, min_gap):
    haystack, key_type, value_type, n_keys, n_values, n_queries = _NIAH[task]
    kind = value_type
    make_value = _number if value_type == "number" else _uuid
    make_key = (lambda r: r.choice(NAMES)) if key_type == "word" else _uuid
    pre = _Text()
    pre.add(_TEMPLATES["niah_preamble"], kind=kind)
    needle_len = len(_segment(_TEMPLATES["niah_needle"], kind=kind, key=make_key(rng), value=make_value(rng)))

    if haystack == "needle":
        # The whole haystack is needles with distinct keys; the gold one ends >= min_gap before the end.
        n_needles = body_len // needle_len
        lead = body_len - n_needles * needle_len
        gold_candidates = [i for i in range(n_needles) if body_len - (lead + (i + 1) * needle_len) >= min_gap]
        if not gold_candidates:
            raise ValueError("context too short")
        keys = _distinct(rng, make_key, n_needles)
        values = _distinct(rng, make_value, n_needles)
        gold = rng.choice(gold_candidates)
        words, kinds = _filler(rng, "essay", lead)[0], [FILLER] * lead
        spans = []
        for key, value in zip(keys, values):
            seg = _segment(_TEMPLATES["niah_needle"], ("key", "value"), kind=kind, key=key, value=value)
            spans.append((len(words), len(words) + len(seg)))
            words += [w for w, _ in seg]
            kinds += [k for _, k in seg]
        spans = [spans[gold]]
        keys, values = [keys[gold]], [values[gold]]
        queries = [0]
    else:
        keys = _distinct(rng, make_key, n_keys)
        values = _distinct(rng, make_value, n_keys * n_values)
        needle_keys = [k for k in keys for _ in range(n_values)]
        inserts = [_segment(_TEMPLATES["niah_needle"], ("key", "value"), kind=kind, key=k, value=v)
                   for k, v in zip(needle_keys, values)]
        words, kinds, spans = _haystack(rng, haystack, body_len, inserts, min_gap, ordered=False)
        queries = sorted(rng.sample(range(n_keys), n_queries)) if n_queries > 1 else [rng.randrange(n_keys)]
        if n_keys > 1 and n_queries == 1:
            spans = [spans[queries[0]]]  # distractor needles carry no answer; only the gold one must be far
        if n_queries > 1:
            rng.shuffle(queries)

    question, target = _Text(), _Text()
    if n_values > 1:  # multivalue: one key, its values in order of appearance
        order = sorted(range(len(values)), key=lambda i: spans[i][0])
        ordered_values = [values[i] for i in order]
        question.add(_TEMPLATES["mv_question"], ("key",), kind=kind, key=keys[0])
        target.add(_TEMPLATES["mv_target"].split("{values}")[0], kind=kind, key=keys[0])
        for i, value in enumerate(ordered_values):
            target.add(", {value}" if i else "{value}", ("value",), value=value)
        answers = tuple(ordered_values)
    elif n_queries > 1:  # multiquery: keys in question order, each restated before its value
        qkeys = [keys[q] for q in queries]
        question.add(_TEMPLATES["mq_question"], ("keys",), kind=kind,
                     keys=" , ".join(qkeys[:-1]) + " and " + qkeys[-1])
        target.add(_TEMPLATES["mq_target"].split("{pairs}")[0], kind=kind)
        for i, q in enumerate(queries):
            target.add(", {key} is {value}" if i else "{key} is {value}", ("value",), key=keys[q], value=values[q])
        answers = tuple(values[q] for q in queries)
    else:
        q = queries[0] if haystack != "needle" else 0
        question.add(_TEMPLATES["niah_question"], ("key",), kind=kind, key=keys[q])
        target.add(_TEMPLATES["niah_target"], ("value",), kind=kind, key=keys[q], value=values[q])
        answers = (values[q],)
    return pre, words, kinds, spans, question, target, answers


def _vt(rng, body_len, min_gap, n_hops: int = 4):
    names = rng.sample(NAMES, n_hops + 1)
    value = _number(rng)
    inserts = [_segment(_TEMPLATES["vt_first"], ("var", "value"), var=names[0], value=value)]
    for prev, var in zip(names, names[1:]):
        inserts.append(_segment(_TEMPLATES["vt_hop"], ("var", "prev"), var=var, prev=prev))
    words, kinds, spans = _haystack(rng, "essay", body_len, inserts, min_gap, ordered=True)
    pre, question, target = _Text(), _Text(), _Text()
    pre.add(_TEMPLATES["vt_preamble"])
    question.add(_TEMPLATES["vt_question"], ("value",), value=value)
    target.add(_TEMPLATES["vt_target"], ("vars",), vars=" ".join(names))
    return pre, words, kinds, spans, question, target, tuple(names)


def _list_words_and_gap(rng, body_len, min_gap):
    room = body_len - min_gap - 20  # keep at least 20 list words
    if room < 0:
        raise ValueError("context too short")
    gap = min_gap + rng.randrange(0, 1 + min(16, room))
    n_list = body_len - gap
    return n_list, _filler(rng, "essay", gap)[0]


def _cwe(rng, body_len, min_gap, n_common: int = 5):
    n_list, gap = _list_words_and_gap(rng, body_len, min_gap)
    common_freq = max(4, round(0.06 * n_list))
    n_rest = n_list - n_common * common_freq
    words = rng.sample(NAMES, min(len(NAMES), n_common + n_rest))
    common, uncommon = words[:n_common], words[n_common:]
    counts = [n_rest // len(uncommon) + (1 if i < n_rest % len(uncommon) else 0) for i in range(len(uncommon))]
    if max(counts) >= common_freq:
        raise ValueError("context too long for the cwe word pool")
    items = [w for w in common for _ in range(common_freq)] + [w for w, c in zip(uncommon, counts) for _ in range(c)]
    rng.shuffle(items)
    first_seen = sorted(common, key=items.index)
    pre, question, target = _Text(), _Text(), _Text()
    pre.add(_TEMPLATES["cwe_preamble"])
    question.add(_TEMPLATES["cwe_question"])
    target.add(_TEMPLATES["cwe_target"], ("words",), words=" ".join(first_seen))
    body = items + gap
    kinds = [CONTENT] * len(items) + [FILLER] * len(gap)
    return pre, body, kinds, [(0, len(items))], question, target, tuple(first_seen)


def _fwe(rng, body_len, min_gap, n_top: int = 3, alpha: float = 1.0):
    n_list, gap = _list_words_and_gap(rng, body_len, min_gap)
    n_types = min(len(NAMES), max(12, n_list // 6))
    weights = [1.0 / (r + 1) ** alpha for r in range(n_types)]
    scale = n_list / sum(weights)
    counts = [max(1, int(w * scale)) for w in weights]
    # A unique answer: strictly decreasing top ranks, and a margin of 2 over rank n_top + 1.
    for r in range(n_top - 1, -1, -1):
        counts[r] = max(counts[r], counts[r + 1] + (2 if r == n_top - 1 else 1))
    while sum(counts) > n_list:  # trim the tail (ranks > n_top), dropping words that reach zero
        if len(counts) <= n_top + 2:
            raise ValueError("context too short for fwe")
        counts[-1] -= 1
        if counts[-1] == 0:
            counts.pop()
    deficit = n_list - sum(counts)
    for r in range(n_top):  # spread the rounding deficit over the top ranks (keeps their order)
        counts[r] += deficit // n_top + (1 if r < deficit % n_top else 0)
    words = rng.sample(NAMES, len(counts))
    items = [w for w, c in zip(words, counts) for _ in range(c)]
    rng.shuffle(items)
    top = words[:n_top]
    pre, question, target = _Text(), _Text(), _Text()
    pre.add(_TEMPLATES["fwe_preamble"])
    question.add(_TEMPLATES["fwe_question"])
    target.add(_TEMPLATES["fwe_target"], ("words",), words=" ".join(top))
    body = items + gap
    kinds = [CONTENT] * len(items) + [FILLER] * len(gap)
    return pre, body, kinds, [(0, len(items))], question, target, tuple(top)


def _qa1(rng, body_len, min_gap):
    n_facts = max(2, min(12, body_len // 48))
    n_entities = max(2, (n_facts + 1) // 2)
    entities = rng.sample(NAMES, n_entities + n_facts)
    entities, values = entities[:n_entities], entities[n_entities:]
    pairs = [(e, r) for e in entities for r in _RELATIONS]
    rng.shuffle(pairs)
    pairs = pairs[:n_facts]
    inserts = [_segment(_TEMPLATES["qa1_fact"], ("entity", "value"), relation=r, entity=e, value=v)
               for (e, r), v in zip(pairs, values)]
    words, kinds, spans = _haystack(rng, "essay", body_len, inserts, min_gap, ordered=False)
    gold = rng.randrange(n_facts)
    (entity, relation), value = pairs[gold], values[gold]
    pre, question, target = _Text(), _Text(), _Text()
    pre.add(_TEMPLATES["qa_preamble"])
    question.add(_TEMPLATES["qa1_question"], ("entity",), relation=relation, entity=entity)
    target.add(_TEMPLATES["qa1_target"], ("value",), relation=relation, entity=entity, value=value)
    return pre, words, kinds, [spans[gold]], question, target, (value,)


def _qa2(rng, body_len, min_gap):
    n_chains = max(1, min(6, body_len // 64))
    names = rng.sample(NAMES, 3 * n_chains)
    persons, places, lands = names[:n_chains], names[n_chains:2 * n_chains], names[2 * n_chains:]
    inserts = []
    for person, place, land in zip(persons, places, lands):
        inserts.append(_segment(_TEMPLATES["qa2_fact_home"], ("person", "place"), person=person, place=place))
        inserts.append(_segment(_TEMPLATES["qa2_fact_land"], ("place", "land"), place=place, land=land))
    words, kinds, spans = _haystack(rng, "essay", body_len, inserts, min_gap, ordered=False)
    gold = rng.randrange(n_chains)
    pre, question, target = _Text(), _Text(), _Text()
    pre.add(_TEMPLATES["qa_preamble"])
    question.add(_TEMPLATES["qa2_question"], ("person",), person=persons[gold])
    home, land = _TEMPLATES["qa2_target"].split(" , ")
    target.add(home, ("place",), person=persons[gold], place=places[gold])
    target.add(", " + land, ("land",), place=places[gold], land=lands[gold])  # the restated place is visible
    return pre, words, kinds, spans[2 * gold:2 * gold + 2], question, target, (lands[gold],)


def _generate(task: str, rng: random.Random, length: int, min_gap: int):
    # Word budget: length - 1 (<bos>) = preamble + body + question.
    fixed = _fixed_lengths(task)
    body_len = length - 1 - fixed
    if body_len <= 0:
        raise ValueError(f"length {length} too short for {task}")
    if task in _NIAH:
        return _niah(task, rng, body_len, min_gap)
    return {"vt": _vt, "cwe": _cwe, "fwe": _fwe, "qa_1": _qa1, "qa_2": _qa2}[task](rng, body_len, min_gap)


def _fixed_lengths(task: str) -> int:
    """Preamble + question words of `task` (independent of the random draw)."""
    t = _TEMPLATES
    if task in _NIAH:
        _, key_type, value_type, _, n_values, n_queries = _NIAH[task]
        key_len = 1 if key_type == "word" else 5
        pre = len(t["niah_preamble"].split())
        if n_values > 1:
            q = len(t["mv_question"].split()) - 1 + key_len
        elif n_queries > 1:
            q = len(t["mq_question"].split()) - 1 + n_queries * key_len + (n_queries - 1)
        else:
            q = len(t["niah_question"].split()) - 1 + key_len
        return pre + q
    if task == "vt":
        return len(t["vt_preamble"].split()) + len(t["vt_question"].split()) - 1 + 3
    if task == "cwe":
        return len(t["cwe_preamble"].split()) + len(t["cwe_question"].split())
    if task == "fwe":
        return len(t["fwe_preamble"].split()) + len(t["fwe_question"].split())
    if task == "qa_1":
        return len(t["qa_preamble"].split()) + len(t["qa1_question"].split())
    if task == "qa_2":
        return len(t["qa_preamble"].split()) + len(t["qa2_question"].split())
    raise KeyError(task)


def build_example(task: str, length: int, seed: int, *, min_gap: int = 64, split: str = "train", index: int = 0,
                  attempt: int = 0) -> Example:
    """One example of `task` with a prompt of exactly `length` tokens (incl. ``<bos>``) from `seed`."""
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; expected one of {TASKS}")
    rng = random.Random(seed)
    pre, body, body_kinds, spans, question, target, answers = _generate(task, rng, length, min_gap)
    words = pre.words + body + question.words
    kinds = [FILLER] + pre.kinds + body_kinds + question.kinds
    target_kinds = tuple(ANSWER if k == CONTENT else FILLER for k in target.kinds)
    target = " ".join(target.words)
    if len(words) + 1 != length:
        raise AssertionError(f"{task}: built {len(words) + 1} tokens, wanted {length}")
    offset = 1 + len(pre)
    question_start = offset + len(body)
    needle_spans = tuple((offset + a, offset + b) for a, b in spans)
    return Example(task, split, index, length, " ".join(words), target, tuple(answers), needle_spans,
                   question_start, tuple(kinds), target_kinds, attempt)


def min_length(task: str, min_gap: int = 64) -> int:
    """Smallest prompt length (tokens) this generator supports for `task` (checked by search)."""
    lo = _fixed_lengths(task) + min_gap + 2
    for length in range(lo, lo + 400):
        try:
            for seed in range(8):
                build_example(task, length, seed, min_gap=min_gap)
            return length
        except ValueError:
            continue
    raise ValueError(task)


# --------------------------------------------------------------------------------------------------
# Seeded splits
# --------------------------------------------------------------------------------------------------


def _derive_seed(*parts) -> int:
    digest = hashlib.sha256("|".join(str(p) for p in ("oda-organism-v1",) + parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


class OrganismCorpus:
    """Deterministic train/dev/test examples of the organism language.

    Args:
        seed: master seed; every example is a pure function of (seed, split, task, length, index).
        window: the Local window ``w``; needles end at least ``min_gap = window`` tokens before the
            question unless a smaller ``min_gap`` is asked for (training curricula only).
        heldout_size: dev and test hold exactly this many examples per (task, length).
    """

    def __init__(self, seed: int = 0, window: int = 64, heldout_size: int = 100):
        self.seed = seed
        self.window = window
        self.heldout_size = heldout_size
        self._hashes: dict[tuple, frozenset] = {}

    def example(self, task: str, length: int, split: str = "test", index: int = 0,
                min_gap: int | None = None) -> Example:
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; expected one of {SPLITS}")
        gap = self.window if min_gap is None else min_gap
        if split != "train":
            if gap != self.window:
                raise ValueError("held-out splits always use min_gap = window")
            if not 0 <= index < self.heldout_size:
                raise IndexError(f"{split} holds {self.heldout_size} examples per task and length; got index {index}")
        excluded = self._excluded(split, task, length)
        for attempt in range(1000):
            seed = _derive_seed(self.seed, split, task, length, gap, index, attempt)
            ex = build_example(task, length, seed, min_gap=gap, split=split, index=index, attempt=attempt)
            if ex.content_hash not in excluded:
                return ex
        raise RuntimeError("could not draw a fresh example")  # pragma: no cover

    def examples(self, split: str, tasks=TASKS, lengths=(256,), n: int | None = None) -> list[Example]:
        n = self.heldout_size if n is None else n
        return [self.example(t, L, split, i) for L in lengths for t in tasks for i in range(n)]

    def split_hashes(self, split: str, task: str, length: int) -> frozenset:
        """Content hashes of the whole held-out `split` ('dev' or 'test') for (task, length)
        (empty when the task does not fit in `length` tokens with the window gap)."""
        if split not in HELDOUT_PRECEDENCE:
            raise KeyError(f"only held-out splits {HELDOUT_PRECEDENCE} have a fixed hash set")
        key = (split, task, length)
        if key not in self._hashes:
            try:
                hashes = frozenset(self.example(task, length, split, i).content_hash
                                   for i in range(self.heldout_size))
            except ValueError:  # too short for this task: the split has no examples here
                hashes = frozenset()
            self._hashes[key] = hashes
        return self._hashes[key]

    def _excluded(self, split: str, task: str, length: int) -> frozenset:
        """Hashes `split` must avoid: those of every held-out split of higher precedence."""
        higher = HELDOUT_PRECEDENCE[: HELDOUT_PRECEDENCE.index(split)] if split in HELDOUT_PRECEDENCE \
            else HELDOUT_PRECEDENCE
        out = frozenset()
        for other in higher:
            out |= self.split_hashes(other, task, length)
        return out

    def fingerprint(self, split: str, tasks=TASKS, lengths=(256, 512, 1024)) -> str:
        """SHA-256 over the content hashes of a held-out split (identifies the exact data)."""
        h = hashlib.sha256()
        for L in lengths:
            for t in tasks:
                for x in sorted(self.split_hashes(split, t, L)):
                    h.update(x.encode())
        return h.hexdigest()


TASK_METRIC = {task: ("part" if task.startswith("qa") else "all") for task in TASKS}
