"""ODA model classes for vLLM: the stock Llama / Qwen2 / Qwen3 / Qwen3.5 / Gemma 3 models with a routed decode step.

Each class is vLLM's own model (its modules, weight loading, `compute_logits`) with one change: `forward` returns,
for every decode row, the final hidden state of the branch ODA selected (ODA_SPEC 2). Per step:

1. One pass over all scheduled tokens. Prefill chunks, decode steps whose history still fits in sinks + window and
   rows already decided Full (policy ``full``, a Random or schedule hit) attend natively; the other decode rows attend
   Local, read from the paged cache (`attention.paged_local_attention`), in the global layers; a hybrid's
   sliding-window layers (Gemma 3) attend natively in every pass. Every token's KV is written to its slot. A
   hybrid's linear-attention layers (Qwen3.5's Gated DeltaNet) update each row's recurrent state in place, so the
   states of the rows the head will judge are saved first (`RecurrentStates`).
2. The recall head scores the rows that use it: ``q = head(h_prev, embed(x_t), h_L)``; Full where ``q > theta`` or
   ``q`` is not finite.
3. A Full pass over those rows only (metadata built for that sub-batch): it overwrites their KV slot, so the last
   pass to write a row's slot is its selected branch. Recurrent states of those rows are restored before it, so the
   Full pass applies the step's update once, from the same state as the Local pass.
4. ``h_prev`` of every row becomes the hidden state of its last token (prefill: Full; decode: the selected one).

A preempted request comes back as a prompt chunk over its prompt and generated tokens; each generated token is
recomputed as its routed step went, and the chunk's last token is routed as a decode step (`_replay`).

Sampling, logits processors and the scheduler stay vLLM's. The routing state lives in the ODA model runner
(`runner.OdaRunnerMixin`), which passes each step's rows to `forward` as ``oda_step``.
"""

from __future__ import annotations

import contextlib

import torch

from ..policies import head_asks
from .attention import LocalPlan, check_prefix_caching, local_plan, oda_attention_impl_class, routed_layers
from .requests import rank_zeros_decisions, replay_flags
from .settings import ServingSettings, check_engine_features


class OdaCausalLMMixin:
    """Mixed in before a vLLM ``*ForCausalLM`` class (see the classes at the bottom)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        from vllm.config import CUDAGraphMode
        from vllm.model_executor.layers.attention import Attention

        # torch.compile (vLLM's default; on during the CPU build's tests) is fine: the compiled decoder splits at every
        # attention op, and the routing (which rows attend Local, the head, the Full retry) runs in Python around and
        # inside those ops. CUDA graphs are not: a graph replays the step's shapes, and the Full retry is a pass over a
        # sub-batch of another size. (enforce_eager, engine_args' GPU setting, turns compile off too in vLLM.)
        graphs = vllm_config.compilation_config.cudagraph_mode
        if graphs is not None and graphs != CUDAGraphMode.NONE:
            raise ValueError(f"ODA's routed step cannot run inside CUDA graphs (cudagraph_mode={graphs.name}): start "
                             "the engine with enforce_eager=True (oda_hf.vllm.engine_args does on GPUs).")
        check_engine_features(vllm_config)
        self.oda_settings = ServingSettings.from_override(getattr(vllm_config.model_config.hf_config, "oda", None))
        head = None
        if self.oda_settings.head is not None:
            head = _load_head(self.oda_settings.head, vllm_config.model_config.hf_config)
        # Not a registered submodule: vLLM's loader must not look for the head's weights in the base checkpoint.
        self.__dict__["oda_head"] = head
        self.oda_runner_attached = False
        layers = [module for module in self.modules() if isinstance(module, Attention)]
        self.__dict__["oda_recurrent"] = RecurrentStates.of(self)
        check_prefix_caching(layers, prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                             hybrid_manager=not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
                             recurrent=self.oda_recurrent is not None)
        routed = routed_layers(layers)
        self.oda_routed_names = {module.layer_name for module in routed}
        for module in routed:
            module.impl.__class__ = oda_attention_impl_class(type(module.impl), module.attn_backend.get_name())
        for module in layers:
            module.__class__ = _prompt_only_caching_class(type(module))

    # -- the routed step --------------------------------------------------------------------------------
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, oda_step=None, **kwargs):
        if oda_step is None:
            if not self.oda_runner_attached:
                raise RuntimeError("This ODA model is served without ODA's model runner, so it cannot route: start "
                                   "the engine with oda_hf.vllm.engine_args(...) or `oda serve` (worker_cls "
                                   "oda_hf.vllm.worker.OdaCPUWorker / OdaGPUWorker).")
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if intermediate_tensors is not None or inputs_embeds is not None:
            raise NotImplementedError("ODA serves token-id prompts on one pipeline stage (no prompt embeddings, no "
                                      "pipeline parallelism).")
        return self._routed_forward(oda_step, input_ids, positions)

    def _routed_forward(self, step, input_ids, positions):
        settings = self.oda_settings
        span = settings.sinks + settings.window
        local_flags, head_rows = {}, []   # row -> per token of this pass: True = attends Local; rows the head judges
        for row, state in enumerate(step.states):
            if step.decode[row]:
                decided = state.predecided(state.routed_steps + 1)
                if step.seq_lens[row] <= span:      # Local reads the whole history: Local == Full, nothing to decide
                    state.record(False, decided_step=False)
                elif decided is None:               # the head decides after the Local pass
                    local_flags[row] = [True]
                    head_rows.append(row)
                else:
                    state.record(decided)
                    if not decided:
                        local_flags[row] = [True]
            elif step.seq_lens[row] > step.prompt_lens[row] or state.reaches_earlier_steps(
                    step.computed[row], step.token_count[row]):  # a preempted request recomputing its generated tokens
                flags, head = self._replay(step, row, span)
                if any(flags):
                    local_flags[row] = flags
                if head:
                    head_rows.append(row)

        saved = self.oda_recurrent.save(head_rows) if head_rows and self.oda_recurrent is not None else None
        if local_flags:
            plan = self._plan(step, [(row, step.token_start[row], step.token_count[row])
                                     for row in range(len(step.states))], local_flags, positions.device)
            with local_plan(plan):
                hidden = super().forward(input_ids, positions, None, None)
        else:
            hidden = super().forward(input_ids, positions, None, None)

        if head_rows:
            self._decide_and_retry(step, head_rows, input_ids, positions, hidden, saved, local_flags)
        for row, state in enumerate(step.states):
            last = step.token_start[row] + step.token_count[row] - 1
            state.prev_hidden = hidden[last].detach().clone()
        return hidden

    def _replay(self, step, row, span) -> tuple[list, bool]:
        """How each token of a recomputed chunk attends, and whether the head decides its last token
        (`requests.replay_flags`)."""
        return replay_flags(step.states[row], step.prompt_lens[row], step.computed[row], step.token_count[row], span)

    def _plan(self, step, segments, local_flags, device) -> LocalPlan:
        """The `LocalPlan` of a pass over `segments` ``(row, first token, tokens)``, concatenated in that order;
        `local_flags`: row -> per token of its segment, True where it attends Local (a row not in it: natively).

        Runs of native tokens become causal segments with their own metadata, single-token ones first (as vLLM orders
        decode rows before prompt chunks); every Local token reads the sinks and window below its own position."""
        native, local_tokens, local_rows, local_seq_lens = [], [], [], []
        offset = 0
        for k, (row, start, count) in enumerate(segments):
            flags = local_flags.get(row) or [False] * count
            first = step.position(row, start)
            i = 0
            while i < count:
                if flags[i]:
                    local_tokens.append(offset + i)
                    local_rows.append(k)
                    local_seq_lens.append(first + i + 1)
                    i += 1
                    continue
                j = i
                while j < count and not flags[j]:
                    j += 1
                single = j - i == 1 and first + i >= step.prompt_lens[row]
                native.append((not single, (row, start + i, j - i, first + j), (offset + i, offset + j)))
                i = j
            offset += count
        native.sort(key=lambda entry: entry[0])   # stable: single-token segments first, each group in pass order
        plan = LocalPlan(sinks=self.oda_settings.sinks, window=self.oda_settings.window,
                         local_tokens=torch.tensor(local_tokens, dtype=torch.long, device=device),
                         local_rows=torch.tensor(local_rows, dtype=torch.long, device=device),
                         local_seq_lens=torch.tensor(local_seq_lens, dtype=torch.long, device=device))
        if native:
            plan.native_tokens = torch.cat([torch.arange(a, b) for _, _, (a, b) in native]).to(device)
            plan.native_metadata, _ = step.metadata_for([segment for _, segment, _ in native], self.oda_routed_names)
        return plan

    def _decide_and_retry(self, step, head_rows, input_ids, positions, hidden, saved=None, local_flags=None):
        head = self.oda_head
        if head is None:
            raise RuntimeError("A request asked for the recall head (oda_policy head or budget) from an engine served "
                               "without one. Build the engine with oda_hf.vllm.engine_args(base, head=...) or `oda "
                               "serve`: they serve the head, and an engine they start without one refuses such "
                               "requests at admission.")
        last = [step.token_start[r] + step.token_count[r] - 1 for r in head_rows]
        states = [step.states[r] for r in head_rows]
        for row, state, token in zip(head_rows, states, last):
            if not step.decode[row]:   # a recomputed chunk: the preceding selected state was recomputed just before
                state.prev_hidden = hidden[token - 1].detach().clone()
        if any(state.prev_hidden is None for state in states):
            raise RuntimeError("ODA internal error: a decode row has no preceding hidden state (its prefill was not "
                               "seen by this runner).")
        tokens = torch.tensor(last, device=hidden.device)
        with torch.no_grad(), step.sub_batch_loras([(row, token, 1) for row, token in zip(head_rows, last)]):
            scores = head(torch.stack([s.prev_hidden for s in states]), self.embed_input_ids(input_ids[tokens]),
                          hidden[tokens]).float()
        thresholds = torch.tensor([s.routing.threshold for s in states], dtype=torch.float32, device=scores.device)
        asks = rank_zeros_decisions(head_asks(scores, thresholds)).tolist()
        recall = [ask and state.within_budget() for ask, state in zip(asks, states)]  # budget: calls within the rate
        for state, score, full in zip(states, scores.tolist(), recall):
            state.record(bool(full), score)
        retry_rows = [row for row, full in zip(head_rows, recall) if full]
        if not retry_rows:
            return
        if saved is not None:
            saved.restore([i for i, full in enumerate(recall) if full])  # positions among head_rows
        # The Full pass: the retried token of each row; with recurrent states (restored to the start of the step), a
        # recomputed chunk's whole row again, its earlier tokens as they went in the first pass.
        segments, nested = [], {}
        for row in retry_rows:
            start, count = step.token_start[row], step.token_count[row]
            if step.decode[row] or self.oda_recurrent is None:
                segments.append((row, start + count - 1, 1))
            else:
                segments.append((row, start, count))
                flags = list(local_flags[row])[:-1] + [False]   # as in the first pass, but the last token Full
                if any(flags):
                    nested[row] = flags
        plan = self._plan(step, segments, nested, hidden.device) if nested else None
        metadata, slots = step.metadata_for([(row, start, count, step.position(row, start) + count)
                                             for row, start, count in segments])
        retry_tokens = torch.cat([torch.arange(start, start + count) for _, start, count in segments]).to(hidden.device)
        with _swapped_forward_context(metadata, slots), step.sub_batch_loras(segments), \
                (local_plan(plan) if plan else contextlib.nullcontext()):
            full_hidden = super().forward(input_ids[retry_tokens], positions[retry_tokens], None, None)
        hidden[retry_tokens] = full_hidden


class RecurrentStates:
    """The in-place recurrent states of a hybrid's linear-attention layers (vLLM's `MambaBase` layers: Qwen3.5's Gated
    DeltaNet keeps a convolution state and a recurrent state per request).

    A decode step updates them in place, so a row retried with Full would apply the step twice. `save` copies the
    rows' states before the step's first pass; `SavedStates.restore` puts a subset back before the Full pass. The
    slots are read from the step's own metadata of each layer (``non_spec_state_indices_tensor``, one per request,
    in batch order), so they are right under any of vLLM's state-cache modes."""

    def __init__(self, layers: list):
        self.layers = layers

    @classmethod
    def of(cls, model) -> "RecurrentStates | None":
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        layers = [module for module in model.modules() if isinstance(module, MambaBase)]
        return cls(layers) if layers else None

    def save(self, rows: list) -> "SavedStates":
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        saved, rows_t = [], None
        for layer in self.layers:
            slots = metadata[layer.prefix].non_spec_state_indices_tensor
            if slots is None:
                raise RuntimeError("ODA internal error: a decode step without per-request state slots (speculative "
                                   "decoding is not supported with ODA).")
            if rows_t is None:  # one index tensor per step, not per layer
                rows_t = torch.tensor(rows, device=slots.device)
            index = slots[rows_t].long()
            saved.append((layer, index, [state.index_select(0, index.to(state.device)) for state in layer.kv_cache]))
        return SavedStates(saved)


class SavedStates:
    def __init__(self, saved: list):
        self.saved = saved

    def restore(self, positions: list) -> None:
        """Put back the saved states of the saved rows at `positions` (indices into the rows given to `save`)."""
        chosen = None
        for layer, index, copies in self.saved:
            if chosen is None:  # one index tensor per step, not per layer
                chosen = torch.tensor(positions, device=index.device)
            for state, copy in zip(layer.kv_cache, copies):
                state.index_copy_(0, index[chosen].to(state.device), copy[chosen.to(copy.device)])


@contextlib.contextmanager
def _swapped_forward_context(attn_metadata: dict, slot_mapping: dict):
    """Run a pass over a sub-batch: its attention metadata and KV-write slots replace the step's."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    saved = context.attn_metadata, context.slot_mapping
    context.attn_metadata, context.slot_mapping = attn_metadata, slot_mapping
    try:
        yield
    finally:
        context.attn_metadata, context.slot_mapping = saved


_ATTENTION_CLASSES: dict[type, type] = {}


def _prompt_only_caching_class(attention_class: type) -> type:
    """A one-base subclass of vLLM's `Attention` whose KV-cache spec allows prefix caching of prompt blocks only
    (`kv_cache.PromptOnlyFullAttentionSpec`)."""
    from .kv_cache import prompt_only_spec

    if attention_class not in _ATTENTION_CLASSES:
        def get_kv_cache_spec(self, vllm_config):
            return prompt_only_spec(attention_class.get_kv_cache_spec(self, vllm_config))

        _ATTENTION_CLASSES[attention_class] = type(f"Oda{attention_class.__name__}", (attention_class,), {
            "get_kv_cache_spec": get_kv_cache_spec, "oda_prompt_only_caching": True})
    return _ATTENTION_CLASSES[attention_class]


def _load_head(folder: str, base_config):
    """The recall head of `folder` (FP32, on the CPU until the runner moves it), checked against the served base."""
    from ..head import RecallHead

    with torch.device("cpu"):
        head = RecallHead.from_pretrained(folder)
    head.check_compatible(base_config)
    return head.float().eval()


def _oda_class(base: type, name: str) -> type:
    return type(name, (OdaCausalLMMixin, base), {"__doc__": f"vLLM's {base.__name__} with ODA's routed decode step."})


def _llama():
    from vllm.model_executor.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _qwen2():
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    return Qwen2ForCausalLM


def _qwen3():
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM


def _gemma3():
    from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM

    return Gemma3ForCausalLM


def _qwen3_5():
    try:
        from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM
    except (ImportError, RuntimeError) as err:
        if "torchvision" not in f"{getattr(err, 'name', '')} {err}":
            raise
        raise ImportError(f"vLLM's Qwen3.5 module imports its vision code, which needs a working torchvision ({err}). "
                          "Install the torchvision build that matches your torch (for a CPU torch: pip install "
                          "torchvision --index-url https://download.pytorch.org/whl/cpu).") from err
    return Qwen3_5ForCausalLM


_LAZY_CLASSES = {"OdaQwen3_5ForCausalLM": _qwen3_5}  # imported on first use: its vLLM module needs torchvision


def __getattr__(name: str):
    if name in _LAZY_CLASSES:
        globals()[name] = cls = _oda_class(_LAZY_CLASSES[name](), name)
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


OdaLlamaForCausalLM = _oda_class(_llama(), "OdaLlamaForCausalLM")
OdaQwen2ForCausalLM = _oda_class(_qwen2(), "OdaQwen2ForCausalLM")
OdaQwen3ForCausalLM = _oda_class(_qwen3(), "OdaQwen3ForCausalLM")
OdaGemma3ForCausalLM = _oda_class(_gemma3(), "OdaGemma3ForCausalLM")
