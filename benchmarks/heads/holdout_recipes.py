"""Compare recall-head recipes on held-out rows of one supervision cache (minutes, not a RULER calibration's hour).

    python benchmarks/heads/holdout_recipes.py --cache runs/qwen/cache --width 224 --epochs 20
    python benchmarks/heads/holdout_recipes.py --cache runs/qwen/cache --width 448 --epochs 20

Every fifth cached row is held out; a head is trained on the others with the paper's optimiser (AdamW, lr 3e-4 after a
20-update linear warm-up, then constant; clipping 1.0; Huber loss on ``T(g - lambda)``; 4 rows per update) and scored
on the held-out positions: the share of their positive gain that the head's top 10 / 25 / 50% of positions capture
(`net@rate`; the oracle ranks by the gain itself), the rate and captured gain at fixed thresholds, and the AUROC of the
score for ``g > 0.1``. A proxy for ranking quality, not for RULER scores: calibration and the held-out tables decide
what ships. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oda_hf.cli_common import thread_count
from oda_hf.evaluation.stats import auroc
from oda_hf.head import RecallHead, RecallHeadConfig
from oda_hf.training.losses import regression_target, token_losses
from oda_hf.training.supervision_cache import INPUT_TENSORS, SupervisionCache
from oda_hf.validation import argument, integer, number, seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--width", type=argument(integer, "width", minimum=1), default=None,
                        help="head tower width (default hidden / 2)")
    parser.add_argument("--epochs", type=argument(integer, "epochs", minimum=1), default=20)
    parser.add_argument("--lam", type=argument(number, "lam", minimum=0.0), default=0.0,
                        help="Full-call penalty lambda")
    parser.add_argument("--lr", type=argument(number, "lr", minimum=0.0, exclusive_minimum=True), default=3e-4)
    parser.add_argument("--rows-per-update", type=argument(integer, "rows-per-update", minimum=1), default=4)
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument("--seed", type=argument(seed, "seed"), default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    try:
        cache = SupervisionCache(args.cache)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    rows = [cache.row(i) for i in range(len(cache))]
    held = [row for i, row in enumerate(rows) if i % 5 == 0]
    train = [row for i, row in enumerate(rows) if i % 5 != 0]
    config = RecallHeadConfig(hidden_size=rows[0]["prev_hidden"].shape[1], head_width=args.width,
                              sinks=cache.sinks, window=cache.window)
    head = RecallHead(config)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    updates, start = 0, time.time()
    for _ in range(args.epochs):
        order = torch.randperm(len(train)).tolist()
        for first in range(0, len(order), args.rows_per_update):
            batch = [train[i] for i in order[first:first + args.rows_per_update]]
            inputs = {key: torch.cat([row[key] for row in batch]) for key in INPUT_TENSORS + ("gains",)}
            for group in optimizer.param_groups:
                group["lr"] = args.lr * min(1.0, (updates + 1) / 20)
            scores = head(inputs["prev_hidden"], inputs["input_embeds"], inputs["local_hidden"])
            loss = token_losses(scores, regression_target(inputs["gains"], args.lam)).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            updates += 1

    with torch.no_grad():
        inputs = {key: torch.cat([row[key] for row in held]) for key in INPUT_TENSORS + ("gains",)}
        scores = head(inputs["prev_hidden"], inputs["input_embeds"], inputs["local_hidden"]).float().flatten()
        gains = inputs["gains"].flatten()
        loss = token_losses(scores, regression_target(gains, args.lam)).mean().item()
    positive = gains.clamp(min=0).sum().item()
    out = dict(cache=args.cache, width=config.head_width, epochs=args.epochs, lam=args.lam, lr=args.lr,
               updates=updates, train_seconds=round(time.time() - start), held_out_positions=len(gains),
               held_out_loss=round(loss, 4))
    for rate in (0.1, 0.25, 0.5):
        k = int(rate * len(gains))
        out[f"net@{rate}"] = round(gains[torch.topk(scores, k).indices].sum().item() / positive, 3)
        out[f"oracle@{rate}"] = round(gains[torch.topk(gains, k).indices].sum().item() / positive, 3)
    for threshold in (0.0, 0.05, 0.1, 0.2):
        chosen = scores > threshold
        out[f"rate@theta{threshold}"] = round(chosen.float().mean().item(), 3)
        out[f"net@theta{threshold}"] = round(gains[chosen].sum().item() / positive, 3)
    out["auroc(g>0.1)"] = round(auroc(scores.numpy(), (gains > 0.1).numpy()), 4)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
