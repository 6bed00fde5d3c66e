"""Model cards generated from the templates in `model_cards/` (installed as `oda_hf.model_cards`).

Values that come from a config (a base model's name, a revision) are plain text, not markdown: a name with a
quote, a newline, ``#``, ``:`` or backticks must not break the card. `render_template(..., plain=names)` puts
each such value in its place escaped for that place: a YAML double-quoted scalar in the front matter, the
inside of a Python string literal in a fenced code block, a code span for a template's `` `${name}` ``, and
backslash-escaped one-line markdown text elsewhere. Other fields (``training``, ``evaluation``: markdown
written by oda_hf) are inserted as they are.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from string import Template

from .files import write_text

_FIELD = re.compile(r"`\$\{(\w+)\}`|\$\{(\w+)\}|\$\$")
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]<>()#+!|~&$])")  # $: the hub renders $$...$$ as math


def _text(value) -> str:
    return "n/a" if value is None else str(value)


def _one_line(text: str) -> str:
    """`text` with line breaks and other non-printable characters written as visible escapes (``\\n``)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _yaml_scalar(text: str) -> str:
    try:
        import yaml
    except ImportError:  # huggingface_hub depends on PyYAML; JSON strings of ASCII are YAML scalars too
        return json.dumps(text)
    return yaml.safe_dump(text, default_style='"', allow_unicode=True, width=float("inf")).strip()


def _python_string_inside(text: str) -> str:
    """The inside of a double-quoted Python string literal whose value is `text`."""
    return "".join("\\" + ch if ch in '"\\' else ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _code_span(text: str, in_table: bool) -> str:
    text = _one_line(text)
    if in_table:
        text = text.replace("|", "\\|")  # GFM splits table cells on | even inside code spans
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _markdown_text(text: str) -> str:
    return _MARKDOWN_SPECIAL.sub(r"\\\1", _one_line(text))


def _render(text: str, fields: dict, plain: set) -> str:
    """`string.Template` substitution (``${name}``, ``$$``) with each plain field escaped for its context."""
    lines, out = text.split("\n"), []
    front = len(lines) > 1 and lines[0] == "---"
    in_code = False
    for number, line in enumerate(lines):
        if front and number > 0 and line == "---":
            front = False
            out.append(line)
            continue
        if not front and line.lstrip().startswith("```"):
            in_code = not in_code

        def place(match, front=front, in_code=in_code, line=line):
            if match.group(0) == "$$":
                return "$"
            name = match.group(1) or match.group(2)
            value = _text(fields[name])  # KeyError for a missing field, as Template.substitute
            if name not in plain:
                return match.group(0).replace("${" + name + "}", value)
            if front:
                return _yaml_scalar(value)
            if in_code:
                return _python_string_inside(value)
            if match.group(1):
                return _code_span(value, in_table=line.lstrip().startswith("|"))
            return _markdown_text(value)

        out.append(_FIELD.sub(place, line))
    return "\n".join(out)


def render_template(name: str, fields: dict, plain=None) -> str:
    """The template `name` with `fields` substituted; fields named in `plain` are escaped (module docstring)."""
    text = resources.files("oda_hf.model_cards").joinpath(name).read_text(encoding="utf-8")
    if plain is None:
        return Template(text).substitute({k: _text(v) for k, v in fields.items()})
    return _render(text, fields, set(plain))


#: Head card fields that hold markdown written by oda_hf; every other field is plain text.
MARKDOWN_FIELDS = ("training", "evaluation", "num_parameters")


def write_head_model_card(head, save_directory: str, extra: dict | None = None) -> str:
    """Write README.md for a saved `RecallHead`; `extra` may give `training` and `evaluation` text."""
    cfg = head.config
    fields = {
        "base_model": cfg.base_model_name_or_path or "unknown",
        "base_revision": cfg.base_model_revision,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.base_vocab_size,
        "head_width": cfg.head_width,
        "input_variant": cfg.input_variant,
        "num_parameters": f"{sum(p.numel() for p in head.parameters()):,}",
        "sinks": cfg.sinks,
        "window": cfg.window,
        "oda_lambda": cfg.oda_lambda,
        "tau_hist": cfg.tau_hist,
        "training": "Training data and procedure were not recorded for this head.",
        "evaluation": "No evaluation results were recorded for this head.",
    }
    fields.update(extra or {})
    path = os.path.join(save_directory, "README.md")
    write_text(path, render_template("recall_head.md", fields, plain=set(fields) - set(MARKDOWN_FIELDS)))
    return path
