"""Choose the organism head's routing threshold on the *dev* split and save it with the head.

    python -m oda_hf.organism.calibrate --organism <dir with backbone/ and head/> [--n 5]

Runs Full and ODA at every threshold of a grid on dev prompts (never test), then keeps the
threshold with the lowest pooled Full-call rate whose dev macro score is within ``--tolerance``
points of Full's. It is written into ``<organism>/head/oda_config.json``, the routing default that
`OdaForCausalLM.from_pretrained(base, head=...)` loads, and the whole sweep into
``calibration.json`` (in ``<output>`` and beside the head).

Why a threshold: the head regresses the NLL gain of Full over Local, so restating the question
(which Local reads from its window) gets small positive scores, and theta = 0 calls Full for them
too; retrieval steps score far higher.
"""

from __future__ import annotations

import argparse
import json
import os

from ..evaluation.calibration import choose_threshold, save_calibration
from .corpus import TASKS, OrganismCorpus
from .evaluate import EVAL_LENGTHS, organism_examples

# Fine near 0, where the restatement steps' scores lie; above 0.5 low-scoring retrieval steps go Local
# (an earlier head lost 2-5 dev points at 0.75-1.5).
THRESHOLD_GRID = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5)


def calibrate_threshold(organism: str, output: str, n: int = 5, grid=THRESHOLD_GRID, tolerance: float = 1.0,
                        lengths=EVAL_LENGTHS, tasks=TASKS, write: bool = True) -> dict:
    from ..evaluation.report import summarize
    from ..evaluation.runner import evaluate, full, oda
    from ..evaluation.suites import examples_from_organism
    from .demo import load_organism

    if not grid:
        raise ValueError("The threshold grid is empty.")
    model, tokenizer, info = load_organism(organism)
    corpus = OrganismCorpus(seed=info.get("seed", 0), window=model.oda_config.window)
    examples = examples_from_organism(organism_examples(corpus, "dev", n, lengths, tasks))
    os.makedirs(output, exist_ok=True)
    records = evaluate(model, tokenizer, examples, [full()] + [oda(t) for t in grid],
                       os.path.join(output, "calibration_records.jsonl"))
    groups = summarize(records)
    full_score = groups["full"].score.mean
    sweep = [{"threshold": g.threshold, "macro_score": g.score.mean, "pooled_full_call_rate": g.pooled_rate.mean,
              "task_averaged_full_call_rate": g.task_averaged_rate.mean}
             for g in groups.values() if g.kind == "oda"]
    chosen = choose_threshold(sweep, full_score, tolerance)
    result = {"split": "dev", "examples": len(examples), "per_task_examples": n, "tolerance": tolerance,
              "full_macro_score": full_score, "sweep": sweep, "chosen": chosen}
    with open(os.path.join(output, "calibration.json"), "w") as f:
        json.dump(result, f, indent=1)
    if write:
        # oda_config.json gets the threshold; calibration.json is shipped beside the head as its provenance
        result["written"] = save_calibration(os.path.join(organism, "head"), model.oda_config, result)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--organism", required=True, help="organism folder with backbone/ and head/")
    parser.add_argument("--output", default="organism_calibration")
    parser.add_argument("--n", type=int, default=5, help="dev examples per task and length")
    parser.add_argument("--grid", default=",".join(str(t) for t in THRESHOLD_GRID), help="comma-separated thresholds")
    parser.add_argument("--tolerance", type=float, default=1.0, help="allowed dev macro-score loss vs Full (points)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    grid = tuple(float(t) for t in args.grid.split(",") if t.strip())
    result = calibrate_threshold(args.organism, args.output, args.n, grid, args.tolerance)
    print(f"dev Full macro {result['full_macro_score']:.1f}")
    for s in result["sweep"]:
        print(f"  theta={s['threshold']:<5g} macro {s['macro_score']:.1f}  pooled Full-call rate "
              f"{s['pooled_full_call_rate']:.1%}")
    print(f"chosen theta={result['chosen']['threshold']:g}, written to {result['written']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
