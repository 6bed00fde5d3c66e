"""Measured decode time of two HF-path savings (random weights: speed does not depend on their values).

* Batched Full retry: batch 1/4/8 at a Full-call rate of 25% (`RandomPolicy`), the retry run on the
  chosen rows only (``rows``: `OdaForCausalLM.max_row_retry_fraction` = 1) or on the whole batch
  (``whole``: fraction 0), on a prompt past sinks + window.
* Short prompts: a request whose history stays within sinks + window, where ODA runs Local only (no
  head, no retry), against the stock model's `generate()` with a static cache and with its default
  dynamic cache. The target is ODA <= 1.05x stock static.

Each configuration runs one warm-up request, then `--runs` measured ones; the median decode time per
generated token is reported (prefill included, identical across methods of a row).

Usage:
  python benchmarks/retry_and_window.py --device cuda --dtype bfloat16     # Qwen3-0.6B shapes
  python benchmarks/retry_and_window.py --model smollm2 --window 256 --long-prompt 1024   # after `oda fetch smollm2`
  python benchmarks/retry_and_window.py --tiny --runs 1 --new-tokens 4     # seconds; what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from decode_throughput import MODEL_NAMES, load_model

from oda_hf import OdaConfig, OdaForCausalLM, RandomPolicy, RecallHead, RecallHeadConfig


def _timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _median_ms_per_token(device, fn, runs: int, new_tokens: int) -> float:
    fn()  # warm-up
    return 1000 * statistics.median(_timed(device, fn) for _ in range(runs)) / new_tokens


def measure(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    base = load_model(args.model, dtype, args.seed).to(device)
    vocab = base.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    results = {"batch_retry": [], "short_prompt": []}

    oda = OdaForCausalLM(base, oda_config=OdaConfig(sinks=args.sinks, window=args.window,
                                                     policy=RandomPolicy(args.rate, seed=args.seed)))
    for batch in args.batches:
        ids = torch.randint(3, vocab, (batch, args.long_prompt), generator=generator).to(device)
        row = {"batch": batch, "rate": args.rate, "prompt": args.long_prompt}
        for mode, fraction in (("whole", 0.0), ("rows", 1.0)):
            oda.max_row_retry_fraction = fraction
            with torch.no_grad():
                row[f"{mode}_ms"] = _median_ms_per_token(
                    device, lambda: oda.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen),
                    args.runs, args.new_tokens)
        row["full_call_rate"] = oda.routing.full_call_rate
        row["rows_over_whole"] = row["rows_ms"] / row["whole_ms"]
        results["batch_retry"].append(row)

    torch.manual_seed(args.seed)
    head = RecallHead(RecallHeadConfig.for_base(base))
    short = OdaForCausalLM(base, head, OdaConfig(sinks=args.sinks, window=args.window, policy="head"))
    length = args.short_prompt
    if length + args.new_tokens > args.sinks + args.window:
        raise SystemExit(f"--short-prompt {length} + --new-tokens {args.new_tokens} must stay within sinks + window "
                         f"({args.sinks + args.window}).")
    ids = torch.randint(3, vocab, (1, length), generator=generator).to(device)
    mask = torch.ones_like(ids)
    methods = {
        "stock_static": lambda: base.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **gen),
        "stock_dynamic": lambda: base.generate(input_ids=ids, attention_mask=mask, **gen),
        "oda_head": lambda: short.generate(input_ids=ids, attention_mask=mask, **gen),
    }
    row = {"prompt": length}
    with torch.no_grad():
        for name, fn in methods.items():
            row[f"{name}_ms"] = _median_ms_per_token(device, fn, args.runs, args.new_tokens)
    row["window_steps"] = int(short.routing.window_steps_per_row.sum())
    row["routed_steps"] = int(short.routing.steps_per_row.sum())
    row["oda_over_stock_static"] = row["oda_head_ms"] / row["stock_static_ms"]
    results["short_prompt"].append(row)
    return results


def markdown(results: dict) -> str:
    lines = ["| Batch | Full-call rate | whole retry ms/token | rows retry ms/token | rows / whole |", "|---|---|---|---|---|"]
    for r in results["batch_retry"]:
        lines.append(f"| {r['batch']} | {r['full_call_rate']:.1%} | {r['whole_ms']:.2f} | {r['rows_ms']:.2f} | "
                     f"{r['rows_over_whole']:.3f} |")
    lines += ["", "| Prompt | in-window steps | stock static ms/token | stock dynamic ms/token | ODA ms/token | "
              "ODA / stock static |", "|---|---|---|---|---|---|"]
    for r in results["short_prompt"]:
        lines.append(f"| {r['prompt']} | {r['window_steps']}/{r['routed_steps']} | {r['stock_static_ms']:.2f} | "
                     f"{r['stock_dynamic_ms']:.2f} | {r['oda_head_ms']:.2f} | {r['oda_over_stock_static']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_NAMES),
                        help="qwen3-0.6b: published shapes, random weights; smollm2: the fetched model")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (for tests): --model tiny")
    parser.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 8])
    parser.add_argument("--rate", type=float, default=0.25)
    parser.add_argument("--long-prompt", type=int, default=4096, help="prompt tokens for the batch-retry rows")
    parser.add_argument("--short-prompt", type=int, default=64, help="prompt tokens for the in-window row")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
    results = measure(args)
    os.makedirs(args.output, exist_ok=True)
    suffix = {"qwen3-0.6b": "", "tiny": "_tiny"}.get(args.model, "_" + args.model)
    stem = os.path.join(args.output, "retry_and_window" + suffix)
    with open(stem + ".json", "w") as f:
        json.dump({"settings": vars(args), **results}, f, indent=2)
    table = (f"{MODEL_NAMES[args.model]}, {args.dtype} on {args.device}, {torch.get_num_threads()} thread(s), "
             f"s={args.sinks}, w={args.window}, {args.new_tokens} new tokens, median of {args.runs} runs.\n\n"
             + markdown(results))
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
