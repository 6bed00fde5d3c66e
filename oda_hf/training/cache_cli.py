"""``oda cache-supervision``: paired supervision computed once into shards (`supervision_cache`).

Kept apart from `supervision_cache` so that building the ``oda`` parser imports no torch.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..cli_common import (UsageError, context_limit, data_tokenizer, dtype_name, require_model_source, require_paths,
                          thread_count, torch_dtype, user_input)
from ..known_models import base_argument
from ..validation import MAX_SPAN, argument, integer, number
from .cli import _needs_datasets, check_output_folder, path_argument


def add_cli(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cache-supervision", help="run the frozen backbone once per training row and store the head's supervision",
        description="Paired supervision (H after tau_hist, E, L, gains) of every packed row, at eligible positions, "
                    "into safetensors shards + manifest.json (resumable: a rerun skips finished shards). Train "
                    "from it with `oda train-head --from-cache`.")
    parser.add_argument("--base", type=base_argument, required=True, help="base causal LM: hub id, local folder, or smollm2 / organism")
    parser.add_argument("--data", type=path_argument, required=True,
                        help=".jsonl of {input_ids} or {text} records, or a save_to_disk folder")
    parser.add_argument("--output", type=path_argument, required=True, help="cache folder")
    parser.add_argument("--tokenizer", type=base_argument, default=None, help="tokenizer id or folder (needed for text records)")
    parser.add_argument("--sinks", type=argument(integer, "sinks", minimum=0, maximum=MAX_SPAN), default=4,
                        help="sink positions s (default 4)")
    parser.add_argument("--window", type=argument(integer, "window", minimum=1, maximum=MAX_SPAN), default=2048,
                        help="recent window w incl. current token (default 2048)")
    parser.add_argument("--tau-hist", type=argument(number, "tau-hist"), default=0.001,
                        help="history threshold tau_hist (default 0.001)")
    parser.add_argument("--seq-len", type=argument(integer, "seq-len", minimum=2, maximum=MAX_SPAN), default=8192,
                        help="tokens per packed row (default 8192)")
    parser.add_argument("--rows-per-shard", type=argument(integer, "rows-per-shard", minimum=1), default=16,
                        help="packed rows per shard file (default 16)")
    parser.add_argument("--storage-dtype", choices=("bfloat16", "float16", "float32"), default="float32",
                        help="dtype of H/E/L on disk (default float32; bf16/fp16 halve the size but training then "
                             "differs from recomputation)")
    parser.add_argument("--dtype", type=dtype_name, default="auto",
                        help="backbone dtype: auto (checkpoint's), float32|fp32, bfloat16|bf16, float16|fp16")
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="CPU threads for torch (default: torch's choice)")
    parser.set_defaults(func=run_cli)
    return parser


def run_cli(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from ..config import OdaConfig
    from ..modeling import OdaForCausalLM
    from .data import check_positions, check_token_ids, min_document_length, pack_documents, read_documents
    from .supervision_cache import cache_supervision

    check_output_folder("--output", args.output)
    with user_input("--sinks/--window"):
        OdaConfig(sinks=args.sinks, window=args.window)  # validate before any loading
    require_paths("--data", args.data)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokenizer = data_tokenizer(args.tokenizer, args.base)
    min_length = min_document_length(args.sinks, args.window)
    if args.seq_len < min_length:
        raise UsageError(f"--seq-len {args.seq_len} is shorter than s + w + 2 = {min_length} tokens, the shortest row "
                         f"with an eligible position: use --seq-len >= {min_length} or a smaller --window/--sinks.")
    with user_input("--data"), _needs_datasets():
        rows, stats = pack_documents(read_documents(args.data, tokenizer), args.seq_len, min_length=min_length)
    if warning := stats.split_warning(args.seq_len, min_length):
        print(f"[oda] warning: {warning}", file=sys.stderr)
    if stats.documents == 0:
        raise UsageError(f"No training document in {args.data}: it is empty (or holds only blank lines).")
    if not rows:
        raise UsageError(f"No training row: every document is shorter than s + w + 2 = "
                         f"{min_document_length(args.sinks, args.window)} tokens. Use longer documents or a smaller --window.")
    require_model_source("--base", args.base)
    with user_input("--base", "give a local model folder or a hub id available offline"):
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch_dtype(args.dtype),
                                                    attn_implementation="sdpa")
    with user_input("--data", "tokenize it with --base's tokenizer"):
        check_token_ids(rows, base.config.get_text_config(decoder=True).vocab_size)
    with user_input("--seq-len", "or give shorter documents"):
        check_positions(rows, context_limit(base.config))
    model = OdaForCausalLM(base, None, OdaConfig(sinks=args.sinks, window=args.window, policy="local"))
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else \
        base.config.get_text_config(decoder=True).pad_token_id
    started = time.perf_counter()
    # One writer per cache folder (cache_supervision takes the lock); a folder holding another cache is refused.
    with user_input("--output"):  # the messages say what to do (same settings, or a new folder)
        cache = cache_supervision(model, rows, args.output, sinks=args.sinks, window=args.window,
                                  tau_hist=args.tau_hist, seq_len=args.seq_len, rows_per_shard=args.rows_per_shard,
                                  dtype=args.storage_dtype, pad_token_id=pad if pad is not None else 0,
                                  base_name=args.base)
    print(f"[oda] {len(cache)} rows, {cache.num_positions} eligible positions, {cache.num_bytes / 1e6:.1f} MB "
          f"({cache.bytes_per_1k_positions() / 1e6:.2f} MB per 1K positions) in {args.output} "
          f"[{time.perf_counter() - started:.1f} s this run]", file=sys.stderr)
    return 0
