"""One validation layer for the values a user gives, on the command line or through the Python API.

Every check raises `ValueError` (a value out of range, not finite, not whole) or `TypeError` (a value of the
wrong kind) with one line that names the value and what is accepted; nothing is coerced silently (2.9 is not
an integer, NaN is not a temperature, ``random::0.5`` is not a policy). `argument` turns a check into an
argparse ``type=`` so the CLI reports the same text as ``oda <command>: error: argument --flag: ...`` with
exit status 2. Kept free of torch imports: building the parser stays instant.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

# 2**24 = 16,777,216 positions: above every released model's context (the longest, 10M tokens), far below
# where a typo such as window=1e9 starts; the Local workspace is sized by the request, not by this bound.
MAX_SPAN = 2**24
# torch.Generator.manual_seed takes at most 64 bits: a larger seed fails deep inside torch ("Overflow when
# unpacking long long"), so it is refused here, naming the range.
MAX_SEED = 2**64 - 1

__all__ = ["MAX_SPAN", "MAX_SEED", "integer", "number", "probability", "seed", "argument", "PolicySpecText", "parse_policy_text", "POLICY_HELP"]


def _show(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _bounds(minimum, maximum, exclusive_minimum: bool = False) -> str:
    low = "" if minimum is None else (f"> {_show(minimum)}" if exclusive_minimum else f">= {_show(minimum)}")
    high = "" if maximum is None else f"<= {_show(maximum)}"
    if low and high:
        return f" {low} and {high}"
    return f" {low or high}" if (low or high) else ""


def _boolean(value) -> bool:
    """A Python, numpy or torch boolean (numpy's and torch's convert to 1/0 like ints; none is a number here)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def integer(name: str, value, minimum: int | None = None, maximum: int | None = None, meaning: str = "") -> int:
    """`value` as an int in [minimum, maximum]: numpy/torch integers are accepted, bools, floats and strings are not."""
    what = f"`{name}` must be an integer{_bounds(minimum, maximum)}" + (f" ({meaning})" if meaning else "")
    if _boolean(value) or not hasattr(value, "__index__"):
        raise TypeError(f"{what}; got {value!r} ({type(value).__name__}).")
    value = value.__index__()
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{what}; got {value}.")
    return value


def number(name: str, value, minimum: float | None = None, maximum: float | None = None,
           exclusive_minimum: bool = False, finite: bool = True, meaning: str = "") -> float:
    """`value` as a float in range; NaN is always refused, infinities unless ``finite=False``."""
    what = (f"`{name}` must be a {'finite ' if finite else ''}number{_bounds(minimum, maximum, exclusive_minimum)}"
            + (f" ({meaning})" if meaning else ""))
    if _boolean(value) or isinstance(value, (str, bytes, bytearray, memoryview)):   # float() would parse text
        raise TypeError(f"{what}; got {value!r} ({type(value).__name__}).")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what}; got {value!r} ({type(value).__name__}).") from None
    except OverflowError:   # an integer past the float range (10**400): infinite for every comparison below
        if finite:
            raise ValueError(f"{what}; got an integer too large for a float.") from None
        value = math.inf if value > 0 else -math.inf
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{what}; got {value}.")
    if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
        raise ValueError(f"{what}; got {value:g}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{what}; got {value:g}.")
    return value


def probability(name: str, value) -> float:
    return number(name, value, minimum=0.0, maximum=1.0, meaning="a probability")


def seed(name: str, value) -> int:
    """`value` as a random seed: an integer in [0, 2**64 - 1], the range torch's generators accept."""
    value = integer(name, value, minimum=0)
    if value > MAX_SEED:
        raise ValueError(f"`{name}` must be an integer >= 0 and <= 2**64 - 1 (the seed range of torch); got {value}.")
    return value


def parse_int(text: str) -> int:
    try:
        if "_" in text:   # Python reads "1_0" as 10: a typo would run as another value
            raise ValueError
        return int(text.strip())
    except ValueError:
        raise ValueError(f"must be an integer; got {text!r}.") from None


def parse_float(text: str) -> float:
    try:
        if "_" in text:
            raise ValueError
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"must be a number; got {text!r}.") from None
    if value == 0.0 and Decimal(text.strip()) != 0:   # 1e-400 (any digits float reads): 0, a different knob
        raise ValueError(f"must be a number a float can hold; {text!r} is too small (it would be read as 0).")
    return value


def argument(check: Callable, name: str = "value", **bounds) -> Callable[[str], object]:
    """An argparse ``type=`` that parses the text (int for `integer`, float otherwise) and applies `check`.

    The error reads ``argument --flag: must be an integer >= 1; got 0.`` (argparse adds the flag)."""
    parse = parse_int if check in (integer, seed) else parse_float

    def convert(text: str):
        try:
            return check(name, parse(text), **bounds)
        except (TypeError, ValueError) as err:
            message = str(err)
            raise argparse.ArgumentTypeError(message.replace(f"`{name}` ", "", 1)) from None

    convert.__name__ = check.__name__
    return convert


# -- routing policies as text: the CLI's --policy and vLLM's per-request `oda_policy` --------------------

POLICY_HELP = "head, full, local, random:P[:SEED], schedule:K:PERIOD or budget:RATE[:THRESHOLD]"


@dataclass(frozen=True)
class PolicySpecText:
    """A parsed policy text: `kind` and its parameters (None where the kind has none)."""

    kind: str
    p: float | None = None
    seed: int | None = None
    k: int | None = None
    period: int | None = None
    threshold: float | None = None


def parse_policy_text(text) -> PolicySpecText:
    """'head', 'full', 'local', 'random:P[:SEED]' (SEED default 42) or 'schedule:K:PERIOD', strictly:
    empty fields (``random::0.5``, ``head:``), fractional counts (``schedule:2.9:3``) and NaN are errors."""
    if not isinstance(text, str):
        raise TypeError(f"a policy must be a string ({POLICY_HELP}); got {text!r}.")
    kind, *fields = text.strip().split(":")
    unknown = ValueError(f"unknown policy {text!r}: use {POLICY_HELP}.")
    if kind in ("head", "full", "local"):
        if fields:
            raise unknown
        return PolicySpecText(kind)
    if kind == "random" and 1 <= len(fields) <= 2:
        try:
            p = probability("random:P", parse_float(fields[0]))
            seed_value = seed("random:P:SEED", parse_int(fields[1])) if len(fields) == 2 else 42
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad policy {text!r}: {err}") from None
        return PolicySpecText("random", p=p, seed=seed_value)
    if kind == "budget" and 1 <= len(fields) <= 2:
        try:
            rate = probability("budget:RATE", parse_float(fields[0]))
            threshold = number("budget:RATE:THRESHOLD", parse_float(fields[1])) if len(fields) == 2 else None
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad policy {text!r}: {err}") from None
        return PolicySpecText("budget", p=rate, threshold=threshold)
    if kind == "schedule" and len(fields) == 2:
        try:
            period = integer("schedule:K:PERIOD", parse_int(fields[1]), minimum=1)
            k = integer("schedule:K", parse_int(fields[0]), minimum=0, maximum=period)
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad policy {text!r}: {err}") from None
        return PolicySpecText("schedule", k=k, period=period)
    raise unknown
