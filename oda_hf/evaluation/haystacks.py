"""Haystack text for the offline RULER suite (`ruler_synth`): RULER's noise sentences and real prose.

* ``noise``: RULER's repeated filler, "The grass is green. The sky is blue. The sun is yellow.
  Here we go. There and back again." (one line of five sentences).
* ``kjv``: the King James Bible (public domain), shipped compressed in the package
  (``data/kjv.txt.xz``, one verse a line, ``<reference> <text>`` as Debian's ``bible`` program
  prints it with ``-f``), so no download or apt is needed. `export_kjv` reproduces the file from
  Debian's ``bible-kjv`` + ``bible-kjv-text`` packages; the loader checks its SHA-256.

RULER's own prose haystack is Paul Graham's essays, downloaded from the web; they are not available
offline, and the KJV stands in for them.

Splits by text, so that head-training data and evaluation data never share haystack prose:
the Old Testament (Genesis-Malachi, ~609K words) is the ``train`` split, the Gospels and Acts
(Matthew-Acts, ~108K words) the ``test`` split, and the Epistles and Revelation (Romans-Revelation,
~72K words) the ``dev`` split.
"""

from __future__ import annotations

import functools
import hashlib
import lzma
import os
import re
import shutil
import subprocess
from importlib import resources

NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = tuple(s + "." for s in NOISE_LINE.rstrip(".").split(". "))

HAYSTACKS = ("noise", "kjv")
SPLITS = ("train", "dev", "test")

KJV_RESOURCE = "data/kjv.txt.xz"
#: SHA-256 of the uncompressed text (UTF-8), as `export_kjv` writes it.
KJV_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"
#: The verse range `bible -f` prints: the whole book, Genesis 1:1 to Revelation 22:21.
KJV_RANGE = "Gen1:1-Rev22:21"

# Book abbreviations as Debian's `bible` prints them, in canonical order.
KJV_OLD_TESTAMENT = (
    "Ge", "Exo", "Lev", "Num", "Deu", "Josh", "Jdgs", "Ruth", "1Sm", "2Sm", "1Ki", "2Ki", "1Chr", "2Chr", "Ezra",
    "Neh", "Est", "Job", "Psa", "Prv", "Eccl", "SSol", "Isa", "Jer", "Lam", "Eze", "Dan", "Hos", "Joel", "Amos",
    "Obad", "Jonah", "Mic", "Nahum", "Hab", "Zep", "Hag", "Zec", "Mal",
)
KJV_GOSPELS_ACTS = ("Mat", "Mark", "Luke", "John", "Acts")
KJV_EPISTLES_REVELATION = (
    "Rom", "1Cor", "2Cor", "Gal", "Eph", "Phi", "Col", "1Th", "2Th", "1Tim", "2Tim", "Titus", "Phmn", "Heb", "Jas",
    "1Pet", "2Pet", "1Jn", "2Jn", "3Jn", "Jude", "Rev",
)
KJV_SPLIT_BOOKS = {"train": KJV_OLD_TESTAMENT, "dev": KJV_EPISTLES_REVELATION, "test": KJV_GOSPELS_ACTS}

_REFERENCE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+)$")


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")
    return split


def check_haystack(haystack: str) -> str:
    if haystack not in HAYSTACKS:
        raise ValueError(f"Unknown haystack {haystack!r}; expected one of {HAYSTACKS}.")
    return haystack


def export_kjv(path: str | os.PathLike | None = None, *, program: str = "bible") -> str:
    """The KJV text from Debian's ``bible`` program (apt-get install bible-kjv bible-kjv-text).

    Returns the text (one verse a line) and, with `path`, writes it xz-compressed there: this is
    how the shipped ``data/kjv.txt.xz`` was made. Raises if the text's SHA-256 is not `KJV_SHA256`.
    """
    if shutil.which(program) is None:
        raise FileNotFoundError(f"The {program!r} program was not found: install Debian's packages with "
                                "`apt-get install bible-kjv bible-kjv-text`.")
    text = subprocess.run([program, "-f", KJV_RANGE], check=True, capture_output=True, text=True,
                          encoding="utf-8").stdout
    _check_kjv(text, f"`{program} -f {KJV_RANGE}`")
    if path is not None:
        with lzma.open(path, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
            f.write(text)
    return text


def _check_kjv(text: str, source: str) -> None:
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != KJV_SHA256:
        raise ValueError(f"The KJV text from {source} has SHA-256 {digest}, expected {KJV_SHA256}: "
                         "the suite would not be reproducible with it.")


@functools.lru_cache(maxsize=1)
def kjv_verses() -> tuple[tuple[str, str], ...]:
    """All verses as (book abbreviation, text), in canonical order, from the shipped file."""
    with resources.files(__package__).joinpath(KJV_RESOURCE).open("rb") as raw, \
            lzma.open(raw, "rt", encoding="utf-8") as f:
        text = f.read()
    _check_kjv(text, f"the shipped {KJV_RESOURCE}")
    verses = []
    for number, line in enumerate(text.splitlines(), start=1):
        reference, _, verse = line.partition(" ")
        match = _REFERENCE.match(reference)
        if match is None or not verse:
            raise ValueError(f"{KJV_RESOURCE}:{number}: expected '<Book><chapter>:<verse> <text>'.")
        verses.append((match.group(1), verse))
    return tuple(verses)


@functools.lru_cache(maxsize=None)
def prose_words(haystack: str, split: str) -> tuple[str, ...]:
    """The prose of `haystack` for `split` as one stream of whitespace-separated words."""
    check_split(split)
    if check_haystack(haystack) != "kjv":
        raise ValueError(f"Haystack {haystack!r} is not prose.")
    books = set(KJV_SPLIT_BOOKS[split])
    words = tuple(w for book, verse in kjv_verses() if book in books for w in verse.split())
    if not words:
        raise ValueError(f"No KJV verses for split {split!r} (books {sorted(books)}).")
    return words
