"""``oda calibrate``: the head's threshold for a Full-call budget or a score tolerance (`calibration`).

Kept apart from `calibration` so that building the ``oda`` parser imports no torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..cli_common import UsageError, dtype_name, load_tokenizer, thread_count, require_model_source, require_paths, torch_dtype, user_input
from ..known_models import base_argument
from ..validation import argument, integer, number, probability


def add_cli(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "calibrate", help="choose the head's threshold on dev prompts (Full-call budget or score tolerance)",
        description="Greedy generation on dev prompts at several thresholds; saves the chosen threshold in the "
                    "head folder's oda_config.json and the sweep in calibration.json (resumable).")
    parser.add_argument("--base", type=base_argument, required=True, help="base causal LM: hub id, local folder, or smollm2 / organism")
    parser.add_argument("--head", required=True, help="recall head folder (the threshold is written into it)")
    parser.add_argument("--tokenizer", type=base_argument, default=None, help="tokenizer id or folder (default: --base)")
    parser.add_argument("--sinks", type=argument(integer, "sinks", minimum=0), default=None,
                        help="sink positions s (default: the head's)")
    parser.add_argument("--window", type=argument(integer, "window", minimum=1), default=None,
                        help="recent window w (default: the head's)")
    parser.add_argument("--dtype", type=dtype_name, default="float32", help="base model dtype (default float32)")
    parser.add_argument("--data", required=True, help="dev prompts: JSONL of {id, task, prompt, answers, max_new_tokens}")
    parser.add_argument("--test-data", default=None, help="test prompts (same format): report the realised rate there")
    rule = parser.add_mutually_exclusive_group(required=True)
    rule.add_argument("--target-rate", type=argument(probability, "target-rate"), default=None,
                      help="Full-call budget: the highest pooled dev rate not above this fraction (e.g. 0.25)")
    rule.add_argument("--within-full", type=argument(number, "within-full", minimum=0), default=None,
                      help="lowest pooled rate whose dev macro score is within this many points of Full")
    parser.add_argument("--grid", nargs="+", type=argument(number, "grid"), default=None, help="thresholds to run first (default: calibration.DEFAULT_GRID)")
    parser.add_argument("--refine-steps", type=argument(integer, "refine-steps", minimum=0), default=4, help="bisection runs after the grid (--target-rate)")
    parser.add_argument("--tasks", nargs="+", default=None, help="only these tasks")
    parser.add_argument("--limit", type=argument(integer, "limit", minimum=1), default=None,
                        help="N examples per task, spread evenly over the suite's order (first and last included)")
    parser.add_argument("--max-new-tokens", type=argument(integer, "max-new-tokens", minimum=1), default=None,
                        help="output cap (default: the suite's)")
    parser.add_argument("--chat-template", action="store_true", help="wrap prompts in the tokenizer's chat template")
    parser.add_argument("--out", required=True, help="output folder (records, calibration.json)")
    parser.add_argument("--no-write", action="store_true", help="do not write the threshold into the head folder")
    parser.add_argument("--threads", type=thread_count, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run_cli)
    return parser


def run_cli(args) -> int:
    from .cli import locked_output

    with locked_output(args.out, "this calibration"):
        return _run_cli(args)


def _run_cli(args) -> int:
    import dataclasses

    import torch

    from ..modeling import OdaForCausalLM
    from .calibration import DEFAULT_GRID, _check_rate, calibrate, save_calibration
    from .suites import load_examples, suite_sha256

    if args.target_rate is not None:
        try:
            _check_rate(args.target_rate)
        except ValueError as err:
            raise UsageError(f"--target-rate: {err}") from err
    if not args.no_write and not os.path.isdir(args.head):
        raise UsageError(f"--head {args.head} is not a local folder: the threshold is written into it. Download the "
                         "head to a folder, or pass --no-write.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    select = dict(default_max_new_tokens=args.max_new_tokens, tasks=args.tasks, limit=args.limit)
    require_paths("--data", args.data)
    with user_input("--data"):
        dev = load_examples(args.data, **select)
    if args.test_data:
        require_paths("--test-data", args.test_data)
    with user_input("--test-data"):
        test = load_examples(args.test_data, **select) if args.test_data else None
    if args.max_new_tokens is not None:  # the one cap for every prompt, as `oda eval --max-new-tokens` does
        dev = [dataclasses.replace(e, max_new_tokens=args.max_new_tokens) for e in dev]
        test = [dataclasses.replace(e, max_new_tokens=args.max_new_tokens) for e in test] if test else test
    routing = {key: getattr(args, key) for key in ("sinks", "window") if getattr(args, key) is not None}
    tokenizer = load_tokenizer(args.tokenizer, args.base)
    require_model_source("--base", args.base)
    require_model_source("--head", args.head)
    with user_input("--base/--head"):
        model = OdaForCausalLM.from_pretrained(args.base, head=args.head, dtype=torch_dtype(args.dtype),
                                               policy="head", **routing)
    model.eval()
    provenance = {"dev_data": os.path.basename(args.data), "dev_sha256": suite_sha256(args.data),
                  "sinks": model.oda_config.sinks, "window": model.oda_config.window,
                  "chat_template": args.chat_template}
    if args.test_data:
        provenance.update(test_data=os.path.basename(args.test_data), test_sha256=suite_sha256(args.test_data))
    try:
        result = calibrate(model, tokenizer, dev, args.out, target_rate=args.target_rate, within_full=args.within_full,
                           grid=args.grid if args.grid is not None else DEFAULT_GRID, refine_steps=args.refine_steps, chat_template=args.chat_template,
                           test_examples=test, provenance=provenance, progress=not args.no_progress)
    except ValueError as err:
        raise UsageError(str(err)) from err
    for s in result["sweep"]:
        print(f"  theta={s['threshold']:<9g} dev pooled Full-call rate {s['pooled_full_call_rate']:.1%}  "
              f"macro {s['macro_score']:.1f}  ({s['stage']})", file=sys.stderr)
    chosen = result["chosen"]
    print(f"[oda] chosen theta={chosen['threshold']:g}: dev rate {chosen['pooled_full_call_rate']:.1%}, dev macro "
          f"{chosen['macro_score']:.1f}", file=sys.stderr)
    if result.get("rule_met") is False:
        print(f"[oda] warning: no threshold of the grid came within {result['within_full']:g} points of Full's dev "
              f"macro {result['full_macro_score']:.1f}; theta={chosen['threshold']:g} is the best-scoring one, not one "
              "that meets --within-full. Add lower thresholds to --grid, or accept the gap.", file=sys.stderr)
    if "test" in result:
        test_result = result["test"]
        print(f"[oda] test ({test_result['examples']} prompts): realised pooled Full-call rate "
              f"{test_result['pooled_full_call_rate']:.1%}, macro {test_result['macro_score']:.1f}", file=sys.stderr)
    if not args.no_write:
        path = save_calibration(args.head, model.oda_config, result)
        print(f"[oda] threshold written to {path}", file=sys.stderr)
    return 0
