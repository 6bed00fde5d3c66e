"""Long-context decode throughput: native Full vs ODA (paper Appendix B.8 protocol, on CPU).

Methods, all on the same synthetic history and the same continuation (produced by native Full):
  native-full   stock transformers forward with its default DynamicCache
  oda-full      OdaForCausalLM, always-Full (the Local attempt is skipped)
  streamingllm  OdaForCausalLM, always-Local (the HF path, not a standalone Local engine)
  oda-12.5/25/50  OdaForCausalLM, Full on the first 2/4/8 of every 16 routed steps, head run every step

Protocol differences from the paper, and why:
* The history is synthetic: random KV for n positions loaded into each method's cache (RoPE
  positions 0..n-1) instead of a real prefill. Decode speed does not depend on KV or weight values,
  and a real 32K prefill of a 0.6B model takes far longer than the decode measurement on 2 cores.
* One warm-up segment and three measured segments of `--steps` routed steps each, run back to back
  on one cache (the history grows by 4 x steps tokens, < 0.5% at 32K).
* Each (length, method) runs in its own subprocess, so its peak RSS (`ru_maxrss`, weights included)
  is its own.

Usage:
  python benchmarks/decode_throughput.py                      # Qwen3-0.6B shapes, 4K-32K, fp32
  python benchmarks/decode_throughput.py --tiny --lengths 256,512   # seconds; what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

METHODS = {
    "native-full": None,
    "oda-full": ("full", None),
    "streamingllm": ("local", None),
    "oda-12.5": ("schedule", 2),
    "oda-25": ("schedule", 4),
    "oda-50": ("schedule", 8),
}
PERIOD = 16

# Qwen3-0.6B published shapes (speed does not depend on weight values).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def build_model(shape: dict, dtype: torch.dtype, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, max_position_embeddings=1 << 20)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)  # random weights: values do not affect speed
    return model.eval()


def synthetic_history(model, length: int, seed: int):
    """Random KV per layer, generated one layer at a time (the caller stores it straight away)."""
    config = model.config
    generator = torch.Generator().manual_seed(seed + 1)
    shape = (1, config.num_key_value_heads, length, config.head_dim)
    for _ in range(config.num_hidden_layers):
        keys = torch.randn(shape, generator=generator).to(model.dtype)
        values = torch.randn(shape, generator=generator).to(model.dtype)
        yield keys, values


def worker(args) -> dict:
    """One (length, method): fill the cache, decode warm-up + measured segments, report timings."""
    from transformers import DynamicCache

    from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig, SchedulePolicy
    from oda_hf.compat import cache_kwargs

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = build_model(TINY if args.tiny else QWEN3_0_6B, dtype, args.seed)
    steps_total = (1 + args.runs) * args.steps
    continuation = json.loads(args.continuation) if args.continuation else None
    generator = torch.Generator().manual_seed(args.seed + 2)
    last_hidden = torch.randn(1, model.config.hidden_size, generator=generator).to(dtype)
    first_token = int(torch.randint(model.config.vocab_size, (1,), generator=generator))

    method = METHODS[args.method]
    if method is None:
        cache = DynamicCache(config=model.config)
        for layer, (keys, values) in zip(cache.layers, synthetic_history(model, args.length, args.seed)):
            layer.update(keys, values)

        def step(token):
            return model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits
    else:
        kind, k = method
        policy = SchedulePolicy(k, PERIOD, run_head=True) if kind == "schedule" else kind
        head = RecallHead(RecallHeadConfig.for_base(model)) if kind == "schedule" else None
        oda = OdaForCausalLM(model, head, OdaConfig(sinks=args.sinks, window=args.window, policy=policy))
        cache = oda.new_cache(max_cache_len=args.length + steps_total + 1)
        cache.load_history(synthetic_history(model, args.length, args.seed))  # one layer at a time
        oda.begin_request(cache, last_hidden)

        def step(token):
            return oda(input_ids=token, past_key_values=cache).logits

    tokens, times = [first_token], []
    with torch.no_grad():
        for index in range(steps_total):
            token = torch.tensor([[continuation[index] if continuation else tokens[-1]]])
            start = time.perf_counter()
            logits = step(token)
            times.append(time.perf_counter() - start)
            tokens.append(int(logits[0, -1].argmax()))
    segments = [times[i * args.steps:(i + 1) * args.steps] for i in range(1, 1 + args.runs)]
    result = {
        "method": args.method, "length": args.length,
        "throughput": [args.steps / sum(seg) for seg in segments],
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "continuation": tokens[:steps_total] if method is None else None,
    }
    if method is not None and method[0] != "full":
        result["full_call_rate"] = oda.routing.full_call_rate
    return result


def predicted_ratio(method: str, length: int, steps: int, sinks: int, window: int, shape: dict) -> float | None:
    """FLOPs ratio native-Full / method over the measured steps, from the analytical ledger."""
    from oda_hf.cost import CostLedger, ModelShape, head_param_count, schedule_first_k

    model_shape = ModelShape.from_config(dict(shape, model_type="qwen3"))
    ledger = CostLedger(model_shape, head_param_count(shape["hidden_size"]), sinks=sinks, window=window)
    full = ledger.sequence_flops("full", length, steps)
    kind = METHODS[method]
    if kind is None or kind[0] == "full":
        return 1.0
    if kind[0] == "local":
        return full / ledger.sequence_flops("local", length, steps)
    return full / ledger.sequence_flops("oda", length, schedule_first_k(kind[1], PERIOD, steps))


def run_worker_subprocess(args, length: int, method: str, continuation, script: str = __file__,
                          extra: tuple[str, ...] = ()) -> dict:
    """Measure one (length, method) in a fresh `script --worker` process (clean peak memory);
    `extra` carries the script's own options."""
    command = [sys.executable, os.path.abspath(script), "--worker", "--method", method, "--length", str(length),
               "--steps", str(args.steps), "--runs", str(args.runs), "--dtype", args.dtype, "--sinks",
               str(args.sinks), "--window", str(args.window), "--threads", str(args.threads), "--seed",
               str(args.seed), *extra]
    if args.tiny:
        command.append("--tiny")
    if continuation is not None:
        command += ["--continuation", json.dumps(continuation)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"worker {method} @ {length} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    lines = ["| Input tokens | Method | Full (%) | tok/s (median of 3) | Speedup vs native | FLOPs-model ratio "
             "| Peak RSS (GB) |", "|---:|:---|---:|---:|---:|---:|---:|"]
    for row in rows:
        rate = row.get("full_call_rate")
        full_pct = "100.0" if row["method"] in ("native-full", "oda-full") else f"{100 * rate:.1f}"
        lines.append(f"| {row['length']:,} | {row['method']} | {full_pct} | {row['median']:.3f} | "
                     f"{row['speedup']:.2f}x | {row['predicted']:.2f}x | {row['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for method in METHODS:
        sub = [r for r in rows if r["method"] == method]
        if sub:
            ax1.plot([r["length"] for r in sub], [r["median"] for r in sub], marker="o", label=method)
            ax2.plot([r["length"] for r in sub], [r["speedup"] for r in sub], marker="o", label=method)
    for ax, label in ((ax1, "decode tokens/s"), (ax2, "speedup vs native Full")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_shared_arguments(parser: argparse.ArgumentParser, output_help: str) -> None:
    """Options both decode benchmarks take (lengths, schedule segments, routing, shapes, output, and the
    hidden options of one worker process)."""
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--steps", type=int, default=16, help="routed steps per segment (one schedule period)")
    parser.add_argument("--runs", type=int, default=3, help="measured segments after one warm-up segment")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (for tests), not Qwen3-0.6B")
    parser.add_argument("--output", default="benchmarks/results", help=output_help)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--continuation", help=argparse.SUPPRESS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dtype", default="float32")
    add_shared_arguments(parser, output_help="folder for the table, JSON and PNG")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    methods = args.methods.split(",")
    if methods[0] != "native-full":
        raise SystemExit("--methods must start with native-full: it produces the continuation and the baseline.")
    shape = TINY if args.tiny else QWEN3_0_6B
    rows = []
    from tqdm import tqdm

    jobs = [(int(n), m) for n in args.lengths.split(",") for m in methods]
    continuation = None
    baseline = {}
    for length, method in tqdm(jobs, desc="decode benchmark", unit="run"):
        result = run_worker_subprocess(args, length, method, None if method == "native-full" else continuation)
        if method == "native-full":
            continuation = result["continuation"]
            baseline[length] = statistics.median(result["throughput"])
        result.pop("continuation", None)
        result["median"] = statistics.median(result["throughput"])
        result["speedup"] = result["median"] / baseline[length]
        result["predicted"] = predicted_ratio(method, length, args.steps * args.runs, args.sinks, args.window, shape)
        rows.append(result)
        tqdm.write(f"{length:>7} {method:<13} {result['median']:.3f} tok/s  {result['speedup']:.2f}x "
                   f"(FLOPs model {result['predicted']:.2f}x)  peak RSS {result['peak_rss_gb']:.2f} GB")

    os.makedirs(args.output, exist_ok=True)
    header = (f"CPU decode benchmark: {'tiny' if args.tiny else 'Qwen3-0.6B'} shapes, {args.dtype}, "
              f"{args.threads} threads on {os.cpu_count()} cores, s={args.sinks}, w={args.window}, "
              f"{args.runs} x {args.steps} measured routed steps after {args.steps} warm-up steps.")
    table = format_table(rows)
    print(header + "\n\n" + table)
    name = "decode_tiny" if args.tiny else "decode_qwen3_0.6b"
    with open(os.path.join(args.output, name + ".md"), "w") as f:
        f.write(header + "\n\n" + table + "\n")
    with open(os.path.join(args.output, name + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(args.output, name + ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
