"""The request checks vLLM runs at admission: logits processors that change nothing but validate ODA's knobs.

`OdaRequestValidator` is registered under vLLM's ``vllm.logits_processors`` entry point, so ``vllm serve`` and
``vllm.LLM`` load it with the plugin: a request with a bad ``oda_policy`` / ``oda_threshold`` or a misspelled ``oda_``
key fails alone (HTTP 400 / ``ValueError``). An engine served without a recall head also gets
`HeadlessEngineValidator` (its config hook adds it), which refuses requests for the head's policies; an engine whose
default policy does not ask its head gets `HeadlessDefaultValidator`, which refuses a threshold without a policy.
"""

from __future__ import annotations

from vllm.v1.sample.logits_processor import LogitsProcessor

from .requests import is_oda_key
from .settings import check_request_admissible


class OdaRequestValidator(LogitsProcessor):
    """Changes no logits; rejects a request whose ODA knobs are invalid before it reaches the engine."""

    serves_head = True
    default_asks_head = True

    @classmethod
    def validate_params(cls, sampling_params):
        extra = getattr(sampling_params, "extra_args", None) or {}
        if any(is_oda_key(key) for key in extra):
            check_request_admissible(extra, cls.serves_head, cls.default_asks_head)

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        pass


class HeadlessEngineValidator(OdaRequestValidator):
    """The check of an engine served without a recall head: also refuses ``oda_policy`` head / budget."""

    serves_head = False


class HeadlessDefaultValidator(OdaRequestValidator):
    """The check of an engine with a head whose default policy does not ask it (``policy="local"``...): also refuses
    ``oda_threshold`` without an ``oda_policy`` (it would go unread)."""

    default_asks_head = False
