"""`OdaStaticEngine`: ODA decoding with static buffers, device-side routing and (on CUDA) graphs.

One routed step (paper Algorithm 1 and App. "Selected-state execution"), all on the device::

    embed(x_t) -> Local backbone (direct-ring kernel over the workspace) -> h_L
    q = head(h_prev, E, h_L)                    (when the policy runs the head)
    select_full[b] = the policy's rule (q > theta or q not finite; the schedule; precomputed Random draws),
                     False for rows whose history is within s + w (Local == Full there, as on the HF path)
    if any(select_full): Full backbone over the cache's bucket columns (torch.cond: an IF node), for the
                         whole batch (a per-row retry would change shapes, which a captured graph fixes)
    h = select_full ? h_F : h_L   per row;  commit selected KV to cache column n and the ring
    h_prev = h;  n += 1;  valid_count += 1;  step_counter += 1

With conditional nodes (torch >= 2.13) the step reads nothing back to the host; the host only knows
that one token was committed, which is all it needs to pick the length bucket. Without them
(``conditional="host"``), the step runs as three graphs and the host reads ``any(select_full)`` once
between the first two, to replay the Full graph or skip it. `lm_head` and sampling run after the step (outside the
conditional), once, on the selected hidden state.

The engine reuses the HF model's own modules (embedding, decoder layers, norm, rotary, lm_head) and
drives them through `attention.EngineCache` and the ``oda_static_engine`` attention function.
"""

from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace

import torch

from ..cache import workspace_geometry
from ..compat import cache_kwargs
from ..kernels import HAS_TRITON, fused_commit, kernels_interpreted, workspace_slot
from . import routing as device_routing
from .attention import (
    FULL,
    LOCAL,
    PREFILL,
    VERIFY,
    EngineCache,
    FullAttention,
    LocalAttention,
    engine_attention,
    register_engine_attention,
    window_offsets,
)
from .graphs import (
    CONDITIONAL_NODES_MODULE,
    CONDITIONALS,
    DEFAULT_BUCKET_SIZE,
    GRAPH_MODES,
    GraphKey,
    StepGraphs,
    bucket_columns,
    bucket_index,
    conditional,
    cuda_graph_conditionals_available,
)
from .state import EngineState
from .support import (
    DISABLE_ENV,
    HOST_DEPENDENT_ROPE,
    FastPathUnsupported,
    check_model_supported,
    fast_path_disabled,
    rope_types,
    sliding_windows,
)

KERNEL_BACKENDS = ("triton", "sdpa", "reference")


class _StepScratch(SimpleNamespace):
    """Tensors one part of a step leaves for the next (embeds, positions, full_mask, local_hidden, select_full,
    any_full, full_hidden). With captured split steps, one per graph key: the parts' graphs read and write
    exactly these tensors, so the host reads ``any_full`` here after replaying ``route``."""


def _is_oda_model(model) -> bool:
    # Checked by class name, not isinstance: importing oda_hf.modeling here would close an import circle
    # (modeling imports the engine for generate(oda_fast=True)).
    return any(cls.__name__ == "OdaForCausalLM" and cls.__module__ == "oda_hf.modeling" for cls in type(model).__mro__)


class OdaStaticEngine:
    """A static decode engine for one `OdaForCausalLM` (Llama, Mistral, Qwen2, Qwen3; Gemma 3 with its sliding layers).

    Args:
        model: the `OdaForCausalLM` (its recall head and routing config are used; its modules are shared).
        max_length: longest request, prompt (or loaded history) plus generated tokens.
        batch_size: rows per request (fixed: buffers have static shapes).
        bucket_size: graphs are reused within lengths ``ceil(L / bucket_size)`` (paper: 128).
        kernels: attention and commit backend (`attention.LocalAttention`, `attention.FullAttention`):
            ``"triton"`` (direct-ring Local kernel, split-K Full kernel, fused commit; default on CUDA when
            Triton is installed; on CPU only under ``TRITON_INTERPRET=1``, for tiny tests), ``"sdpa"`` (masked
            SDPA + PyTorch commit; default otherwise) or ``"reference"`` (the Local kernel's PyTorch reference,
            SDPA for Full, PyTorch commit).
        graph_mode: ``"cuda"`` (capture CUDA graphs; default on CUDA), ``"eager"`` (default elsewhere),
            or ``"emulate"`` (graph bookkeeping with eager re-execution; for CPU tests).
        conditional: how the step branches to Full: ``"cond"`` (`torch.cond`, a CUDA-graph IF node: nothing
            read back; default with CUDA graphs on torch >= 2.13), ``"host"`` (three graphs per bucket, Local +
            head, Full, commit, with one host read of the decision between them; default with CUDA graphs on
            older torch) or ``"eager"`` (Python ``if`` on the predicate; default without graphs).
        full_dot: with ``kernels="triton"``, whether the Full kernel's two products run as ``tl.dot`` (tensor
            cores; the default) or elementwise (``False``). Measured on an H200: 1.6-1.8x faster per layer at
            16K-32K columns, the always-Full step 4.70 -> 2.95 ms at 32K (Qwen2.5-0.5B shapes).

    Use `generate` for whole requests; `prefill` / `load_history` + `step` drive it token by token.
    The model's attention implementation is switched to the engine's only during a step and restored
    right after, so the same model keeps working on the HF path. `release()` frees buffers and graphs.
    """

    def __init__(self, model, *, max_length: int, batch_size: int = 1,
                 bucket_size: int = DEFAULT_BUCKET_SIZE, kernels: str = "auto", graph_mode: str = "auto",
                 conditional: str = "auto", full_dot: bool | None = None):
        if fast_path_disabled():
            raise FastPathUnsupported(f"The fast path is disabled ({DISABLE_ENV}=1); use model.generate(...), the "
                                      "HF path.")
        if not _is_oda_model(model):
            raise TypeError(f"OdaStaticEngine drives an OdaForCausalLM; got {type(model).__name__}.")
        check_model_supported(model)
        if max_length < 2 or batch_size < 1 or bucket_size < 1:
            raise ValueError(f"need max_length >= 2, batch_size >= 1, bucket_size >= 1; got {max_length}, "
                             f"{batch_size}, {bucket_size}.")
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.sinks, self.window = model.oda_config.sinks, model.oda_config.window
        self.bucket_size = int(bucket_size)
        self.kernels = self._resolve_kernels(kernels)
        self.graph_mode = self._resolve_graph_mode(graph_mode)
        self.conditional = self._resolve_conditional(conditional)
        if full_dot not in (None, True, False):
            raise TypeError(f"full_dot must be None (the default: tl.dot with Triton), True or False; got "
                            f"{full_dot!r}.")
        if full_dot is not None and self.kernels != "triton":
            raise ValueError(f"full_dot selects a variant of the Triton Full kernel; kernels is {self.kernels!r}.")

        config = model.config
        self.decoder = model.get_decoder()
        self.embed = model.get_input_embeddings()
        layers, q_heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
        capacity = bucket_index(max_length, self.bucket_size) * self.bucket_size
        # The workspace never needs more slots than the engine has columns (same access sets, see cache.py).
        self.ws_sinks, self.ws_window = workspace_geometry(self.sinks, self.window, capacity)
        self.state = EngineState.allocate(
            layers=layers, batch=batch_size, kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim,
            hidden=config.hidden_size, capacity=capacity, sinks=self.ws_sinks, window=self.ws_window, dtype=self.dtype,
            device=self.device)
        self.local = LocalAttention(self.kernels, self.ws_sinks, self.ws_window, layers=layers, batch=batch_size,
                                    q_heads=q_heads, head_dim_v=head_dim, dtype=self.dtype, device=self.device)
        self.full = FullAttention(self.kernels, self.state, layers=layers, q_heads=q_heads, head_dim_v=head_dim,
                                  use_dot=full_dot is not False)
        # Sliding-window layers (Gemma 3) read their native window from the cache in both passes.
        self.windows = tuple(sliding_windows(config))
        # Per width W: the constant offsets -(W - 1)..0 from column n, and a buffer (fixed address, for graphs) with
        # the step's window columns, filled once per step by `_window_masks` and read by every sliding layer.
        self._window_offsets = window_offsets(list(self.windows), self.device)
        self._window_columns = {width: torch.zeros_like(offsets) for width, offsets in self._window_offsets.items()}
        self._caches = {mode: EngineCache(self.state, mode, list(self.windows), self._window_columns)
                        for mode in (PREFILL, LOCAL, FULL, VERIFY)}
        self._column_index = torch.arange(capacity, device=self.device)
        self._forced = {flag: torch.tensor(flag, device=self.device) for flag in (True, False)}
        self.graphs = None if self.graph_mode == "eager" else StepGraphs(
            self.graph_mode, self.device, conditional_nodes=self.conditional == "cond")
        self._split_scratch: dict[GraphKey, _StepScratch] = {}  # conditional="host": the captured parts' tensors
        register_engine_attention()

        # Host mirrors of device counters: advanced by one per step, never read back from the device.
        self._length = 0  # committed columns n
        self._steps = 0  # routed steps in this request
        self._exact_mark = 0  # exact decoding: first position drafted since the last verification
        self._used = 0  # columns written since the last reset (what reset clears)
        self._plan = self._policy = None
        self._step_limit = 0
        self._finished_at = None
        self._routing = None
        self._weights = self._weights_fingerprint()
        self._draft_hidden = torch.zeros(batch_size, config.hidden_size, dtype=self.dtype, device=self.device)
        self._draft_score = torch.zeros(batch_size, dtype=torch.float32, device=self.device)
        self._released = False

    # -- configuration -------------------------------------------------------------------------------
    def _resolve_kernels(self, kernels: str) -> str:
        if kernels == "auto":
            return "triton" if self.device.type == "cuda" and HAS_TRITON else "sdpa"
        if kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels must be 'auto' or one of {KERNEL_BACKENDS}; got {kernels!r}.")
        if kernels == "triton" and not (HAS_TRITON and (self.device.type == "cuda" or kernels_interpreted())):
            raise ValueError(
                "kernels='triton' needs Triton and a CUDA device (or, for tests on CPU, TRITON_INTERPRET=1 set before "
                "triton and oda_hf.kernels were imported). Use kernels='sdpa' or 'reference'."
            )
        return kernels

    def _resolve_graph_mode(self, graph_mode: str) -> str:
        if graph_mode == "auto":
            graph_mode = "cuda" if self.device.type == "cuda" else "eager"
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be 'auto' or one of {GRAPH_MODES}; got {graph_mode!r}.")
        if graph_mode == "cuda":
            if self.device.type != "cuda":
                raise ValueError(f"graph_mode='cuda' needs a CUDA model; this one is on {self.device}.")
            host_dependent = [kind for kind in rope_types(self.model.config)
                              if any(name in kind for name in HOST_DEPENDENT_ROPE)]
            if host_dependent:
                raise FastPathUnsupported(
                    f"RoPE type {host_dependent[0]!r} picks its frequencies on the host from the positions, "
                    "which a CUDA graph would freeze: use graph_mode='eager' or the HF path."
                )
        return graph_mode

    def _resolve_conditional(self, conditional: str) -> str:
        if conditional == "auto":
            if self.graph_mode != "cuda":
                return "eager"
            # Conditional nodes keep the whole step on the device; without them (torch < 2.13) the step is split
            # into graphs around one host read of the decision.
            return "cond" if cuda_graph_conditionals_available() else "host"
        if conditional not in CONDITIONALS:
            raise ValueError(f"conditional must be 'auto' or one of {CONDITIONALS}; got {conditional!r}.")
        if conditional == "cond" and self.graph_mode == "cuda" and not cuda_graph_conditionals_available():
            raise FastPathUnsupported(
                f"conditional='cond' with CUDA graphs needs a torch that captures torch.cond as a CUDA-graph "
                f"conditional node ({CONDITIONAL_NODES_MODULE}; torch 2.13 has it, this is {torch.__version__}): "
                "upgrade torch or use conditional='host' (one host read of the decision per step).")
        if conditional == "eager" and self.graph_mode == "cuda":
            raise ValueError("conditional='eager' branches with a Python if inside the step, which a graph would "
                             "freeze: use 'host' or 'cond' with graphs.")
        return conditional

    @property
    def capacity(self) -> int:
        return self.state.capacity

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    @property
    def length(self) -> int:
        """Committed columns of the current request (prompt, left padding included, plus decoded tokens)."""
        return self._length

    @property
    def routed_steps(self) -> int:
        return self._steps

    @property
    def routing(self):
        """`RoutingRecord` of the current (or last) request, read from the device record."""
        if self._plan is None:
            raise RuntimeError("No request yet: call generate(), prefill() or load_history() first.")
        if self._routing is None or self._routing.routed_steps != self._steps:
            self._routing = device_routing.routing_record(self.state, self._steps, self._finished_at)
        return self._routing

    def graph_key(self, length: int | None = None) -> GraphKey:
        """Key of the graph that runs the next step (or a step whose committed length is `length`)."""
        self._require_request()
        length = self._length if length is None else length
        return GraphKey(bucket_index(length + 1, self.bucket_size), self._plan)

    # -- requests ------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the current request (history, workspace, hidden state, counters); keep buffers and graphs."""
        self._require_alive()
        self.state.reset(self._used)
        self._length = self._steps = self._used = self._exact_mark = 0
        self._plan = self._finished_at = self._routing = None

    def _begin_request(self, batch: int, length: int, max_steps: int | None) -> None:
        self._require_alive()
        if batch != self.batch_size:
            raise ValueError(f"This engine was built for batch_size={self.batch_size}; got {batch} rows. Build "
                             "an engine for this batch size (buffers have static shapes).")
        if length + 1 > self.capacity:
            raise ValueError(f"A history of {length} tokens leaves no room in the engine's capacity {self.capacity} "
                             "(max_length rounded up to the bucket size).")
        config = self.model.oda_config
        if (config.sinks, config.window) != (self.sinks, self.window):
            raise ValueError(f"The model's routing now uses sinks={config.sinks}, window={config.window}; this engine "
                             f"was built for {self.sinks}, {self.window}. Build a new engine.")
        weights = self._weights_fingerprint()
        if weights != self._weights:
            self._check_weights_compatible()
            if self.graphs is not None:
                self._clear_graphs()  # captured graphs hold the old parameter addresses
            self._weights = weights
        policy = config.routing_policy()
        plan = device_routing.plan_for(policy, self.model.recall_head is not None)
        self.reset()
        max_steps = self.capacity - length if max_steps is None else min(max_steps, self.capacity - length)
        device_routing.prepare_request(self.state, policy, plan, batch, max_steps)
        self._plan, self._policy, self._step_limit = plan, policy, max_steps
        self._finished_at = torch.full((batch,), -1, dtype=torch.long)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                max_new_tokens: int | None = None) -> torch.Tensor:
        """Start a request with a Full prefill of the prompt; returns the first output's logits ``[B, vocab]``.

        `attention_mask`: 2D, left padding only (the last column must be valid in every row).
        """
        input_ids = input_ids.to(self.device)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length]; got shape {tuple(input_ids.shape)}.")
        batch, length = input_ids.shape
        mask = self._check_mask(attention_mask, batch, length)
        max_steps = None if max_new_tokens is None else max(max_new_tokens - 1, 0)
        self._begin_request(batch, length, max_steps)
        self._used = length  # what reset() clears, even if the prefill fails
        # Same inputs as generate() gives the HF path: a 2D mask and positions counted over valid tokens.
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        out = self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                           **cache_kwargs(self._caches[PREFILL]), use_cache=True)
        hidden = out.last_hidden_state
        self.state.load_prefix(mask.bool(), self.ws_sinks, self.ws_window)
        self.state.selected_hidden.copy_(hidden[:, -1])
        self._length = self._used = self._exact_mark = length
        return self.model.lm_logits(hidden[:, -1:])[:, -1]

    @torch.no_grad()
    def load_history(self, key_values, selected_hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     *, max_steps: int | None = None) -> None:
        """Start a request from KV computed elsewhere (as `OdaCache.load_history` + `begin_request`).

        `key_values`: one ``(keys, values)`` ``[batch, kv_heads, n, head_dim]`` per layer, RoPE applied at
        positions ``0..n-1`` (of valid tokens); `selected_hidden`: ``[batch, hidden]``, the final normed
        hidden state of the last history position.
        """
        layers = self.state.cache_keys.shape[0]
        key_values = iter(key_values)  # consumed layer by layer: a long history need not exist twice
        first = next(key_values, None)
        if first is None:
            raise ValueError("load_history() needs one (keys, values) pair per layer; got none.")
        batch, _, length, _ = first[0].shape
        mask = self._check_mask(attention_mask, batch, length)
        self._begin_request(batch, length, max_steps)
        self._used = length  # what reset() clears if a layer turns out not to fit
        loaded = 0
        for layer, (keys, values) in enumerate(itertools.chain([first], key_values)):
            if layer >= layers or tuple(keys.shape[:3]) != (batch, self.state.cache_keys.shape[2], length):
                self.reset()
                raise ValueError(f"Expected {layers} layers of keys [batch, kv_heads, length] = "
                                 f"{(batch, self.state.cache_keys.shape[2], length)}; layer {layer} does not fit.")
            self.state.cache_keys[layer, :, :, :length] = keys
            self.state.cache_values[layer, :, :, :length] = values
            loaded += 1
        if loaded != layers:
            self.reset()
            raise ValueError(f"Expected one (keys, values) per layer ({layers}); got {loaded}.")
        self.state.load_prefix(mask.bool(), self.ws_sinks, self.ws_window)
        self.state.selected_hidden.copy_(selected_hidden)
        self._length = self._used = self._exact_mark = length

    def _check_mask(self, attention_mask, batch: int, length: int) -> torch.Tensor:
        if attention_mask is None:
            return torch.ones(batch, length, dtype=torch.long, device=self.device)
        mask = attention_mask.to(self.device).long()
        if tuple(mask.shape) != (batch, length):
            raise ValueError(f"attention_mask must be 2D [batch, length] = {(batch, length)}; got {tuple(mask.shape)}.")
        if not bool(mask[:, -1].all()):
            raise ValueError("The static engine supports left padding only: the last column must be a real token "
                             "in every row (pad on the left, e.g. tokenizer.padding_side='left').")
        return mask

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, decoding: torch.Tensor | None = None) -> torch.Tensor:
        """One routed step for the current tokens (``[B]`` or ``[B, 1]``); returns logits ``[B, vocab]``.

        `decoding` (bool ``[B]``, optional): False for rows that stopped (their token is padding): they take Local."""
        self._require_request()
        if self._steps >= self._step_limit:  # e.g. Random's per-step decisions were drawn for this many steps
            raise RuntimeError(f"This request was started for {self._step_limit} routed steps (the engine's capacity "
                               "or max_new_tokens - 1); start it with a larger limit.")
        self.state.input_ids.copy_(input_ids.reshape(self.batch_size, 1))
        if decoding is not None:
            self.state.decoding.copy_(decoding.reshape(self.batch_size))
        key = self.graph_key()
        try:
            if self.graphs is not None and not self._captured(key):
                self._capture(key)
            if self._split(key.plan):
                self._split_step(key)
            elif self.graphs is None:
                self._run_step(key)
            else:
                self.graphs.replay(key)
        except BaseException:
            self._plan = None  # a half-run step may have written the ring: the request cannot continue
            raise
        self._length += 1
        self._used = max(self._used, self._length)
        self._steps += 1
        return self.model.lm_logits(self.state.selected_hidden[:, None])[:, -1]

    # -- graphs --------------------------------------------------------------------------------------
    def capture_buckets(self, final_length: int) -> list[GraphKey]:
        """Capture now every graph the steps up to `final_length` committed columns will replay.

        Keeps captures out of timed regions (otherwise a capture happens at the first step of each
        bucket). Each capture is a state transaction, so the request's history is unchanged. Returns
        the keys captured (none without graphs).
        """
        self._require_request()
        if self.graphs is None or final_length <= self._length:
            return []
        final_length = min(final_length, self.capacity)
        first, last = bucket_index(self._length + 1, self.bucket_size), bucket_index(final_length, self.bucket_size)
        keys = [GraphKey(bucket, self._plan) for bucket in range(first, last + 1)]
        keys = [key for key in keys if not self._captured(key)]
        for key in keys:
            self._capture(key)
        return keys

    def _capture(self, key: GraphKey) -> None:
        """Warm both branches up, then capture; each run is a transaction that restores what it touched.

        Every trial starts from the committed state (a second warm-up must not see the first one's
        advanced position), and none of them advances the request's history.
        """
        if self._split(key.plan):
            self._capture_split(key)
            return
        for force in ((True, False) if key.plan.run_local else (None,)):
            with self.state.preserved(self._length, self.ws_sinks, self.ws_window):
                self.graphs.warm_up(lambda: self._run_step(key, force=force))
        with self.state.preserved(self._length, self.ws_sinks, self.ws_window):
            self.graphs.capture(key, lambda: self._run_step(key))

    def _clear_graphs(self) -> None:
        self.graphs.clear()
        self._split_scratch.clear()

    def _captured(self, key: GraphKey) -> bool:
        return (key.with_part("route") if self._split(key.plan) else key) in self.graphs

    def _split(self, plan) -> bool:
        """Whether steps of `plan` run as route/full/finish parts (conditional="host" and a branching plan)."""
        return self.conditional == "host" and self._branches(plan)

    # -- the step ------------------------------------------------------------------------------------
    def _run_step(self, key: GraphKey, force: bool | None = None) -> None:
        with torch.no_grad(), engine_attention(self.model.config):
            self._step_body(key, force)

    def _step_body(self, key: GraphKey, force: bool | None) -> None:
        """Device work of one routed step, one body (``conditional`` "eager" or "cond"). `force` pins the branch
        (warm-up only)."""
        step = _StepScratch()
        self._route(key, step)
        if self._branches(key.plan):
            pred = step.any_full if force is None else self._forced[force]
            step.full_hidden = conditional(self.conditional, pred, self._full_branch, self._skip_branch,
                                           (step.embeds, step.positions, step.full_mask, *step.window_masks))
        elif not key.plan.never_full:
            step.full_hidden = self._full_branch(step.embeds, step.positions, step.full_mask, *step.window_masks)
        self._finish(key, step)

    @staticmethod
    def _branches(plan) -> bool:
        """Whether the step's Full pass depends on a device decision (else it always or never runs)."""
        return plan.run_local and not plan.never_full

    def _route(self, key: GraphKey, step: "_StepScratch") -> None:
        """Embed, Local pass, head, decision and its record; leaves the Full pass's inputs in `step`."""
        state, plan = self.state, key.plan
        columns = bucket_columns(key.bucket, self.bucket_size, self.capacity)
        self._caches[FULL].full_columns = columns
        step.embeds = embeds = self.embed(state.input_ids)
        step.positions = state.valid_count[:, None].clone()  # 0-based position of the current valid token
        full_mask = (state.column_valid[:, :columns] & (self._column_index[:columns] <= state.cache_position))
        step.full_mask = full_mask[:, None, None, :]
        step.window_masks = self._window_masks()
        scores = None
        if plan.run_local:
            step.local_hidden = self._decode(LOCAL, embeds, step.positions, oda_local=self.local,
                                             oda_valid_count=state.valid_count,
                                             oda_local_mask=self.local.visibility(state.valid_count),
                                             **self._window_kwargs(step.window_masks))
        if plan.run_head:
            scores = self.model.recall_head(state.selected_hidden, embeds[:, -1], step.local_hidden)
        select_full = device_routing.decide(state, self._policy, plan, scores)
        # Rows whose history is within s + w read the same positions either way: they take Local (as on the
        # HF path). The head still runs here (static shapes), but its score is not recorded on steps where
        # every row is in the window, where the HF path skips it.
        in_window = state.valid_count + 1 <= self.sinks + self.window
        if plan.run_local:
            select_full = select_full & ~in_window & state.decoding   # a stopped row's token is padding
            if scores is not None:
                scores = torch.where(in_window.all(), torch.full_like(scores, float("nan")), scores)
        device_routing.record(state, select_full, scores, in_window)
        step.select_full, step.any_full = select_full, select_full.any()

    def _full_part(self, key: GraphKey, step: "_StepScratch") -> None:
        """The Full pass of a split step (conditional="host"), run only when some row recalls."""
        self._caches[FULL].full_columns = bucket_columns(key.bucket, self.bucket_size, self.capacity)
        step.full_hidden = self._full_branch(step.embeds, step.positions, step.full_mask, *step.window_masks)

    def _finish(self, key: GraphKey, step: "_StepScratch") -> None:
        """Per row, the selected hidden state; commit its KV; advance the counters."""
        plan = key.plan
        if not plan.run_local:
            hidden = step.full_hidden
        elif plan.never_full or getattr(step, "full_hidden", None) is None:  # (a split step before any Full pass)
            hidden = step.local_hidden
        else:  # a split step whose Full pass did not run reads a stale full_hidden here, for rows it does not select
            hidden = torch.where(step.select_full[:, None], step.full_hidden, step.local_hidden)
        self._commit(step.select_full, with_full=not plan.never_full)
        self.state.selected_hidden.copy_(hidden)
        self.state.advance(step.select_full)

    def _split_step(self, key: GraphKey) -> None:
        """A step as parts, reading the decision on the host between them (conditional="host")."""
        if self.graphs is None:
            self._run_parts(key, _StepScratch())
            return
        step = self._split_scratch[key]  # the tensors the captured parts read and write
        self.graphs.replay(key.with_part("route"))
        if bool(step.any_full):  # the one host sync of the step
            self.graphs.replay(key.with_part("full"))
        self.graphs.replay(key.with_part("finish"))

    def _run_parts(self, key: GraphKey, step: "_StepScratch", full: bool | None = None) -> None:
        """Route, the Full pass (if `full`; None: if some row recalls, read on the host), finish; eagerly."""
        with torch.no_grad(), engine_attention(self.model.config):
            self._route(key, step)
            if bool(step.any_full) if full is None else full:
                self._full_part(key, step)
            self._finish(key, step)

    def _capture_split(self, key: GraphKey) -> None:
        """Warm the three parts up (Full included), then capture them in order, each reading the last's outputs."""
        with self.state.preserved(self._length, self.ws_sinks, self.ws_window):
            self.graphs.warm_up(lambda: self._run_parts(key, _StepScratch(), full=True))
        step = self._split_scratch[key] = _StepScratch()
        with self.state.preserved(self._length, self.ws_sinks, self.ws_window):
            for part, body in (("route", self._route), ("full", self._full_part), ("finish", self._finish)):
                self.graphs.capture(key.with_part(part), functools.partial(self._run_part, body, key, step))

    def _run_part(self, body, key: GraphKey, step: "_StepScratch") -> None:
        with torch.no_grad(), engine_attention(self.model.config):
            body(key, step)

    def _decode(self, mode: str, embeds, positions, **attention_kwargs) -> torch.Tensor:
        return self._decoder_hidden(mode, embeds, positions, **attention_kwargs)[:, -1]

    def _full_branch(self, embeds, positions, full_mask, *window_masks):
        # A fresh tensor: torch.cond outputs must not alias inputs or buffers.
        return self._decode(FULL, embeds, positions, oda_full=self.full, oda_full_mask=full_mask,
                            **self._window_kwargs(window_masks)).clone()

    def _skip_branch(self, embeds, *unused):
        return embeds.new_zeros(embeds.shape[0], embeds.shape[-1])

    def _window_masks(self) -> tuple[torch.Tensor, ...]:
        """Per sliding-window width W (ascending), bool ``[B, 1, 1, W]``: which of columns ``[n - W + 1, n]`` the
        current token sees (those at or after column 0 and not prompt padding; column n is the token itself). Also
        fills the step's window columns (indices below 0 read column 0, hidden by the mask)."""
        state, masks = self.state, []
        for width, offsets in self._window_offsets.items():
            columns = state.cache_position + offsets
            self._window_columns[width].copy_(columns.clamp(min=0))
            visible = (columns >= 0)[None, :] & state.column_valid.index_select(1, self._window_columns[width])
            masks.append(visible[:, None, None, :])
        return tuple(masks)

    def _window_kwargs(self, window_masks) -> dict:
        """The attention function's arguments for sliding-window layers (none for a full-attention model)."""
        if not self._window_offsets:
            return {}
        return {"oda_windows": self.windows, "oda_window_masks": dict(zip(self._window_offsets, window_masks))}

    def _commit(self, select_full: torch.Tensor, with_full: bool) -> None:
        state = self.state
        if self.kernels == "triton":
            fused_commit(state.cache_keys, state.cache_values, state.ws_keys, state.ws_values,
                         state.ws_keys[:, :, :, -1:], state.ws_values[:, :, :, -1:],
                         state.full_keys if with_full else None, state.full_values if with_full else None,
                         select_full, state.cache_position, state.valid_count, self.ws_sinks, self.ws_window,
                         full_already_written=True)
        else:
            state.commit(select_full, with_full, self.ws_sinks, self.ws_window)

    # -- exact decoding (oda_hf.exact): Local drafts and Full verification passes, one row -----------------
    def draft_step(self, token: int, run_head: bool) -> tuple[torch.Tensor, float | None]:
        """A Local step on `token` at the next position, not yet committed: ``(Local hidden [1, d], score)``.

        The score is the recall head's (None when `run_head` is False or the history is within s + w, where
        Local reads what Full reads). `accept_draft` commits the step's Local KV; anything else drops it.
        On CUDA the step replays a captured graph (one per `run_head`), as routed steps do.
        """
        self._require_exact_request()
        if self._length + 1 > self.capacity:
            raise ValueError(f"The engine's capacity of {self.capacity} columns is full.")
        in_window = self._length + 1 <= self.sinks + self.window
        run_head = run_head and not in_window
        self.state.input_ids.fill_(int(token))
        key = GraphKey(0, device_routing.StepPlan(("exact-draft",), run_local=True, run_head=run_head, never_full=True))
        if self.graphs is None:
            self._draft_body(run_head)
        else:  # the body writes only the workspace's current slot and the draft scratch: no transaction needed
            if key not in self.graphs:
                self.graphs.warm_up(lambda: self._draft_body(run_head))
                self.graphs.capture(key, lambda: self._draft_body(run_head))
            self.graphs.replay(key)
        return self._draft_hidden, float(self._draft_score[0]) if run_head else None

    def _draft_body(self, run_head: bool) -> None:
        with torch.no_grad(), engine_attention(self.model.config):
            state = self.state
            embeds = self.embed(state.input_ids)
            hidden = self._decode(LOCAL, embeds, state.valid_count[:, None].clone(), oda_local=self.local,
                                  oda_valid_count=state.valid_count,
                                  oda_local_mask=self.local.visibility(state.valid_count),
                                  **self._window_kwargs(self._window_masks()))
            self._draft_hidden.copy_(hidden)
            if run_head:
                self._draft_score.copy_(self.model.recall_head(state.selected_hidden, embeds[:, -1], hidden))

    def accept_draft(self) -> None:
        """Commit the last `draft_step`'s Local KV at the next position; its hidden state becomes the selected one."""
        self._require_exact_request()
        local_only = self._forced[False].expand(self.batch_size)
        self._commit(local_only, with_full=False)
        self.state.selected_hidden.copy_(self._draft_hidden)
        self.state.advance(local_only)
        self._length += 1
        self._used = max(self._used, self._length)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """One Full pass over `tokens` ``[m]`` at positions ``start...``: their Full KV goes into cache columns
        ``[start, start + m)``; returns their final hidden states ``[m, d]``. Follow with `keep_verified`."""
        self._require_exact_request()
        tokens = tokens.reshape(1, -1).to(self.device)
        count = tokens.shape[1]
        if not 0 <= start <= self._length or start + count > self.capacity:
            raise ValueError(f"A verification of {count} tokens at position {start} does not fit: {self._length} "
                             f"positions are committed, the capacity is {self.capacity}.")
        stop = start + count
        positions = torch.arange(start, stop, device=self.device)[None]
        distance = positions[0][:, None] - self._column_index[:stop][None, :]  # query position - key column
        causal = (distance >= 0)[None, None]  # [1, 1, m, stop]
        windows = tuple(causal & (distance < width) for width in self._window_offsets)  # sliding layers' bands
        self._caches[VERIFY].verify_start = start
        with engine_attention(self.model.config):
            hidden = self._decoder_hidden(VERIFY, self.embed(tokens), positions, oda_full_mask=causal,
                                          **self._window_kwargs(windows))
        self._used = max(self._used, stop)
        return hidden[0]

    def keep_verified(self, length: int, selected_hidden: torch.Tensor) -> None:
        """After `verify`: keep positions ``[0, length)`` (their KV is Full's), drop the rest, and put the
        workspace back as that history's; `selected_hidden` ``[d]`` is the last kept position's Full hidden."""
        self._require_exact_request()
        state = self.state
        touched = max(self._length, length)  # drafts wrote ring slots of [mark, _length); the pass may add one
        if not self._exact_mark < length <= min(touched, self.capacity):
            raise ValueError(f"keep_verified(length={length}) must keep a verified position in "
                             f"({self._exact_mark}, {min(touched, self.capacity)}].")
        state.cache_position.fill_(length)
        state.valid_count.fill_(length)
        # Each touched slot gets the latest position below `length` that maps to it: the position itself
        # (its Full KV now) or one a ring's turn or more away (drafts longer than the ring overwrite their own
        # slots; the cache still has every position). Slots a history of `length` does not fill stay masked.
        position = torch.arange(self._exact_mark, touched, device=self.device)
        ring = max(self.ws_window - 1, 1)
        in_ring = position >= self.ws_sinks
        source = torch.where(in_ring, position + ring * torch.div(length - 1 - position, ring, rounding_mode="floor"),
                             position)
        slot = workspace_slot(position, self.ws_sinks, self.ws_window)
        keep = (slot >= 0) & torch.where(in_ring, source >= self.ws_sinks, position < length)
        slot, source = slot[keep], source[keep]
        for cache, workspace in ((state.cache_keys, state.ws_keys), (state.cache_values, state.ws_values)):
            workspace[:, 0, :, slot] = cache[:, 0, :, source]
        state.selected_hidden.copy_(selected_hidden.reshape(1, -1))
        self._length = self._exact_mark = length

    def _decoder_hidden(self, mode: str, embeds, positions, **attention_kwargs) -> torch.Tensor:
        out = self.decoder(inputs_embeds=embeds, position_ids=positions, **cache_kwargs(self._caches[mode]),
                           use_cache=True, oda_mode=mode, **attention_kwargs)
        return out.last_hidden_state

    def _require_exact_request(self) -> None:
        self._require_request()
        if self.batch_size != 1:
            raise ValueError(f"Exact decoding runs one row at a time: build the engine with batch_size=1 (this one "
                             f"has {self.batch_size}).")

    # -- whole requests ------------------------------------------------------------------------------
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """Like `model.generate` (greedy or sampling, EOS, max_new_tokens); routing in `self.routing`.

        Returns the sequences ``[B, prompt + new]`` (or a `GenerateDecoderOnlyOutput` with
        ``return_dict_in_generate=True``: sequences, and ``scores`` / ``logits`` when asked; its
        ``past_key_values`` is None, the history stays in the engine). Settings the engine cannot run
        raise `FastPathUnsupported`.
        """
        from .generation import run_generate

        return run_generate(self, inputs, generation_config, kwargs)

    def mark_finished(self, finished_at: torch.Tensor) -> None:
        """Record per-row finishing steps (routed steps taken when a row stopped; -1 = not finished)."""
        self._require_request()
        self._finished_at = finished_at.detach().cpu().long().clone()
        self._routing = None

    # -- lifetime ------------------------------------------------------------------------------------
    def release(self) -> None:
        """Free the buffers and graphs. The model's attention implementation is already its own."""
        if self.graphs is not None:
            self._clear_graphs()
        self.state = self.local = self.full = self._caches = None
        self._released = True

    def __enter__(self) -> "OdaStaticEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _require_alive(self) -> None:
        if self._released:
            raise RuntimeError("This OdaStaticEngine was released; build a new one.")

    def _require_request(self) -> None:
        self._require_alive()
        if self._plan is None:
            raise RuntimeError("No request is active: call prefill() or load_history() first.")

    def _weights_fingerprint(self) -> tuple:
        return tuple((p.data_ptr(), p.dtype, p.device) for p in self.model.parameters())

    def _check_weights_compatible(self) -> None:
        if (self.model.device, self.model.dtype) != (self.device, self.dtype):
            raise RuntimeError(f"The model moved to {self.model.device}/{self.model.dtype} after the engine was built "
                               f"for {self.device}/{self.dtype}; build a new engine.")
