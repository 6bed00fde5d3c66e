"""One OdaTrainer update on a fixed tiny setup; run by test_training under torchrun (2 CPU processes, gloo)
and imported by it for the single-process reference. Not a test module.

    torchrun --nproc-per-node 2 tests/ddp_head_worker.py OUT.pt

It also evaluates a set of 3 rows, which 2 processes split unevenly (the eval loss must pool each row once).
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig  # noqa: E402
from oda_hf.training import OdaTrainer, OdaTrainingArguments, PackedDataset  # noqa: E402
from tiny_models import VOCAB, tiny_model  # noqa: E402

SINKS, WINDOW = 2, 3
# Four rows -> two microbatches of two rows (pooled over workers). Row 1 has no eligible position, so
# microbatch counts differ (micro != step) and one worker has an empty microbatch.
LENGTHS = (16, 5, 12, 14)


def rows() -> list[dict]:
    g = torch.Generator().manual_seed(123)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist(), "position_ids": list(range(n))}
            for n in LENGTHS]


def one_update(reduction: str, per_device_batch: int, output_dir: str) -> dict:
    """Head parameters after one SGD update (lr 1, no clipping): the update equals minus the gradient."""
    base = tiny_model("qwen3")
    torch.manual_seed(1)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    model = OdaForCausalLM(base, head, OdaConfig(sinks=SINKS, window=WINDOW))
    args = OdaTrainingArguments(
        output_dir=output_dir, max_steps=1, per_device_train_batch_size=per_device_batch, gradient_accumulation_steps=2,
        optim="sgd", learning_rate=1.0, warmup_steps=0, lr_scheduler_type="constant", max_grad_norm=0.0,
        train_sampling_strategy="sequential", save_strategy="no", use_cpu=True, disable_tqdm=True,
        oda_loss_reduction=reduction,
    )
    OdaTrainer(model=model, args=args, train_dataset=PackedDataset(rows())).train()
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


def evaluation(output_dir: str, dispatch_batches: bool = False) -> dict:
    """`evaluate()` of a fixed head on 3 rows, one per device batch (with accelerate's `dispatch_batches`, 3 equal
    rows: the dispatcher collates them on one process)."""
    torch.manual_seed(1)
    base = tiny_model("qwen3")
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=SINKS, window=WINDOW))
    args = OdaTrainingArguments(output_dir=output_dir, per_device_eval_batch_size=1, use_cpu=True, disable_tqdm=True,
                                report_to=[], accelerator_config={"dispatch_batches": dispatch_batches})
    data = rows()[:1] * 3 if dispatch_batches else rows()[:1] + rows()[2:]
    metrics = OdaTrainer(model=model, args=args, eval_dataset=PackedDataset(data)).evaluate()
    return {key: torch.tensor(float(metrics[key])) for key in ("eval_loss", "eval_eligible_tokens")}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        results = {reduction: one_update(reduction, 1, tmp) for reduction in ("micro", "step")}
        results["eval"] = evaluation(tmp)
        results["eval_dispatched"] = evaluation(tmp, dispatch_batches=True)
    if int(os.environ.get("RANK", "0")) == 0:
        safetensors.torch.save_file({f"{reduction}/{name}": tensor for reduction, state in results.items()
                                     for name, tensor in state.items()}, sys.argv[1])
    # Tear the process group down before interpreter exit: left to exit-time destructors, gloo's threads
    # sometimes abort the process ("terminate called without an active exception", SIGABRT).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
