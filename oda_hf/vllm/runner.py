"""ODA's model runner: vLLM's runner plus the per-request routing state the model needs each step.

vLLM's model ``forward`` sees flattened tokens only. The runner knows which request each row is, whether the row is
a decode step, and how to build attention metadata; `OdaRunnerMixin` hands the model an `OdaStep` with exactly that,
keeps each request's `RequestState` (``h_prev``, knobs, counts) and keeps the counts of finished requests for
`routing_stats` (read with ``LLM.collective_rpc``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from .requests import (FinishedRecords, RequestState, counts_only, external_request_id, packed, pooled, records_of,
                       sample_index, unpacked)


def is_decode_step(count: int, computed: int, prompt_tokens: int, state: RequestState) -> bool:
    """Whether a row's scheduled tokens are the request's next routed step: one token, the first not yet routed.

    A preempted request recomputes its prompt and generated tokens in chunks as the token budget allows, and a chunk
    may be a single already-routed token: that one is recomputed as its step went (`_replay`), not routed again."""
    return count == 1 and computed - prompt_tokens == state.routed_steps


@dataclass
class OdaStep:
    """The rows of one scheduled step, in batch order."""

    token_start: list          # first token index of each row in the flattened batch
    token_count: list          # scheduled tokens per row
    seq_lens: list             # cached positions per row after this step
    decode: list               # the row is a decode step (one token, past its prompt)
    states: list               # RequestState per row
    computed: list             # positions cached before this step, per row
    prompt_lens: list          # prompt tokens per row
    metadata_for: Callable | None = None  # segments -> (attention metadata per layer, KV-write slots per layer)
    loras_for: Callable | None = None     # segments -> context in which LoRA layers map a sub-batch's tokens

    def sub_batch_loras(self, segments):
        """The context of a pass over `segments` ``(row, first token, tokens)`` only: with LoRA adapters served, each
        token of the sub-batch gets its own request's adapter (the step's mapping covers the whole batch)."""
        return self.loras_for(segments) if self.loras_for is not None else contextlib.nullcontext()

    def position(self, row: int, token: int) -> int:
        """The sequence position of flat token index `token`, one of `row`'s tokens this step."""
        return self.computed[row] + token - self.token_start[row]


class OdaRunnerMixin:
    """Mixed in before vLLM's V1 model runner class (CPU or GPU)."""

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        from .model import OdaCausalLMMixin

        model = self.get_model()
        if not isinstance(model, OdaCausalLMMixin):
            # ODA's worker runs only ODA's model classes: another one here means the engine's hf_overrides lost
            # their ODA architecture (e.g. replaced by a user's flag), and every request would be served by stock
            # vLLM, with Full attention, as if routed.
            raise ValueError(f"ODA's worker loaded {type(model).__name__}, not one of ODA's model classes: the engine's "
                             "hf_overrides do not name an ODA architecture (were they replaced?). Build the engine "
                             "with oda_hf.vllm.engine_args(...) or `oda serve`, and leave --hf-overrides to them.")
        self.oda_model = model
        self.oda_states: dict[str, RequestState] = {}
        self.oda_finished = FinishedRecords()
        if self.oda_model is not None:
            model.oda_runner_attached = True
            if model.oda_head is not None:
                model.oda_head.to(self.device)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if getattr(self, "oda_model", None) is not None:
            from .attention import check_local_layouts

            check_local_layouts(self.oda_model)

    def _on_request_state_removed(self, req_id, req_state):
        super()._on_request_state_removed(req_id, req_state)
        state = getattr(self, "oda_states", {}).pop(req_id, None)
        if state is not None:
            self.oda_finished.add(req_id, packed(state.summary()))

    def _update_streaming_request(self, req_id, new_req_data):
        # The next turn of a streaming-input session (vLLM's resumable requests: one request id, turn after turn). Its
        # prompt now begins with the earlier turns' output and it brings its own sampling params, so routing starts
        # afresh (the turn's knobs, steps counted from its prompt); the earlier turns' counts stay in its records, and
        # their decisions too: a recompute after a preemption writes their Local steps' KV as Local again (`_replay`).
        earlier = getattr(self, "oda_states", {}).pop(req_id, None)
        prompt_tokens = self.requests[req_id].num_prompt_tokens if earlier is not None else 0
        req_state = super()._update_streaming_request(req_id, new_req_data)
        if earlier is not None:
            extra = getattr(new_req_data.sampling_params, "extra_args", None)
            self.oda_states[req_id] = earlier.next_turn(self.oda_model.oda_settings.routing_for(extra), prompt_tokens)
        return req_state

    def oda_routing_stats(self, response_id: str | None = None, engine_ids=None, details: bool = True,
                          caller_ids=None, finish_times: bool = False) -> dict:
        """Counts per engine request id (finished and running) and the pooled Full-call rate over them; `evicted`:
        the summed counts of the finished records no longer kept. Which records (each filter found without a scan of
        the finished ones, since every running request waits for this call): `response_id`, those of that OpenAI
        response by its id's form (`requests.records_of`); `caller_ids`, those whose caller's id is one of them;
        `engine_ids`, those. `details=False`: without their decisions and scores (what `/metrics` reads of every
        record). `finish_times`: also when each finished record's request finished (`finish_times`, engine id ->
        seconds since the epoch), by which the server orders the records of several engines."""
        finished, running = self.oda_finished.records, self.oda_states
        if response_id is not None:
            finished = records_of(self.oda_finished.named(response_id), response_id, sub_requests=True,
                                  key=external_request_id)
            running = records_of(running, response_id, sub_requests=True, key=external_request_id)
        if caller_ids is not None:
            wanted = set(caller_ids)
            finished = {rid: finished[rid] for rid in self.oda_finished.of_callers(wanted) if rid in finished}
            running = {rid: state for rid, state in running.items() if external_request_id(rid) in wanted}
        if engine_ids is not None:
            finished = {rid: finished[rid] for rid in engine_ids if rid in finished}
            running = {rid: running[rid] for rid in engine_ids if rid in running}
        records = {**{rid: unpacked(record) if details else counts_only(record) for rid, record in finished.items()},
                   **{rid: state.summary(details) for rid, state in running.items()}}
        stats = pooled(records)
        stats["evicted"] = dict(self.oda_finished.evicted)
        if finish_times:
            stats["finish_times"] = {rid: self.oda_finished.finish_time(rid) for rid in finished}
        return stats

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        if getattr(self, "oda_model", None) is None:
            return super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
        step = self._oda_step(positions)
        return super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds, oda_step=step,
                                      **model_kwargs)

    def _oda_step(self, positions) -> OdaStep:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        starts = self.query_start_loc.cpu[: num_reqs + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:num_reqs].tolist()
        settings = self.oda_model.oda_settings
        counts, seq_lens, decode, states, prompt_lens = [], [], [], [], []
        for row in range(num_reqs):
            req_id = batch.req_ids[row]
            request = self.requests[req_id]
            state = self.oda_states.get(req_id)
            if state is None:
                extra = getattr(request.sampling_params, "extra_args", None)
                state = self.oda_states[req_id] = RequestState(settings.routing_for(extra),
                                                               sample=sample_index(req_id))
            count = starts[row + 1] - starts[row]
            counts.append(count)
            seq_lens.append(computed[row] + count)
            decode.append(is_decode_step(count, computed[row], request.num_prompt_tokens, state))
            states.append(state)
            prompt_lens.append(request.num_prompt_tokens)
        step = OdaStep(starts[:-1], counts, seq_lens, decode, states, computed, prompt_lens)
        step.metadata_for = lambda segments, layers=None: self._oda_metadata_for(segments, positions, layers)
        if getattr(self, "lora_config", None):
            step.loras_for = lambda segments: self._oda_sub_batch_loras(segments, counts)
        return step

    @contextlib.contextmanager
    def _oda_sub_batch_loras(self, segments, step_counts):
        """vLLM's LoRA layers read one adapter index per token of the pass, set for the whole step's batch; a pass over
        a sub-batch (the Full retry) maps its own tokens to their requests' adapters, then the step's mapping comes
        back (the logits are computed after the model's forward, under it)."""
        import numpy as np

        mapping = self.input_batch.request_lora_mapping[: self.input_batch.num_reqs]
        rows = np.array([segment[0] for segment in segments])
        tokens = np.array([segment[2] for segment in segments])
        requests = set(self.input_batch.lora_id_to_lora_request.values())
        self._set_active_loras(tuple(mapping[rows]), tuple(mapping[rows].repeat(tokens)), requests)
        try:
            yield
        finally:
            self.set_active_loras(self.input_batch, np.array(step_counts, dtype=np.int32))

    def _oda_metadata_for(self, segments, positions, layers=None):
        """Attention metadata and KV-write slots for the tokens of `segments` only, from each group's own builder.

        A segment ``(row, first token, tokens, seq_len)`` is a run of one row's tokens that attend causally to every
        position below `seq_len` (a whole row, or, when a preempted request recomputes its history, part of one).
        `layers`: build only for the groups holding these layer names (None: every group)."""
        from copy import copy

        from vllm.forward_context import get_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        context = get_forward_context()
        num_reqs = self.input_batch.num_reqs
        rows_t = torch.tensor([segment[0] for segment in segments], dtype=torch.long)
        counts = torch.tensor([segment[2] for segment in segments], dtype=torch.int32)
        query_start_cpu = torch.zeros(len(segments) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=query_start_cpu[1:])
        tokens = torch.cat([torch.arange(start, start + count) for _, start, count, _ in segments])
        seq_lens_cpu = torch.tensor([segment[3] for segment in segments], dtype=torch.int32)
        computed = seq_lens_cpu - counts
        prompt = self.input_batch.num_prompt_tokens_cpu_tensor[:num_reqs][rows_t]
        device = positions.device
        seq_lens = seq_lens_cpu.to(self.seq_lens.device)
        tokens_dev = tokens.to(device)
        metadata, slots = {}, {}
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if layers is not None and not layers.intersection(group.layer_names):
                continue
            layer_slots = context.slot_mapping[group.layer_names[0]][tokens_dev]
            common = CommonAttentionMetadata(
                query_start_loc=query_start_cpu.to(device), query_start_loc_cpu=query_start_cpu,
                seq_lens=seq_lens, num_reqs=len(segments), num_actual_tokens=int(tokens.numel()),
                max_query_len=int(counts.max()), max_seq_len=int(seq_lens_cpu.max()),
                block_table_tensor=self.input_batch.block_table[gid].get_device_tensor(num_reqs)[rows_t.to(device)],
                slot_mapping=layer_slots, causal=True, is_prefilling=computed < prompt,
                seq_lens_cpu_upper_bound=seq_lens_cpu,  # read by the Gated DeltaNet builder
                positions=positions[tokens_dev],
            )
            for attn_group in self.attn_groups[gid]:
                built = build_sub_batch_metadata(attn_group, copy(common))
                for name in attn_group.layer_names:
                    metadata[name] = built
            for name in group.layer_names:
                slots[name] = layer_slots
        return metadata, slots


def build_sub_batch_metadata(attn_group, common):
    """`attn_group.build_metadata(common)` for a sub-batch of the step, leaving the step's own metadata intact.

    Where a group's kernels use smaller blocks than its cache manager (e.g. a hybrid model's large manager blocks on a
    backend with fixed kernel blocks), vLLM maps each build's block table into kernel blocks inside one buffer of the
    group, shared by every build, and the metadata keeps a view of it: a sub-batch's build would overwrite the rows
    of the step's own table, which Local attention reads afterwards (another request's blocks). So the table is
    mapped here into a tensor of its own (vLLM's mapping: kernel block j of block b is ``b * stride + j``)."""
    from dataclasses import replace

    if getattr(attn_group, "kernel_block_size", None) is None:
        return attn_group.build_metadata(common)
    per_block = attn_group.kv_cache_spec.block_size // attn_group.kernel_block_size
    table = common.block_table_tensor
    mapped = (table.unsqueeze(-1) * (attn_group.kernel_block_stride or per_block)
              + attn_group.kernel_block_offsets.to(table.device)).flatten(1).to(table.dtype)
    return attn_group.get_metadata_builder(0).build(0, replace(common, block_table_tensor=mapped))
