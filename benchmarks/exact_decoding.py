"""Exact ODA against stock static-cache decoding and fixed-length self-speculation, on real prompts.

SmolLM2-135M-Instruct with its shipped head (s=4, w=256), held-out RULER test prompts (chat template) at each
length. Per prompt the stock model prefills once; every arm decodes from a copy of that history:

  stock-static   transformers' StaticCache, one greedy token per forward (the strongest stock baseline here)
  fixed-k        exact mode with fixed drafts: Local drafts k tokens, one Full pass verifies (the MagicDec-style
                 anchor: same code path, head ignored; `verify_threshold=inf`, `max_draft=k`)
  head@T         exact mode gated by the head: verify when its score passes T (or at `--max-draft` drafts)
  engine ...     the same arms on the static engine (`--backends hf,engine`; `generate(oda_fast=True)`)

Every arm decodes `--new-tokens` greedy tokens with EOS ignored (equal work per arm; a RULER answer is shorter).
Columns: ms per token (decode only, median over prompts), speed against stock static, accepted drafts per Full
pass, Full passes per token, tokens that differ from stock static (and near-ties, where Full's top two logits
are within 1e-4), and the bytes-model limit: the bytes each arm's passes read (weights once per pass, the K/V
each pass attends to) over the bytes stock static reads, i.e. the speed ratio a purely memory-bound machine
would give.

Usage (after `oda fetch smollm2`; run alone, one thread; ~15 min):
  python benchmarks/exact_decoding.py --lengths 2048,4096,7000 --prompts 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

TASKS = ("niah_single_2", "niah_multikey_1", "vt", "qa_1", "niah_multivalue")


def load(threads: int):
    from transformers import AutoTokenizer

    from oda_hf import OdaForCausalLM
    from oda_hf.known_models import resolve_base

    torch.set_num_threads(threads)
    model = OdaForCausalLM.from_pretrained("smollm2", head="smollm2", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(resolve_base("smollm2"))
    return model, tokenizer


def prompts(tokenizer, model, length: int, count: int) -> list[list[int]]:
    from oda_hf.evaluation.ruler_synth import generate_suite
    from oda_hf.evaluation.runner import encode_prompt

    examples = []
    for task in TASKS:
        examples += generate_suite(tokenizer, [task], [length], split="test", n=1, haystack="kjv",
                                   max_position_embeddings=model.config.max_position_embeddings)
        if len(examples) >= count:
            break
    return [encode_prompt(example, tokenizer, chat_template=True) for example in examples[:count]]


def stock_prefill(base, ids: list[int]):
    """(per-layer (keys, values), last hidden [1, H], first greedy token) of one stock Full prefill."""
    from transformers import DynamicCache

    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        out = base.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    hidden = out.last_hidden_state[:, -1]
    first = int(torch.argmax(base.lm_head(hidden)[0]))
    return [(layer.keys, layer.values) for layer in cache.layers], hidden, first


@torch.no_grad()
def stock_static(base, history, length: int, first: int, new_tokens: int) -> tuple[list[int], float]:
    from transformers import StaticCache

    cache = StaticCache(config=base.config, max_cache_len=length + new_tokens + 1)
    for layer, (keys, values) in zip(cache.layers, history):
        layer.update(keys, values, cache_kwargs={"cache_position": torch.arange(length)})
    tokens, start = [first], time.perf_counter()
    for position in range(length, length + new_tokens - 1):
        logits = base(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                      cache_position=torch.tensor([position]), use_cache=True).logits
        tokens.append(int(torch.argmax(logits[0, -1])))
    return tokens, time.perf_counter() - start


@torch.no_grad()
def exact(model, history, hidden, ids: list[int], new_tokens: int, max_draft: int, threshold: float, engine=None):
    """Exact decoding from a loaded history: on the Transformers path (an OdaCache), or on `engine`."""
    from oda_hf.engine.generation import resolve_request
    from oda_hf.exact import (
        CacheDrafts,
        EngineDrafts,
        ExactRecord,
        check_exact_settings,
        decode_after_prefill,
        new_exact_cache,
    )

    settings = check_exact_settings(model, max_draft, threshold)
    request = resolve_request(model, torch.tensor([ids]), None, dict(max_new_tokens=new_tokens, do_sample=False,
                                                                   eos_token_id=None, pad_token_id=0))
    if engine is None:
        cache = new_exact_cache(model, len(ids) + new_tokens + max_draft + 1)
        cache.load_history(iter(history))
        drafts = CacheDrafts(model, cache, hidden)
    else:
        engine.load_history(iter(history), hidden)
        drafts = EngineDrafts(engine)
    record = ExactRecord(1, settings.max_draft, settings.verify_threshold)
    start = time.perf_counter()
    tokens = decode_after_prefill(model, drafts, ids, hidden, request, settings, set(), record)
    return tokens, time.perf_counter() - start, record


def bytes_ratio(model, length: int, new_tokens: int, record=None) -> float:
    """Bytes stock static reads over bytes the arm reads (weights per pass + the K/V each pass attends to)."""
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    weights = sum(p.numel() * p.element_size() for p in model.base_model.parameters())
    per_position = 2 * layers * kv_heads * head_dim * 4
    span = model.oda_config.sinks + model.oda_config.window
    stock = sum(weights + per_position * (length + t) for t in range(new_tokens - 1))
    if record is None:
        return 1.0
    passes, local_steps = record.total("full_passes"), record.total("drafted") + record.total("head_verifications")
    mid = length + new_tokens // 2
    arm = passes * (weights + per_position * mid) + local_steps * (weights + per_position * span)
    return stock / arm


def run(args) -> list[dict]:
    model, tokenizer = load(args.threads)
    from oda_hf.engine import OdaStaticEngine

    arms = [("stock-static", None, None, None)]
    for backend in args.backends:  # the Transformers path's arms keep their names; the engine's are prefixed
        prefix = "" if backend == "hf" else "engine "
        arms += [(f"{prefix}fixed-{k}", k, math.inf, backend) for k in args.fixed]
        arms += [(f"{prefix}head@{t:g}", args.max_draft, t, backend) for t in args.thresholds]
    rows = []
    for length in args.lengths:
        measured: dict[str, list[dict]] = {arm[0]: [] for arm in arms}
        engine = None
        if "engine" in args.backends:
            longest = max(args.fixed + [args.max_draft])
            engine = OdaStaticEngine(model, max_length=int(length * 1.03) + args.new_tokens + longest + 2)
        for ids in tqdm(prompts(tokenizer, model, length, args.prompts), desc=f"{length} tokens", unit="prompt"):
            history, hidden, first = stock_prefill(model.base_model, ids)
            reference, seconds = stock_static(model.base_model, history, len(ids), first, args.new_tokens)
            measured["stock-static"].append({"seconds": seconds, "tokens": reference, "record": None})
            for name, max_draft, threshold, backend in arms[1:]:
                tokens, seconds, record = exact(model, history, hidden, ids, args.new_tokens, max_draft, threshold,
                                                engine if backend == "engine" else None)
                measured[name].append({"seconds": seconds, "tokens": tokens, "record": record,
                                       "reference": reference})
        base_ms = statistics.median(m["seconds"] * 1000 / (args.new_tokens - 1) for m in measured["stock-static"])
        if engine is not None:
            engine.release()
        for name, *_ in arms:
            runs = measured[name]
            ms = statistics.median(m["seconds"] * 1000 / (args.new_tokens - 1) for m in runs)
            row = {"length": length, "arm": name, "ms_per_token": ms, "speed": base_ms / ms, "prompts": len(runs)}
            if runs[0]["record"] is not None:
                records = [m["record"] for m in runs]
                passes = sum(r.total("full_passes") for r in records)
                row |= {"accepted_per_pass": sum(r.total("accepted") for r in records) / passes,
                        "passes_per_token": passes / sum(r.total("generated") for r in records),
                        "differing": sum(sum(a != b for a, b in zip(m["tokens"], m["reference"])) for m in runs),
                        "near_ties": sum(r.total("near_ties") for r in records),
                        "bytes_limit": statistics.mean(bytes_ratio(model, length, args.new_tokens, r) for r in records)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict], args) -> str:
    lines = [f"# Exact ODA vs stock static and fixed-length self-speculation (SmolLM2-135M-Instruct, fp32, "
             f"{args.threads} thread(s))", "",
             f"`python benchmarks/exact_decoding.py --lengths {','.join(map(str, args.lengths))} --prompts "
             f"{args.prompts} --new-tokens {args.new_tokens} --fixed {','.join(map(str, args.fixed))} --thresholds "
             f"{','.join(f'{t:g}' for t in args.thresholds)} --max-draft {args.max_draft} --backends "
             f"{','.join(args.backends)} --threads {args.threads}`; `engine ...`: the same arm on the static engine; "
             "`head@T`: verify when the head's score passes T or at --max-draft drafts; held-out RULER test prompts "
             "(chat template), greedy, EOS ignored, decode time only (one shared stock prefill per prompt); median "
             "over prompts. `differing`: output tokens unlike stock static's (near-ties: Full's top two within 1e-4).",
             "", "| length | arm | ms/token | vs stock static | accepted / Full pass | Full passes / token | "
             "differing (near-ties) | bytes-model limit |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        extra = (f"{row['accepted_per_pass']:.2f} | {row['passes_per_token']:.3f} | {row['differing']} "
                 f"({row['near_ties']}) | {row['bytes_limit']:.2f}x" if "accepted_per_pass" in row else
                 "- | 1.000 | - | 1.00x")
        lines.append(f"| {row['length']} | {row['arm']} | {row['ms_per_token']:.1f} | {row['speed']:.2f}x | {extra} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096, 7000])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--fixed", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16])
    parser.add_argument("--thresholds", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 0.5, 1.0])
    parser.add_argument("--max-draft", type=int, default=16)
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["hf"],
                        help="hf (Transformers path, OdaCache) and/or engine (the static engine), comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/exact_smollm2")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.backends) - {"hf", "engine"})
    if unknown or not args.backends:
        parser.error(f"--backends takes hf and/or engine, comma-separated; got {','.join(args.backends)!r}.")
    rows = run(args)
    from oda_hf.files import write_json, write_text

    write_json(args.out + ".json", rows)
    write_text(args.out + ".md", table(rows, args))
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
