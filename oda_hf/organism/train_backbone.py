"""Train the organism backbone: a stock `Qwen3ForCausalLM` from scratch on the synthetic corpus, on CPU.

    python -m oda_hf.organism.train_backbone --output runs/organism [--resume] [--max-steps N] [--seed S]

The loss is ``mean CE over target tokens + filler_coef * mean CE over predictable prompt text``
(random payload such as keys, values and list words gets no LM loss). Batches are a pure function of
``(seed, step)``, so a resumed run sees exactly the data an uninterrupted run would. The run writes a
checkpoint (model, optimizer, scheduler, RNG, step, data digest) atomically every ``--save-every``
steps, as one safetensors file (tensors) with JSON metadata (everything else; no pickle), and, at the end, a loadable model folder (safetensors, config, generation config, tokenizer,
``organism.json`` with seeds and data hashes).

`evaluate_backbone(model_dir, split, n)` scores greedy generation per task (RULER string match) with
Full attention and with StreamingLLM-style Local attention (``OdaForCausalLM`` with policy="local").
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..files import atomic_path
from .corpus import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TASKS,
    VOCAB,
    OrganismCorpus,
    _derive_seed,
    copy_sequence,
    min_length,
    training_sequence,
    vocab_sha256,
)
from .metrics import example_score

CHECKPOINT_NAME = "checkpoint.safetensors"
LEGACY_CHECKPOINT_NAME = "checkpoint.pt"  # pickle, written by older versions: never loaded
CHECKPOINT_FORMAT = 1
ORGANISM_FILE = "organism.json"
EVAL_LENGTHS = (256, 512, 1024)


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass
class Stage:
    """Curriculum stage, active for steps ``< until``: prompt lengths (one drawn per batch), needle gap,
    tokens per batch and the tasks drawn (uniformly, among those that fit the length)."""

    until: int
    lengths: tuple[int, ...]
    min_gap: int | None = None  # None -> the Local window
    batch_tokens: int = 4096
    tasks: tuple[str, ...] | None = None  # None -> all of TASKS
    copy_fraction: float = 0.0  # share of the batch that is `copy_sequence` induction drills
    local_view: float = 0.0  # share of task examples trained with a Local view of the target (see batch_losses)


@dataclass
class TrainConfig:
    seed: int = 0
    sinks: int = 4
    window: int = 64
    # Model (Qwen3 shapes): 2 layers, hidden 128 (~0.6M parameters).
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    rope_theta: float = 10000.0
    # Optimisation.
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    filler_coef: float = 0.0  # only answers are ever decoded; filler LM loss delayed retrieval in trials
    max_steps: int = 7500
    # Curriculum. Retrieval is learned after a plateau; copy drills and short prompts with a small needle
    # gap shorten it (session-1 trials without drills: 4 layers with filler loss were at chance after 2,250
    # steps; 2 layers on single needles only took ~1,250 steps and never learned key matching). Stage 1
    # mixes in the multi-key lookups so that retrieval must match keys, not just find "the" number.
    # Later stages use the evaluation geometry (gap = window) on every task, half the examples with a
    # Local view of their answer (see `batch_losses`), then the evaluation lengths.
    curriculum: list[Stage] = field(default_factory=lambda: [
        Stage(until=1500, lengths=(128,), min_gap=16, batch_tokens=2048, copy_fraction=0.25,
              tasks=("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                     "niah_multiquery", "niah_multivalue")),
        Stage(until=3000, lengths=(256,), batch_tokens=4096, local_view=0.5),
        Stage(until=10**9, lengths=(256, 512, 768, 1024), batch_tokens=4096, local_view=0.5),
    ])
    heldout_size: int = 100
    save_every: int = 200
    eval_every: int = 250
    threads: int = 2

    def stage(self, step: int) -> Stage:
        for stage in self.curriculum:
            if step < stage.until:
                return stage
        return self.curriculum[-1]

    def model_config(self):
        from transformers import Qwen3Config

        cfg = Qwen3Config(
            vocab_size=len(VOCAB), hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, max_position_embeddings=2048,
            rope_theta=self.rope_theta, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
            pad_token_id=PAD_ID, attention_dropout=0.0)
        cfg._attn_implementation = "sdpa"
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        d["curriculum"] = [Stage(**{**s, "lengths": tuple(s["lengths"]),
                                    "tasks": None if s.get("tasks") is None else tuple(s["tasks"])})
                           for s in d["curriculum"]]
        return cls(**d)


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _fits(task: str, length: int, gap: int) -> bool:
    return min_length(task, gap) <= length


def _draw_batch(corpus: OrganismCorpus, cfg: TrainConfig, step: int):
    """The task examples of `step`, its prompt length and its sequence count (drills included)."""
    stage = cfg.stage(step)
    rng = random.Random(_derive_seed(cfg.seed, "batch", step))
    length = rng.choice(stage.lengths)
    gap = cfg.window if stage.min_gap is None else stage.min_gap
    tasks = [t for t in (stage.tasks or TASKS) if _fits(t, length, gap)]
    if not tasks:
        raise ValueError(f"no task of {stage.tasks or TASKS} fits length {length} with gap {gap}")
    n = max(1, stage.batch_tokens // length)
    n_tasks = n - round(stage.copy_fraction * n)
    examples = [corpus.example(rng.choice(tasks), length, "train", step * 4096 + j, min_gap=gap)
                for j in range(n_tasks)]
    return examples, length, n


def batch_examples(corpus: OrganismCorpus, cfg: TrainConfig, step: int):
    """The task examples of `step` (a pure function of the seed and the step)."""
    return _draw_batch(corpus, cfg, step)[0]


def batch_sequences(corpus: OrganismCorpus, cfg: TrainConfig, step: int):
    """The training sequences of `step` and, per sequence, whether it is trained with a Local view:
    the stage's task examples, then its copy drills (same length)."""
    examples, length, n = _draw_batch(corpus, cfg, step)
    sequences = [training_sequence(ex, filler_weight=1.0) for ex in examples]
    sequences += [copy_sequence(_derive_seed(cfg.seed, "copy", step, j), length) for j in range(n - len(examples))]
    n_local = round(cfg.stage(step).local_view * len(examples))
    return sequences, [j < n_local for j in range(len(sequences))]


def collate(sequences, local_view=None) -> dict:
    """Right-padded tensors: input_ids, attention_mask, labels, weights, retrieved, prompt_length and
    local_view (which rows are trained with a Local view of their target; default none)."""
    T = max(len(s.input_ids) for s in sequences)
    out = {k: [] for k in ("input_ids", "attention_mask", "labels", "weights", "retrieved")}
    for s in sequences:
        pad = T - len(s.input_ids)
        out["input_ids"].append(s.input_ids + [PAD_ID] * pad)
        out["attention_mask"].append([1] * len(s.input_ids) + [0] * pad)
        out["labels"].append(s.labels + [-100] * pad)
        out["weights"].append(s.weights + [0.0] * pad)
        out["retrieved"].append(s.retrieved + [0] * pad)
    batch = {k: torch.tensor(v, dtype=torch.float32 if k == "weights" else torch.long) for k, v in out.items()}
    batch["prompt_length"] = torch.tensor([s.prompt_length for s in sequences])
    batch["local_view"] = torch.tensor([False] * len(sequences) if local_view is None else list(local_view))
    return batch


def local_attention_mask(length: int, sinks: int, window: int, batch: int = 1) -> dict:
    """A Local (sinks + recent window, current token included) causal mask in the dict form
    Qwen3 accepts as ``attention_mask`` (bypasses mask building). For teacher-forced diagnostics."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = (j <= i) & ((j < sinks) | (j > i - window))
    return {"full_attention": allowed[None, None].expand(batch, 1, length, length)}


def local_view_attention_mask(batch: dict, sinks: int, window: int) -> dict:
    """Per-row masks: Full causal attention, except that in ``local_view`` rows every position from
    the first target token on sees only the sinks and the recent window. This is what StreamingLLM
    decoding after a Full prefill computes, so training on it teaches the model to continue
    locally predictable text (the question's restatement, formatting, ``<eos>``) from a Local view."""
    B, T = batch["input_ids"].shape
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    causal = j <= i
    local = causal & ((j < sinks) | (j > i - window))
    local_rows = batch["local_view"][:, None] & (torch.arange(T)[None, :] >= batch["prompt_length"][:, None])
    return {"full_attention": torch.where(local_rows[:, :, None], local, causal)[:, None]}


def batch_losses(model, batch: dict, filler_coef: float, attention_mask=None, sinks: int = 4,
                 window: int = 64) -> dict:
    """Target CE, filler CE, the training loss and token accuracies of one batch.

    In ``local_view`` rows, the target positions see only the Local view (`local_view_attention_mask`)
    and the loss skips the retrieved tokens, which Local cannot know: the model learns to restate
    and format from the window, and retrieval stays Full's job.
    """
    local_view = batch.get("local_view")
    has_local = local_view is not None and bool(local_view.any())
    if attention_mask is None:
        attention_mask = local_view_attention_mask(batch, sinks, window) if has_local else batch["attention_mask"]
    logits = model(input_ids=batch["input_ids"], attention_mask=attention_mask).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    retrieved = batch["retrieved"][:, 1:].bool()
    is_target = batch["labels"][:, 1:] != -100
    local_rows = (local_view if has_local else torch.zeros(len(targets), dtype=torch.bool))[:, None]
    is_answer = is_target & ~(local_rows & retrieved)
    weights = batch["weights"][:, 1:] * (~is_target)
    correct = logits.argmax(-1) == targets
    full_retrieved = retrieved & ~local_rows
    local_target = is_target & ~retrieved & local_rows
    answer_loss = (ce * is_answer).sum() / is_answer.sum().clamp(min=1)
    filler_loss = (ce * weights).sum() / weights.sum().clamp(min=1e-9)
    return {
        "loss": answer_loss + filler_coef * filler_loss,
        "answer_loss": answer_loss,
        "filler_loss": filler_loss,
        "answer_acc": (correct & is_answer).sum() / is_answer.sum().clamp(min=1),
        "retrieved_acc": (correct & full_retrieved).sum() / full_retrieved.sum().clamp(min=1),
        "local_target_acc": (correct & local_target).sum() / local_target.sum().clamp(min=1),
        "row_retrieved_acc": (correct & full_retrieved).sum(1) / full_retrieved.sum(1).clamp(min=1),
    }


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, each with its own memory (safetensors refuses shared storage, e.g. tied embeddings)."""
    seen, out = set(), {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out


def save_checkpoint(path: str, *, cfg: TrainConfig, model, optimizer, scheduler, step: int, train_digest: str,
                    n_seen: int, elapsed: float) -> None:
    """Write the training state atomically: tensors in safetensors, the rest as JSON in its metadata."""
    from safetensors.torch import save_file

    tensors = {f"model/{name}": t for name, t in model.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    plain_state = {}
    for index, entry in optimizer_state["state"].items():
        plain_state[str(index)] = {k: v for k, v in entry.items() if not torch.is_tensor(v)}
        tensors.update({f"optimizer/{index}/{k}": v for k, v in entry.items() if torch.is_tensor(v)})
    tensors["rng/torch"] = torch.get_rng_state()
    python_rng = random.getstate()
    state = {"format": CHECKPOINT_FORMAT, "config": cfg.to_dict(), "step": step, "train_digest": train_digest,
             "n_seen": n_seen, "elapsed": elapsed, "scheduler": scheduler.state_dict(),
             "optimizer": {"param_groups": optimizer_state["param_groups"], "state": plain_state},
             "python_rng": [python_rng[0], list(python_rng[1]), python_rng[2]]}
    with atomic_path(path) as temporary:  # its staging folder also holds safetensors' own temporary
        save_file(_unshared(tensors), temporary, metadata={"oda_organism_checkpoint": json.dumps(state)})


def load_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON state, tensors) of a checkpoint written by `save_checkpoint`."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a file that is not safetensors
        raise ValueError(f"{path} is not a readable safetensors checkpoint ({err}). Start a new run in another "
                         "--output.") from err
    if "oda_organism_checkpoint" not in metadata:
        raise ValueError(f"{path} is not an organism training checkpoint (no 'oda_organism_checkpoint' metadata).")
    state = json.loads(metadata["oda_organism_checkpoint"])
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r} is not supported "
                         f"(this version reads format {CHECKPOINT_FORMAT}).")
    return state, tensors


def restore_checkpoint(state: dict, tensors: dict[str, torch.Tensor], model, optimizer, scheduler) -> None:
    """Put a loaded checkpoint back into the model, optimizer, scheduler and RNGs."""
    model.load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
    optimizer_state = {int(index): dict(entry) for index, entry in state["optimizer"]["state"].items()}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, index, name = key.split("/", 2)
            optimizer_state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": optimizer_state, "param_groups": state["optimizer"]["param_groups"]})
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(tensors["rng/torch"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))


def _lr_lambda(cfg: TrainConfig):
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return fn


def _fixed_dev_batches(corpus: OrganismCorpus, cfg: TrainConfig, lengths, per_task: int = 2):
    batches = {}
    for length in lengths:
        tasks = [t for t in TASKS if _fits(t, length, cfg.window)]
        exs = [corpus.example(t, length, "dev", i) for t in tasks for i in range(per_task)]
        batches[length] = (collate([training_sequence(e, filler_weight=1.0) for e in exs]), [e.task for e in exs])
    return batches


@torch.no_grad()
def dev_report(model, batches: dict, cfg: TrainConfig) -> dict:
    """Teacher-forced accuracies on fixed dev examples: retrieved tokens with Full (overall and per
    task) and with an all-Local mask, and the non-retrieved target tokens with a Local view."""
    model.eval()
    report = {}
    for length, (batch, tasks) in batches.items():
        full = batch_losses(model, batch, cfg.filler_coef)
        local_mask = local_attention_mask(batch["input_ids"].shape[1], cfg.sinks, cfg.window,
                                          batch["input_ids"].shape[0])
        local = batch_losses(model, batch, cfg.filler_coef, attention_mask=local_mask)
        viewed = batch_losses(model, {**batch, "local_view": torch.ones_like(batch["local_view"])}, cfg.filler_coef,
                              sinks=cfg.sinks, window=cfg.window)
        per_task = {}
        for task, acc in zip(tasks, full["row_retrieved_acc"].tolist()):
            per_task.setdefault(task, []).append(acc)
        report[length] = {
            "full_retrieved_acc": round(full["retrieved_acc"].item(), 4),
            "local_retrieved_acc": round(local["retrieved_acc"].item(), 4),
            "local_view_target_acc": round(viewed["local_target_acc"].item(), 4),
            "full_filler_ce": round(full["filler_loss"].item(), 4),
            "per_task_full_retrieved_acc": {t: round(sum(v) / len(v), 2) for t, v in per_task.items()},
        }
    model.train()
    return report


def train(output: str, cfg: TrainConfig, resume: bool = False, progress: bool = True,
          stop_at: int | None = None) -> str:
    """Train (or resume) into `output`; returns the output folder.

    `stop_at` pauses the run at that step (checkpoint written, no model export); ``resume=True``
    later continues it. The learning-rate schedule always spans ``cfg.max_steps``.
    """
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from .tokenizer import save_tokenizer

    torch.set_num_threads(cfg.threads)
    os.makedirs(output, exist_ok=True)
    ckpt_path = os.path.join(output, CHECKPOINT_NAME)
    corpus = OrganismCorpus(seed=cfg.seed, window=cfg.window, heldout_size=cfg.heldout_size)

    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(cfg.model_config())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    step, digest, n_seen, elapsed = 0, hashlib.sha256(b"oda-organism-train").hexdigest(), 0, 0.0
    legacy_path = os.path.join(output, LEGACY_CHECKPOINT_NAME)
    if resume and not os.path.exists(ckpt_path) and os.path.exists(legacy_path):
        raise ValueError(
            f"{legacy_path} is a pickle checkpoint of an older oda_hf. It is not loaded: unpickling can run arbitrary "
            f"code. Start a new run in another --output (or without --resume); this version writes {CHECKPOINT_NAME}.")
    if resume and os.path.exists(ckpt_path):
        state, tensors = load_checkpoint(ckpt_path)
        saved = TrainConfig.from_dict(state["config"])
        if dataclasses.replace(saved, max_steps=cfg.max_steps, threads=cfg.threads, save_every=cfg.save_every,
                               eval_every=cfg.eval_every) != cfg:
            raise ValueError(f"{ckpt_path} was written with a different configuration; use another --output.")
        restore_checkpoint(state, tensors, model, optimizer, scheduler)
        step, digest, n_seen, elapsed = state["step"], state["train_digest"], state["n_seen"], state["elapsed"]
        print(f"[organism] resumed from {ckpt_path} at step {step}")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    print(f"[organism] seed={cfg.seed} params={n_params:,} vocab={len(VOCAB)} vocab_sha256={vocab_sha256()[:16]}")
    eval_lengths = sorted({L for s in cfg.curriculum for L in s.lengths if L >= 256} | {256})
    dev_batches = _fixed_dev_batches(corpus, cfg, eval_lengths[:1] + eval_lengths[-1:])
    log_path = os.path.join(output, "train_log.jsonl")

    def checkpoint():
        save_checkpoint(ckpt_path, cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler, step=step,
                        train_digest=digest, n_seen=n_seen, elapsed=elapsed)

    bar = tqdm(total=cfg.max_steps, initial=step, disable=not progress, dynamic_ncols=True, desc="organism",
               mininterval=0.5 if sys.stderr.isatty() else 10.0)
    ema = {}
    t_last = time.time()
    end = cfg.max_steps if stop_at is None else min(stop_at, cfg.max_steps)
    while step < end:
        sequences, local_view = batch_sequences(corpus, cfg, step)
        for seq in sequences:
            digest = hashlib.sha256((digest + seq.content_hash).encode()).hexdigest()
        n_seen += len(sequences)
        batch = collate(sequences, local_view)
        out = batch_losses(model, batch, cfg.filler_coef, sinks=cfg.sinks, window=cfg.window)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        for k in ("loss", "answer_acc", "retrieved_acc", "local_target_acc", "filler_loss"):
            ema[k] = out[k].item() if k not in ema else 0.95 * ema[k] + 0.05 * out[k].item()
        bar.update(1)
        bar.set_postfix(L=len(sequences[0].input_ids), loss=f"{ema['loss']:.3f}", ans=f"{ema['answer_acc']:.2f}",
                        ret=f"{ema['retrieved_acc']:.2f}", loc=f"{ema['local_target_acc']:.2f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
        record = None
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            record = {"step": step, "elapsed_s": round(elapsed, 1), "steps_per_s": round(step / max(elapsed, 1e-9), 3),
                      **{f"train_{k}": round(v, 4) for k, v in ema.items()},
                      "dev": dev_report(model, dev_batches, cfg)}
            tqdm.write(json.dumps(record))
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            t_last = time.time()  # evaluation time is not training time
        if step % cfg.save_every == 0 or step == end:
            checkpoint()
            t_last = time.time()
    bar.close()
    if step < cfg.max_steps:
        print(f"[organism] paused at step {step}/{cfg.max_steps}: {ckpt_path} (continue with --resume)")
        return output

    model.eval()
    model.save_pretrained(output, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False,
                     max_new_tokens=64).save_pretrained(output)
    save_tokenizer(output)
    info = {
        "seed": cfg.seed, "steps": step, "train_examples_seen": n_seen, "train_data_sha256": digest,
        "vocab_sha256": vocab_sha256(), "heldout_size": cfg.heldout_size,
        "test_sha256": corpus.fingerprint("test", lengths=EVAL_LENGTHS),
        "dev_sha256": corpus.fingerprint("dev", lengths=EVAL_LENGTHS),
        "sinks": cfg.sinks, "window": cfg.window, "parameters": n_params, "train_seconds": round(elapsed, 1),
        "train_config": cfg.to_dict(),
    }
    with open(os.path.join(output, ORGANISM_FILE), "w") as f:
        json.dump(info, f, indent=2)
    print(f"[organism] done: steps={step} seed={cfg.seed} train_data_sha256={digest} "
          f"test_sha256={info['test_sha256']} dev_sha256={info['dev_sha256']}")
    return output


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_backbone(model_dir, split: str = "test", n: int = 20, *, tasks=TASKS, lengths=EVAL_LENGTHS,
                      policies=("full", "local"), sinks: int = 4, window: int = 64, seed: int | None = None,
                      batch_size: int = 10, return_predictions: bool = False, progress: bool = False) -> dict:
    """Greedy generation on held-out prompts, scored per task with RULER's string match (percent).

    `model_dir` is a folder written by `train` (or an already loaded model). ``"full"`` is the
    stock model's `generate`; ``"local"`` is StreamingLLM (sinks + window) through
    ``OdaForCausalLM(policy="local")`` with Full prefill. Returns
    ``{policy: {length: {task: score, "avg": mean}}}`` (plus ``"predictions"`` if asked).
    """
    from transformers import AutoModelForCausalLM

    from .. import OdaConfig, OdaForCausalLM

    if isinstance(model_dir, (str, os.PathLike)):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        info_path = os.path.join(model_dir, ORGANISM_FILE)
        if seed is None and os.path.exists(info_path):
            with open(info_path) as f:
                seed = json.load(f)["seed"]
    else:
        model = model_dir.eval()
    corpus = OrganismCorpus(seed=seed or 0, window=window)
    runners = {}
    for policy in policies:
        if policy == "full":
            runners[policy] = model
        else:
            runners[policy] = OdaForCausalLM(model, oda_config=OdaConfig(sinks=sinks, window=window, policy=policy))
    results = {policy: {} for policy in policies}
    predictions = []
    todo = [(L, t) for L in lengths for t in tasks]
    for length, task in tqdm(todo, disable=not progress, desc="evaluate"):
        examples = [corpus.example(task, length, split, i) for i in range(n)]
        max_new = max(len(e.target_ids()) for e in examples) + 4
        for policy, runner in runners.items():
            scores = []
            for b in range(0, n, batch_size):
                chunk = examples[b:b + batch_size]
                ids = torch.tensor([e.prompt_ids() for e in chunk])  # same length: no padding
                out = runner.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                      do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
                for e, row in zip(chunk, out[:, ids.shape[1]:].tolist()):
                    text = " ".join(VOCAB[i] for i in row if i not in (PAD_ID, BOS_ID, EOS_ID))
                    scores.append(example_score(text, e.answers, e.metric))
                    if return_predictions:
                        predictions.append({"policy": policy, "task": task, "length": length, "index": e.index,
                                            "prediction": text, "answers": list(e.answers), "target": e.target})
            results[policy].setdefault(length, {})[task] = 100.0 * sum(scores) / len(scores)
    for policy in policies:
        for length, per_task in results[policy].items():
            per_task["avg"] = sum(per_task.values()) / len(per_task)
    if return_predictions:
        results["predictions"] = predictions
    return results


def format_scores(results: dict) -> str:
    lines = []
    for policy, by_length in results.items():
        if policy == "predictions":
            continue
        for length, per_task in by_length.items():
            cells = " ".join(f"{t}={s:.0f}" for t, s in per_task.items())
            lines.append(f"{policy:>6} L={length}: {cells}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="output folder (model, tokenizer, checkpoint)")
    parser.add_argument("--resume", action="store_true", help="continue from <output>/checkpoint.safetensors if present")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="corpus and initialisation seed (default: --config's, "
                        "else 0)")
    parser.add_argument("--stop-at", type=int, default=None, help="pause at this step (resume later)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 2)")
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--config", default=None, help="JSON file overriding TrainConfig fields")
    parser.add_argument("--evaluate", type=int, default=0, metavar="N",
                        help="after training, evaluate N test examples per task and length (Full and Local)")
    args = parser.parse_args(argv)

    overrides = {}
    if args.config:
        with open(args.config) as f:
            overrides = json.load(f)
    base = TrainConfig().to_dict()
    base.update(overrides)
    for key in ("seed", "max_steps", "threads", "save_every", "eval_every"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    cfg = TrainConfig.from_dict(base)
    train(args.output, cfg, resume=args.resume, stop_at=args.stop_at)
    if args.evaluate and os.path.exists(os.path.join(args.output, ORGANISM_FILE)):
        results = evaluate_backbone(args.output, "test", args.evaluate, sinks=cfg.sinks, window=cfg.window)
        print(format_scores(results))


if __name__ == "__main__":
    main()
