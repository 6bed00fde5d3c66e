"""Long-context decode speed: stock transformers (dynamic, static, compiled static cache) vs ODA, with the
memory-bandwidth limit of every arm measured in the same run.

Arms, all on the same history and the same continuation (produced by the first stock arm):
  native-dynamic   stock forward, default DynamicCache (concatenates the history every step)
  native-static    stock forward, StaticCache (`cache_implementation="static"`): the baseline ratios are taken to
  native-compiled  stock forward, StaticCache, `torch.compile` (inductor; on CPU it needs a C++ compiler)
  oda-full         OdaForCausalLM (HF path), always Full (the Local attempt is skipped)
  streamingllm     OdaForCausalLM (HF path), always Local (no head)
  oda-12.5/25/50   OdaForCausalLM (HF path), Full on the first 2/4/8 of every 16 routed steps, head run every step
  engine-*         the same policies on the static engine (`generate(oda_fast=True)`; eager on CPU)

Columns: ms per decoded token (median over segments and rounds); speed against stock static (and dynamic);
the *limit*: bytes the arm's steps must read (weights once per backbone pass, the K/V positions each
attention reads, the head, the output projection; `oda_hf.cost.BatchCostModel`) over the memory bandwidth
of a large tensor copy measured in the same run with the same thread count; the measured time over that
limit; the bytes model's speed ratio against stock static (limit_static / limit_arm); the FLOPs model's
ratio against native Full.

Protocol:
* The history is synthetic: random K/V for n positions (RoPE positions 0..n-1) loaded into each arm's
  cache, instead of a real prefill; decode speed does not depend on the values (a real prefill of 7K
  tokens takes 40 s on one thread, far longer than the measurement).
* One warm-up segment (it absorbs `torch.compile`) and `--runs` measured segments of `--steps` routed steps,
  run back to back on one cache.
* Each (length, arm) runs in its own subprocess (its peak RSS is its own); `--rounds R` repeats every
  arm R times, alternating the order, so slow drift of the machine's load hits every arm alike.

Usage:
  python benchmarks/decode_throughput.py --model smollm2 --lengths 4096,7000 --threads 1   # after `oda fetch smollm2`
  python benchmarks/decode_throughput.py                      # Qwen3-0.6B shapes (random weights), 4K-32K
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

PERIOD = 16
SCHEDULES = {"12.5": 2, "25": 4, "50": 8}
METHODS = {  # name -> (path, routing): routing is "dynamic"/"static"/"compiled" for stock arms,
    "native-dynamic": ("native", "dynamic"),  # "full"/"local" or a schedule's k for ODA arms
    "native-static": ("native", "static"),
    "native-compiled": ("native", "compiled"),
    "oda-full": ("hf", "full"),
    "streamingllm": ("hf", "local"),
    **{f"oda-{rate}": ("hf", k) for rate, k in SCHEDULES.items()},
    "engine-full": ("engine", "full"),
    "engine-local": ("engine", "local"),
    **{f"engine-{rate}": ("engine", k) for rate, k in SCHEDULES.items()},
}
DEFAULT_METHODS = ("native-dynamic,native-static,native-compiled,oda-full,streamingllm,oda-12.5,oda-25,oda-50,"
                   "engine-full,engine-12.5")
BASELINE = "native-static"

# Published shapes (speed does not depend on weight values): (transformers config class, its arguments).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
# Qwen2.5-Coder-0.5B-Instruct: every layer full attention, untied output head.
QWEN2_5_CODER_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=False)
# Gemma 3 270M: window-global hybrid (sliding window 512, a global layer every 6th), tied 262K vocabulary.
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
                   tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
TINY_HYBRID = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=16,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=True)
SHAPES = {"qwen3-0.6b": ("Qwen3", QWEN3_0_6B), "qwen2.5-coder-0.5b": ("Qwen2", QWEN2_5_CODER_0_5B),
          "gemma3-270m": ("Gemma3Text", GEMMA3_270M), "tiny": ("Qwen3", TINY), "tiny-hybrid": ("Gemma3Text", TINY_HYBRID)}
MODEL_NAMES = {"qwen3-0.6b": "Qwen3-0.6B shapes (random weights)",
               "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B shapes (random weights)",
               "gemma3-270m": "Gemma 3 270M shapes (random weights; window-global hybrid)", "tiny": "tiny shapes",
               "tiny-hybrid": "tiny window-global hybrid shapes", "smollm2": "SmolLM2-135M-Instruct (real weights)"}


def shape_config(name: str):
    """The transformers config of a published shape (by `SHAPES` name)."""
    import transformers

    family, shape = SHAPES[name]
    return getattr(transformers, f"{family}Config")(**shape, max_position_embeddings=1 << 20)


def build_model(name: str, dtype: torch.dtype, seed: int):
    import transformers

    config = shape_config(name)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model_class = getattr(transformers, f"{SHAPES[name][0].removesuffix('Text')}ForCausalLM")
    model = model_class(config).to(dtype)  # random weights: values do not affect speed
    return model.eval()


def model_name(args) -> str:
    return "tiny" if args.tiny else args.model


def load_model(name: str, dtype: torch.dtype, seed: int):
    """The benchmark's model: random weights in published shapes, or the fetched SmolLM2."""
    if name in SHAPES:
        return build_model(name, dtype, seed)
    from transformers import AutoModelForCausalLM

    from oda_hf.known_models import resolve_base

    return AutoModelForCausalLM.from_pretrained(resolve_base(name), dtype=dtype, attn_implementation="sdpa").eval()


def model_config(name: str):
    if name in SHAPES:
        return shape_config(name)
    from transformers import AutoConfig

    from oda_hf.known_models import resolve_base

    return AutoConfig.from_pretrained(resolve_base(name))


def synthetic_history(model, length: int, seed: int, device: torch.device | None = None, batch: int = 1):
    """Random KV per layer for `batch` rows, generated one layer at a time (the caller stores it straight away), on
    `device` (drawing 32K positions x 28 layers on the host and copying them over takes longer than the
    measurement)."""
    config = model.config
    device = device or torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (batch, config.num_key_value_heads, length, head_dim)
    for _ in range(config.num_hidden_layers):
        keys = torch.randn(shape, generator=generator, device=device).to(model.dtype)
        values = torch.randn(shape, generator=generator, device=device).to(model.dtype)
        yield keys, values


def oda_routing(routing):
    """(policy, needs a head) for an ODA arm's routing ("full", "local" or a schedule's k)."""
    from oda_hf import SchedulePolicy

    if isinstance(routing, int):
        return SchedulePolicy(routing, PERIOD, run_head=True), True
    return routing, False


def start_engine(oda, history, last_hidden, max_length: int, steps: int, bucket_size: int | None = None,
                 batch: int = 1, **options):
    """An `OdaStaticEngine` over `history` (consumed one layer at a time), its graphs for every length up to
    `max_length` captured before timing (none on CPU); returns (engine, keys captured, capture seconds).
    `options`: further `OdaStaticEngine` arguments."""
    from oda_hf.engine import OdaStaticEngine

    if bucket_size is not None:
        options["bucket_size"] = bucket_size
    engine = OdaStaticEngine(oda, max_length=max_length + 1, batch_size=batch, **options)
    engine.load_history(history, last_hidden, max_steps=steps)
    start = time.perf_counter()
    captured = engine.capture_buckets(max_length)  # no capture inside timed segments
    return engine, captured, time.perf_counter() - start


def stock_step(model, kind: str, length: int, max_length: int, history, device: torch.device | None = None):
    """One decode step of the stock model on a filled cache of `kind` (dynamic, static or compiled static).
    On CUDA the compiled arm is what transformers recommends for fast static-cache decoding: `torch.compile`
    with mode="reduce-overhead" (inductor kernels replayed as CUDA graphs)."""
    from transformers import DynamicCache, StaticCache

    device = device or torch.device("cpu")
    if kind == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=max_length)
    for layer, (keys, values) in zip(cache.layers, history):
        layer.update(keys, values)
    if kind == "compiled":
        mode = "reduce-overhead" if device.type == "cuda" else None
        forward = torch.compile(model, dynamic=False, mode=mode)
    else:
        forward = model
    cache_position = torch.tensor([length - 1], device=device)

    def step(token):  # cache_position as a tensor, as generate() passes it: no recompilation per step
        # advanced on the device, as generate() does (a host-built tensor per step made each stock step wait for the
        # GPU, which the engine arms never do)
        cache_position.add_(1)
        return forward(input_ids=token, past_key_values=cache, cache_position=cache_position, use_cache=True).logits

    return step


def worker(args) -> dict:
    """One (length, arm): fill the cache, decode warm-up + measured segments, report timings."""
    from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = load_model(model_name(args), dtype, args.seed)
    steps_total = sum(measured_and_warmup(args))
    max_length = args.length + steps_total + 1
    continuation = json.loads(args.continuation) if args.continuation else None
    generator = torch.Generator().manual_seed(args.seed + 2)
    last_hidden = torch.randn(1, model.config.hidden_size, generator=generator).to(dtype)
    first_token = int(torch.randint(model.config.vocab_size, (1,), generator=generator))
    history = synthetic_history(model, args.length, args.seed)

    path, routing = METHODS[args.method]
    routed = None
    if path == "native":
        step = stock_step(model, routing, args.length, max_length, history)
    else:
        policy, needs_head = oda_routing(routing)
        head = RecallHead(RecallHeadConfig.for_base(model)) if needs_head else None
        oda = OdaForCausalLM(model, head, OdaConfig(sinks=args.sinks, window=args.window, policy=policy))
        if path == "hf":
            cache = oda.new_cache(max_cache_len=max_length)
            cache.load_history(history)  # one layer at a time
            oda.begin_request(cache, last_hidden)
            routed = oda

            def step(token):
                return oda(input_ids=token, past_key_values=cache).logits
        else:
            engine, _, _ = start_engine(oda, history, last_hidden, max_length - 1, steps_total)
            routed = engine

            def step(token):
                return engine.step(token.view(1))[:, None]

    tokens, times = [first_token], []
    profiler = None
    with torch.no_grad():
        for index in range(steps_total):
            if index == args.steps and args.profile:  # the measured segments only
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
            token = torch.tensor([[continuation[index] if continuation else tokens[-1]]])
            start = time.perf_counter()
            logits = step(token)
            times.append(time.perf_counter() - start)
            tokens.append(int(logits[0, -1].argmax()))
    if profiler is not None:
        profiler.__exit__(None, None, None)
        with open(args.profile, "w") as f:
            f.write(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    segments = [times[i * args.steps:(i + 1) * args.steps] for i in range(1, 1 + args.runs)]
    result = {
        "method": args.method, "length": args.length,
        "throughput": [args.steps / sum(seg) for seg in segments],
        "warmup_s": sum(times[:args.steps]),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "continuation": tokens[:steps_total] if continuation is None else None,
    }
    if routed is not None and routing != "full":   # over the measured steps, as the times are (not the warm-up's)
        result["full_call_rate"] = float(routed.routing.decisions[:, args.steps:].double().mean())
    return result


def copy_bandwidth(threads: int, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second the fastest of `repeats` copies of an `nbytes` float32 tensor moves: each byte read once and
    written once, as `engine_throughput.copy_bandwidth` counts (counted as reads alone, the bandwidth came out half
    a read's and the bytes limits twice too long)."""
    torch.set_num_threads(threads)
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # touch every page first
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def cost_models(name: str, sinks: int, window: int, dtype: torch.dtype, bandwidth: float):
    """(FLOPs ledger, bytes model on a bandwidth-only roofline) for the benchmark's model."""
    from oda_hf.cost import BatchCostModel, CostLedger, Hardware, ModelShape, head_param_count

    config = model_config(name)
    ledger = CostLedger(ModelShape.from_config(config), head_param_count(config.hidden_size), sinks=sinks,
                        window=window)
    size = torch.finfo(dtype).bits // 8
    hardware = Hardware("tensor-copy bandwidth of this machine", float("inf"), bandwidth)
    return ledger, BatchCostModel(ledger, hardware, weight_bytes=size, kv_bytes=size)


def measured_and_warmup(args) -> tuple[int, int]:
    """The routed steps a worker times (`--runs` segments) and those before them (one warm-up segment): `worker`'s
    layout, which the limit and the FLOPs ratio must follow."""
    return args.steps * args.runs, args.steps


def step_decisions(method: str, steps: int, warmup: int) -> list[bool] | None:
    """Full (True) or Local per measured step (the `steps` after `warmup` warm-up steps: the schedule counts from the
    warm-up's first step); None for stock arms (a plain Full step)."""
    from oda_hf.cost import schedule_first_k

    path, routing = METHODS[method]
    if path == "native":
        return None
    if isinstance(routing, int):
        return schedule_first_k(routing, PERIOD, warmup + steps)[warmup:]
    return [routing == "full"] * steps


def limit_seconds(method: str, length: int, steps: int, warmup: int, bytes_model) -> float:
    """Mean seconds per measured step at the bandwidth limit (the history grows by one per step)."""
    decisions = step_decisions(method, steps, warmup)
    lengths = [length + warmup + t for t in range(steps)]  # after the warm-up steps
    if decisions is None or METHODS[method][1] == "full":
        costs = [bytes_model.full_step([n]) for n in lengths]
    elif METHODS[method][1] == "local":
        costs = [bytes_model.local_step([n]) for n in lengths]
    else:
        costs = [bytes_model.oda_step_pattern([n], [d], "whole") for n, d in zip(lengths, decisions)]
    return sum(c.seconds for c in costs) / steps


def predicted_ratio(method: str, length: int, steps: int, warmup: int, ledger) -> float:
    """FLOPs ratio native-Full / method over the measured steps, from the analytical ledger."""
    decisions = step_decisions(method, steps, warmup)
    if decisions is None or METHODS[method][1] == "full":
        return 1.0
    start = length + warmup   # the history when the measured steps begin
    full = ledger.sequence_flops("full", start, steps)
    if METHODS[method][1] == "local":
        return full / ledger.sequence_flops("local", start, steps)
    return full / ledger.sequence_flops("oda", start, decisions)


def job_order(lengths: list[int], methods: list[str], rounds: int) -> list[tuple[int, str, int]]:
    """(length, method, round) in run order: odd rounds reverse every arm after the first (the stock arm that makes
    each length's continuation runs first in every round), so slow drift of the machine's load hits every arm alike."""
    return [(length, method, r) for r in range(rounds) for length in lengths
            for method in (methods if r % 2 == 0 else [methods[0]] + methods[:0:-1])]


def run_worker_subprocess(args, length: int, method: str, continuation, script: str = __file__,
                          extra: tuple[str, ...] = ()) -> dict:
    """Measure one (length, method) in a fresh `script --worker` process (clean peak memory);
    `extra` carries the script's own options."""
    command = [sys.executable, os.path.abspath(script), "--worker", "--method", method, "--length", str(length),
               "--steps", str(args.steps), "--runs", str(args.runs), "--dtype", args.dtype, "--sinks",
               str(args.sinks), "--window", str(args.window), "--threads", str(args.threads), "--seed",
               str(args.seed), "--model", model_name(args), *extra]
    if continuation is not None:
        command += ["--continuation", json.dumps(continuation)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"worker {method} @ {length} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    lines = ["| Input tokens | Method | Full (%) | ms/token | vs native-static | vs native-dynamic | limit ms/token "
             "| / limit | bytes-model ratio vs static | FLOPs-model ratio vs Full | Peak RSS (GB) |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        rate = row.get("full_call_rate")
        full_pct = "0.0" if METHODS[row["method"]][1] == "local" else "100.0" if rate is None else f"{100 * rate:.1f}"
        ratio = lambda key: "-" if row.get(key) is None else f"{row[key]:.2f}x"  # noqa: E731
        lines.append(f"| {row['length']:,} | {row['method']} | {full_pct} | {row['ms_per_token']:.2f} | "
                     f"{ratio('vs_static')} | {ratio('vs_dynamic')} | {row['limit_ms']:.2f} | "
                     f"{row['ms_per_token'] / row['limit_ms']:.2f} | {ratio('bytes_ratio')} | {row['predicted']:.2f}x | "
                     f"{row['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(methods) * len(lengths) ** 0.5, 4))
    width = 0.8 / len(lengths)
    for i, length in enumerate(lengths):
        by_method = {r["method"]: r for r in rows if r["length"] == length}
        xs = [j + i * width for j, m in enumerate(methods) if m in by_method]
        ax.bar(xs, [by_method[m]["ms_per_token"] for m in methods if m in by_method], width,
               label=f"{length:,} tokens")
        ax.scatter(xs, [by_method[m]["limit_ms"] for m in methods if m in by_method], marker="_", s=200,
                   color="black", zorder=3, label="bandwidth limit" if i == 0 else None)
    ax.set_xticks([j + width * (len(lengths) - 1) / 2 for j in range(len(methods))], methods, rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("ms per decoded token")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_shared_arguments(parser: argparse.ArgumentParser, output_help: str) -> None:
    """Options both decode benchmarks take (model, lengths, schedule segments, routing, output, and the
    hidden options of one worker process)."""
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_NAMES),
                        help="qwen3-0.6b: published shapes, random weights; smollm2: the fetched model (oda fetch smollm2)")
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--steps", type=int, default=16, help="routed steps per segment (one schedule period)")
    parser.add_argument("--runs", type=int, default=3, help="measured segments after one warm-up segment")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (for tests): --model tiny")
    parser.add_argument("--output", default="benchmarks/results", help=output_help)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--continuation", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)  # worker: write a torch.profiler table here


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list from {list(METHODS)}")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every arm, alternating the order")
    parser.add_argument("--copy-mb", type=int, default=1024, help="size of the bandwidth-measuring copy")
    add_shared_arguments(parser, output_help="folder for the table, JSON and PNG")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or METHODS[methods[0]][0] != "native":
        raise SystemExit(f"--methods must start with a stock arm (it produces the continuation) and come from "
                         f"{list(METHODS)}; unknown: {unknown}")
    from tqdm import tqdm

    name = model_name(args)
    bandwidth = [copy_bandwidth(args.threads, args.copy_mb << 20)]
    lengths = [int(n) for n in args.lengths.split(",")]
    jobs = job_order(lengths, methods, args.rounds)
    measured: dict[tuple[int, str], list[dict]] = {}
    continuation: dict[int, list[int]] = {}
    for length, method, _ in tqdm(jobs, desc="decode benchmark", unit="run"):
        result = run_worker_subprocess(args, length, method, continuation.get(length))
        if result.get("continuation") is not None:
            continuation[length] = result["continuation"]
        result.pop("continuation")
        measured.setdefault((length, method), []).append(result)
        tqdm.write(f"{length:>7} {method:<16} {1000 / statistics.median(result['throughput']):.1f} ms/token")
    bandwidth.append(copy_bandwidth(args.threads, args.copy_mb << 20))  # did the machine's state change?
    # The limit uses the faster copy: the tighter bound.
    ledger, bytes_model = cost_models(name, args.sinks, args.window, getattr(torch, args.dtype), max(bandwidth))

    rows = []
    measured_steps, warmup_steps = measured_and_warmup(args)
    for length in lengths:
        for method in methods:
            results = measured[(length, method)]
            throughput = [t for r in results for t in r["throughput"]]
            row = {"method": method, "length": length, "throughput": throughput,
                   "ms_per_token": 1000 / statistics.median(throughput),
                   "peak_rss_gb": max(r["peak_rss_gb"] for r in results),
                   "warmup_s": [r["warmup_s"] for r in results],
                   "limit_ms": 1000 * limit_seconds(method, length, measured_steps, warmup_steps, bytes_model),
                   "predicted": predicted_ratio(method, length, measured_steps, warmup_steps, ledger)}
            if "full_call_rate" in results[0]:
                row["full_call_rate"] = results[0]["full_call_rate"]
            rows.append(row)
        by_method = {r["method"]: r for r in rows if r["length"] == length}
        for row in by_method.values():
            for key, reference in (("vs_static", "native-static"), ("vs_dynamic", "native-dynamic")):
                if reference in by_method:
                    row[key] = by_method[reference]["ms_per_token"] / row["ms_per_token"]
            if BASELINE in by_method:
                row["bytes_ratio"] = by_method[BASELINE]["limit_ms"] / row["limit_ms"]

    os.makedirs(args.output, exist_ok=True)
    header = (f"CPU decode benchmark: {MODEL_NAMES[name]}, {args.dtype}, {args.threads} threads on {os.cpu_count()} "
              f"cores, s={args.sinks}, w={args.window}, {args.rounds} round(s) x {args.runs} x {args.steps} measured "
              f"routed steps after {args.steps} warm-up steps. Copy bandwidth {bandwidth[0] / 1e9:.1f} GB/s before, "
              f"{bandwidth[1] / 1e9:.1f} GB/s after (the limit uses the faster).")
    table = format_table(rows)
    print(header + "\n\n" + table)
    stem = os.path.join(args.output, f"decode_{name.replace('-', '_')}")
    with open(stem + ".md", "w") as f:
        f.write(header + "\n\n" + table + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"bandwidth_bytes_per_s": bandwidth, "args": vars(args), "rows": rows}, f, indent=1)
    plot(rows, stem + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
