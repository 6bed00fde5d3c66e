"""Prefix caching that never shares KV written by a Local step.

vLLM caches every full block of a request, generated tokens included, and a later request with the same token
prefix reuses those blocks as if a Full prefill had written them. Under ODA a decode block holds KV of Local steps,
so the ODA model's attention layers declare `PromptOnlyFullAttentionSpec`, served by `PromptOnlyCachingManager`: the
stock full-attention manager with caching capped at the request's prompt (blocks a Full prefill wrote). A hybrid's
sliding-window layers (Gemma 3) are not restricted by Local, but the hidden states they read at a decode step come
from the branch the step took, so their decode blocks are capped the same way (`PromptOnlySlidingWindowSpec`).
Importing this module registers the pairs with vLLM's KV-cache spec registry, in the worker (which builds the spec)
and in the engine process (which unpickles it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from .requests import cacheable_tokens


@dataclass(frozen=True, kw_only=True)
class PromptOnlyFullAttentionSpec(FullAttentionSpec):
    """A full-attention layer whose blocks may be prefix-cached only up to the end of the prompt."""


@dataclass(frozen=True, kw_only=True)
class PromptOnlySlidingWindowSpec(SlidingWindowSpec):
    """A sliding-window layer of an ODA hybrid whose blocks may be prefix-cached only up to the end of the prompt."""


class _PromptOnlyCaching:
    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries):
        # Blocks past the prompt hold decode KV (Local or Full, per step): never hash them for reuse.
        super().cache_blocks(request, min(num_tokens, cacheable_tokens(request)), retention_interval,
                             replay_boundaries=replay_boundaries)


class PromptOnlyCachingManager(_PromptOnlyCaching, FullAttentionManager):
    pass


class PromptOnlySlidingWindowManager(_PromptOnlyCaching, SlidingWindowManager):
    pass


_PROMPT_ONLY = {FullAttentionSpec: PromptOnlyFullAttentionSpec, SlidingWindowSpec: PromptOnlySlidingWindowSpec}


def prompt_only_spec(spec):
    """`spec` as its prompt-only variant when it is a plain full-attention or sliding-window spec, else unchanged."""
    variant = _PROMPT_ONLY.get(type(spec))
    if variant is None:
        return spec
    return variant(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.init})


KVCacheSpecRegistry._ensure_registered()   # the built-in specs first: the registry fills itself only when empty
KVCacheSpecRegistry.register(PromptOnlyFullAttentionSpec, PromptOnlyCachingManager,
                             uniform_type_base_spec=FullAttentionSpec)
KVCacheSpecRegistry.register(PromptOnlySlidingWindowSpec, PromptOnlySlidingWindowManager,
                             uniform_type_base_spec=SlidingWindowSpec)
