"""Cost of cached paired supervision on a real base model (CPU): caching, disk, head updates from the cache.

    python benchmarks/supervision_cache.py --base SmolLM2-135M-folder --text FILE [FILE ...] [--seq-len 2048] \
        [--sinks 4] [--window 256] [--update-positions 4096] [--threads 1] [--output DIR] [--json OUT.json]

* caching: `cache_supervision` of one `--seq-len` token row of the concatenated text files (one backbone
  pass: trunk + Local-cf + Full-cf, gains, H/E/L), wall time, shard bytes and bytes per 1K positions;
* a head update from the cache: forward, Huber loss, backward and an AdamW step of a fresh head on
  `--update-positions` cached positions (the row's positions repeated to that count), median of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from oda_hf.training import regression_target, token_losses
from oda_hf.training.supervision_cache import INPUT_TENSORS, cache_supervision


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--text", nargs="+", required=True, help="plain-text files, concatenated")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--update-positions", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="cache folder (default: a temporary one)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    text = "\n\n".join(open(path, encoding="utf-8", errors="replace").read() for path in args.text)
    ids = tokenizer(text)["input_ids"][:args.seq_len]
    if len(ids) < args.seq_len:
        raise SystemExit(f"The text has only {len(ids)} tokens; give more files for --seq-len {args.seq_len}.")
    row = {"input_ids": ids, "position_ids": list(range(len(ids)))}
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32, attn_implementation="sdpa")
    model = OdaForCausalLM(base, None, OdaConfig(sinks=args.sinks, window=args.window, policy="local"))

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.output or tmp
        started = time.perf_counter()
        cache = cache_supervision(model, [row], folder, seq_len=args.seq_len, progress=False, base_name=args.base)
        cache_seconds = time.perf_counter() - started
        item = cache.row(0)
        positions, shard_bytes = cache.num_positions, cache.num_bytes

    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(base)).float().train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-4, weight_decay=0.0)
    repeat = -(-args.update_positions // positions)
    batch = {key: item[key].repeat(repeat, *([1] * (item[key].dim() - 1)))[:args.update_positions]
             for key in INPUT_TENSORS + ("gains",)}
    times = []
    for _ in range(args.repeats + 1):  # the first is warm-up
        started = time.perf_counter()
        scores = head(batch["prev_hidden"], batch["input_embeds"], batch["local_hidden"])
        loss = token_losses(scores, regression_target(batch["gains"])).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    result = {
        "base": args.base, "seq_len": args.seq_len, "sinks": args.sinks, "window": args.window, "threads": args.threads,
        "hidden_size": base.config.hidden_size, "eligible_positions": positions,
        "cache_seconds_per_row": round(cache_seconds, 2), "shard_bytes": shard_bytes,
        "bytes_per_1k_positions": round(1000 * shard_bytes / positions),
        "head_parameters": sum(p.numel() for p in head.parameters()),
        "update_positions": args.update_positions, "head_update_seconds_median": round(statistics.median(times[1:]), 4),
        "head_update_seconds_all": [round(t, 4) for t in times[1:]],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
