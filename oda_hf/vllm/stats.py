"""A vLLM stat logger that tells the server how many tokens each finished request returned.

A stop string is matched in vLLM's front end (its output processor), which then aborts the request in the engine; by
then the engine has run a step or more past it, routed and counted in the worker's record like any other, whose
tokens are never returned. The worker cannot tell where the front end cut; the front end's finished-request stats can
(request id, generated tokens). vLLM's ``AsyncLLM`` (what ``oda serve`` runs) loads `ReturnedTokens` through the
``vllm.stat_logger_plugins`` entry point; the server's middleware trims the records with its counts
(`requests.returned_tokens`). The offline ``LLM`` does not load it: `oda_hf.vllm.routing_stats` trims with the outputs.
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase

from .requests import note_returned

_counting = False


def counting() -> bool:
    """Whether this process runs an ODA engine's front end with the logger: every finished request is noted."""
    return _counting


def serves_oda(vllm_config) -> bool:
    from . import ODA_ARCHITECTURES

    architectures = getattr(getattr(getattr(vllm_config, "model_config", None), "hf_config", None),
                            "architectures", None) or []
    return bool(set(architectures) & set(ODA_ARCHITECTURES.values()))


class ReturnedTokens(StatLoggerBase):
    """Per engine: notes each finished request's generated tokens (idle for models other than ODA's)."""

    def __init__(self, vllm_config, engine_index: int = 0):
        global _counting
        self.serves_oda = serves_oda(vllm_config)
        _counting = _counting or self.serves_oda

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if not self.serves_oda or iteration_stats is None:
            return
        for finished in iteration_stats.finished_requests:
            if finished.request_id is not None:
                note_returned(finished.request_id, finished.num_generation_tokens)

    def log_engine_initialized(self):
        pass
