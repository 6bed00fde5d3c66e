"""Train the organism's recall head: `oda train-head` on organism *training* sequences only.

    python -m oda_hf.organism.train_head --backbone <organism backbone dir> --output <dir> [--resume]

Writes ``<output>/train.jsonl`` (training-split sequences: prompt + reference answer, every task
family, lengths 256-1024, labels on the answer only, so gains are supervised where the head will
route; held-out dev/test examples are excluded by the corpus's content hashes),
prints the seed and the data's SHA-256, then runs the public `oda train-head` command on it, so
the organism's head is trained exactly as a user would train one (head-only checkpoints,
`--resume`, a progress bar).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

from .corpus import TASKS, OrganismCorpus, training_sequence

HEAD_LENGTHS = (256, 512, 768, 1024)


def write_head_data(path: str, seed: int, per_task_and_length: int, window: int = 64) -> str:
    """Write organism training sequences as ``{"input_ids", "labels"}`` lines (labels mask all but the
    answer); returns the file's SHA-256."""
    corpus = OrganismCorpus(seed=seed, window=window)
    digest = hashlib.sha256()
    with open(path + ".tmp", "w") as f:
        for length in HEAD_LENGTHS:
            for task in TASKS:
                for index in range(per_task_and_length):
                    try:
                        example = corpus.example(task, length, "train", index)
                    except ValueError:  # this task does not fit in `length` tokens with the window gap
                        continue
                    sequence = training_sequence(example)
                    # Supervise only answer positions: at deployment the head routes answer generation.
                    line = json.dumps({"input_ids": sequence.input_ids, "labels": sequence.labels}) + "\n"
                    digest.update(line.encode())
                    f.write(line)
    os.replace(path + ".tmp", path)  # atomic: a rerun never sees a half-written file
    return digest.hexdigest()


def main(argv=None) -> int:
    from ..cli import main as oda_main

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", required=True, help="organism backbone folder (train_backbone's output)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=None, help="corpus seed (default: the backbone's)")
    parser.add_argument("--per-task", type=int, default=40, help="training sequences per task and length")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--tau-hist", type=float, default=0.001)
    parser.add_argument("--lambda", dest="oda_lambda", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a tiny backbone gains nothing from more)")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    seed = args.seed
    if seed is None:
        with open(os.path.join(args.backbone, "organism.json")) as f:
            seed = json.load(f)["seed"]
    os.makedirs(args.output, exist_ok=True)
    data = os.path.join(args.output, "train.jsonl")
    if not (args.resume and os.path.exists(data)):
        sha = write_head_data(data, seed, args.per_task)
    else:
        with open(data, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
    print(f"[organism head] corpus seed {seed}; training data {data} sha256 {sha}")
    # --seq-len 1152: the longest training sequences (prompts of 1,024 plus their answers) run to ~1,054 tokens, and a
    # document with a masked prompt is never split (the shipped head was trained at 1,024, without that quarter)
    command = ["train-head", "--base", args.backbone, "--data", data, "--output", args.output,
               "--sinks", "4", "--window", "64", "--lambda", str(args.oda_lambda), "--tau-hist", str(args.tau_hist),
               "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size), "--seq-len", "1152",
               "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps), "--save-steps", "100",
               "--seed", str(seed), "--threads", str(args.threads)]
    if args.resume:
        command.append("--resume")
    return oda_main(command)


if __name__ == "__main__":
    raise SystemExit(main())
