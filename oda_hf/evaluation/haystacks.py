"""Haystack text for the offline RULER suite (`ruler_synth`): RULER's noise sentences and real prose.

* ``noise``: RULER's repeated filler, "The grass is green. The sky is blue. The sun is yellow.
  Here we go. There and back again." (one line of five sentences).
* ``kjv``: the King James Bible (public domain), shipped compressed in the package
  (``data/kjv.txt.xz``, one verse a line, ``<reference> <text>`` as Debian's ``bible`` program
  prints it with ``-f``), so no download or apt is needed. `export_kjv` reproduces the file from
  Debian's ``bible-kjv`` + ``bible-kjv-text`` packages; the loader checks its SHA-256.

* ``python-docs``: the prose paragraphs of the Python documentation as Debian's ``python3.X-doc``
  package installs it (``/usr/share/doc/python3.X/html``), read from the system (not shipped); the
  newest installed version is used, and records carry a SHA-256 of the text used.

RULER's own prose haystack is Paul Graham's essays, downloaded from the web; they are not available
offline, and the KJV stands in for them.

Splits by text, so that head-training data and evaluation data never share haystack prose:
the Old Testament (Genesis-Malachi, ~609K words) is the ``train`` split, the Gospels and Acts
(Matthew-Acts, ~108K words) the ``test`` split, and the Epistles and Revelation (Romans-Revelation,
~72K words) the ``dev`` split. The Python docs split by section: library reference, C API,
extending and distribution guides -> ``train`` (~780K words); HOWTOs, FAQ, setup -> ``dev``
(~105K); tutorial, language reference, what's new -> ``test`` (~255K). About 0.5% of the
sentences (boilerplate) occur in more than one section.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import lzma
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from importlib import resources

NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = tuple(s + "." for s in NOISE_LINE.rstrip(".").split(". "))

HAYSTACKS = ("noise", "kjv", "python-docs")
PROSE_HAYSTACKS = ("kjv", "python-docs")
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

PYTHON_DOCS_GLOB = "/usr/share/doc/python3.*/html"
PYTHON_DOCS_SPLIT_SECTIONS = {
    "train": ("library", "c-api", "extending", "distutils", "distributing", "install", "installing"),
    "dev": ("howto", "faq", "using"),
    "test": ("tutorial", "reference", "whatsnew"),
}
#: Paragraphs shorter than this are navigation ("Previous topic", titles), not prose.
PYTHON_DOCS_MIN_WORDS = 6

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
        from ..files import atomic_path

        with atomic_path(path) as temporary, lzma.open(temporary, "wt", encoding="utf-8",
                                                       preset=9 | lzma.PRESET_EXTREME) as f:
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


class _Paragraphs(HTMLParser):
    """Text of the <p> elements of one HTML page, outside <pre>/<script>/<style>."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.open, self.skip, self.buffer, self.paragraphs = 0, 0, [], []

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self.open, self.buffer = self.open + 1, []
        elif tag in ("pre", "script", "style"):
            self.skip += 1

    def handle_endtag(self, tag):
        if tag == "p" and self.open:
            self.open -= 1
            text = " ".join("".join(self.buffer).split())
            if len(text.split()) >= PYTHON_DOCS_MIN_WORDS:
                self.paragraphs.append(text)
        elif tag in ("pre", "script", "style") and self.skip:
            self.skip -= 1

    def handle_data(self, data):
        if self.open and not self.skip:
            self.buffer.append(data)


def python_docs_root() -> str:
    """The newest installed Python HTML documentation (Debian's python3.X-doc)."""
    def version(path):
        return tuple(int(p) for p in re.findall(r"python(\d+)\.(\d+)", path)[-1])

    roots = [r for r in glob.glob(PYTHON_DOCS_GLOB) if re.search(r"python\d+\.\d+/html$", r)]
    if not roots:
        raise FileNotFoundError(f"No Python documentation under {PYTHON_DOCS_GLOB}: the python-docs haystack reads "
                                "Debian's python3.X-doc package, e.g. `apt-get install python3.11-doc`.")
    return max(roots, key=version)


@functools.lru_cache(maxsize=4)
def _python_docs_sections(root: str) -> dict[str, tuple[str, ...]]:
    sections: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "*.html"))):
        parser = _Paragraphs()
        with open(path, encoding="utf-8") as f:
            parser.feed(f.read())
        sections.setdefault(os.path.basename(os.path.dirname(path)), []).extend(parser.paragraphs)
    return {name: tuple(paragraphs) for name, paragraphs in sections.items()}


@functools.lru_cache(maxsize=None)
def prose_words(haystack: str, split: str) -> tuple[str, ...]:
    """The prose of `haystack` for `split` as one stream of whitespace-separated words."""
    check_split(split)
    if check_haystack(haystack) == "kjv":
        books = set(KJV_SPLIT_BOOKS[split])
        words = tuple(w for book, verse in kjv_verses() if book in books for w in verse.split())
    elif haystack == "python-docs":
        sections = _python_docs_sections(python_docs_root())
        words = tuple(w for name in PYTHON_DOCS_SPLIT_SECTIONS[split]
                      for paragraph in sections.get(name, ()) for w in paragraph.split())
    else:
        raise ValueError(f"Haystack {haystack!r} is not prose.")
    if not words:
        raise ValueError(f"No {haystack} text for split {split!r}.")
    return words


@functools.lru_cache(maxsize=None)
def prose_fingerprint(haystack: str, split: str) -> str:
    """SHA-256 of the words `prose_words` gives (records carry it: the Python docs come from the system)."""
    return hashlib.sha256(" ".join(prose_words(haystack, split)).encode("utf-8")).hexdigest()
