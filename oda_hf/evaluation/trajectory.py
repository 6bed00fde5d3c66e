"""Routing trajectories (paper Figure 3): generated tokens coloured by the access that produced them.

Output token 0 comes from the Full prefill (grey); output token k >= 1 from routed step k, which
used Full (pink) or Local (blue) as ``decisions[k - 1]`` says. Substrings of the reference answers
are underlined (orange), on every token that overlaps one. Optional prompt context is shown in grey
text before the output.

    tokens = token_strings(tokenizer, record["output_ids"])
    html = render_html(tokens, record["decisions"], answers=record["answers"])
    render_png(tokens, record["decisions"], "trajectory.png", answers=record["answers"])
"""

from __future__ import annotations

import html as _html
import os
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

COLORS = {"prefill": "#dee2e6", "local": "#d0ebff", "full": "#ffdeeb", "prompt": "#f8f9fa"}
UNDERLINE = "#f76707"


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
    """The text each token adds to the decoded output, so that the pieces join to the full text.

    Computed from incremental decodes, which handles byte-level BPE and SentencePiece spacing. A
    character split over several byte tokens is carried by the token that completes it (the
    earlier ones get an empty piece).
    """
    pieces, clean, text = [], "", ""
    for k in range(len(ids)):
        text = tokenizer.decode(list(ids[: k + 1]), skip_special_tokens=False)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its last byte
            pieces.append("")
        elif text.startswith(clean):
            pieces.append(text[len(clean):])
            clean = text
        else:  # the decoder rewrote earlier text (rare): fall back to this token's own decode
            pieces.append(tokenizer.decode([ids[k]], skip_special_tokens=False))
            clean = text
    if pieces and text != clean and text.startswith(clean):
        pieces[-1] += text[len(clean):]  # the output ends inside a character
    return pieces


@dataclass
class TrajectoryToken:
    text: str
    role: str  # "prompt", "prefill", "local" or "full"
    answer: bool = False
    score: float | None = None  # head score q of the step, when known
    step: int | None = None  # routed step (1-based); None for prompt and prefill tokens


def align(tokens: Sequence[str], decisions: Sequence, answers: Sequence[str] = (),
          head_scores: Sequence[float | None] | None = None,
          prompt_tokens: Sequence[str] = ()) -> list[TrajectoryToken]:
    """Pair output tokens with the access that produced them and mark reference-answer overlap.

    `decisions` may be longer than ``len(tokens) - 1`` (a displayed prefix of the output), not shorter.
    """
    if tokens and len(decisions) < len(tokens) - 1:
        raise ValueError(f"{len(tokens)} output tokens need {len(tokens) - 1} routed decisions (the first token "
                         f"comes from prefill); got {len(decisions)}.")
    spans = _answer_spans("".join(tokens), answers)
    out = [TrajectoryToken(t, "prompt") for t in prompt_tokens]
    start = 0
    for k, text in enumerate(tokens):
        end = start + len(text)
        answer = any(a < end and start < b for a, b in spans) if end > start else False
        if k == 0:
            out.append(TrajectoryToken(text, "prefill", answer))
        else:
            score = head_scores[k - 1] if head_scores is not None and k - 1 < len(head_scores) else None
            out.append(TrajectoryToken(text, "full" if decisions[k - 1] else "local", answer, score, k))
        start = end
    return out


def _answer_spans(text: str, answers: Sequence[str]) -> list[tuple[int, int]]:
    lowered, spans = text.lower(), []
    for answer in answers:
        needle = answer.lower()
        if not needle:
            continue
        position = lowered.find(needle)
        while position >= 0:
            spans.append((position, position + len(needle)))
            position = lowered.find(needle, position + 1)
    return spans


def summary_line(items: Sequence[TrajectoryToken]) -> str:
    routed = [t for t in items if t.role in ("local", "full")]
    full = sum(t.role == "full" for t in routed)
    rate = f" ({100 * full / len(routed):.1f}%)" if routed else ""
    return f"Full at {full} of {len(routed)} routed positions{rate}"


# -- HTML --------------------------------------------------------------------------------------------

_CSS = f"""
body {{ font-family: sans-serif; margin: 1.5em; }}
.traj {{ font-family: monospace; white-space: pre-wrap; line-height: 2.0; max-width: 60em; }}
.tok {{ padding: 2px 0; border-radius: 2px; }}
.prompt {{ color: #868e96; }}
.prefill {{ background: {COLORS['prefill']}; }}
.local {{ background: {COLORS['local']}; }}
.full {{ background: {COLORS['full']}; }}
.answer {{ text-decoration: underline; text-decoration-color: {UNDERLINE}; text-decoration-thickness: 3px;
           text-underline-offset: 4px; }}
.legend span {{ margin-right: 1em; padding: 2px 6px; }}
"""


def render_html(tokens: Sequence[str], decisions: Sequence, *, answers: Sequence[str] = (),
                head_scores: Sequence[float | None] | None = None, prompt_tokens: Sequence[str] = (),
                title: str = "Routing trajectory") -> str:
    """A standalone HTML page: one ``<span class="tok ROLE [answer]">`` per token (ROLE: prompt,
    prefill, local, full); hovering a routed token shows its step and head score."""
    items = align(tokens, decisions, answers, head_scores, prompt_tokens)
    spans = []
    for item in items:
        classes = f"tok {item.role}" + (" answer" if item.answer else "")
        tip = "prompt" if item.role == "prompt" else "prefill (Full)" if item.role == "prefill" else \
            f"step {item.step}: {item.role.capitalize()}" + (f", q={item.score:.4g}" if item.score is not None else "")
        spans.append(f'<span class="{classes}" title="{_html.escape(tip)}">{_html.escape(item.text)}</span>')
    legend = ('<div class="legend"><span class="prefill">prefill</span><span class="local">Local</span>'
              '<span class="full">Full</span><span class="answer">reference answer</span></div>')
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{_html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n<h3>{_html.escape(title)}</h3>\n<p>{summary_line(items)}</p>\n"
            f"{legend}\n<div class=\"traj\">{''.join(spans)}</div>\n</body></html>\n")


# -- PNG ---------------------------------------------------------------------------------------------


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text)


def _layout(items: Sequence[TrajectoryToken], columns: int) -> list[tuple[TrajectoryToken, str, int, int]]:
    """(token, displayed text, column, line) per drawn piece; tokens wrap whole when they fit a line."""
    placed, col, line = [], 0, 0
    for item in items:
        parts = item.text.split("\n")
        for i, part in enumerate(parts):
            if i > 0:  # the token contains a line break: mark it, then continue on the next line
                placed.append((item, "↵", col, line))
                col, line = 0, line + 1
            while part:
                width = _width(part)
                if col + width > columns and col > 0 and width <= columns:
                    col, line = 0, line + 1
                piece = part
                while _width(piece) > columns - col:  # longer than a line: hard-split it
                    piece = piece[:-1]
                placed.append((item, piece, col, line))
                col += _width(piece)
                part = part[len(piece):]
    return placed


def _cjk_fonts() -> list[str]:
    """Installed fonts with CJK glyphs (e.g. Debian's fonts-noto-cjk); without one, CJK shows as boxes."""
    from matplotlib import font_manager

    markers = ("CJK", "WenQuanYi", "Source Han", "SimHei", "Heiti", "Droid Sans Fallback")
    return sorted({f.name for f in font_manager.fontManager.ttflist if any(m in f.name for m in markers)})


def render_png(tokens: Sequence[str], decisions: Sequence, path: str | os.PathLike, *, answers: Sequence[str] = (),
               prompt_tokens: Sequence[str] = (), title: str | None = None, columns: int = 90) -> None:
    """The trajectory as a wrapped, coloured token image (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    items = align(tokens, decisions, answers, None, prompt_tokens)
    placed = _layout(items, columns)
    lines = (placed[-1][3] + 1) if placed else 1
    char_w, line_h = 0.1, 0.28  # inches
    width, height = columns * char_w + 0.4, lines * line_h + 0.55  # 0.45 in of header for two title lines
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes([0.2 / width, 0.1 / height, columns * char_w / width, lines * line_h / height])
    ax.set_xlim(0, columns)
    ax.set_ylim(lines, 0)
    ax.axis("off")
    fontsize = char_w * 72 / 0.602  # DejaVu Sans Mono advances 0.602 em per character
    family = ["DejaVu Sans Mono", *_cjk_fonts()]  # matplotlib falls back per glyph along this list
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # glyphs missing from the monospace font (e.g. CJK) render as boxes
        for item, text, col, line in placed:
            width = _width(text)
            if item.role != "prompt":
                ax.add_patch(Rectangle((col, line + 0.08), width, 0.84, facecolor=COLORS[item.role], linewidth=0))
            ax.text(col, line + 0.5, text, family=family, fontsize=fontsize, va="center", ha="left",
                    parse_math=False,  # a token like "$x$" is text, not mathtext
                    color="#868e96" if item.role == "prompt" else "black")
            if item.answer:
                ax.plot([col, col + width], [line + 0.95, line + 0.95], color=UNDERLINE, linewidth=2.2,
                        solid_capstyle="butt")
        heading = (title + " — " if title else "") + summary_line(items)
        fig.suptitle(heading + "\ngrey: prefill · blue: Local · pink: Full · orange underline: reference answer",
                     fontsize=8, x=0.01, y=0.995, ha="left", va="top", parse_math=False)
        from .report import save_figure

        save_figure(fig, path, dpi=110)
    plt.close(fig)


def render_record(record: dict, tokenizer, *, html_path: str | os.PathLike | None = None,
                  png_path: str | os.PathLike | None = None, include_special: bool = False) -> list[TrajectoryToken]:
    """Render one evaluation record (needs ``output_ids``, ``decisions``, ``answers``).

    Special tokens (the terminating EOS) are left out unless `include_special`; the Full-call
    summary then counts the displayed output only, as the paper's panels do.
    """
    ids = list(record["output_ids"])
    tokens = token_strings(tokenizer, ids)
    decisions = list(record["decisions"])
    scores = record.get("head_scores")
    if not include_special:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        keep = [k for k, i in enumerate(ids) if i not in special]
        # Keep each kept token's own decision: token k >= 1 came from routed step k.
        decisions_full = [None] + decisions
        scores_full = [None] + list(scores) if scores is not None else None
        tokens = [tokens[k] for k in keep]
        kept_decisions = [decisions_full[k] for k in keep]
        if keep and keep[0] != 0:
            raise ValueError("The prefill output token is a special token; render with include_special=True.")
        decisions = kept_decisions[1:]
        scores = [scores_full[k] for k in keep][1:] if scores_full is not None else None
    title = f"{record.get('task', '')} {record.get('id', '')} · {record.get('policy', '')}".strip()
    if html_path is not None:
        from ..files import write_text

        write_text(html_path, render_html(tokens, decisions, answers=record.get("answers", ()), head_scores=scores,
                                          title=title))
    if png_path is not None:
        render_png(tokens, decisions, png_path, answers=record.get("answers", ()), title=title)
    return align(tokens, decisions, record.get("answers", ()), scores)


def file_stem(example_id: str, hashed: bool = False) -> str:
    """A file name for an example id: characters other than letters, digits, ``.``, ``-`` and ``_`` become ``_``
    (a ``/``, a NUL or a leading ``.`` in an id must not reach the file system), at most 120 characters; an id that
    had to change otherwise, or any id when `hashed` (the caller's other id has the readable name: ``qa/1`` and
    ``qa_1``), gets a short hash so that two ids never share a file."""
    import hashlib
    import re

    stem = re.sub(r"[^A-Za-z0-9._-]", "_", example_id).lstrip(".") or "_"
    if not hashed and stem == example_id.replace("/", "_") and len(stem) <= 120:
        return stem  # RULER-style ids ("cwe/4096/test/0") keep their readable names
    return f"{stem[:100]}-{hashlib.sha256(example_id.encode()).hexdigest()[:12]}"
