"""``oda train-head``: train a recall head for a base model on token or text data.

    oda train-head --base Qwen/Qwen3-1.7B --data corpus.jsonl --output heads/qwen3 \
        --window 2048 --seq-len 8192 --max-steps 2000 --save-steps 200 [--resume]

`add_cli(subparsers)` registers the subcommand; `run_cli(args)` runs it. Data: a JSON-lines file of
``{"input_ids": [...]}`` (optionally ``"labels"``) or ``{"text": ...}`` records (tokenized with
``--tokenizer``, default ``--base``'s), or a ``datasets.save_to_disk`` folder with one of those columns.
Documents are packed into rows of ``--seq-len`` tokens (`oda_hf.training.data`). Checkpoints (every ``--save-steps``
updates) and the final result in ``--output`` hold only the head and its routing defaults.
Multi-GPU: launch the same command with ``torchrun --nproc-per-node N -m oda_hf.cli train-head ...``.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..cli_common import (UsageError, dtype_name, load_tokenizer, require_model_source, require_paths, torch_dtype,
                          user_input)


def add_cli(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train-head", help="train a recall head on paired supervision (head-only checkpoints)",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="base causal LM: hub id or local folder")
    parser.add_argument("--data", required=True, help=".jsonl of {input_ids} or {text} records, or a save_to_disk folder")
    parser.add_argument("--output", required=True, help="output folder (checkpoints and the final head)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer id or folder for text records (default: --base's, if it has one)")
    parser.add_argument("--sinks", type=int, default=4, help="sink positions s (default 4)")
    parser.add_argument("--window", type=int, default=2048, help="recent window w incl. current token (default 2048)")
    parser.add_argument("--lambda", dest="oda_lambda", type=float, default=0.0, help="Full-call penalty lambda (default 0)")
    parser.add_argument("--tau-hist", type=float, default=0.001, help="history threshold tau_hist (default 0.001)")
    parser.add_argument("--loss-reduction", choices=("micro", "step"), default="micro",
                        help="micro: mean of microbatch means; step: sum / eligible tokens of the update")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer updates (default 1000)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    parser.add_argument("--warmup-steps", type=int, default=102, help="linear warm-up updates (default 102)")
    parser.add_argument("--batch-size", type=int, default=1, help="rows per microbatch and device (default 1)")
    parser.add_argument("--grad-accum", type=int, default=1, help="microbatches per update (default 1)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per packed row (default 8192)")
    parser.add_argument("--save-steps", type=int, default=200, help="updates between head checkpoints (default 200)")
    parser.add_argument("--logging-steps", type=int, default=10, help="updates between log lines (default 10)")
    parser.add_argument("--head-width", type=int, default=None, help="head tower width m (default hidden/2)")
    parser.add_argument("--input-variant", default="HEL", help="head inputs: H, E, L, HE, HL, EL or HEL (default HEL)")
    parser.add_argument("--dtype", type=dtype_name, default="auto",
                        help="backbone dtype: auto (checkpoint's), float32|fp32, bfloat16|bf16, float16|fp16")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 avoids oversubscription beside other jobs")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output")
    parser.set_defaults(func=run_cli)
    return parser


def run_cli(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, set_seed
    from transformers.trainer_utils import get_last_checkpoint

    from ..config import OdaConfig
    from ..head import RecallHead, RecallHeadConfig
    from ..modeling import OdaForCausalLM
    from .data import OdaDataCollator, PackedDataset, min_document_length, pack_documents, read_documents
    from .trainer import OdaTrainer, OdaTrainingArguments

    with user_input("--sinks/--window"):
        OdaConfig(sinks=args.sinks, window=args.window)  # validate before any loading
    require_paths("--data", args.data)
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}.")
        torch.set_num_threads(args.threads)
    set_seed(args.seed)
    checkpoint = None
    if args.resume:
        checkpoint = get_last_checkpoint(args.output) if os.path.isdir(args.output) else None
        if checkpoint is None:
            raise UsageError(f"--resume: no checkpoint-* folder in {args.output}; run without --resume to start.")

    tokenizer = _tokenizer(args)
    with user_input("--data"):
        rows, stats = pack_documents(read_documents(args.data, tokenizer), args.seq_len,
                                     min_length=min_document_length(args.sinks, args.window))
    print(f"[oda] {stats.documents} documents -> {stats.rows} rows of <= {args.seq_len} tokens, {stats.segments} "
          f"segments, {stats.tokens} tokens; {stats.dropped_pieces} pieces shorter than "
          f"{min_document_length(args.sinks, args.window)} tokens dropped (no eligible position).", file=sys.stderr)
    if not rows:
        raise UsageError(f"No training row: every document is shorter than s + w + 2 = "
                         f"{min_document_length(args.sinks, args.window)} tokens. Use longer documents or a smaller --window.")

    require_model_source("--base", args.base)
    with user_input("--base", "give a local model folder or a hub id available offline"):
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch_dtype(args.dtype),
                                                    attn_implementation="sdpa")
    if checkpoint is not None:
        head = RecallHead.from_pretrained(checkpoint)  # its config (width, variant); weights are reloaded on resume
    else:
        head = RecallHead(RecallHeadConfig.for_base(base, head_width=args.head_width, input_variant=args.input_variant))
    model = OdaForCausalLM(base, head, OdaConfig(sinks=args.sinks, window=args.window, policy="head"))

    training_args = OdaTrainingArguments(
        output_dir=args.output, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, warmup_steps=args.warmup_steps,
        save_strategy="steps", save_steps=args.save_steps, logging_steps=args.logging_steps, seed=args.seed,
        disable_tqdm=False, oda_lambda=args.oda_lambda, oda_tau_hist=args.tau_hist,
        oda_loss_reduction=args.loss_reduction, oda_sinks=args.sinks, oda_window=args.window,
        use_cpu=not torch.cuda.is_available(),
    )
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else \
        base.config.get_text_config(decoder=True).pad_token_id
    trainer = OdaTrainer(model=model, args=training_args, train_dataset=PackedDataset(rows),
                         data_collator=OdaDataCollator(pad_token_id=pad if pad is not None else 0))
    result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model(args.output)
    print(f"[oda] {result.global_step} updates ({trainer.skipped_updates} skipped without eligible tokens), "
          f"final loss {result.training_loss:.5f}; recall head saved to {args.output}", file=sys.stderr)
    return 0



def _tokenizer(args):
    """--tokenizer, else --base's own tokenizer. Token-id data needs none, so a base folder without tokenizer
    files is fine until a text record asks for one (its error names --tokenizer)."""
    if args.tokenizer:
        return load_tokenizer(args.tokenizer, args.base)
    try:
        return load_tokenizer(None, args.base)
    except UsageError as err:
        print(f"[oda] no tokenizer from {err}; token-id records need none, text records need --tokenizer.",
              file=sys.stderr)
        return None
