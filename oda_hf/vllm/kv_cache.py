"""Prefix caching that never shares KV written by a Local step.

vLLM caches every full block of a request, generated tokens included, and a later request with the same token
prefix reuses those blocks as if a Full prefill had written them. Under ODA a decode block holds KV of Local steps,
so the ODA model's attention layers declare `PromptOnlyFullAttentionSpec`, served by `PromptOnlyCachingManager`: the
stock full-attention manager with caching capped at the request's prompt (blocks a Full prefill wrote). A hybrid's
sliding-window layers (Gemma 3) are not restricted by Local, but the hidden states they read at a decode step come
from the branch the step took, so their decode blocks are capped the same way (`PromptOnlySlidingWindowSpec`).
Capping what is stored is not enough: vLLM looks a request up over all its tokens, and a preempted request resumes
through that lookup with its prompt and its output so far. Another request whose prompt equals them would lend it
the blocks of its own Full prefill in place of this request's decode KV, and the replay of its routed steps would
start past them (measured: a preempted Schedule request's tokens off from output 105, exit 0). So the hashes of a
request's blocks past its cacheable prefix are made its own (`_seal_decode_hashes`): a lookup never matches them.
Importing this module registers the pairs with vLLM's KV-cache spec registry, in the worker (which builds the spec)
and in the engine process (which unpickles it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

from vllm.v1.core.kv_cache_utils import BlockHash
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
        _seal_decode_hashes(request, self.block_pool.hash_block_size)
        super().cache_blocks(request, min(num_tokens, cacheable_tokens(request)), retention_interval,
                             replay_boundaries=replay_boundaries)


def _seal_decode_hashes(request, hash_block_size: int) -> None:
    """Make the hashes of `request`'s blocks that reach past its cacheable prefix (`cacheable_tokens`) its own: a
    prefix-cache lookup of this request (its resumption after a preemption) then stops at its prompt. Runs before
    each caching of its blocks (the first is before its first output): the request's block hasher is wrapped once, so
    that every later hash past the prefix is salted as vLLM computes it, and hashes already there are salted in
    place (the list object is kept: connectors may hold it)."""
    if "oda_sealed_from" in request.__dict__:
        return
    first = cacheable_tokens(request) // hash_block_size   # the block holding the first token not to share
    salt = f"oda-decode|{request.request_id}|".encode()
    request.oda_sealed_from = first
    hashes = request.block_hashes
    for index in range(first, len(hashes)):
        hashes[index] = _salted(salt, hashes[index])
    hasher = request._block_hasher
    if hasher is not None:
        request._block_hasher = _sealing_hasher(hasher, first, salt)


def _sealing_hasher(hasher, first: int, salt: bytes):
    """vLLM's per-request block hasher (``hasher(request)`` -> the new full blocks' hashes), with those from block
    `first` on salted. (Holds no reference to the request: vLLM keeps the hasher unbound to avoid a cycle.)"""
    def hash_new_blocks(request) -> list:
        start = len(request.block_hashes)
        return [_salted(salt, block_hash) if start + i >= first else block_hash
                for i, block_hash in enumerate(hasher(request))]
    return hash_new_blocks


def _salted(salt: bytes, block_hash) -> BlockHash:
    return BlockHash(hashlib.sha256(salt + bytes(block_hash)).digest())


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
