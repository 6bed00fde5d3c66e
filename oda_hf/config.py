"""`OdaConfig`: the routing knobs of an `OdaForCausalLM`, in one place."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from transformers.utils import logging

from .policies import RoutingPolicy, resolve_policy
from .files import write_json
from .validation import MAX_SPAN, integer, number

logger = logging.get_logger(__name__)

ODA_CONFIG_NAME = "oda_config.json"
#: Beside it in a head folder: the sweep `oda calibrate` chose the threshold from (valid for those weights only).
CALIBRATION_NAME = "calibration.json"
ROUTING_KEYS = ("sinks", "window", "threshold", "policy")


def _check_count(name: str, value, minimum: int, meaning: str) -> int:
    try:
        return integer(name, value, minimum=minimum, maximum=MAX_SPAN, meaning=meaning)
    except TypeError as err:  # a float window (2048.0, 2.9) is a value error to the config's users
        raise ValueError(str(err)) from None


@dataclass
class OdaConfig:
    """Local access set and routing rule.

    Args:
        sinks: number of initial (sink) positions Local always reads (``s``, default 4; at most 2**24).
        window: recent window Local reads, *including* the current token (``w``, default 2048; at most
            2**24). The Local workspace holds min(s + w, the request's length) positions.
        threshold: the head's decision threshold ``theta``: Full when ``q > theta`` (default 0).
        policy: ``"head"`` (learned), ``"full"``, ``"local"`` (StreamingLLM), or a `RoutingPolicy`
            instance such as ``RandomPolicy(p, seed)`` / ``SchedulePolicy(k, period)``.
    """

    sinks: int = 4
    window: int = 2048
    threshold: float = 0.0
    policy: str | RoutingPolicy = field(default="head")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        self.sinks = _check_count("sinks", self.sinks, 0, "number of initial positions")
        self.window = _check_count("window", self.window, 1, "recent positions, current token included")
        try:
            self.threshold = number("threshold", self.threshold)
        except TypeError as err:
            raise ValueError(str(err)) from None
        if not isinstance(self.policy, (str, RoutingPolicy)):
            raise ValueError(
                f"`policy` must be 'head', 'full', 'local' or a RoutingPolicy instance; got {type(self.policy).__name__}."
            )
        resolve_policy(self.policy, self.threshold)  # raises on an unknown name

    @property
    def local_span(self) -> int:
        """``s + w``: up to this many positions, Local and Full read the same set."""
        return self.sinks + self.window

    def routing_policy(self) -> RoutingPolicy:
        return resolve_policy(self.policy, self.threshold)

    @classmethod
    def from_kwargs(cls, base: "OdaConfig | None" = None, **kwargs) -> "OdaConfig":
        """A copy of `base` (or the defaults) with the given routing keys replaced."""
        unknown = set(kwargs) - set(ROUTING_KEYS)
        if unknown:
            raise TypeError(f"Unknown OdaConfig keys {sorted(unknown)}; expected some of {list(ROUTING_KEYS)}.")
        values = asdict(base) if base is not None else {}
        if base is not None:
            values["policy"] = base.policy  # keep the policy object itself, not a dict of it
        values.update(kwargs)
        return cls(**values)

    def to_dict(self) -> dict:
        values = asdict(self)
        values["policy"] = self.policy if isinstance(self.policy, str) else repr(self.policy)
        return values

    def save_pretrained(self, save_directory: str) -> None:
        """Write `oda_config.json`. A policy object (RandomPolicy, SchedulePolicy...) is a run-time control:
        it is left out with a warning, and loading then uses the default policy 'head'."""
        values = self.to_dict()
        if not isinstance(self.policy, str):
            del values["policy"]
            logger.warning(
                f"oda_config.json saves sinks, window and threshold but not the policy {self.policy!r}: policy "
                "objects are run-time controls. Loading this folder uses policy='head'; pass policy=... to change it."
            )
        write_json(os.path.join(save_directory, ODA_CONFIG_NAME), values, indent=2)

    @classmethod
    def from_json_file(cls, path: str) -> "OdaConfig":
        """Read `oda_config.json`; errors name the file and what is wrong with it."""
        try:
            with open(path) as f:
                values = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err}). Fix or delete it (it only holds routing "
                             "defaults), or re-save with OdaForCausalLM.save_pretrained.") from err
        if not isinstance(values, dict):
            raise ValueError(f"{path} must hold a JSON object of routing keys; got {type(values).__name__}.")
        unknown = sorted(set(values) - set(ROUTING_KEYS))
        if unknown:
            raise ValueError(f"{path} has unknown keys {unknown}; an oda_config.json holds some of {list(ROUTING_KEYS)}.")
        try:
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
