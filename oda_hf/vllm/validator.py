"""The request check vLLM runs at admission: a logits processor that changes nothing but validates ODA's knobs.

Registered under vLLM's ``vllm.logits_processors`` entry point, so ``vllm serve`` and ``vllm.LLM`` load it with the
plugin; a request with a bad ``oda_policy`` / ``oda_threshold``, a misspelled ``oda_`` key, or one asking for the
head from a server without one, fails alone (HTTP 400 / ``ValueError``).
"""

from __future__ import annotations

from vllm.v1.sample.logits_processor import LogitsProcessor

from .requests import is_oda_key
from .settings import check_request_admissible


class OdaRequestValidator(LogitsProcessor):
    """Changes no logits; rejects a request whose ODA knobs are invalid before it reaches the engine."""

    @classmethod
    def validate_params(cls, sampling_params):
        extra = getattr(sampling_params, "extra_args", None) or {}
        if any(is_oda_key(key) for key in extra):
            check_request_admissible(extra)

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        pass
