"""`OdaTrainer`: Hugging Face Trainer for the recall head (paper Algorithm 2, Appendix "Regression target").

    trainer = OdaTrainer(model=oda_model, args=OdaTrainingArguments(output_dir=..., max_steps=...),
                         train_dataset=PackedDataset(rows))
    trainer.train()            # head-only checkpoints; resume_from_checkpoint=True resumes them
    trainer.save_model(path)   # the head (+ routing defaults), loadable by OdaForCausalLM.from_pretrained

What differs from a stock Trainer:

* `trainer.model` is a `HeadTrainingModule`: the frozen backbone runs without gradients in its own
  dtype and in eval mode (paired supervision), the head runs in FP32 with autocast off; only head
  parameters require gradients.
* Before an update, `get_batch_samples` counts eligible tokens of each microbatch (tokens only, no
  model), all-reduced over processes; the counts ride along in each batch and give `compute_loss`
  the ``micro``/``step`` normalisation of `losses.py`. `num_items_in_batch` is the update's pooled
  eligible count.
* An update whose pooled count is zero is skipped on every process: no forward or backward, the
  optimizer sees no gradient (so it changes nothing) and the LR scheduler does not advance; as with
  an AMP overflow skip, ``global_step`` still counts it. `skipped_updates` / `applied_updates` count
  both kinds, and every training log line carries ``eligible_tokens`` and ``skipped_updates``; its
  ``loss`` (and ``train_loss``) is the mean over the updates applied, which a skipped one's zero would lower.
  Training data with no eligible position at all raises ``ValueError``.
* Checkpoints hold the head only (``model.safetensors`` + ``config.json`` via
  `RecallHead.save_pretrained`, plus ``oda_config.json``); resuming loads them back into the head.
  Each is written under a temporary name and renamed when complete, so a run killed mid-save never
  leaves a partial ``checkpoint-N``; ``resume_from_checkpoint=True`` takes the newest complete one
  (`last_complete_checkpoint`). The final head (`save_model`) is staged beside its folder and moved in
  with ``config.json`` last, so it is complete or absent too. No pickle: the training arguments are
  saved as JSON.
* ``oda_training.json`` (in every checkpoint and the final folder) records the settings that define
  the supervision (`OdaTrainer.supervision_settings`). Resuming with other settings is an error
  naming them, unless ``oda_allow_changed_settings=True``; the file then keeps the change in its
  ``history``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from dataclasses import dataclass, field

import safetensors.torch
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import find_batch_size
from transformers.trainer_utils import (PREFIX_CHECKPOINT_DIR, EvalLoopOutput, IntervalStrategy, TrainOutput,
                                      rotate_checkpoints)
from transformers.utils import SAFE_WEIGHTS_NAME, logging

from ..config import CALIBRATION_NAME, OdaConfig
from ..files import publish_files, staging_folder
from ..known_models import short_name_of
from ..head import HEAD_WEIGHT_FILES
from ..head import uncalibrated_routing
from ..head import base_config_fingerprint, base_fingerprint as weights_fingerprint
from ..validation import MAX_SPAN, integer, number
from ..modeling import OdaForCausalLM
from .data import OdaDataCollator
from .layout import count_eligible
from .losses import check_reduction, microbatch_loss, regression_target, token_losses
from .paired import LM_CHUNK, paired_supervision

logger = logging.get_logger(__name__)

TRAINING_ARGS_NAME = "training_args.json"
TRAINER_STATE_NAME = "trainer_state.json"
SETTINGS_NAME = "oda_training.json"
#: Training arguments a resumed run keeps whatever it is given: the checkpoint's optimizer and schedule state carry
#: its learning rate and warm-up, and the data order follows its seed and batch shape.
RESUME_KEEPS = ("learning_rate", "warmup_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "weight_decay",
                "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "data_seed", "optim",
                "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon")
STAGING_PREFIX = "tmp-checkpoint-"  # a checkpoint being written; renamed to checkpoint-N when complete
MICRO_COUNT, UPDATE_COUNT, NUM_MICRO = "oda_micro_count", "oda_update_count", "oda_num_micro"
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "labels")


@dataclass
class OdaTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus ODA's head-training knobs; defaults follow the paper (ODA_SPEC section 5).

    Paper defaults set here: AdamW, lr 3e-4 after a 102-update linear warm-up (then constant: the paper
    gives no decay), weight decay 0, gradient clipping 1.0.
    """

    oda_lambda: float = field(default=0.0, metadata={"help": "Full-call penalty lambda (NLL scale), >= 0."})
    oda_tau_hist: float = field(default=0.001, metadata={"help": "History threshold tau_hist for H selection."})
    oda_loss_reduction: str = field(default="micro", metadata={"help": "'micro' or 'step' (see oda_hf.training.losses)."})
    oda_sinks: int | None = field(default=None, metadata={"help": "Sinks s (default: the model's OdaConfig)."})
    oda_window: int | None = field(default=None, metadata={"help": "Window w (default: the model's OdaConfig)."})
    oda_lm_chunk: int = field(default=LM_CHUNK, metadata={"help": "Positions per vocabulary log-sum-exp chunk."})
    oda_allow_changed_settings: bool = field(default=False, metadata={
        "help": "Resume even if the checkpoint was trained with other supervision settings (recorded in its history)."})

    learning_rate: float = field(default=3e-4, metadata={"help": "Peak learning rate (paper: 3e-4)."})
    warmup_steps: float = field(default=102, metadata={"help": "Linear warm-up updates (paper: 102)."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": "LR schedule after warm-up."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep position_ids/labels columns."})
    # Every head parameter takes part in every forward (an empty microbatch still runs the head on zero rows).
    ddp_find_unused_parameters: bool | None = field(default=False, metadata={"help": "See DDP."})

    def __post_init__(self):
        self._check_values()
        super().__post_init__()
        check_reduction(self.oda_loss_reduction)
        if self.push_to_hub:
            raise ValueError("OdaTrainingArguments(push_to_hub=True): the Trainer's own push uploads its checkpoints "
                             "(optimizer state, pickles) and a card without ODA's provenance, not a head that loads by "
                             "id. Train, then call trainer.push_to_hub(repo_id) (or model.push_to_hub(repo_id)), which "
                             "publishes the head's files in one commit.")
        if getattr(self, "activation_checkpointing", False):
            raise ValueError("The backbone runs without gradients and the head is small: activation checkpointing "
                             "has nothing to save here; leave it off.")
        if self.fp16 or self.bf16:
            raise ValueError(
                "OdaTrainer keeps the recall head in FP32 and runs the frozen backbone in the dtype it was loaded "
                "with: load the base model in bfloat16/float16 instead of setting bf16/fp16."
            )

    def _check_values(self) -> None:
        """Counts and rates a Trainer run needs, checked before the stock arguments use them: a zero accumulation
        would divide by zero, zero epochs or steps (or lr 0) would save an untrained head as if trained."""
        self.per_device_train_batch_size = integer("per_device_train_batch_size", self.per_device_train_batch_size,
                                                   minimum=1)
        self.gradient_accumulation_steps = integer("gradient_accumulation_steps", self.gradient_accumulation_steps,
                                                   minimum=1)
        self.max_steps = integer("max_steps", self.max_steps, minimum=-1)
        if self.max_steps == 0:
            raise ValueError("`max_steps` must be >= 1 (optimizer updates), or -1 to train for num_train_epochs; "
                             "got 0.")
        if self.max_steps < 0:  # epochs decide
            number("num_train_epochs", self.num_train_epochs, minimum=0.0, exclusive_minimum=True)
        number("learning_rate", self.learning_rate, minimum=0.0, exclusive_minimum=True)
        number("warmup_steps", self.warmup_steps, minimum=0.0)
        for name in ("save_steps", "logging_steps"):  # a float < 1 is the stock "fraction of training"
            if getattr(self, name) is not None:
                number(name, getattr(self, name), minimum=0.0, exclusive_minimum=True)
        self.seed = integer("seed", self.seed, minimum=0, maximum=2**32 - 1)
        number("oda_lambda", self.oda_lambda, minimum=0.0, meaning="a Full-call penalty")
        number("oda_tau_hist", self.oda_tau_hist, meaning="the history threshold")
        if self.oda_sinks is not None:
            self.oda_sinks = integer("oda_sinks", self.oda_sinks, minimum=0, maximum=MAX_SPAN)
        if self.oda_window is not None:
            self.oda_window = integer("oda_window", self.oda_window, minimum=1, maximum=MAX_SPAN)
        self.oda_lm_chunk = integer("oda_lm_chunk", self.oda_lm_chunk, minimum=1)


def is_complete_checkpoint(folder: str) -> bool:
    """A checkpoint folder whose head weights, head config and (last written) trainer state are there and readable."""
    if not os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_NAME)):
        return False
    for name in (TRAINER_STATE_NAME, "config.json"):  # a 0-byte config.json of an older, non-atomic save
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                if not isinstance(json.load(f), dict):
                    return False
        except (OSError, ValueError):
            return False
    return True


def last_complete_checkpoint(folder: str, clean: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` in `folder` (None if there is none).

    Incomplete ones (written by a run killed mid-save before saves were atomic) are skipped, and
    leftover ``tmp-checkpoint-N`` folders of interrupted saves are removed (``clean``); both are logged.
    """
    if not os.path.isdir(folder):
        return None
    found = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(STAGING_PREFIX):
            if clean:
                logger.warning(f"Removing {path}: a checkpoint whose writing was interrupted.")
                shutil.rmtree(path, ignore_errors=True)
            continue
        prefix, _, number = name.partition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and number.isdigit():
            found.append((int(number), path))
    for _, path in sorted(found, reverse=True):
        if is_complete_checkpoint(path):
            return path
        logger.warning(f"Skipping {path}: incomplete checkpoint (no {SAFE_WEIGHTS_NAME} or no readable "
                       f"{TRAINER_STATE_NAME}); resuming from an older one.")
    return None


#: Supervision settings recorded since a later oda_hf: compared only where a checkpoint records them.
RECORDED_SINCE = ("base_fingerprint", "base_dtype", "cache_dtypes", "base_config_sha256", "head_width",
                  "input_variant")


def _differences(saved: dict, current: dict) -> list[str]:
    if saved.get("base_model"):  # checkpoints written before bases were recorded by short name hold the path
        saved = {**saved, "base_model": short_name_of(saved["base_model"]) or saved["base_model"]}
    return [f"{key}: {saved.get(key)!r} in the checkpoint, {current.get(key)!r} now"
            for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)
            and (key in saved or key not in RECORDED_SINCE)]


class HeadTrainingModule(nn.Module):
    """What the Trainer (and DDP) wraps: forward gives per-token Huber losses of the eligible positions."""

    accepts_loss_kwargs = False
    main_input_name = "input_ids"

    def __init__(self, oda_model: OdaForCausalLM, *, sinks: int, window: int, oda_lambda: float, tau_hist: float,
                 lm_chunk: int = LM_CHUNK):
        super().__init__()
        self.oda = oda_model
        self.sinks, self.window, self.oda_lambda, self.tau_hist, self.lm_chunk = sinks, window, oda_lambda, tau_hist, lm_chunk
        oda_model.base_model.requires_grad_(False)
        oda_model.base_model.eval()
        oda_model.recall_head.float().requires_grad_(True)

    @property
    def recall_head(self):
        return self.oda.recall_head

    def train(self, mode: bool = True):
        # Trainer switches the model to train mode every step: only the head may follow (no backbone dropout).
        self.training = mode
        self.oda.recall_head.train(mode)
        self.oda.base_model.eval()
        return self

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None) -> dict:
        with torch.autocast(device_type=input_ids.device.type, enabled=False):
            batch = paired_supervision(self.oda, input_ids, attention_mask, position_ids, labels, sinks=self.sinks,
                                       window=self.window, tau_hist=self.tau_hist, lm_chunk=self.lm_chunk)
            scores = self.oda.recall_head(batch.prev_hidden, batch.input_embeds, batch.local_hidden)
            targets = regression_target(batch.gains, self.oda_lambda)
            losses = token_losses(scores, targets)
        return {"losses": losses, "scores": scores.detach(), "targets": targets, "gains": batch.gains}


class _SkipAwareScheduler:
    """Wraps the LR scheduler so that a skipped (empty) update does not advance it."""

    def __init__(self, scheduler, trainer: "OdaTrainer"):
        self.__dict__.update(scheduler=scheduler, _trainer=trainer)

    def step(self, *args, **kwargs):
        if not self._trainer._skip_update:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["scheduler"], name)


class _RetryFromTheStart(TrainerCallback):
    """Starts each run of the training loop where `train()` did (`OdaTrainer._start_attempt`): `auto_find_batch_size`
    reruns the loop at a smaller batch after an out-of-memory error, which transformers continues from the failed
    attempt's head, optimizer state and (ODA's) update counts."""

    def __init__(self, trainer: "OdaTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._start_attempt()


def _on_cpu(value):
    """A copy of `value` (dicts, lists and tuples of tensors and plain values) with its tensors on the CPU."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return copy.deepcopy(value)


def eval_sets(eval_dataset) -> dict:
    """Trainer's `eval_dataset` as ``{name: dataset}``: its named sets, or ``{None: it}`` ({} without one)."""
    if eval_dataset is None:
        return {}
    return dict(eval_dataset) if isinstance(eval_dataset, dict) else {None: eval_dataset}


def _over_applied(loss: float, updates: int, skipped: int) -> float:
    """A logged loss (Trainer's sum over `updates` divided by their number) as the mean over the updates applied: a
    skipped one adds a zero loss to the sum (NaN when none was applied)."""
    if not skipped:
        return loss
    return loss * updates / (updates - skipped) if updates > skipped else float("nan")


class OdaTrainer(Trainer):
    """Trains `model.recall_head` of an `OdaForCausalLM` on paired supervision (see the module docstring)."""

    loss_is_scaled_for_ga = True  # compute_loss normalises over the whole update itself
    training_module_class = HeadTrainingModule  # what runs per microbatch (subclasses: cached supervision)
    model_inputs = MODEL_INPUTS                  # batch keys passed to it

    def __init__(self, model: OdaForCausalLM, args: OdaTrainingArguments, train_dataset=None, eval_dataset=None,
                 data_collator=None, supervision_settings: dict | None = None, **kwargs):
        """`supervision_settings`: further settings that change the supervision and are known only to the
        caller (e.g. the packing length of the data); recorded and checked on resume with the trainer's own."""
        if not isinstance(model, OdaForCausalLM):
            raise TypeError(f"OdaTrainer trains the recall head of an OdaForCausalLM; got {type(model).__name__}.")
        if model.recall_head is None:
            raise ValueError("The OdaForCausalLM has no recall head to train: build one with "
                             "RecallHead(RecallHeadConfig.for_base(base)) and pass it as head=...")
        if not isinstance(args, OdaTrainingArguments):
            raise TypeError("OdaTrainer needs OdaTrainingArguments (it carries oda_lambda, oda_tau_hist, ...).")
        self.oda_model = model
        self.oda_sinks = model.oda_config.sinks if args.oda_sinks is None else args.oda_sinks
        self.oda_window = model.oda_config.window if args.oda_window is None else args.oda_window
        OdaConfig(sinks=self.oda_sinks, window=self.oda_window)  # validates both
        head_config = model.recall_head.config
        head_config.sinks, head_config.window = self.oda_sinks, self.oda_window
        head_config.oda_lambda, head_config.tau_hist = args.oda_lambda, args.oda_tau_hist
        # The weights the head learns to read: `for_base` records them only when given a loaded model (a head made
        # from the base's name held none, so using it on another base went unnoticed).
        head_config.base_fingerprint = weights_fingerprint(model.base_model)
        head_config.base_config_sha256 = base_config_fingerprint(model)
        base_path = getattr(model.config, "_name_or_path", None) or None
        base_name = short_name_of(base_path) or base_path  # a fetched base by its short name, not this machine's path
        head_config.base_model_name_or_path = head_config.base_model_name_or_path or base_name
        module = self.training_module_class(model, sinks=self.oda_sinks, window=self.oda_window,
                                            oda_lambda=args.oda_lambda, tau_hist=args.oda_tau_hist,
                                            lm_chunk=args.oda_lm_chunk)
        if data_collator is None:
            pad = getattr(model.config.get_text_config(decoder=True), "pad_token_id", None)
            data_collator = OdaDataCollator(pad_token_id=pad if pad is not None else 0)
        super().__init__(model=module, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         data_collator=data_collator, **kwargs)
        if self.args.n_gpu > 1:
            raise ValueError("OdaTrainer does not support single-process multi-GPU DataParallel; launch one process "
                             "per GPU (torchrun / accelerate launch) for data parallelism.")
        self.skipped_updates = 0
        self.applied_updates = 0
        self._skip_update = False
        self._eligible_since_log = 0
        self._updates_since_log = self._skipped_since_log = self._skipped_before_train = 0
        self._best_loaded_step = None   # the update count of a best checkpoint loaded at the end (`_load_best_model`)
        self._counts_before_train, self._attempt_start = (0, 0), None
        self.add_callback(_RetryFromTheStart(self))
        from .supervision_cache import base_fingerprint

        self.supervision_settings = {
            "base_model": base_name,
            # the weights, config and dtype the hidden states come from (a path, or a name, says none of them)
            "base_fingerprint": base_fingerprint(model), "base_dtype": str(model.dtype).removeprefix("torch."),
            "base_config_sha256": base_config_fingerprint(model),
            # the head's shape: a fresh run of another shape into a run's folder would replace its checkpoints
            "head_width": head_config.head_width, "input_variant": head_config.input_variant,
            "sinks": self.oda_sinks, "window": self.oda_window, "oda_lambda": args.oda_lambda,
            "tau_hist": args.oda_tau_hist, "loss_reduction": args.oda_loss_reduction, **(supervision_settings or {}),
        }
        self._settings_history: list[dict] = []
        self._staging_dir: str | None = None

    # -- eligible-token counts of an update -----------------------------------------------------------
    def _pooled_counts(self, batch_samples: list, device) -> torch.Tensor:
        """Eligible tokens per microbatch, summed over processes: long ``[M]``."""
        local = torch.tensor([self.count_eligible(b) for b in batch_samples], dtype=torch.long, device=device)
        if self.args.world_size > 1 and len(batch_samples):
            local = self.accelerator.gather(local).view(self.args.world_size, -1).sum(0)
        return local

    def count_eligible(self, batch: dict) -> int:
        """Eligible positions of one collated microbatch (from its tokens: no model runs)."""
        return count_eligible(batch, sinks=self.oda_sinks, window=self.oda_window)

    def _get_num_items_in_batch(self, batch_samples: list, device):
        return self._pooled_counts(batch_samples, device).sum()

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        counts = self._pooled_counts(batch_samples, device)
        total = counts.sum()
        for batch, count in zip(batch_samples, counts):
            batch[MICRO_COUNT], batch[UPDATE_COUNT], batch[NUM_MICRO] = count, total, len(batch_samples)
        self._skip_update = bool(batch_samples) and int(total) == 0
        self._eligible_since_log += int(total)
        self._updates_since_log += bool(batch_samples)
        self._skipped_since_log += self._skip_update
        if self._skip_update:
            self.skipped_updates += 1
            logger.warning(f"Update {self.state.global_step + 1} has no eligible position (no sequence longer than "
                           f"s + w + 1 = {self.oda_sinks + self.oda_window + 1} tokens): skipped.")
        elif batch_samples:
            self.applied_updates += 1
        return batch_samples, total

    # -- loss -----------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._skip_update:
            if any(p.grad is not None for p in self.oda_model.recall_head.parameters()):
                raise RuntimeError("A skipped update found leftover gradients; it would change the head.")
            return torch.zeros((), device=self.args.device)
        return super().training_step(model, inputs, num_items_in_batch)

    def _forward(self, model, inputs: dict) -> dict:
        """The training module on a batch's model inputs: per-token Huber losses of its eligible positions."""
        return model(**{key: inputs[key] for key in self.model_inputs if key in inputs})

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        micro, update, num_micro = inputs.pop(MICRO_COUNT, None), inputs.pop(UPDATE_COUNT, None), inputs.pop(NUM_MICRO, None)
        outputs = self._forward(model, inputs)
        losses = outputs["losses"]
        if micro is None:  # outside the training loop: this batch's own eligible-token mean
            loss = losses.sum() / max(losses.numel(), 1)
        else:
            loss = microbatch_loss(losses, reduction=self.args.oda_loss_reduction, micro_count=micro,
                                   update_count=update, num_micro=num_micro, world_size=self.args.world_size)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs:  # a training log line: add the supervision it came from
            logs["loss"] = _over_applied(logs["loss"], self._updates_since_log, self._skipped_since_log)
            logs["eligible_tokens"] = self._eligible_since_log
            logs["skipped_updates"] = self.skipped_updates
            self._eligible_since_log = self._updates_since_log = self._skipped_since_log = 0
        if "train_loss" in logs:   # the end of train(): over this call's updates
            logs["train_loss"] = self._train_loss(logs["train_loss"])
        super().log(logs, *args, **kwargs)

    def _start_attempt(self) -> None:
        """At the start of each run of the training loop: the counts its first run began with, nothing since the last
        log; under `auto_find_batch_size` also the head and optimizer state (after a checkpoint's were loaded), kept
        on the CPU until `train()` returns."""
        head, optimizer = self.oda_model.recall_head, self.optimizer
        if self.args.auto_find_batch_size and optimizer is not None:
            if self._attempt_start is None:
                self._attempt_start = (_on_cpu(head.state_dict()), _on_cpu(optimizer.state_dict()))
            else:
                logger.warning("Training again from the start at batch size %d (auto_find_batch_size).",
                               self._train_batch_size)
                head.load_state_dict(self._attempt_start[0])
                optimizer.load_state_dict(self._attempt_start[1])   # (onto the parameters' device)
        self.skipped_updates, self.applied_updates = self._counts_before_train
        self._skipped_before_train = self.skipped_updates
        self._eligible_since_log = self._updates_since_log = self._skipped_since_log = 0

    def _train_loss(self, value: float) -> float:
        steps = self.state.global_step - getattr(self, "_initial_global_step", 0)
        return _over_applied(value, steps, self.skipped_updates - self._skipped_before_train)

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        with self._each_row_once(self.eval_dataset if dataset is None else dataset):
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        with self._each_row_once(test_dataset):
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _each_row_once(self, dataset):
        """Under data parallelism accelerate evens the processes' eval batches by repeating the set's first rows, which
        then counted twice in the pooled loss (`evaluation_loop` does not know which rows repeat): shard without
        padding instead (also without `dispatch_batches`, whose dispatcher pads whatever `even_batches` says: 40
        positions of 30). Uneven shards are safe there, as no collective runs before the loop's end. An iterable set
        is padded whatever the settings (measured: 40 eligible positions counted of 30), so it is refused."""
        self._check_evaluable(dataset)
        config = self.accelerator.dataloader_config
        kept = config.even_batches, config.dispatch_batches
        config.even_batches = config.dispatch_batches = False
        try:
            yield
        finally:
            config.even_batches, config.dispatch_batches = kept

    def _check_evaluable(self, dataset, what: str = "An iterable dataset") -> None:
        if self.args.world_size > 1 and isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError(f"{what} ({type(dataset).__name__}) cannot be evaluated over {self.args.world_size} "
                             "processes: accelerate pads its last batches with repeated rows, which would count twice "
                             "in the eval loss. Pass a dataset with __len__ and __getitem__ (a list of rows, "
                             "PackedDataset, SupervisionCacheDataset), or evaluate in one process.")

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """`evaluate()` / `predict()`: the training loss over every eligible position of the set, pooled. (The stock
        loop averaged each batch's own mean over rows: the number changed with the eval batch size, a batch without an
        eligible position counted as a loss of 0, and a set without any scored a perfect 0.)"""
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.args.device)   # loss sum, eligible positions
        samples = 0
        for inputs in dataloader:
            inputs = self._prepare_inputs(inputs)
            samples += find_batch_size(inputs) or 0
            with torch.no_grad():
                losses = self._forward(model, inputs)["losses"]
            total += torch.stack([losses.double().sum(), torch.tensor(float(losses.numel()), device=total.device)])
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        if self.args.world_size > 1:
            total = self.accelerator.gather(total[None]).sum(dim=0)
        if int(total[1]) == 0:
            raise ValueError(self._no_supervision_message(f"the {metric_key_prefix} data"))
        metrics = {f"{metric_key_prefix}_loss": float(total[0] / total[1]),
                   f"{metric_key_prefix}_eligible_tokens": int(total[1])}
        dataset = getattr(dataloader, "dataset", None)   # (every process's samples, for the speed metrics)
        samples = len(dataset) if hasattr(dataset, "__len__") else samples * self.args.world_size
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=samples)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, (_SkipAwareScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            self.lr_scheduler = _SkipAwareScheduler(scheduler, self)
        return self.lr_scheduler

    # -- a dataset without supervision is an error, not a silent no-op --------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        self._best_loaded_step = None
        resume_from_checkpoint = self.check_before_training(resume_from_checkpoint)
        self._drop_calibrated_threshold()
        finished = self._finished_checkpoint(resume_from_checkpoint)
        if finished is not None:
            return finished
        if resume_from_checkpoint and not any(os.path.isfile(os.path.join(resume_from_checkpoint, name))
                                              for name in ("optimizer.pt", "optimizer.bin")):
            # (transformers would resume with a fresh optimizer and warm-up, the head going on as another run)
            raise ValueError(f"{resume_from_checkpoint} holds no optimizer state (saved with save_only_model=True?): "
                             "it cannot be resumed as the same run. Start a new output folder, or train on from its "
                             "head as a new run.")
        self._counts_before_train, self._attempt_start = (self.skipped_updates, self.applied_updates), None
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._attempt_start = None
        output = output._replace(training_loss=self._train_loss(output.training_loss))
        # (counts of this process: a resumed run whose remaining updates all lack supervision is not an error, since
        # the checkpoint's updates had some; data without any is refused before training, `_check_supervision`)
        if not resume_from_checkpoint and self.state.global_step > 0 and self.applied_updates == 0 \
                and self.skipped_updates > 0:
            raise ValueError(self._no_supervision_message("the training data"))
        return output

    def _drop_calibrated_threshold(self) -> None:
        """A head loaded from a calibrated folder routes at the threshold `oda calibrate` chose for its weights
        there; trained, those weights change, and every save (a checkpoint, the final head, the model's
        save_pretrained into a new folder) would have kept a threshold measured on others: the default instead."""
        model = self.oda_model
        source = getattr(model.recall_head, "_oda_source_folder", None)
        if not source or not os.path.isfile(os.path.join(source, CALIBRATION_NAME)):
            return
        # (the folder's calibrated threshold goes back to the default; a threshold the caller chose stays)
        routing, _ = uncalibrated_routing(source, model.oda_config)
        if routing.threshold != model.oda_config.threshold:
            logger.warning(f"The head was loaded from a calibrated folder ({source}, threshold "
                           f"{model.oda_config.threshold:g}); training changes its weights, so it routes and is saved "
                           f"at the default threshold {routing.threshold:g}: run `oda calibrate` on the trained head.")
            model.set_routing(threshold=routing.threshold)

    def _finished_checkpoint(self, checkpoint) -> TrainOutput | None:
        """Resuming from a checkpoint that already holds all `max_steps` updates (a run killed while saving its final
        head, or a finished run resumed again): its head, and no update. transformers' loop checks for the end only
        after an update, so it would run one more, mid-epoch; with its default linear schedule at learning rate 0
        that changes nothing, but OdaTrainer's constant schedule would apply it."""
        if not checkpoint:
            return None
        state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
        planned = self.args.max_steps
        if planned <= 0:   # --epochs: this run's updates, counted as transformers counts them (when the checkpoint
            # says its own run ended there: else the count, which builds a dataloader, is not needed)
            if state.max_steps <= 0 or state.global_step < state.max_steps:
                return None
            planned = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
        if state.global_step < planned:
            return None
        self._load_from_checkpoint(checkpoint)
        self.state = state
        if self.args.load_best_model_at_end and state.best_model_checkpoint:   # as the finished run ended: its best
            # (found beside this checkpoint: the path recorded is where the run was, and the folder may have moved)
            best = os.path.join(os.path.dirname(os.path.abspath(checkpoint)),
                                os.path.basename(state.best_model_checkpoint))
            if os.path.isdir(best):
                self.state.best_model_checkpoint = best
                self._load_best_model()
            else:
                logger.warning(f"{checkpoint}'s run ended with its best head from {best}, which is gone: this is its "
                               "last head, not its best.")
        logger.info("%s already holds all %d updates: nothing left to train.", checkpoint, planned)
        return TrainOutput(state.global_step, 0.0, {})

    def check_before_training(self, resume_from_checkpoint: str | bool | None = None):
        """The checks `train` makes first (the checkpoint is complete and has the same supervision settings; the
        data has supervision); returns the checkpoint to resume from. Raises ValueError naming the problem."""
        if resume_from_checkpoint is True:  # the stock pick would take a partial folder
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir, clean=self.args.should_save)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {self.args.output_dir}.")
        if resume_from_checkpoint:
            if not is_complete_checkpoint(resume_from_checkpoint):
                raise ValueError(f"{resume_from_checkpoint} is not a complete checkpoint (no {SAFE_WEIGHTS_NAME} or no "
                                 f"readable {TRAINER_STATE_NAME}; an interrupted write?). Pass "
                                 "resume_from_checkpoint=True to take the newest complete one.")
            self._check_resume_settings(resume_from_checkpoint)
        self._check_supervision()
        return resume_from_checkpoint

    def _check_resume_settings(self, checkpoint: str) -> None:
        """Resuming must keep the supervision the checkpoint was trained with (unless explicitly allowed)."""
        allow = self.args.oda_allow_changed_settings
        path = os.path.join(checkpoint, SETTINGS_NAME)
        if not os.path.isfile(path):
            message = (f"{checkpoint} records no training settings ({SETTINGS_NAME}; written by an older oda_hf), so "
                       "resuming cannot check that the supervision stays the same")
            if not allow:
                raise ValueError(message + ". Pass oda_allow_changed_settings=True (--allow-changed-settings) to "
                                 "resume anyway, or start a new output folder.")
            logger.warning(message + "; resuming anyway (allowed).")
            return
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path} is unreadable ({err}): resume from another checkpoint or start a new output "
                             "folder.") from None
        if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict) \
                or not isinstance(saved.get("history", []), list):
            raise ValueError(f"{path} is not an {SETTINGS_NAME} written by OdaTrainer (it needs a 'settings' object "
                             "and a 'history' list): resume from another checkpoint or start a new output folder.")
        self._settings_history = list(saved.get("history", []))
        self._check_resume_arguments(checkpoint, allow)
        differences = _differences(saved["settings"], self.supervision_settings)
        if not differences:
            return
        if not allow:
            raise ValueError(
                f"Resuming {checkpoint} with other supervision settings: " + "; ".join(differences) + ". Resume with "
                "the checkpoint's settings or start a new output folder; to continue anyway (the saved head then "
                "claims the new settings, and oda_training.json keeps the change in its history), pass "
                "oda_allow_changed_settings=True (--allow-changed-settings).")
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
            step = json.load(f).get("global_step")
        logger.warning(f"Resuming {checkpoint} with other supervision settings (allowed): " + "; ".join(differences))
        self._settings_history.append({"until_step": step, "settings": saved["settings"]})

    def _check_resume_arguments(self, checkpoint: str, allow: bool) -> None:
        """Resuming with another learning rate, schedule, batch shape or seed (`RESUME_KEEPS`) would record the new
        values while the checkpoint's optimizer and scheduler state go on with the old ones."""
        path = os.path.join(checkpoint, TRAINING_ARGS_NAME)
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return  # written by an older oda_hf: nothing to compare with
        current = self.args.to_dict()
        differences = [f"{key}: {saved.get(key)!r} in the checkpoint, {current.get(key)!r} now" for key in RESUME_KEEPS
                       if isinstance(saved, dict) and key in saved and saved.get(key) != current.get(key)]
        if differences and not allow:
            raise ValueError(f"Resuming {checkpoint} with other training arguments: " + "; ".join(differences) + ". "
                             "A resumed run goes on with the checkpoint's optimizer and learning-rate schedule: resume "
                             "with its values, or start a new output folder (--allow-changed-settings resumes anyway).")
        if differences:
            logger.warning(f"Resuming {checkpoint} with other training arguments (allowed; the optimizer and schedule "
                           "state of the checkpoint still apply): " + "; ".join(differences))

    def _no_supervision_message(self, what: str) -> str:
        return (f"No eligible position in {what}: supervision needs segments longer than s + w + 1 = "
                f"{self.oda_sinks + self.oda_window + 1} tokens (with unmasked next-token labels). Use longer "
                "sequences or a smaller window.")

    def _check_supervision(self) -> None:
        """Data without one eligible position is refused before training: the training set (else every update is
        skipped) and, when training evaluates, each eval set (else the first evaluation fails mid-run), as is an eval
        set that `_each_row_once` refuses."""
        named = [("the training dataset", self.train_dataset, False)]
        if self.args.eval_strategy != IntervalStrategy.NO:
            named += [(f"the eval dataset{'' if key is None else f' {key!r}'}", data, True)
                      for key, data in eval_sets(self.eval_dataset).items()]
        for what, dataset, evaluated in named:
            if evaluated:
                self._check_evaluable(dataset, what[0].upper() + what[1:])
            if dataset is None or not hasattr(dataset, "__len__"):
                continue  # iterable data: checked as it is read (every update skipped, an empty evaluation -> error)
            if not any(self.count_eligible(self.data_collator([dataset[i]])) for i in range(len(dataset))):
                raise ValueError(self._no_supervision_message(f"{what} ({len(dataset)} rows)"))

    # -- head-only checkpoints ------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        if os.path.isfile(output_dir):
            raise ValueError(f"{output_dir} is a file: save the recall head to a folder.")
        head = self.oda_model.recall_head
        training = (f"Trained with oda_hf's OdaTrainer: paired supervision, lambda={self.args.oda_lambda}, "
                    f"tau_hist={self.args.oda_tau_hist}, reduction={self.args.oda_loss_reduction}, "
                    f"s={self.oda_sinks}, w={self.oda_window}, " + (
                        f"{self.state.global_step} updates." if self._best_loaded_step is None else
                        f"{self._best_loaded_step} updates (the best checkpoint of {self.state.global_step})."))
        # Every file is written into a staging folder and published with config.json last: a run killed while
        # saving leaves the previous head (or none), never a mix or a 0-byte config.json.
        staging = staging_folder(output_dir)
        # A calibration (`oda calibrate`) belongs to the weights it was measured on: saving new weights over a
        # calibrated head drops it and its threshold, or the folder would ship a threshold chosen for other weights.
        calibration = os.path.join(output_dir, CALIBRATION_NAME)
        threshold = self.oda_model.oda_config.threshold
        if os.path.exists(calibration):
            threshold = OdaConfig().threshold
            logger.warning(f"{output_dir} held a calibrated head: the new weights are saved uncalibrated (threshold "
                           f"{threshold:g}, {CALIBRATION_NAME} removed); run `oda calibrate` on them again.")
        try:
            head.save_files(staging, model_card_fields={"training": training})
            OdaConfig(sinks=self.oda_sinks, window=self.oda_window, threshold=threshold,
                      policy="head").save_pretrained(staging)
            with open(os.path.join(staging, TRAINING_ARGS_NAME), "w", encoding="utf-8") as f:
                f.write(self.args.to_json_string())  # JSON, not the stock pickled training_args.bin
            with open(os.path.join(staging, SETTINGS_NAME), "w", encoding="utf-8") as f:
                json.dump({"format": 1, "settings": self.supervision_settings, "history": self._settings_history}, f,
                          indent=2)
            if os.path.exists(calibration):
                os.remove(calibration)   # before the new weights are published: they never sit beside it
            publish_files(staging, output_dir, marker="config.json", replaces=HEAD_WEIGHT_FILES)  # no older shard stays
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, *,
                    repo_id: str | None = None, **kwargs):
        """Publish the head as `save_model` writes it (weights, config, routing config, card, training settings) to
        `repo_id` (default: ``args.hub_model_id``, else the output folder's name; `revision` default
        ``args.hub_revision``) in one commit that also removes what an older save left there
        (`hub.push_saved_to_hub`); transformers' push would upload a checkpoint's optimizer state and pickles and
        build a card from the training module. transformers' signature: `blocking` is accepted (the commit is made
        before returning); `kwargs` (card fields) would go unread and are refused."""
        from types import SimpleNamespace

        from ..hub import push_saved_to_hub

        if kwargs:
            raise TypeError(f"OdaTrainer.push_to_hub writes ODA's own model card; {sorted(kwargs)} would go unread.")
        if not self.is_world_process_zero():
            return None
        token = token if token is not None else self.args.hub_token
        revision = revision if revision is not None else self.args.hub_revision
        repo_id = repo_id or self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        private = self.args.hub_private_repo if private is None else private
        return push_saved_to_hub(SimpleNamespace(save_pretrained=self._save), repo_id, commit_message=commit_message,
                                 private=private, token=token, revision=revision)

    # -- atomic checkpoints ---------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        # While a checkpoint is written, the stock _save_checkpoint writes it inside the staging folder.
        return self._staging_dir if self._staging_dir is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The stock checkpoint, written under a temporary name and renamed to ``checkpoint-N`` when complete."""
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, f"{STAGING_PREFIX}{self.state.global_step}")
        staged, final = os.path.join(staging, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.exists(staging):
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        self.accelerator.wait_for_everyone()  # every process has written its part (e.g. its RNG state)
        if self.state.best_model_checkpoint == staged:
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        if self.args.should_save:
            if os.path.exists(final):  # e.g. a partial folder of an older version at this step
                shutil.rmtree(final)
            os.replace(staged, final)
            os.rmdir(staging)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    def _load_head(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{checkpoint} holds no recall-head weights ({SAFE_WEIGHTS_NAME}); was it written "
                                    "by OdaTrainer?")
        head = self.oda_model.recall_head
        state = safetensors.torch.load_file(path, device=str(next(head.parameters()).device))
        head.load_state_dict(state, strict=True)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self._load_head(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        self._load_head(self.state.best_model_checkpoint)
        # the head now holds the best checkpoint's weights: a save names its update count (`checkpoint-N`), not the
        # last step's
        name = os.path.basename(os.path.normpath(self.state.best_model_checkpoint))
        step = name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        self._best_loaded_step = int(step) if step.isdigit() else None
