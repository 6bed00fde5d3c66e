"""Cached paired supervision: contents, resumable shards, settings checks, training equal to recomputation, CLI."""

from __future__ import annotations

import argparse
import copy
import json
import os
from unittest import mock

import pytest
import safetensors.torch
import torch

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from oda_hf.training import OdaTrainer, OdaTrainingArguments, PackedDataset, pack_documents, paired_supervision
from oda_hf.cli_common import UsageError
from oda_hf.training import cache_cli
from oda_hf.training import supervision_cache as sc
from oda_hf.training.data import OdaDataCollator
from tiny_models import VOCAB, tiny_model

S, W = 2, 3


def oda_model(seed: int = 1) -> OdaForCausalLM:
    base = tiny_model("qwen3")
    torch.manual_seed(seed)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    return OdaForCausalLM(base, head, OdaConfig(sinks=S, window=W, policy="local"))


def packed_rows(lengths=(14, 9, 12, 20, 7, 16, 11, 13), seq_len=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    docs[2]["labels"] = [-100] * 6 + docs[2]["input_ids"][6:]  # masked labels remove eligible positions
    rows, _ = pack_documents(docs, seq_len=seq_len, min_length=S + W + 2)
    return rows


def args(path, **overrides):
    values = dict(output_dir=str(path), per_device_train_batch_size=2, gradient_accumulation_steps=2, warmup_steps=0,
                  learning_rate=1e-2, use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1,
                  report_to=[], seed=7, oda_tau_hist=0.05)
    values.update(overrides)
    return OdaTrainingArguments(**values)


def test_cache_holds_the_paired_supervision_of_each_row(tmp_path):
    model, rows = oda_model(), packed_rows()
    cache = sc.cache_supervision(model, rows, tmp_path, tau_hist=0.05, seq_len=24, rows_per_shard=2, progress=False)
    assert len(cache) == len(rows) and len(cache.shards) == -(-len(rows) // 2)
    collate = OdaDataCollator()
    total = 0
    for i, row in enumerate(rows):
        batch = collate([row])
        want = paired_supervision(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                  batch.get("labels"), tau_hist=0.05)
        got = cache.row(i)
        assert torch.equal(got["gains"], want.gains)
        for key in sc.INPUT_TENSORS:
            assert torch.equal(got[key], getattr(want, key))
        total += want.num_eligible
    assert cache.num_positions == total > 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["tau_hist"] == 0.05 and manifest["window"] == W and manifest["seq_len"] == 24
    d = model.config.hidden_size
    # fp32: 3 d values + gain + column per position, plus a small header and row offsets per shard
    assert 3 * d * 4 + 8 <= cache.bytes_per_1k_positions() / 1000 < 3 * d * 4 + 8 + 200


def test_rerun_skips_finished_shards_and_rejects_other_settings(tmp_path):
    model, rows = oda_model(), packed_rows()
    first = sc.cache_supervision(model, rows, tmp_path, tau_hist=0.05, rows_per_shard=3, progress=False)
    before = {s["file"]: safetensors.torch.load_file(tmp_path / s["file"]) for s in first.shards}
    lost = first.shards[1]["file"]
    os.remove(tmp_path / lost)                                     # as if the run died while writing it
    (tmp_path / f".{lost}.tmp").write_bytes(b"partial")
    calls = []
    real = sc.paired_supervision
    with mock.patch.object(sc, "paired_supervision", lambda *a, **k: calls.append(1) or real(*a, **k)):
        again = sc.cache_supervision(model, rows, tmp_path, tau_hist=0.05, rows_per_shard=3, progress=False)
    assert len(calls) == first.shards[1]["rows"]                   # only the missing shard was recomputed
    for name, tensors in before.items():
        after = safetensors.torch.load_file(tmp_path / name)
        assert all(torch.equal(tensors[k], after[k]) for k in tensors)
    assert again.num_positions == first.num_positions

    with pytest.raises(ValueError, match="tau_hist: cache 0.05, this run 0.001"):
        sc.cache_supervision(model, rows, tmp_path, tau_hist=0.001, rows_per_shard=3, progress=False)
    with pytest.raises(ValueError, match="data_sha256"):
        sc.cache_supervision(model, rows[:-1], tmp_path, tau_hist=0.05, rows_per_shard=3, progress=False)
    with pytest.raises(ValueError, match="base_fingerprint"):
        sc.cache_supervision(OdaForCausalLM(tiny_model("qwen3", seed=3), None, OdaConfig(sinks=S, window=W, policy="local")), rows,
                             tmp_path, tau_hist=0.05, rows_per_shard=3, progress=False)
    with pytest.raises(ValueError, match="storage dtype"):
        sc.cache_supervision(model, rows, tmp_path / "x", dtype="int8")

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    older = {k: v for k, v in manifest.items() if k != "eligibility"}   # an older oda_hf's rule: not resumed into
    (tmp_path / "manifest.json").write_text(json.dumps(older))
    with pytest.raises(ValueError, match="eligibility: cache None"):
        sc.cache_supervision(model, rows, tmp_path, tau_hist=0.05, rows_per_shard=3, progress=False)
    manifest["shards"] = manifest["shards"][:1]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="incomplete"):
        sc.SupervisionCache(tmp_path)
    with pytest.raises(FileNotFoundError, match="cache-supervision"):
        sc.SupervisionCache(tmp_path / "nothing")


@pytest.mark.parametrize("reduction,batch_size,accumulation,atol", [
    ("micro", 1, 3, 1e-6), ("step", 1, 3, 1e-6),
    # Two padded rows per backbone pass round differently from one row alone (the cache's pass): ~1e-7 input noise.
    ("micro", 2, 2, 1e-5)])
def test_training_from_the_cache_equals_training_with_recomputation(tmp_path, reduction, batch_size, accumulation,
                                                                     atol):
    rows = packed_rows()
    recompute = oda_model()
    cached = copy.deepcopy(recompute)
    initial = {k: v.clone() for k, v in recompute.recall_head.state_dict().items()}
    cache = sc.cache_supervision(cached, rows, tmp_path / "cache", tau_hist=0.05, rows_per_shard=3, progress=False)
    options = dict(num_train_epochs=3, oda_loss_reduction=reduction, oda_lambda=0.1,  # 3 epochs, random row order
                   per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation)
    OdaTrainer(model=recompute, args=args(tmp_path / "a", **options), train_dataset=PackedDataset(rows)).train()
    trainer = sc.OdaCacheTrainer(model=cached, args=args(tmp_path / "b", **options), cache=cache)
    trainer.train()
    assert trainer.state.global_step == 6 and trainer.applied_updates == 6  # 6 rows: 2 updates per epoch
    want, got = recompute.recall_head.state_dict(), cached.recall_head.state_dict()
    assert max((want[k] - initial[k]).abs().max() for k in want) > 1e-3  # the head really trained
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=0)

    with pytest.raises(ValueError, match="tau_hist: cache 0.05, training 0.001"):
        sc.OdaCacheTrainer(model=cached, args=args(tmp_path / "c", oda_tau_hist=0.001), cache=cache)


def test_training_on_two_caches_equals_training_on_one_cache_of_their_rows(tmp_path):
    rows = packed_rows()
    model = oda_model()
    first = sc.cache_supervision(model, rows[:4], tmp_path / "first", tau_hist=0.05, rows_per_shard=3, progress=False)
    second = sc.cache_supervision(model, rows[4:], tmp_path / "second", tau_hist=0.05, rows_per_shard=2,
                                  progress=False)
    whole = sc.cache_supervision(model, rows, tmp_path / "whole", tau_hist=0.05, rows_per_shard=3, progress=False)
    combined = sc.open_cache([tmp_path / "first", tmp_path / "second"])
    assert isinstance(combined, sc.CombinedSupervisionCache)
    assert len(combined) == len(whole) and combined.num_positions == whole.num_positions
    assert combined.window == W and combined.tau_hist == 0.05
    for i in range(len(whole)):
        want, got = whole.row(i), combined.row(i)
        assert all(torch.equal(want[key], got[key]) for key in want)
    with pytest.raises(IndexError):
        combined.row(len(whole))

    heads = []
    for name, cache in (("w", whole), ("c", combined)):
        trained = oda_model()
        options = dict(num_train_epochs=2, oda_lambda=0.1, per_device_train_batch_size=1, gradient_accumulation_steps=2)
        sc.OdaCacheTrainer(model=trained, args=args(tmp_path / name, **options), cache=cache).train()
        heads.append(trained.recall_head.state_dict())
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])

    with pytest.raises(ValueError, match="hold the same rows"):
        sc.open_cache([first.path, whole.path, first.path])
    other = sc.cache_supervision(model, rows[:2], tmp_path / "other", tau_hist=0.001, rows_per_shard=3, progress=False)
    with pytest.raises(ValueError, match="differ in tau_hist"):
        sc.open_cache([second.path, other.path])
    foreign = OdaForCausalLM(tiny_model("qwen3", seed=3), None, OdaConfig(sinks=S, window=W, policy="local"))
    sc.cache_supervision(foreign, rows[:2], tmp_path / "foreign", tau_hist=0.05, rows_per_shard=3, progress=False)
    with pytest.raises(ValueError, match="differ in base_fingerprint"):
        sc.open_cache([first.path, tmp_path / "foreign"])


def test_a_train_dataset_given_is_checked_and_recorded_as_the_cache(tmp_path):
    """OdaCacheTrainer(train_dataset=...) trains on that cache's rows: checked against the model, recorded for resume."""
    rows, model = packed_rows(), oda_model()
    first = sc.cache_supervision(model, rows[:4], tmp_path / "first", tau_hist=0.05, progress=False)
    second = sc.cache_supervision(model, rows[4:], tmp_path / "second", tau_hist=0.05, progress=False)
    wider = sc.cache_supervision(model, rows[:4], tmp_path / "w4", window=W + 1, tau_hist=0.05, progress=False)
    with pytest.raises(ValueError, match="window"):   # trained with exit 0 under the first cache's window
        sc.OdaCacheTrainer(model=model, args=args(tmp_path / "a"), cache=first,
                           train_dataset=sc.SupervisionCacheDataset(wider))
    subset = torch.utils.data.Subset(sc.SupervisionCacheDataset(second), [0, 1])
    trainer = sc.OdaCacheTrainer(model=model, args=args(tmp_path / "b"), cache=first, train_dataset=subset)
    assert trainer.supervision_settings["cache_rows_sha256"] == [second.manifest["data_sha256"]]
    with pytest.raises(ValueError, match="trains on supervision-cache rows.*PackedDataset"):
        sc.OdaCacheTrainer(model=model, args=args(tmp_path / "c"), cache=first, train_dataset=PackedDataset(rows))


def test_cli_caches_then_trains_from_the_cache(tmp_path, capsys):
    from oda_hf.training import cli as training_cli

    base_dir = tmp_path / "base"
    tiny_model("qwen3").save_pretrained(base_dir)
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()}) + "\n"
                            for n in (20, 3, 17, 25)))
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    cache_cli.add_cli(subparsers)
    training_cli.add_cli(subparsers)
    cache_cmd = ["cache-supervision", "--base", str(base_dir), "--data", str(data), "--output", str(tmp_path / "c"),
                 "--sinks", "2", "--window", "3", "--seq-len", "32", "--rows-per-shard", "1", "--dtype", "float32",
                 "--tau-hist", "0.05"]
    run = parser.parse_args(cache_cmd)
    assert run.func(run) == 0
    cache = sc.SupervisionCache(tmp_path / "c")
    assert len(cache) == 3 and cache.window == 3 and cache.tau_hist == 0.05
    assert len(cache.shards) == 3   # --rows-per-shard 1

    train = ["train-head", "--base", str(base_dir), "--from-cache", str(tmp_path / "c"), "--output",
             str(tmp_path / "head"), "--epochs", "2", "--warmup-steps", "0", "--head-width", "8", "--save-steps", "100"]
    run = parser.parse_args(train)
    assert run.func(run) == 0
    model = OdaForCausalLM.from_pretrained(str(base_dir), head=str(tmp_path / "head"))
    assert model.oda_config.window == 3 and model.oda_config.sinks == 2 and model.recall_head.config.tau_hist == 0.05
    long_data = tmp_path / "long.jsonl"   # positions past the base's 512 once cached with exit 0
    long_data.write_text(json.dumps({"input_ids": torch.randint(1, VOCAB, (600,), generator=g).tolist()}) + "\n")
    with pytest.raises(UsageError, match="--seq-len: .* up to 600 tokens long, past the base model's context of 512"):
        run = parser.parse_args(_replace_flags(cache_cmd, {"--data": str(long_data), "--seq-len": "1000",
                                                           "--output": str(tmp_path / "long")}))
        run.func(run)
    with pytest.raises(UsageError, match="--window 5.*cache.*3"):
        run = parser.parse_args(train + ["--window", "5"])
        run.func(run)
    with pytest.raises(UsageError, match="exactly one of --data .* or --from-cache"):
        run = parser.parse_args(train[:3] + ["--output", str(tmp_path / "x")])
        run.func(run)

    # Two caches: the rows of both (the second cached from other documents).
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()}) + "\n"
                            for n in (22, 19)))
    run = parser.parse_args(cache_cmd[:4] + [str(more), "--output", str(tmp_path / "c2")] + cache_cmd[7:])
    assert run.func(run) == 0
    both = train[:5] + [str(tmp_path / "c2"), "--output", str(tmp_path / "head2")] + train[7:]
    run = parser.parse_args(both)
    capsys.readouterr()
    assert run.func(run) == 0
    assert f"supervision cache {tmp_path / 'c'}, {tmp_path / 'c2'}: 5 rows" in capsys.readouterr().err  # 3 + 2
    trained = OdaForCausalLM.from_pretrained(str(base_dir), head=str(tmp_path / "head2"))
    assert trained.oda_config.window == 3
    with pytest.raises(UsageError, match="hold the same rows"):
        run = parser.parse_args(train[:5] + [str(tmp_path / "c"), "--output", str(tmp_path / "head3")] + train[7:])
        run.func(run)
    # --dtype loads the base in that dtype: the cache records the hidden states of a bfloat16 base
    run = parser.parse_args(_replace_flags(cache_cmd, {"--data": str(more), "--output": str(tmp_path / "c16"),
                                                       "--dtype": "bf16"}))
    assert run.func(run) == 0
    assert sc.SupervisionCache(tmp_path / "c16").manifest["base_fingerprint"] == \
        sc.base_fingerprint(tiny_model("qwen3"), torch.bfloat16)


@pytest.mark.parametrize("length,last", [(dict(max_steps=3), 3),
                                         (dict(num_train_epochs=1.5, gradient_accumulation_steps=3), 3)])
def test_resuming_from_the_checkpoint_of_the_last_update_adds_none(tmp_path, length, last):
    """A run killed while saving its final head (or a finished run resumed again) resumes from the checkpoint that
    holds all its updates. transformers' loop checks for the end only after an update, so mid-epoch it ran one
    more, and with OdaTrainer's constant learning rate that update changed the head (3 updates over 8 rows: the
    resumed head had 4). A run of 1.5 epochs (3 updates, the last mid-epoch) was not checked at all (only max_steps
    was)."""
    rows = packed_rows()
    settings = {**dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, save_strategy="steps",
                       save_steps=1), **length}
    whole = oda_model()
    start = copy.deepcopy(whole.recall_head.state_dict())
    OdaTrainer(model=whole, args=args(tmp_path, **settings), train_dataset=PackedDataset(rows)).train()
    resumed = oda_model()
    assert all(torch.equal(a, b) for a, b in zip(resumed.recall_head.state_dict().values(), start.values()))
    trainer = OdaTrainer(model=resumed, args=args(tmp_path, **settings), train_dataset=PackedDataset(rows))
    output = trainer.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{last}"))
    assert output.global_step == trainer.state.global_step == last
    assert not (tmp_path / f"checkpoint-{last + 1}").exists()
    for name, value in whole.recall_head.state_dict().items():
        assert torch.equal(resumed.recall_head.state_dict()[name], value), name


def test_a_head_made_from_the_base_config_records_the_weights_it_trains_on(tmp_path):
    """README's recipe passes the base's name to `RecallHeadConfig.for_base`, which fingerprints only a loaded model:
    the trained head recorded no base weights, and attached to another base of the same shapes it said nothing."""
    from oda_hf.head import base_config_fingerprint, base_fingerprint

    model = oda_model()
    head = RecallHead(RecallHeadConfig.for_base(model.base_model.config, head_width=8))
    assert head.config.base_fingerprint is None
    model.set_head(head)
    OdaTrainer(model=model, args=args(tmp_path, max_steps=1), train_dataset=PackedDataset(packed_rows()))
    assert head.config.base_fingerprint == base_fingerprint(model.base_model) is not None
    assert head.config.base_config_sha256 == base_config_fingerprint(model) is not None   # and its forward config


def test_training_a_calibrated_head_drops_its_threshold_wherever_it_is_saved(tmp_path):
    """A head loaded from a folder `oda calibrate` wrote (threshold 0.425), trained, then saved to a new folder (its
    checkpoints, save_model, the model's save_pretrained): each kept 0.425, chosen for the weights before training."""
    from oda_hf.evaluation.calibration import save_calibration

    model = oda_model()
    model.save_pretrained(tmp_path / "calibrated")
    save_calibration(tmp_path / "calibrated", OdaConfig(sinks=S, window=W), {"chosen": {"threshold": 0.425}})
    model = OdaForCausalLM.from_pretrained(model.base_model, head=str(tmp_path / "calibrated"))
    assert model.oda_config.threshold == 0.425
    trainer = OdaTrainer(model=model, args=args(tmp_path / "out", max_steps=1, save_strategy="steps", save_steps=1),
                         train_dataset=PackedDataset(packed_rows()))
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    model.save_pretrained(tmp_path / "wrapper")
    for folder in ("out/checkpoint-1", "saved", "wrapper"):
        assert json.loads((tmp_path / folder / "oda_config.json").read_text())["threshold"] == 0.0, folder


def test_trainer_push_to_hub_publishes_the_head_not_a_checkpoint(tmp_path, monkeypatch):
    """`OdaTrainingArguments(push_to_hub=True)` uploaded staged checkpoints (optimizer state, pickled
    training_args.bin) at every save and then failed in transformers' card builder: it is refused, and
    `trainer.push_to_hub()` publishes what `save_model` writes, in one commit."""
    import transformers.utils.hub as hub

    from test_head import FakeHubApi

    with pytest.raises(ValueError, match=r"push_to_hub=True.*trainer.push_to_hub\(repo_id\)"):
        args(tmp_path / "pushed", push_to_hub=True, hub_model_id="me/head")
    fake = FakeHubApi()
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    model = oda_model()
    trainer = OdaTrainer(model=model, args=args(tmp_path / "out", max_steps=1, hub_model_id="me/head"),
                         train_dataset=PackedDataset(packed_rows()))
    trainer.train()
    trainer.push_to_hub()
    assert fake.repos == ["me/head"]
    assert set(fake.uploaded) == {"README.md", "config.json", "model.safetensors", "oda_config.json",
                                  "oda_training.json", "training_args.json"}
    trainer.save_model(str(tmp_path / "saved"))
    assert all(fake.uploaded[name] == (tmp_path / "saved" / name).read_bytes()
               for name in ("config.json", "model.safetensors", "oda_config.json"))


def test_a_resumed_run_whose_remaining_updates_lack_supervision_finishes(tmp_path):
    """The end-of-training check (updates ran, none had an eligible position) counted this process's updates only:
    resumed where only an unsupervised row was left, it raised "No eligible position in the training data", and the
    CLI then never saved the final head."""
    rows = packed_rows()[:2]
    rows.append({"input_ids": list(range(1, 25)), "position_ids": list(range(24)), "labels": [-100] * 24})
    settings = dict(max_steps=3, per_device_train_batch_size=1, gradient_accumulation_steps=1, save_strategy="steps",
                    save_steps=1, train_sampling_strategy="sequential")
    whole = oda_model()
    OdaTrainer(model=whole, args=args(tmp_path, **settings), train_dataset=PackedDataset(rows)).train()
    resumed = oda_model()
    trainer = OdaTrainer(model=resumed, args=args(tmp_path, **settings), train_dataset=PackedDataset(rows))
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.state.global_step == 3 and trainer.skipped_updates == 1 and trainer.applied_updates == 0
    for name, value in whole.recall_head.state_dict().items():
        assert torch.equal(resumed.recall_head.state_dict()[name], value), name


def _replace_flags(argv: list, values: dict) -> list:
    argv = list(argv)
    for flag, value in values.items():
        argv[argv.index(flag) + 1] = value
    return argv


def test_the_same_weights_under_another_config_do_not_reuse_the_cache(tmp_path):
    """Found by an audit: the cache's identity covered the base's weights only, so the same weights with another RoPE
    scaling or sliding window (gains 0.5 nats off on a tiny Gemma 3) were resumed into and trained on, exit 0."""
    model, rows = oda_model(), packed_rows()
    cache = sc.cache_supervision(model, rows, tmp_path, tau_hist=0.05, rows_per_shard=3, progress=False)
    other = copy.deepcopy(model)
    other.base_model.config.rope_parameters = {**other.base_model.config.rope_parameters, "rope_theta": 1234.0}
    assert sc.base_fingerprint(other) == sc.base_fingerprint(model)   # the weights' fingerprint alone agrees
    with pytest.raises(ValueError, match="under another configuration .RoPE scaling"):
        cache.check_compatible(other, sinks=S, window=W, tau_hist=0.05)
    with pytest.raises(ValueError, match="base_config_sha256"):
        sc.cache_supervision(other, rows, tmp_path, tau_hist=0.05, rows_per_shard=3, progress=False)
    cache.check_compatible(model, sinks=S, window=W, tau_hist=0.05)   # its own base still fits
    halved = copy.deepcopy(model)   # the same weights in another dtype: the message names the dtype to load
    halved.base_model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="running in float32, and this run loads it in bfloat16.*Load the base in "
                                         "float32 .--dtype."):
        cache.check_compatible(halved, sinks=S, window=W, tau_hist=0.05)
    longer = copy.deepcopy(model)   # dynamic RoPE reads max_position_embeddings as its original length
    longer.base_model.config.max_position_embeddings *= 2
    assert sc.base_config_fingerprint(longer) != sc.base_config_fingerprint(model)


# -- regression tests for the training-path mutation audit's survivors -------------------------------------------
def test_a_rerun_with_other_labels_positions_or_settings_does_not_reuse_the_cache(tmp_path):
    """Labels, position ids, sinks, window, storage dtype and rows per shard are all part of a cache's identity."""
    model, rows = oda_model(), packed_rows()
    assert len(rows[0]["position_ids"]) == 23 and rows[0]["position_ids"][14] == 0     # two segments: 14 + 9
    sc.cache_supervision(model, rows, tmp_path, tau_hist=0.05, rows_per_shard=3, progress=False)
    masked = [dict(rows[0], labels=[-100] * 10 + rows[0]["labels"][10:])] + rows[1:]   # a prompt masked: same tokens
    merged = [dict(rows[0], position_ids=list(range(23)))] + rows[1:]                 # one segment: same tokens
    changes = [(masked, {}, "data_sha256"), (merged, {}, "data_sha256"),
               (rows, dict(sinks=S + 1), f"sinks: cache {S}, this run {S + 1}"),
               (rows, dict(window=W + 1), f"window: cache {W}, this run {W + 1}"),
               (rows, dict(dtype="bfloat16"), "dtype: cache 'float32', this run 'bfloat16'"),
               (rows, dict(rows_per_shard=4), "rows_per_shard: cache 3, this run 4")]
    for changed, settings, fragment in changes:
        with pytest.raises(ValueError, match=fragment):
            sc.cache_supervision(model, changed, tmp_path, **{**dict(tau_hist=0.05, rows_per_shard=3), **settings},
                                 progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (manifest["sinks"], manifest["window"], manifest["dtype"], manifest["rows_per_shard"]) == \
        (S, W, "float32", 3)                                                           # the cache is left as it was


def test_a_bfloat16_cache_keeps_float32_gains(tmp_path):
    """Storage dtype bfloat16 rounds H, E and L only: the gains (regression targets) are stored in float32."""
    model, rows = oda_model(), packed_rows()[:2]
    cache = sc.cache_supervision(model, rows, tmp_path, tau_hist=0.05, dtype="bfloat16", progress=False)
    stored = safetensors.torch.load_file(tmp_path / cache.shards[0]["file"])
    assert stored["gains"].dtype == torch.float32
    assert all(stored[key].dtype == torch.bfloat16 for key in sc.INPUT_TENSORS)
    collate = OdaDataCollator()
    for i, row in enumerate(rows):
        batch = collate([row])
        want = paired_supervision(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                  batch.get("labels"), tau_hist=0.05).gains
        assert want.dtype == torch.float32 and not torch.equal(want.bfloat16().float(), want)   # bf16 would round
        assert torch.equal(cache.row(i)["gains"], want)


def test_training_from_a_cache_of_other_sinks_is_refused(tmp_path):
    """A cache's H and L were computed with its sinks: training with other sinks is refused."""
    model = oda_model()
    cache = sc.cache_supervision(model, packed_rows()[:2], tmp_path / "cache", tau_hist=0.05, progress=False)
    with pytest.raises(ValueError, match=f"sinks: cache {S}, training {S + 1}"):
        sc.OdaCacheTrainer(model=model, args=args(tmp_path / "a", oda_sinks=S + 1), cache=cache)


def test_a_run_on_several_caches_records_each_caches_rows_and_resumes_on_those_only(tmp_path):
    """Every cache's rows hash is recorded, so resuming a run on caches [A, B] with [A, C] is refused."""
    model, rows = oda_model(), packed_rows()
    a, b, c = (sc.cache_supervision(model, rows[i:i + 2], tmp_path / name, tau_hist=0.05, progress=False)
               for i, name in ((0, "a"), (2, "b"), (4, "c")))
    hashes = [cache.manifest["data_sha256"] for cache in (a, b, c)]
    assert len(set(hashes)) == 3
    settings = dict(max_steps=1, save_strategy="steps", save_steps=1, per_device_train_batch_size=1,
                    gradient_accumulation_steps=1)
    first = sc.OdaCacheTrainer(model=oda_model(), args=args(tmp_path / "run", **settings), cache=[a.path, b.path])
    assert first.supervision_settings["cache_rows_sha256"] == hashes[:2]
    first.train()
    other = sc.OdaCacheTrainer(model=oda_model(), args=args(tmp_path / "run", **{**settings, "max_steps": 2}),
                               cache=[a.path, c.path])
    assert other.supervision_settings["cache_rows_sha256"] == [hashes[0], hashes[2]]
    with pytest.raises(ValueError, match="cache_rows_sha256"):
        other.train(resume_from_checkpoint=True)
