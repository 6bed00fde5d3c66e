"""Decode throughput of the static engine (oda_hf.engine) against the HF path and stock decoding.

GPU results: benchmarks/results/gpu_h200_torch2.11.md and gpu_h200_torch2.11_engine/ (on torch < 2.13 the engine's
graphs branch to Full through one host read per step, `conditional="host"`; with conditional nodes the branch stays
on the device). The engine's Full kernel uses tl.dot products; `--elementwise-full` measures the elementwise one.

Methods, all on the same synthetic history and the same continuation (produced by native-full):
  native-full        stock transformers forward + DynamicCache (eager; the reference everywhere)
  native-static      stock forward, StaticCache (eager)
  native-compiled    stock forward, StaticCache, torch.compile (on CUDA mode="reduce-overhead": CUDA graphs, the
                     fastest stock decoding a transformers user gets)
  hf-oda-{full,local}  OdaForCausalLM (HF path), always Full / always Local (StreamingLLM)
  hf-oda-{12.5,25,50}  OdaForCausalLM, the HF path, Full on the first 2/4/8 of every 16 routed steps
  engine-full        OdaStaticEngine, always Full (Local skipped): the engine's own Full baseline
                     (with graphs on CUDA, the fair "native Full" of a graph-captured runtime)
  engine-local       OdaStaticEngine, always Local (StreamingLLM access set; head not run)
  engine-{12.5,25,50}  OdaStaticEngine with the schedule; the head runs every step (with --batch > 1 every row
                     recalls on the same steps: the Full pass's best case)
  engine-random-{12.5,25,50}  OdaStaticEngine, each row Full with that probability, drawn independently per
                     row (RandomPolicy): the Full pass runs for the whole batch when any row recalls, so at batch B
                     a step runs it with probability 1 - (1 - p)^B
Bytes limit (ms/step): the time one step would take if it only moved its bytes at the device's copy bandwidth
(measured in the worker: a 1 GiB tensor copy, read + write): the decoder's weights once per backbone pass (two
passes on a step that recalls: Local, then Full), the output matrix once, and the KV each pass reads (all n
positions for Full, s + w for Local; a sliding-window layer its window in every pass) for every row, at the share of
steps that ran the Full pass. An arm near its limit is bound by memory; far above it, by launches and Python.
Protocol (as benchmarks/decode_throughput.py, whose model shapes and synthetic history it reuses):
one warm-up segment and `--runs` measured segments of `--steps` routed steps, run back to back on one
request; throughput = tokens (steps x rows) / segment time; median reported with the ratio to native-full (and to
engine-full when both run). Each (length, method) runs in its own subprocess (peak memory is its own).
On CUDA the engine's graphs for every length bucket the run will touch are captured before timing
(`capture_buckets`), and segments are timed with device synchronisation at their ends only.

Usage:
  python benchmarks/engine_throughput.py                              # CPU, Qwen3-0.6B shapes, 4K-32K, fp32
  python benchmarks/engine_throughput.py --tiny --lengths 256,1024     # seconds
  python benchmarks/engine_throughput.py --device cuda                # GPU: bf16, graphs, Triton kernels
  python benchmarks/engine_throughput.py --device cuda --model gemma3-270m   # window-global hybrid: + HF-path arms
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

from oda_hf.validation import argument, integer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_throughput  # noqa: E402
from decode_throughput import (  # noqa: E402
    MODEL_NAMES, PERIOD, add_shared_arguments, load_model, model_name, start_engine, stock_step, synthetic_history)

SCHEDULES = {"12.5": 2, "25": 4, "50": 8}
STOCK = {"native-full": "dynamic", "native-static": "static", "native-compiled": "compiled"}
METHODS = [*STOCK, "hf-oda-full", "hf-oda-local", *(f"hf-oda-{r}" for r in SCHEDULES), "engine-full", "engine-local",
           *(f"engine-{r}" for r in SCHEDULES), *(f"engine-random-{r}" for r in SCHEDULES)]
# "vs best stock" is against the fastest stock arm that ran: stock's static cache is the one a user would pick
# (without it a CPU run compared with the dynamic cache alone: 12.3x "vs best stock" at 32K in one published table)
DEFAULT_METHODS = {"cpu": "native-full,native-static,hf-oda-12.5,engine-full,engine-12.5,engine-25,engine-50",
                   "cuda": "native-full,native-static,native-compiled,engine-full,engine-local,engine-12.5,engine-25,"
                           "engine-50"}
# Window-global hybrids (Gemma 3): the engine's arms beside the HF path's. No compiled stock arm by default: on an
# H200 it compiled for 3 minutes and decoded Gemma 3 270M no faster than stock static (46 vs 42 tok/s at 16K).
HYBRID_METHODS = {"cpu": "native-full,native-static,hf-oda-local,hf-oda-12.5,engine-full,engine-local,engine-12.5",
                  "cuda": "native-full,native-static,hf-oda-local,engine-full,engine-local,engine-12.5,engine-25,"
                          "engine-50"}


def _routing(method: str):
    """(policy, needs a head) for an ODA method."""
    from oda_hf import RandomPolicy, SchedulePolicy

    rate = method.rsplit("-", 1)[1]
    if "-random-" in method:
        return RandomPolicy(float(rate) / 100, seed=0, run_head=True), True
    if rate in SCHEDULES:
        return SchedulePolicy(SCHEDULES[rate], PERIOD, run_head=True), True
    return rate, False  # "full" / "local"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second a device-to-device tensor copy moves (bytes read plus bytes written; best of `repeats`)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 27)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy is a warm-up
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del source, target
    return 2 * nbytes / best


def step_bytes(model, length: int, sinks: int, window: int, full_rate: float, runs_local: bool,
               batch: int = 1) -> float:
    """Bytes one decode step must read at least (see the module docstring): weights per pass, output matrix, KV of
    every row. `full_rate`: the share of steps that run the Full pass (at batch > 1 the pass reads every row's KV)."""
    from oda_hf.engine.support import sliding_windows

    output = model.get_output_embeddings().weight
    embedding = model.get_input_embeddings().weight  # read one row per step
    decoder = sum(p.numel() * p.element_size() for p in model.get_decoder().parameters()
                  if p.data_ptr() not in (output.data_ptr(), embedding.data_ptr()))
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_layer_position = 2 * config.num_key_value_heads * head_dim * output.element_size()
    passes = (1 + full_rate) if runs_local else 1
    global_positions = (min(sinks + window, length) + full_rate * length) if runs_local else length
    positions = sum(global_positions if native is None else passes * min(native, length)
                    for native in sliding_windows(config))  # over layers: a sliding layer reads its window per pass
    return decoder * passes + output.numel() * output.element_size() + batch * kv_per_layer_position * positions


def worker(args) -> dict:
    """One (length, method): load the history, decode warm-up + measured segments, report timings."""
    from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    with device:  # random initialisation on the GPU takes a fraction of the host's time
        model = load_model(model_name(args), dtype, args.seed).to(device)
    steps_total = (1 + args.runs) * args.steps
    generator = torch.Generator().manual_seed(args.seed + 2)
    last_hidden = torch.randn(args.batch, model.config.hidden_size, generator=generator).to(device, dtype)
    first_token = int(torch.randint(model.config.vocab_size, (1,), generator=generator))
    continuation = json.loads(args.continuation) if args.continuation else None
    history = synthetic_history(model, args.length, args.seed, device, batch=args.batch)
    produces_continuation = args.method == "native-full"
    if not produces_continuation and continuation is None:
        raise SystemExit(f"{args.method} needs the continuation produced by native-full.")

    engine = oda = None
    if args.method in STOCK:
        stock = stock_step(model, STOCK[args.method], args.length, args.length + steps_total + 1, history, device)

        def step(token):
            return stock(token.view(-1, 1))[:, -1]
    else:
        policy, needs_head = _routing(args.method)
        head = RecallHead(RecallHeadConfig.for_base(model)).to(device) if needs_head else None
        oda = OdaForCausalLM(model, head, OdaConfig(sinks=args.sinks, window=args.window, policy=policy))
        if args.method.startswith("hf-oda"):
            cache = oda.new_cache(max_cache_len=args.length + steps_total + 1)
            cache.load_history(history)  # consumed one layer at a time
            oda.begin_request(cache, last_hidden)

            def step(token):
                return oda(input_ids=token.view(1, 1), past_key_values=cache).logits[:, -1]
        else:
            options = {"full_dot": False} if args.elementwise_full else {}
            engine, captured, capture_seconds = start_engine(oda, history, last_hidden, args.length + steps_total,
                                                             steps_total, args.bucket_size, batch=args.batch, **options)
            step = engine.step

    # Tokens to feed: native-full reads its argmax (it defines the continuation); the others replay
    # it from a device tensor, so timed segments contain no host read. Every row is fed row 0's token
    # (token values do not change the work of a step).
    feed = torch.tensor([first_token] + (continuation or [])[:steps_total], device=device)
    feed = feed[:, None].expand(-1, args.batch).contiguous()
    tokens, seconds = [first_token], []
    with torch.no_grad():
        for segment in range(1 + args.runs):
            _sync(device)
            start = time.perf_counter()
            for index in range(segment * args.steps, (segment + 1) * args.steps):
                token = (torch.full((args.batch,), tokens[-1], device=device) if produces_continuation
                         else feed[index])
                logits = step(token)
                if produces_continuation:
                    tokens.append(int(logits[0].argmax()))
            _sync(device)
            seconds.append(time.perf_counter() - start)
    result = {
        "method": args.method, "length": args.length, "device": args.device, "dtype": args.dtype,
        "batch": args.batch, "throughput": [args.batch * args.steps / s for s in seconds[1:]],  # tokens of all rows
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "continuation": tokens[1:steps_total] if produces_continuation else None,
    }
    if device.type == "cuda":
        result["peak_cuda_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    routing = routing_of(engine, oda)
    # Over the measured steps, as the times are (the first segment is a warm-up): Full calls per row-step, and the
    # share of steps that ran the Full pass (for all rows), above the per-row rate when rows recall independently.
    measured = None if routing is None else routing.decisions[:, args.steps:]
    rate = 1.0 if measured is None else float(measured.double().mean())
    full_pass_rate = 1.0 if measured is None else float(measured.any(0).double().mean())
    runs_local = args.method not in STOCK and not args.method.endswith("-full")
    # the limit is the parent's (`bytes_limit`): one bandwidth for every row, the best any worker measured
    result["step_bytes"] = step_bytes(model, args.length, args.sinks, args.window, full_pass_rate, runs_local,
                                      args.batch)
    result["bandwidth_bytes_per_s"] = copy_bandwidth(device)
    if engine is not None:
        result.update(graphs=len(engine.graphs) if engine.graphs is not None else 0, graph_keys_captured=len(captured),
                      capture_seconds=capture_seconds, kernels=engine.kernels, graph_mode=engine.graph_mode,
                      conditional=engine.conditional, full_dot=engine.full.use_dot)
    if routing is not None:
        result["full_call_rate"] = rate
        result["full_pass_rate"] = full_pass_rate
    return result


def routing_of(engine, oda):
    return engine.routing if engine is not None else (oda.routing if oda is not None else None)


def run_worker_subprocess(args, length: int, method: str, continuation) -> dict:
    extra = ("--device", args.device, "--bucket-size", str(args.bucket_size), "--batch", str(args.batch),
             *(("--elementwise-full",) if args.elementwise_full else ()))
    return decode_throughput.run_worker_subprocess(args, length, method, continuation, script=__file__, extra=extra)


def format_table(rows: list[dict], device: str) -> str:
    memory = "Peak CUDA (GB)" if device == "cuda" else "Peak RSS (GB)"
    lines = [f"| Input tokens | Method | Full (%) | tok/s (median, all rows) | ms/step | vs native-full "
             f"| vs best stock | vs engine-full | bytes limit (ms/step) | {memory} |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        rate = row.get("full_call_rate")
        full_pct = "100.0" if rate is None else f"{100 * rate:.1f}"
        if rate is not None and row.get("full_pass_rate", rate) > rate:  # rows recalled on different steps
            full_pct += f" (Full pass on {100 * row['full_pass_rate']:.1f}% of steps)"
        vs_engine = f"{row['vs_engine_full']:.2f}x" if row.get("vs_engine_full") is not None else "-"
        mem = row.get("peak_cuda_gb", row["peak_rss_gb"])
        step_ms = 1000 * row.get("batch", 1) / row["median"]
        lines.append(f"| {row['length']:,} | {row['method']} | {full_pct} | {row['median']:.3f} | {step_ms:.2f} | "
                     f"{row['speedup']:.2f}x | {row['vs_best_stock']:.2f}x | {vs_engine} "
                     f"| {row['bytes_limit_ms']:.3f} | {mem:.2f} |")
    return "\n".join(lines)


def write_results(args, rows: list[dict]) -> str:
    """Write the table (Markdown, with its header) and the rows (JSON) to `args.output`; returns the Markdown."""
    from oda_hf.files import write_json, write_text

    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"CPU, {args.threads} threads on {os.cpu_count()} cores")
    header = (f"Static-engine decode benchmark: {MODEL_NAMES[model_name(args)]}, {args.dtype}, {where}, "
              f"batch {args.batch}, "
              f"s={args.sinks}, w={args.window}, bucket {args.bucket_size}, {args.runs} x {args.steps} measured routed "
              f"steps after {args.steps} warm-up steps"
              f"{'; engine Full kernel elementwise (--elementwise-full)' if args.elementwise_full else ''}.")
    text = header + "\n\n" + format_table(rows, args.device) + "\n"
    os.makedirs(args.output, exist_ok=True)
    variant = ("_elementwise" if args.elementwise_full else "") + (f"_b{args.batch}" if args.batch > 1 else "")
    name = f"engine_{model_name(args).replace('-', '_')}_{args.device}{variant}"
    write_text(os.path.join(args.output, name + ".md"), text)
    write_json(os.path.join(args.output, name + ".json"), rows)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--methods", default=None, help=f"comma list from {METHODS}; starts with native-full")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--bucket-size", type=int, default=128, help="graph reuse buckets ceil(L / size)")
    parser.add_argument("--elementwise-full", action="store_true",
                        help="engine arms: the Triton Full kernel's elementwise variant instead of tl.dot (CUDA)")
    parser.add_argument("--batch", type=argument(integer, "batch", minimum=1), default=1,
                        help="rows decoded together (stock and engine arms; every row has its own random history)")
    add_shared_arguments(parser, output_help="folder for the table and JSON")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (none is visible).")
    if args.elementwise_full and args.device != "cuda":
        raise SystemExit("--elementwise-full selects a variant of the Triton Full kernel, which the engine runs on "
                         "CUDA.")

    layer_types = getattr(decode_throughput.model_config(model_name(args)), "layer_types", None) or []
    hybrid = any(kind != "full_attention" for kind in layer_types)
    methods = (args.methods or (HYBRID_METHODS if hybrid else DEFAULT_METHODS)[args.device]).split(",")
    if args.batch > 1 and any(method.startswith("hf-oda") for method in methods):
        raise SystemExit("--batch > 1 runs the stock and engine-* methods; the hf-oda-* arms drive one row.")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or methods[0] != "native-full":
        raise SystemExit(f"--methods must start with native-full and come from {METHODS}; unknown: {unknown}")
    from tqdm import tqdm

    rows, continuation, baseline, engine_full, table = [], None, {}, {}, ""
    jobs = [(int(n), m) for n in args.lengths.split(",") for m in methods]
    failed = []
    for length, method in tqdm(jobs, desc="engine benchmark", unit="run"):
        try:
            result = run_worker_subprocess(args, length, method, None if method == "native-full" else continuation)
        except RuntimeError as error:  # one arm's failure costs only that arm (device time is scarce)
            if method == "native-full":
                raise
            tqdm.write(str(error))
            failed.append(f"{method} @ {length}")
            continue
        if method == "native-full":
            continuation = result["continuation"]
        result.pop("continuation", None)
        result["median"] = statistics.median(result["throughput"])
        if method == "native-full":
            baseline[length] = result["median"]
        if method == "engine-full":
            engine_full[length] = result["median"]
        result["speedup"] = result["median"] / baseline[length]
        result["vs_engine_full"] = result["median"] / engine_full[length] if length in engine_full else None
        rows.append(result)
        bytes_limit(rows)
        best_stock = max(r["median"] for r in rows if r["length"] == length and r["method"] in STOCK)
        for row in rows:  # ratios against the fastest stock arm of the length (so far; final once all ran)
            if row["length"] == length:
                row["vs_best_stock"] = row["median"] / best_stock
        tqdm.write(f"{length:>7} {method:<14} {result['median']:.3f} tok/s  {result['speedup']:.2f}x vs native-full")
        table = write_results(args, rows)  # after every run: a run cut short keeps what finished
    print(table)
    if failed:
        print(f"Failed (see above): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def bytes_limit(rows: list) -> None:
    """Each row's bytes limit (ms per step: the bytes it reads over the copy bandwidth) at the highest bandwidth any
    worker measured: each worker's own measurement, taken after its decode loop, varied 20-26 GB/s in one run, so
    two arms reading the same bytes showed limits 7% apart."""
    bandwidth = max(row["bandwidth_bytes_per_s"] for row in rows)
    for row in rows:
        row["bytes_limit_ms"] = 1000 * row["step_bytes"] / bandwidth


if __name__ == "__main__":
    sys.exit(main())
