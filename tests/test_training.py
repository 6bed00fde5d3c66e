"""Recall-head training: paired supervision, eligibility and packing, reductions, OdaTrainer (DDP, checkpoints, CLI)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import subprocess
import sys

import pytest
import safetensors.torch
import torch
import transformers

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from oda_hf.training import (
    HeadTrainingModule,
    OdaTrainer,
    OdaTrainingArguments,
    PackedDataset,
    build_layout,
    microbatch_loss,
    pack_documents,
    paired_supervision,
    preceding_states,
    read_documents,
    regression_target,
    signed_log,
    token_losses,
)
from oda_hf.training.cli import add_cli
from tiny_models import FAMILIES, VOCAB, tiny_model

S, W = 2, 3  # eligible from 1-based position s + w + 1 = 6


def oda_model(family: str, head: bool = False) -> OdaForCausalLM:
    base = tiny_model(family)
    recall_head = None
    if head:
        torch.manual_seed(1)
        recall_head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    return OdaForCausalLM(base, recall_head, OdaConfig(sinks=S, window=W, policy="local"))


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def decode_step(model: OdaForCausalLM, ids: torch.Tensor, t: int, policy: str):
    """One routed step on x_t (0-based column t) after a Full prefill of x_0..x_{t-1}: (log p(x_{t+1}), hidden)."""
    model.set_routing(policy=policy)
    cache = model.new_cache()
    with torch.no_grad():
        model(input_ids=ids[:, :t], past_key_values=cache)
        logits = model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits[0, -1]
    return logits.float().log_softmax(-1)[ids[0, t + 1]], cache.selected_hidden[0]


# -- paired supervision ---------------------------------------------------------------------------------
def qwen2_with_sliding_layers() -> OdaForCausalLM:
    """Qwen2 with `use_sliding_window`: a window-global hybrid (layer 0 full, layer 1 with a native window of 4),
    whose sliding layer takes its own mask from the mask dict the model builds."""
    from tiny_models import COMMON

    torch.manual_seed(0)
    config = transformers.Qwen2Config(num_hidden_layers=2, head_dim=8, use_sliding_window=True, sliding_window=4,
                                      max_window_layers=1, **COMMON)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    base = transformers.Qwen2ForCausalLM(config).eval()
    return OdaForCausalLM(base, None, OdaConfig(sinks=S, window=W, policy="local"))


@pytest.mark.parametrize("family", [*FAMILIES, "qwen2_sliding"])
def test_three_streams_equal_local_and_full_decode_steps(family):
    model = qwen2_with_sliding_layers() if family == "qwen2_sliding" else oda_model(family)
    ids = tokens(14, seed=7)
    batch = paired_supervision(model, ids, keep_streams=True, tau_hist=0.0)
    streams = batch.streams
    with torch.no_grad():
        stock = model.get_decoder()(input_ids=ids).last_hidden_state[0]
    torch.testing.assert_close(streams.trunk[0], stock, atol=2e-5, rtol=0)      # the trunk is a Full forward
    torch.testing.assert_close(streams.full, streams.trunk, atol=2e-5, rtol=0)  # Full-cf equals the trunk
    assert batch.cols.tolist() == list(range(S + W, 13))
    for n, t in enumerate(batch.cols.tolist()):
        logp_local, h_local = decode_step(model, ids, t, "local")
        logp_full, h_full = decode_step(model, ids, t, "full")
        torch.testing.assert_close(streams.local[0, t], h_local, atol=2e-5, rtol=0)
        torch.testing.assert_close(streams.full[0, t], h_full, atol=2e-5, rtol=0)
        assert abs(batch.gains[n].item() - (logp_full - logp_local).item()) < 2e-5
    assert batch.gains.abs().max() > 1e-3  # Local really differs from Full on these positions
    assert model.base_model.config._attn_implementation == "sdpa"  # restored
    assert not any("forward" in vars(m) for m in model.base_model.modules())  # DeltaNet wrappers removed


def test_three_streams_with_grouped_keys_repeated_as_on_cuda(monkeypatch):
    """CUDA's masked SDPA takes no grouped keys, so the paired pass repeats them per query head there (never run on
    the CPU, where SDPA takes them as they are): repeated in the wrong order, each query head read another KV head."""
    import oda_hf.training.attention as paired_attention

    model = oda_model("llama")   # 4 query heads on 2 KV heads
    ids = tokens(14, seed=7)
    native = paired_supervision(model, ids, keep_streams=True, tau_hist=0.0)
    monkeypatch.setattr(paired_attention, "_sdpa_takes_gqa", lambda *args: False)
    repeated = paired_supervision(model, ids, keep_streams=True, tau_hist=0.0)
    torch.testing.assert_close(repeated.gains, native.gains, atol=2e-5, rtol=0)
    torch.testing.assert_close(repeated.streams.local, native.streams.local, atol=2e-5, rtol=0)


def test_eligibility_starts_at_s_plus_w_plus_one():
    layout = build_layout(torch.ones(1, 12, dtype=torch.long), sinks=S, window=W)
    assert layout.eligible[0].nonzero().flatten().tolist() == list(range(S + W, 11))  # 1-based 6..11; 12 has no next
    assert (layout.index[0] == torch.arange(1, 13)).all()
    labels = torch.ones(1, 12, dtype=torch.long)
    labels[0, 8] = -100
    masked = build_layout(torch.ones(1, 12, dtype=torch.long), labels=labels, sinks=S, window=W)
    assert not masked.eligible[0, 7] and masked.eligible[0, 9]           # the masked label is x_{t+1} of t = 7
    assert not masked.eligible[0, 8]   # ...and token 8 is not generated (a prompt's): inference never routes it
    gap = torch.arange(12)[None].clone()
    gap[0, 9:] += 5                                                       # non-consecutive, same segment
    skipped = build_layout(torch.ones(1, 12, dtype=torch.long), position_ids=gap, sinks=S, window=W)
    assert skipped.num_segments == 1 and not skipped.eligible[0, 8] and skipped.eligible[0, 9]
    padded = build_layout(torch.ones(1, 14, dtype=torch.long), attention_mask=torch.tensor([[0, 0] + [1] * 12]),
                          sinks=S, window=W)
    assert padded.eligible[0, 2:].tolist() == layout.eligible[0].tolist() and not padded.eligible[0, :2].any()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma4"])
def test_packed_segments_never_attend_across(family):
    model = oda_model(family)
    first, second = tokens(9, seed=1), tokens(10, seed=2)
    positions = torch.cat([torch.arange(9), torch.arange(10)])[None]
    packed = paired_supervision(model, torch.cat([first, second], 1), position_ids=positions)
    other = paired_supervision(model, torch.cat([tokens(9, seed=3), second], 1), position_ids=positions)
    alone = paired_supervision(model, second)
    pad = paired_supervision(model, torch.cat([torch.zeros(1, 3, dtype=torch.long), second], 1),
                             attention_mask=torch.tensor([[0] * 3 + [1] * 10]))
    assert packed.cols.tolist() == [5, 6, 7] + [14, 15, 16, 17]  # nothing at the boundary column 8
    in_second = packed.cols >= 9
    for result in (other, alone, pad):
        theirs = result.gains[-4:]
        torch.testing.assert_close(packed.gains[in_second], theirs, atol=2e-5, rtol=0)
        torch.testing.assert_close(packed.local_hidden[in_second], result.local_hidden[-4:], atol=2e-5, rtol=0)
        torch.testing.assert_close(packed.prev_hidden[in_second], result.prev_hidden[-4:], atol=2e-5, rtol=0)
    assert (packed.gains[~in_second] - other.gains[:3]).abs().max() > 1e-4  # segment 1 did change


def test_preceding_state_selection_and_shift():
    model = oda_model("qwen3")
    ids = torch.cat([tokens(9, seed=1), tokens(10, seed=2)], 1)
    positions = torch.cat([torch.arange(9), torch.arange(10)])[None]
    batch = paired_supervision(model, ids, position_ids=positions, keep_streams=True, tau_hist=0.0)
    layout, streams, grid = batch.layout, batch.streams, batch.gain_grid(fill=0.0)
    torch.testing.assert_close(batch.prev_hidden, preceding_states(streams, layout, grid, 0.0)[batch.rows, batch.cols],
                               atol=0, rtol=0)
    tau = batch.gains.median().item()                                     # some gains below, some at/above
    prev = preceding_states(streams, layout, grid, tau)
    assert layout.segment_start[0].nonzero().flatten().tolist() == [0, 9]
    assert (prev[0, [0, 9]] == 0).all()                                   # zero at each segment start
    use_local = layout.eligible & (grid < tau)
    selected = torch.where(use_local[..., None], streams.local, streams.trunk)
    for t in [c for c in range(19) if c not in (0, 9)]:
        assert torch.equal(prev[0, t], selected[0, t - 1])               # shifted by one inside the segment
    assert use_local.any() and (layout.eligible & ~use_local).any()       # both branches of the selection occur
    always_local = preceding_states(streams, layout, grid, float("inf"))
    never_local = preceding_states(streams, layout, grid, float("-inf"))
    assert torch.equal(always_local[0, 6], streams.local[0, 5]) and torch.equal(never_local[0, 6], streams.trunk[0, 5])
    assert torch.equal(always_local[0, 5], streams.trunk[0, 4])           # column 4 is not eligible: trunk


def test_no_eligible_position_skips_the_backbone():
    model = oda_model("qwen3")
    batch = paired_supervision(model, tokens(S + W + 1, seed=0))
    assert batch.num_eligible == 0 and batch.prev_hidden.shape == (0, 32)


# -- target, loss, reductions -----------------------------------------------------------------------------
def test_target_transform_and_huber():
    u = torch.tensor([-3.0, -0.5, 0.0, 0.25, 2.0])
    torch.testing.assert_close(signed_log(u), torch.sign(u) * torch.log(1 + u.abs()))
    torch.testing.assert_close(regression_target(u, 0.5), signed_log(u - 0.5))
    losses = token_losses(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([0.5, 1.0, -3.0]))
    torch.testing.assert_close(losses, torch.tensor([0.125, 0.5, 2.5]))


def test_reductions_match_their_formulas():
    g = torch.Generator().manual_seed(0)
    # Per-token losses of each microbatch on each of two workers; microbatch 1 is empty on worker 0 and
    # microbatch 2 is empty everywhere.
    workers = [[torch.rand(5, generator=g), torch.rand(0), torch.rand(0), torch.rand(2, generator=g)],
               [torch.rand(3, generator=g), torch.rand(4, generator=g), torch.rand(0), torch.rand(0)]]
    pooled = [torch.cat([w[j] for w in workers]) for j in range(4)]
    micro_counts = [p.numel() for p in pooled]
    total = sum(micro_counts)
    expected = {
        "micro": sum(p.mean() for p in pooled if p.numel()) / len(pooled),   # empty microbatch: zero term, counted in M
        "step": sum(p.sum() for p in pooled) / total,
    }
    for reduction, value in expected.items():
        one_worker = sum(microbatch_loss(p, reduction=reduction, micro_count=n, update_count=total, num_micro=4)
                         for p, n in zip(pooled, micro_counts))
        torch.testing.assert_close(one_worker, value)
        # Two workers: each backpropagates its share x W, DDP averages -> the same loss (and gradient).
        shares = [sum(microbatch_loss(w[j], reduction=reduction, micro_count=micro_counts[j], update_count=total,
                                      num_micro=4, world_size=2) for j in range(4)) for w in workers]
        torch.testing.assert_close(sum(shares) / 2, value)
    assert microbatch_loss(torch.rand(0), reduction="step", micro_count=0, update_count=0, num_micro=1) == 0
    with pytest.raises(ValueError, match="Unknown loss reduction"):
        microbatch_loss(torch.rand(2), reduction="mean", micro_count=2, update_count=2, num_micro=1)
    with pytest.raises(ValueError, match="Unknown loss reduction"):
        OdaTrainingArguments(output_dir="unused", oda_loss_reduction="sum")


def test_gradients_follow_the_loss_weights():
    """A loss through the head: only head parameters get gradients; an empty microbatch still reaches them."""
    model = oda_model("qwen3", head=True)
    module = HeadTrainingModule(model, sinks=S, window=W, oda_lambda=0.0, tau_hist=0.001)
    out = module(tokens(S + W + 1, seed=0))                               # no eligible position
    microbatch_loss(out["losses"], reduction="micro", micro_count=3, update_count=3, num_micro=2).backward()
    assert all(p.grad is not None and (p.grad == 0).all() for p in model.recall_head.parameters())
    assert all(p.grad is None and not p.requires_grad for p in model.base_model.parameters())


# -- OdaTrainer (`_rows`, below, builds the rows) ------------------------------------------------------------


def _args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=1, warmup_steps=0,
                  train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, save_strategy="no",
                  logging_steps=1)
    values.update(overrides)
    return OdaTrainingArguments(**values)


def _head_state(model):
    return {k: v.detach().clone() for k, v in model.recall_head.state_dict().items()}


def test_two_process_data_parallel_equals_one_process(tmp_path):
    import ddp_head_worker

    out = tmp_path / "ddp.safetensors"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), ddp_head_worker.__file__, str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 and "SIGABRT" in proc.stderr:  # a rare abort at process teardown, not a result: once more
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = {}
    for key, tensor in safetensors.torch.load_file(out).items():
        reduction, name = key.split("/", 1)
        ddp.setdefault(reduction, {})[name] = tensor
    # 3 eval rows over 2 processes: each row counts once (accelerate's padding repeated row 0: 34 positions, not 24)
    single_eval = ddp_head_worker.evaluation(str(tmp_path / "eval"))
    assert float(ddp["eval"]["eval_eligible_tokens"]) == float(single_eval["eval_eligible_tokens"]) == 24
    torch.testing.assert_close(ddp["eval"]["eval_loss"], single_eval["eval_loss"])
    single_eval = ddp_head_worker.evaluation(str(tmp_path / "eval"), dispatch_batches=True)   # (40 of 30 counted)
    assert float(ddp["eval_dispatched"]["eval_eligible_tokens"]) == float(single_eval["eval_eligible_tokens"]) == 30
    for reduction in ("micro", "step"):
        single = ddp_head_worker.one_update(reduction, 2, str(tmp_path / reduction))
        for name, value in single.items():
            torch.testing.assert_close(ddp[reduction][name], value, atol=1e-6, rtol=1e-5)
    assert max((ddp["micro"][k] - ddp["step"][k]).abs().max() for k in single) > 1e-4  # the reductions differ here


def test_backbone_frozen_checkpoints_head_only_and_resume(tmp_path):
    rows = PackedDataset(_rows([14, 12, 13]))
    args = dict(max_steps=3, save_strategy="steps", save_steps=1, learning_rate=1e-2)
    model = oda_model("qwen3", head=True)
    base_before = {k: v.clone() for k, v in model.base_model.state_dict().items()}
    head_before = _head_state(model)
    OdaTrainer(model=model, args=_args(tmp_path / "run", **args), train_dataset=rows).train()
    assert all(torch.equal(base_before[k], v) for k, v in model.base_model.state_dict().items())
    final = _head_state(model)
    assert any(not torch.equal(head_before[k], final[k]) for k in final)

    checkpoint = tmp_path / "run" / "checkpoint-1"
    saved = safetensors.torch.load_file(checkpoint / "model.safetensors")
    assert set(saved) == set(final)                                       # head only: no backbone tensor
    assert json.loads((checkpoint / "oda_config.json").read_text())["window"] == W
    reloaded = OdaForCausalLM.from_pretrained(model.base_model, head=str(tmp_path / "run" / "checkpoint-3"))
    assert reloaded.oda_config.sinks == S and reloaded.recall_head.config.tau_hist == 0.001
    assert all(torch.equal(reloaded.recall_head.state_dict()[k], final[k]) for k in final)

    resumed = oda_model("qwen3", head=True)
    with torch.no_grad():
        for p in resumed.recall_head.parameters():
            p.add_(1.0)                                                   # resume must overwrite this
    trainer = OdaTrainer(model=resumed, args=_args(tmp_path / "run", **args), train_dataset=rows)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    after = _head_state(resumed)
    for k in final:
        torch.testing.assert_close(after[k], final[k], atol=1e-6, rtol=1e-6)


def test_checkpoint_killed_mid_write_resumes_from_the_last_complete_one(tmp_path, caplog):
    rows = PackedDataset(_rows([14, 12, 13, 15]))
    args = dict(max_steps=4, save_strategy="steps", save_steps=1, learning_rate=1e-2, save_total_limit=2)
    straight = oda_model("qwen3", head=True)
    OdaTrainer(model=straight, args=_args(tmp_path / "straight", **args), train_dataset=rows).train()
    assert sorted(p.name for p in (tmp_path / "straight").iterdir() if "checkpoint" in p.name) == \
        ["checkpoint-3", "checkpoint-4"]                                   # rotation still applies

    run = tmp_path / "run"
    killed = OdaTrainer(model=oda_model("qwen3", head=True), args=_args(run, **args), train_dataset=rows)
    save_rng_state = killed._save_rng_state

    def killed_at_step_3(output_dir):  # the head and optimizer are written, the rest is not
        if killed.state.global_step == 3:
            raise KeyboardInterrupt("killed while writing checkpoint-3")
        save_rng_state(output_dir)

    killed._save_rng_state = killed_at_step_3
    with pytest.raises(KeyboardInterrupt):
        killed.train()
    assert (run / "tmp-checkpoint-3" / "checkpoint-3" / "model.safetensors").exists()  # the partial write
    assert not (run / "checkpoint-3").exists()
    # A partial checkpoint-N left by a non-atomic writer is skipped too.
    (run / "checkpoint-9").mkdir()
    (run / "checkpoint-9" / "config.json").write_text("{}")
    (run / "checkpoint-2" / "trainer_state.json").write_text('{"global_st')  # cut mid-write: incomplete
    resumed = oda_model("qwen3", head=True)
    trainer = OdaTrainer(model=resumed, args=_args(run, **args), train_dataset=rows)
    with caplog.at_level("WARNING"):
        trainer.train(resume_from_checkpoint=True)
    assert "checkpoint-9: incomplete checkpoint" in caplog.text and "checkpoint-2: incomplete" in caplog.text
    assert "tmp-checkpoint-3: a checkpoint whose writing was interrupted" in caplog.text
    assert not (run / "tmp-checkpoint-3").exists()
    assert trainer.state.global_step == 4
    after, final = _head_state(resumed), _head_state(straight)
    for k in final:                                                       # resumed from checkpoint-1: same result
        torch.testing.assert_close(after[k], final[k], atol=1e-6, rtol=1e-6)
    assert json.loads((run / "checkpoint-4" / "training_args.json").read_text())["oda_sinks"] is None
    assert not list(run.rglob("*.bin"))                                   # no pickled training arguments


def test_empty_update_is_skipped_and_empty_dataset_rejected(tmp_path):
    model = oda_model("qwen3", head=True)
    trainer = OdaTrainer(model=model, args=_args(tmp_path, max_steps=2, learning_rate=1e-2),
                         train_dataset=PackedDataset(_rows([5, 14])),  # update 1: nothing eligible
                         eval_dataset=PackedDataset(_rows([14, 13], seed=5)))
    trainer.train()
    assert trainer.evaluate()["eval_loss"] > 0
    assert trainer.skipped_updates == 1 and trainer.applied_updates == 1
    assert trainer.lr_scheduler.last_epoch == 1                           # advanced by the real update only
    steps = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert steps == {1}                                                   # one optimizer step per parameter

    short = OdaTrainer(model=oda_model("qwen3", head=True), args=_args(tmp_path, max_steps=1),
                       train_dataset=PackedDataset(_rows([4, 6, 5])))
    # The logged loss is the applied update's: Trainer's mean over both counted the skipped one's zero
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist(), "position_ids": list(range(n))}
            for n in (5, 14)]
    losses = {}
    for name, data, steps in (("with a skipped update", rows, 2), ("its applied update alone", rows[1:], 1)):
        trainer = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=PackedDataset(data),
                             args=_args(tmp_path, max_steps=steps, logging_steps=steps, learning_rate=1e-2))
        output = trainer.train()
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert len(logged) == 1 and logged[0]["skipped_updates"] == (steps == 2)
        losses[name] = (logged[0]["loss"], trainer.state.log_history[-1]["train_loss"], output.training_loss)
    assert losses["with a skipped update"] == pytest.approx(losses["its applied update alone"], rel=1e-6)
    with pytest.raises(ValueError, match="No eligible position"):
        short.train()
    with pytest.raises(ValueError, match="bf16"):
        _args(tmp_path, bf16=True)


# -- data and CLI -----------------------------------------------------------------------------------------
def test_packing_segments_and_reading_documents(tmp_path):
    docs = [{"input_ids": list(range(1, 8))}, {"input_ids": [5, 6]}, {"input_ids": list(range(1, 20))}]
    rows, stats = pack_documents(docs, seq_len=10, min_length=4)
    assert [r["position_ids"] for r in rows] == [list(range(7)), list(range(10)), list(range(9))]
    assert stats.dropped_pieces == 1 and stats.segments == 3
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n\n{"input_ids": [4], "labels": [-100]}\n')
    assert list(read_documents(str(path))) == [{"input_ids": [1, 2, 3]}, {"input_ids": [4], "labels": [-100]}]
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="tokenizer"):
        list(read_documents(str(path)))


def test_a_document_with_a_supervised_answer_is_never_split():
    """A RULER training document is a prompt and its teacher-forced answer (labels mask the prompt). Packed at a
    seq_len of the prompt's length, the answer fell into a short tail piece that was dropped (measured on the shipped
    heads' data: about half the answer targets, every 2,048-token prompt's), with exit 0."""
    answer = [-100] * 12 + [13, 14, 15]
    prose = {"input_ids": list(range(1, 16))}   # unmasked: split into pieces as before, and said so
    rows, stats = pack_documents([prose], seq_len=10, min_length=4)
    assert stats.segments == 2 and "1 of 1 documents are longer than --seq-len 10" in stats.split_warning(10, 4)
    near_fit = {"input_ids": list(range(1, 13))}   # a prompt of 10 and a 2-token answer: the answer is dropped
    _, stats = pack_documents([near_fit, {"input_ids": [1, 2, 3, 4, 5]}], seq_len=10, min_length=4)
    assert (stats.split_documents, stats.dropped_tokens, stats.longest_document) == (1, 2, 12)
    assert stats.split_warning(10, 4).startswith("1 of 2 documents are longer than --seq-len 10 (the longest: 12 "
                                                 "tokens) and were split") and "--seq-len 12." in stats.split_warning(10, 4)
    assert pack_documents([near_fit], seq_len=12, min_length=4)[1].split_warning(12, 4) is None
    fully_labeled = {"input_ids": list(range(1, 16)), "labels": list(range(1, 16))}
    assert pack_documents([fully_labeled], seq_len=10, min_length=4)[1].segments == 2
    with pytest.raises(ValueError, match=r"1 of 2 documents with masked labels .* longer than seq_len=10 \(the "
                                         r"longest: 15 tokens\).*--seq-len 15"):
        pack_documents([{"input_ids": list(range(1, 16)), "labels": answer},
                        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100] * 4 + [5]}], seq_len=10, min_length=4)
    rows, stats = pack_documents([{"input_ids": list(range(1, 16)), "labels": answer}], seq_len=15, min_length=4)
    assert rows[0]["labels"][-3:] == [13, 14, 15] and stats.dropped_pieces == 0


def test_train_head_cli_checkpoints_and_resumes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base_dir = tmp_path / "base"
    tiny_model("qwen3").save_pretrained(base_dir)
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>").save_pretrained(base_dir)
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"w{i}" for i in torch.randint(2, VOCAB, (n,), generator=g).tolist())})
                            + "\n" for n in (20, 3, 17, 25)))
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    common = ["train-head", "--base", str(base_dir), "--tokenizer", str(base_dir), "--data", str(data),
              "--output", str(tmp_path / "out"), "--sinks", "2", "--window", "3", "--seq-len", "32",
              "--save-steps", "1", "--warmup-steps", "0", "--head-width", "8", "--dtype", "float32",
              "--loss-reduction", "step", "--seed", "7"]
    args = parser.parse_args(common + ["--max-steps", "2"])
    assert args.func(args) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint")) == \
        ["checkpoint-1", "checkpoint-2"]
    # --seed reaches the training arguments (data order, the recorded seed)
    assert json.loads((tmp_path / "out" / "checkpoint-2" / "training_args.json").read_text())["seed"] == 7
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit):  # argparse: "argument --threads: must be an integer >= 1", exit 2
            parser.parse_args(common + ["--max-steps", "3", "--resume", "--threads", "0"])
        args = parser.parse_args(common + ["--max-steps", "3", "--resume", "--threads", "1"])
        assert args.func(args) == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "out" / "checkpoint-3").is_dir()
    model = OdaForCausalLM.from_pretrained(str(base_dir), head=str(tmp_path / "out"))
    assert model.oda_config.window == 3 and model.recall_head.config.head_width == 8
    from oda_hf.cli_common import UsageError

    # a fresh run with another learning rate into this run's folder would mix its checkpoints with this run's
    args = parser.parse_args(common + ["--max-steps", "3", "--lr", "0.01"])
    with pytest.raises(UsageError, match=r"learning_rate: 0\.0003 there, 0\.01 now"):
        args.func(args)
    # other training data: --data had recorded no trace of its rows, so a resume on other data was mixed into one
    # head, and a fresh run over this folder's checkpoints was let through (a later --resume took their head)
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text().replace("w2 ", "w3 ").replace("w5", "w6"))
    common[common.index(str(data))] = str(other)
    for extra, fragment in ((["--max-steps", "4", "--resume"], "--resume: Resuming .*rows_sha256"),
                            (["--max-steps", "3"], "rows_sha256")):
        args = parser.parse_args(common + extra)
        with pytest.raises(UsageError, match=fragment):
            args.func(args)
    assert not (tmp_path / "out" / "checkpoint-4").exists()


def test_fetched_or_shipped_base_is_recorded_by_short_name(tmp_path):
    """A base loaded from a known folder (the shipped organism here; fetched bases alike) is recorded by its short
    name, so a shared head's record names no machine path; a checkpoint that recorded the path still resumes."""
    from oda_hf.known_models import organism_dir
    from oda_hf.organism.demo import load_organism
    from oda_hf.training.trainer import _differences

    model, _, _ = load_organism()
    trainer = OdaTrainer(model=model, args=_args(tmp_path / "run", max_steps=1),
                         train_dataset=PackedDataset(_rows([14, 12])))
    assert trainer.supervision_settings["base_model"] == "organism"
    saved = {**trainer.supervision_settings, "base_model": organism_dir("backbone")}
    assert _differences(saved, trainer.supervision_settings) == []
    assert _differences({**saved, "base_model": "/elsewhere/base"}, trainer.supervision_settings)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_with_a_masked_prompt_training_feeds_what_inference_feeds_after_the_prefill(family):
    """Found by an audit: the last token of a masked prompt was eligible (its label, the first answer token, is
    unmasked), though inference never routes it (the prefill is Full); the next position then trained on that
    token's Local H, where inference feeds its Full state (6 of 8 documents differed on a tiny Llama). The first
    answer token is the first eligible position, and its H is what OdaForCausalLM's first routed step feeds."""
    from tiny_models import VOCAB

    sinks, window, prompt, length = 2, 3, 10, 16
    base = tiny_model(family)
    torch.manual_seed(1)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=sinks, window=window, policy="head"))
    for seed in range(4):
        ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
        labels = ids.clone()
        labels[0, :prompt] = -100
        paired = paired_supervision(model, ids, labels=labels, tau_hist=1e9)   # every eligible step passes H on
        columns = paired.cols.tolist()
        assert prompt - 1 not in columns and columns[0] == prompt
        seen = {}
        hook = model.recall_head.register_forward_hook(lambda module, args, out: seen.update(H=args[0][0].clone()))
        cache = model.new_cache()
        with torch.no_grad():
            model(input_ids=ids[:, :prompt], past_key_values=cache)
            model(input_ids=ids[:, prompt:prompt + 1], past_key_values=cache)
        hook.remove()
        torch.testing.assert_close(paired.prev_hidden[0], seen["H"], atol=1e-5, rtol=1e-5)


# -- standard Trainer features (found by an audit) --------------------------------------------------------
def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return PackedDataset([{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist(),
                           "position_ids": list(range(n))} for n in lengths])


def _trainer_args(out, **changes):
    values = dict(output_dir=str(out), per_device_train_batch_size=1, warmup_steps=0, use_cpu=True, disable_tqdm=True,
                  save_strategy="no", logging_steps=1, report_to="none", learning_rate=1e-2,
                  train_sampling_strategy="sequential")
    return OdaTrainingArguments(**{**values, **changes})


def test_the_eval_loss_is_the_pooled_training_loss_whatever_the_batch_size(tmp_path):
    """transformers' loop averaged each eval batch's own mean over rows: 0.0119 / 0.0196 / 0.0182 at eval batch sizes
    1 / 2 / 3 on one set, a row without an eligible position counted as 0, and a set without any scored 0.0."""
    model = oda_model("qwen3", head=True)
    evaluation = _rows([14, 5, 13], seed=5)   # the middle row has no eligible position
    trainer = OdaTrainer(model=model, args=_trainer_args(tmp_path, max_steps=1), train_dataset=_rows([14, 12]))
    trainer.model.eval()
    with torch.no_grad():
        losses = torch.cat([trainer.model(**trainer.data_collator([row]))["losses"] for row in evaluation])
    for batch_size in (1, 2, 3):
        trainer.args.per_device_eval_batch_size = batch_size
        metrics = trainer.evaluate(evaluation)
        # (float32 rounding of a padded batch: 1.3e-6 apart at batch 3 on an AMD EPYC; the bug was 60% apart)
        assert metrics["eval_loss"] == pytest.approx(losses.double().mean().item(), rel=1e-5), batch_size
        assert metrics["eval_eligible_tokens"] == losses.numel()
    with pytest.raises(ValueError, match="No eligible position in the eval data"):
        trainer.evaluate(_rows([5, 6, 4], seed=9))
    # Training that evaluates such a set is refused before its first update (it failed at the first evaluation)
    for eval_dataset, what in ((_rows([5, 6, 4], seed=9), "the eval dataset"),
                               ({"long": evaluation, "short": _rows([5], seed=9)}, "the eval dataset 'short'")):
        args = _trainer_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1)
        evaluating = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=_rows([14, 12]),
                                eval_dataset=eval_dataset, args=args)
        with pytest.raises(ValueError, match=f"No eligible position in {what} \\("):
            evaluating.train()
        assert evaluating.state.global_step == 0
    unevaluated = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=_rows([14, 12]),
                             eval_dataset=_rows([5], seed=9), args=_trainer_args(tmp_path, max_steps=1))
    unevaluated.train()   # not evaluated while training: not checked


class _OutOfMemoryOnce(OdaTrainer):
    """Its third training step at batch size 2 runs out of memory, as on a GPU under `auto_find_batch_size`."""

    steps_at_two = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._train_batch_size == 2:
            self.steps_at_two += 1
            if self.steps_at_two == 3:
                raise RuntimeError("CUDA out of memory.")
        return super().training_step(model, inputs, num_items_in_batch)


def test_an_out_of_memory_retry_trains_as_a_run_at_its_batch_size(tmp_path, caplog):
    """`auto_find_batch_size` reruns the training loop at a smaller batch after an out-of-memory error. It went on
    from the failed attempt's head and Adam state (a head 0.049 away, Adam at step 3 for 2) with its update counts
    (4 skipped / 3 applied for 2 / 2, train_loss NaN, the first loss line rescaled by 7/3 for 4/2), exit 0."""
    data = _rows([5, 5, 14, 13])   # the first two rows have no eligible position
    results = []
    for trainer_class, batch_size in ((_OutOfMemoryOnce, 2), (OdaTrainer, 1)):
        trainer = trainer_class(model=oda_model("qwen3", head=True), train_dataset=data, args=_trainer_args(
            tmp_path, max_steps=4, logging_steps=4, per_device_train_batch_size=batch_size,
            auto_find_batch_size=batch_size == 2))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="oda_hf"):
            output = trainer.train()
        assert trainer._attempt_start is None   # the snapshot (on the CPU) is dropped when train() returns
        assert ("Training again from the start at batch size 1" in caplog.text) == (batch_size == 2)
        logged = [{k: v for k, v in entry.items() if k in ("loss", "skipped_updates", "eligible_tokens")}
                  for entry in trainer.state.log_history if "loss" in entry]
        steps = {int(state["step"]) for state in trainer.optimizer.state_dict()["state"].values()}
        results.append((trainer.skipped_updates, trainer.applied_updates, logged, output.training_loss, steps,
                        _head_state(trainer.oda_model)))
        if batch_size == 2:   # the retry ran, at batch size 1
            assert trainer.steps_at_two == 3 and trainer._train_batch_size == 1
    retried, plain = results
    assert retried[:5] == plain[:5] and plain[:2] == (2, 2) and plain[4] == {2} and math.isfinite(plain[3])
    assert all(torch.equal(retried[5][k], plain[5][k]) for k in plain[5])


class _IterableRows(torch.utils.data.IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows[i] for i in range(len(self.rows)))


def test_an_iterable_eval_set_is_refused_over_several_processes(tmp_path, monkeypatch):
    """accelerate pads an iterable set's last batches with repeated rows over 2 processes (measured: 40 eligible
    positions counted of 30); a map-style set is sharded unpadded (the two-process test above)."""
    iterable = _IterableRows(_rows([14, 13], seed=5))
    one = OdaTrainer(model=oda_model("qwen3", head=True), args=_trainer_args(tmp_path, max_steps=1),
                     train_dataset=_rows([14, 12]))
    assert one.evaluate(iterable)["eval_eligible_tokens"] > 0   # one process: read as it comes
    monkeypatch.setattr(OdaTrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="An iterable dataset \\(_IterableRows\\) cannot be evaluated over 2"):
        one.evaluate(iterable)
    args = _trainer_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1)
    evaluating = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=_rows([14, 12]),
                            eval_dataset={"stream": iterable}, args=args)
    with pytest.raises(ValueError, match="The eval dataset 'stream' \\(_IterableRows\\) cannot be evaluated over 2"):
        evaluating.check_before_training()


def test_resume_needs_the_optimizer_state_and_keeps_the_optimizer_settings(tmp_path):
    """A checkpoint saved with save_only_model=True resumed with a fresh optimizer and warm-up (another head, exit 0);
    Adam's betas, epsilon, data_seed and the schedule's kwargs changed on resume were recorded while the checkpoint's
    state went on."""
    data = _rows([14, 12, 13, 15])
    first = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=data,
                       args=_trainer_args(tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=2,
                                          save_only_model=True))
    first.train()
    again = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=data,
                       args=_trainer_args(tmp_path / "a", max_steps=4, save_strategy="steps", save_steps=2,
                                          save_only_model=True))
    with pytest.raises(ValueError, match="holds no optimizer state"):
        again.train(resume_from_checkpoint=True)
    OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=data,
               args=_trainer_args(tmp_path / "b", max_steps=2, save_strategy="steps", save_steps=2)).train()
    for change in ({"adam_beta2": 0.5}, {"adam_epsilon": 1e-3}, {"data_seed": 7}):
        resumed = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=data,
                             args=_trainer_args(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2,
                                                **change))
        with pytest.raises(ValueError, match=f"{next(iter(change))}: .* in the checkpoint"):
            resumed.train(resume_from_checkpoint=True)


def test_a_finished_run_resumed_with_load_best_model_at_end_gives_its_best_head(tmp_path):
    """Resuming a finished run returned its last checkpoint's head, not the best one the run ended with."""
    data, evaluation = _rows([14, 12, 13, 15, 16, 14]), _rows([14, 13], seed=5)
    settings = dict(max_steps=6, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                    load_best_model_at_end=True, metric_for_best_model="loss", learning_rate=0.3)
    model = oda_model("qwen3", head=True)
    trainer = OdaTrainer(model=model, args=_trainer_args(tmp_path, **settings), train_dataset=data,
                         eval_dataset=evaluation)
    trainer.train()
    best = {k: v.clone() for k, v in model.recall_head.state_dict().items()}
    assert trainer.state.best_model_checkpoint and not trainer.state.best_model_checkpoint.endswith("checkpoint-6")
    # the saved head's card names the best checkpoint's update count (it said the last step's, 6)
    trainer.save_model(str(tmp_path / "final"))
    best_step = int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1])
    assert f", {best_step} updates (the best checkpoint of 6)." in (tmp_path / "final" / "README.md").read_text()
    again = oda_model("qwen3", head=True)
    OdaTrainer(model=again, args=_trainer_args(tmp_path, **settings), train_dataset=data,
               eval_dataset=evaluation).train(resume_from_checkpoint=True)
    assert all(torch.equal(again.recall_head.state_dict()[k], v) for k, v in best.items())


# -- regression tests for the training-path mutation audit's survivors -------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_head_inputs_equal_what_the_routed_step_feeds(family):
    """E, L (and H) stored for column t are the head's inputs in the routed step on x_t after a Full prefill."""
    base = tiny_model(family)
    torch.manual_seed(1)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=S, window=W, policy="head"))
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(5))
    paired = paired_supervision(model, ids, tau_hist=float("-inf"))   # no Local H passed on: H is the Full state
    assert paired.cols.tolist() == list(range(S + W, 12))
    table = model.get_input_embeddings()(torch.arange(VOCAB)).detach()
    for n, t in enumerate(paired.cols.tolist()):
        seen = {}
        hook = model.recall_head.register_forward_hook(
            lambda module, args, out: seen.update(H=args[0][0].clone(), E=args[1][0].clone(), L=args[2][0].clone()))
        cache = model.new_cache()
        with torch.no_grad():
            model(input_ids=ids[:, :t], past_key_values=cache)          # Full prefill of x_0..x_{t-1}
            model(input_ids=ids[:, t:t + 1], past_key_values=cache)     # the routed step on x_t
        hook.remove()
        torch.testing.assert_close(paired.input_embeds[n], seen["E"], atol=1e-6, rtol=0)
        torch.testing.assert_close(paired.input_embeds[n], table[ids[0, t]], atol=0, rtol=0)   # x_t, not x_{t+1}
        torch.testing.assert_close(paired.local_hidden[n], seen["L"], atol=2e-5, rtol=0)
        torch.testing.assert_close(paired.prev_hidden[n], seen["H"], atol=2e-5, rtol=0)


@pytest.mark.parametrize("reduction", ["step", "micro"])
def test_an_updates_loss_over_unequal_microbatches_is_the_documented_reduction(tmp_path, reduction):
    """Summed over an update's microbatches, compute_loss is docs/method.md's step or micro reduction."""
    from oda_hf.training.data import OdaDataCollator
    from oda_hf.training.trainer import MODEL_INPUTS

    rows = _rows([8, 16])                                                  # 2 and 10 eligible positions
    trainer = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=rows,
                         args=_trainer_args(tmp_path, gradient_accumulation_steps=2, oda_loss_reduction=reduction))
    collate = OdaDataCollator()
    samples, _ = trainer.get_batch_samples(iter([collate([row]) for row in rows]), 2, "cpu")
    with torch.no_grad():
        per_token = [trainer.model(**{k: b[k] for k in MODEL_INPUTS if k in b})["losses"].double() for b in samples]
        got = sum(trainer.compute_loss(trainer.model, dict(b)).item() for b in samples)
    assert [p.numel() for p in per_token] == [2, 10]
    if reduction == "step":     # sum over the update / its eligible tokens
        want = (per_token[0].sum() + per_token[1].sum()).item() / 12
    else:                       # mean over microbatches of each one's eligible-token mean
        want = (per_token[0].sum().item() / 2 + per_token[1].sum().item() / 10) / 2
    assert got == pytest.approx(want, rel=1e-6)
    assert abs(per_token[0].mean() - per_token[1].mean()) > 1e-3 * want   # unequal means: the weighting matters


def test_gains_do_not_depend_on_the_vocabulary_chunk_size(monkeypatch):
    """The gains are log pF - log pL of x_{t+1} whatever lm_chunk; every position of every chunk is written."""
    from oda_hf.training import paired as paired_module

    class NanEmpty:   # paired.py's torch, whose empty() is NaN-filled: an unwritten output is NaN, not leftover memory
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(size, **kwargs):
            return torch.full(size, float("nan"), **kwargs)

    model = oda_model("qwen3")
    ids = tokens(48, seed=0)                                               # 42 eligible positions
    monkeypatch.setattr(paired_module, "torch", NanEmpty())
    reference = paired_supervision(model, ids, keep_streams=True)
    cols, streams = reference.cols, reference.streams
    assert cols.numel() == 42
    with torch.no_grad():
        logp = [model.get_output_embeddings()(h[0, cols]).double().log_softmax(-1)[torch.arange(42), ids[0, cols + 1]]
                for h in (streams.full, streams.local)]
    want = (logp[0] - logp[1]).float()
    for chunk in (1, 5, 16, 64):
        gains = paired_supervision(model, ids, lm_chunk=chunk).gains
        assert not gains.isnan().any(), chunk
        torch.testing.assert_close(gains, want, atol=2e-5, rtol=0, msg=f"lm_chunk={chunk}")


def test_a_row_without_labels_in_a_labelled_batch_is_supervised_on_its_own_tokens():
    """The collator labels a row that has no labels with its input_ids, even beside rows that have labels."""
    from oda_hf.training.data import OdaDataCollator

    masked = {"input_ids": list(range(1, 13)), "labels": [-100] * 6 + list(range(7, 13))}
    plain = {"input_ids": list(range(20, 30))}
    batch = OdaDataCollator()([masked, plain])
    assert batch["labels"][0].tolist() == [-100] * 6 + list(range(7, 13))
    assert batch["labels"][1].tolist() == list(range(20, 30)) + [-100] * 2   # its tokens, then padding
    layout = build_layout(batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["labels"],
                          sinks=S, window=W)
    assert layout.eligible[1].nonzero().flatten().tolist() == [5, 6, 7, 8]   # 1-based 6..9 of 10 tokens
    assert layout.eligible[0].nonzero().flatten().tolist() == [6, 7, 8, 9, 10]   # from the first unmasked token


def test_a_repeated_position_id_starts_a_new_segment():
    """A segment starts wherever the position id does not increase, a repeat included (a 1-token segment at 0)."""
    positions = torch.tensor([[0] + list(range(8))])                  # a 1-token segment, then an 8-token one
    layout = build_layout(torch.ones(1, 9, dtype=torch.long), position_ids=positions, sinks=S, window=W)
    assert layout.num_segments == 2 and layout.segment_start[0].nonzero().flatten().tolist() == [0, 1]
    assert layout.index[0].tolist() == [1, 1, 2, 3, 4, 5, 6, 7, 8]
    assert layout.eligible[0].nonzero().flatten().tolist() == [6, 7]   # 1-based 6 and 7 of the second segment


def test_a_document_of_exactly_the_minimum_length_is_packed():
    """A piece of s + w + 2 tokens holds one eligible position and is packed, not dropped."""
    n = S + W + 2
    rows, stats = pack_documents([{"input_ids": list(range(1, n + 1))}, {"input_ids": list(range(1, n))}],
                                 seq_len=16, min_length=n)
    assert rows == [{"input_ids": list(range(1, n + 1)), "position_ids": list(range(n))}]
    assert stats.dropped_pieces == 1 and stats.dropped_tokens == n - 1   # only the one-token-shorter document


def test_data_checks_refuse_the_first_value_past_each_limit():
    """Token id == vocab size, a piece of context + 1 tokens and a masked document of seq_len + 1 are refused."""
    from oda_hf.training.data import check_positions, check_token_ids

    check_token_ids([{"input_ids": [1, 2, VOCAB - 1]}], vocab_size=VOCAB)          # the last id fits
    with pytest.raises(ValueError, match=f"input_ids {VOCAB}, outside the base model's vocabulary of {VOCAB}"):
        check_token_ids([{"input_ids": [1, 2, VOCAB]}], vocab_size=VOCAB)
    with pytest.raises(ValueError, match=f"labels {VOCAB}, outside"):
        check_token_ids([{"input_ids": [1, 2, 3], "labels": [-100, 2, VOCAB]}], vocab_size=VOCAB)
    check_positions([{"input_ids": [1] * 512, "position_ids": list(range(512))}], context=512)   # exactly the context
    with pytest.raises(ValueError, match="up to 513 tokens long, past the base model's context of 512"):
        check_positions([{"input_ids": [1] * 513, "position_ids": list(range(513))}], context=512)
    answer = list(range(1, 11))
    rows, _ = pack_documents([{"input_ids": answer, "labels": [-100] * 7 + answer[7:]}], seq_len=10, min_length=4)
    assert rows[0]["labels"] == [-100] * 7 + [8, 9, 10]                            # seq_len tokens: one piece
    with pytest.raises(ValueError, match="longer than seq_len=10 .the longest: 11 tokens"):
        pack_documents([{"input_ids": answer + [11], "labels": [-100] * 8 + [9, 10, 11]}], seq_len=10, min_length=4)


def test_resuming_with_another_batch_shape_or_seed_is_refused(tmp_path):
    """Gradient accumulation, batch size and seed are kept on resume (transformers skips global_step x GA batches)."""
    data = _rows([14, 12, 13, 15])
    settings = dict(max_steps=1, save_strategy="steps", save_steps=1, gradient_accumulation_steps=2)
    args = _trainer_args(tmp_path, **settings)
    OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=data, args=args).train()
    for key, saved, value in (("gradient_accumulation_steps", 2, 1), ("per_device_train_batch_size", 1, 2),
                              ("seed", 42, 3)):                           # 42: TrainingArguments' default seed
        resumed = OdaTrainer(model=oda_model("qwen3", head=True), train_dataset=data,
                             args=_trainer_args(tmp_path, **{**settings, "max_steps": 2, key: value}))
        with pytest.raises(ValueError, match=f"{key}: {saved} in the checkpoint, {value} now"):
            resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 0


def test_a_setting_recorded_now_but_absent_from_the_checkpoint_is_a_difference():
    """Resume compares every recorded setting; only those in RECORDED_SINCE may be missing from an older checkpoint."""
    from oda_hf.training.trainer import _differences

    saved = {"sinks": S, "window": W, "tau_hist": 0.001}
    now = {**saved, "seq_len": 16, "rows_sha256": "abc", "base_dtype": "float32", "head_width": 8}
    assert _differences(saved, now) == ["rows_sha256: None in the checkpoint, 'abc' now",
                                        "seq_len: None in the checkpoint, 16 now"]
    assert _differences({**saved, "base_dtype": "bfloat16"}, now) == \
        ["base_dtype: 'bfloat16' in the checkpoint, 'float32' now", "rows_sha256: None in the checkpoint, 'abc' now",
         "seq_len: None in the checkpoint, 16 now"]
