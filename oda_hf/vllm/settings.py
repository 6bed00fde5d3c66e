"""The engine-wide ODA settings of a served model: head folder, sinks, window and the default routing.

They travel in the served model's config (``hf_overrides={"oda": {...}}``, see `engine_args`), because vLLM builds
the model in its own worker process from that config alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .requests import RequestRouting, number, parse_policy

MAX_SPAN = 2**24


@dataclass(frozen=True)
class ServingSettings:
    head: str | None
    sinks: int
    window: int
    default_routing: RequestRouting

    @classmethod
    def resolve(cls, head: str | None = None, sinks: int | None = None, window: int | None = None,
                threshold: float | None = None, policy: str | None = None) -> "ServingSettings":
        """Explicit values over the head folder's saved ``oda_config.json``, over its training geometry, over
        s = 4, w = 2048, threshold 0; policy ``head`` with a head and ``local`` without one."""
        saved: dict = {}
        if head is not None:
            from ..known_models import resolve_head
            from ..loading import check_head_folder, read_config_json

            head = os.path.abspath(os.fspath(resolve_head(head)))
            if not os.path.isdir(head):
                raise FileNotFoundError(f"The recall head folder {head} does not exist: give a folder written by "
                                        "save_pretrained (or a shipped head: smollm2, organism).")
            check_head_folder(head)
            trained = read_config_json(head)
            saved = {key: trained.get(key) for key in ("sinks", "window")}
            path = os.path.join(head, "oda_config.json")
            if os.path.isfile(path):
                with open(path) as f:
                    saved.update({k: v for k, v in json.load(f).items() if v is not None})
        pick = lambda value, key, fallback: value if value is not None else (  # noqa: E731
            saved.get(key) if saved.get(key) is not None else fallback)
        sinks, window = pick(sinks, "sinks", 4), pick(window, "window", 2048)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (sinks, window)) or \
                not (0 <= sinks <= MAX_SPAN and 1 <= window <= MAX_SPAN):
            raise ValueError(f"ODA needs integers 0 <= sinks <= 2^24 and 1 <= window <= 2^24; got sinks={sinks!r}, "
                             f"window={window!r}.")
        threshold = number(pick(threshold, "threshold", 0.0), "threshold")
        policy = pick(policy, "policy", "head" if head is not None else "local")
        default = parse_policy(policy, threshold)
        if default.policy == "head" and head is None:
            raise ValueError("policy 'head' needs a recall head: pass head=<folder> (or policy full/local/random/"
                             "schedule for a baseline without one).")
        return cls(head=head, sinks=sinks, window=window, default_routing=default)

    def to_override(self) -> dict:
        return {"head": self.head, "sinks": self.sinks, "window": self.window,
                "threshold": self.default_routing.threshold, "policy": self.default_routing.spec()}

    @classmethod
    def from_override(cls, values: dict | None) -> "ServingSettings":
        if not isinstance(values, dict):
            raise ValueError("This model needs ODA settings in its config (`oda`): build the engine with "
                             "oda_hf.vllm.engine_args(...) or `oda serve`.")
        return cls.resolve(**{key: values.get(key) for key in ("head", "sinks", "window", "threshold", "policy")})
