"""``oda eval`` and ``oda diagnose``: register with `add_cli(subparsers)`.

    oda eval --base Qwen/Qwen3-1.7B --head ./head --suite ruler --data ruler16k/ --policies full local oda random \\
        --paper-sweep --max-new-tokens 512 --chat-template --out runs/ruler16k
    oda diagnose --base Qwen/Qwen3-1.7B --head ./head --data refs.jsonl --positions 128 --out runs/diag
"""

from __future__ import annotations

import argparse
import os
import sys

from ..cli_common import (UsageError, dtype_name, load_tokenizer, require_model_source, require_paths, torch_dtype,
                          user_input)
from ..known_models import base_argument, head_argument

RESULTS_FILE = "results.jsonl"
MANIFEST_FILE = "manifest.json"
POSITIONS_FILE = "positions.jsonl"


def add_cli(subparsers) -> None:
    """Add the ``eval`` and ``diagnose`` subcommands to an argparse subparsers object."""
    evaluate = subparsers.add_parser(
        "eval", help="generation quality against Full-call rate (Full, StreamingLLM, ODA, Random, schedules)",
        description="Greedy generation of every policy on a task suite; writes results.jsonl (resumable), "
                    "manifest.json (the settings of the run), report.md and plots into --out. A rerun into the same "
                    "--out reuses finished records only if they were made with the same settings.")
    _model_arguments(evaluate, required=False)
    evaluate.add_argument("--suite", choices=("jsonl", "ruler", "longbench"), default="jsonl",
                          help="jsonl: {id, task, prompt, answers, max_new_tokens} records; ruler: RULER's generated "
                               "files; longbench: LongBench v1 files (default: jsonl)")
    evaluate.add_argument("--data", nargs="+", help="suite files or directories")
    evaluate.add_argument("--tasks", nargs="+", default=None, help="only these tasks")
    evaluate.add_argument("--limit", type=int, default=None, help="first N examples per task")
    evaluate.add_argument("--max-new-tokens", type=int, default=None,
                          help="output cap for every example (default: the suite's per-task caps; the paper uses 512)")
    evaluate.add_argument("--max-input-tokens", type=int, default=None,
                          help="LongBench input budget with middle truncation (the paper uses 40960)")
    evaluate.add_argument("--chat-template", action="store_true",
                          help="wrap prompts in the tokenizer's chat template (thinking disabled)")
    evaluate.add_argument("--policies", nargs="+", default=["full", "local", "oda"], type=_policy_word,
                          help="any of: full, local (StreamingLLM), oda, random (matched to each ODA threshold), "
                               "random:P (fixed probability), schedule:K:PERIOD (default: full local oda)")
    evaluate.add_argument("--thresholds", nargs="+", type=float, default=None,
                          help="ODA thresholds (default: the head's configured threshold)")
    evaluate.add_argument("--paper-sweep", action="store_true",
                          help="ODA thresholds -0.01 -0.005 -0.001 0 0.001 0.005 0.01 0.05")
    evaluate.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44], help="Random seeds (default 42 43 44)")
    evaluate.add_argument("--primary-threshold", type=float, default=None,
                          help="the ODA threshold of the main table (default: 0 if run, else the first)")
    evaluate.add_argument("--trajectories", type=int, default=0,
                          help="render this many ODA trajectories per task (HTML + PNG) at the primary threshold")
    evaluate.add_argument("--separate-prefills", action="store_true",
                          help="prefill each prompt once per policy instead of once for all (same results, slower; "
                               "holds the prompt's KV once instead of twice)")
    evaluate.add_argument("--adopt-unlabeled-records", action="store_true",
                          help="reuse records of an older oda_hf that carry no settings, trusting that they were made "
                               "with this run's settings (otherwise such records are an error)")
    evaluate.add_argument("--out", required=True, help="output directory")
    evaluate.add_argument("--report-only", action="store_true",
                          help="no generation: rebuild report.md and plots from --out/results.jsonl")
    evaluate.add_argument("--merge", nargs="+", default=None, metavar="FOLDER",
                          help="no generation: add the records of other output folders of the same evaluation "
                               "(e.g. one per --tasks subset, run in parallel) to --out, then rebuild the report; "
                               "their manifests must have --out's settings")
    evaluate.add_argument("--no-plots", action="store_true")
    evaluate.add_argument("--no-progress", action="store_true")
    evaluate.set_defaults(func=run_eval)

    diagnose = subparsers.add_parser(
        "diagnose", help="fixed-reference diagnostics: gains, AUROC/AP, budget curves with bootstrap intervals",
        description="Per-position access gains g_t = log pF - log pL on held-out reference sequences, ranked by "
                    "the head and Local-confidence baselines; writes positions.jsonl (resumable), diagnostics.md, "
                    "diagnostics.json and budget_curve.png into --out.")
    _model_arguments(diagnose, required=False)
    diagnose.add_argument("--threshold", type=float, default=None, help="head threshold for --history selected")
    diagnose.add_argument("--data", help="JSONL of reference sequences: {id, input_ids | text[, start, count]}")
    diagnose.add_argument("--history", choices=("selected", "full"), default="selected",
                          help="commit the head's branch (paper protocol; default) or always Full")
    diagnose.add_argument("--positions", type=int, default=None,
                          help="positions per sequence from the first eligible one (the paper uses 128)")
    diagnose.add_argument("--budget", type=float, default=0.4, help="main offline budget (default 0.4)")
    diagnose.add_argument("--budgets", nargs="+", type=float, default=None,
                          help="budget grid of the curves (default 0, 0.05, ..., 1)")
    diagnose.add_argument("--bootstrap", type=int, default=2000, help="document-bootstrap resamples (default 2000)")
    diagnose.add_argument("--seed", type=int, default=20260910, help="bootstrap seed (default: the paper's)")
    diagnose.add_argument("--out", required=True, help="output directory")
    diagnose.add_argument("--report-only", action="store_true",
                          help="no model: rebuild the report from --out/positions.jsonl")
    diagnose.add_argument("--no-plots", action="store_true")
    diagnose.add_argument("--no-progress", action="store_true")
    diagnose.set_defaults(func=run_diagnose)


def _model_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--base", type=base_argument, required=required, help="base causal LM: hub id, local folder, or smollm2 / organism")
    parser.add_argument("--head", type=head_argument, default=None, help="recall head: hub id, local folder, or a shipped one (organism, smollm2)")
    parser.add_argument("--tokenizer", type=base_argument, default=None, help="tokenizer id or folder (default: --base)")
    parser.add_argument("--sinks", type=int, default=None, help="sink positions s (default: the head's or 4)")
    parser.add_argument("--window", type=int, default=None, help="recent window w incl. the current token")
    parser.add_argument("--dtype", type=dtype_name, default="float32",
                        help="base model dtype: float32|fp32, bfloat16|bf16, float16|fp16 or auto (default float32)")


def _policy_word(text: str) -> str:
    kind = text.split(":", 1)[0]
    if kind not in ("full", "local", "streamingllm", "oda", "random", "schedule"):
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}: use full, local, oda, random, random:P or schedule:K:PERIOD")
    return text


def _load(args, threshold: float | None = None):
    from ..modeling import OdaForCausalLM

    if not args.base:
        raise UsageError("--base is required (unless --report-only).")
    # The tokenizer first: it is quick, and a missing chat template should not wait for the model.
    tokenizer = load_tokenizer(args.tokenizer, args.base)
    if getattr(args, "chat_template", False) and getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(f"--chat-template: the tokenizer of {args.tokenizer or args.base} has no chat template; "
                         "drop --chat-template or give --tokenizer with one that has a template.")
    routing = {key: getattr(args, key) for key in ("sinks", "window") if getattr(args, key) is not None}
    if threshold is not None:
        routing["threshold"] = threshold
    routing["policy"] = "head" if args.head else "local"
    require_model_source("--base", args.base)
    require_model_source("--head", args.head)
    with user_input("loading the model (--base/--head)",
                    "give a local folder written by save_pretrained or a hub id available offline"):
        model = OdaForCausalLM.from_pretrained(args.base, head=args.head, dtype=torch_dtype(args.dtype), **routing)
    model.eval()
    return model, tokenizer


def build_policies(words, thresholds, seeds) -> list:
    """Policy specs from CLI words (see ``--policies``)."""
    from . import runner

    specs = []
    for word in words:
        kind, _, rest = word.partition(":")
        if kind == "full":
            specs.append(runner.full())
        elif kind in ("local", "streamingllm"):
            specs.append(runner.streaming_llm())
        elif kind == "oda":
            specs += [runner.oda(t) for t in thresholds]
        elif kind == "random" and not rest:
            specs += [runner.random_matched(t, s) for t in thresholds for s in seeds]
        elif kind == "random":
            try:
                specs += [runner.random_fixed(float(rest), s) for s in seeds]
            except ValueError as err:
                raise UsageError(f"bad policy {word!r}: {err} (use random:P with 0 <= P <= 1)") from err
        elif kind == "schedule":
            k, _, period = rest.partition(":")
            try:
                specs.append(runner.schedule(int(k), int(period)))
            except ValueError as err:
                raise UsageError(f"bad schedule {word!r}: {err} (use schedule:K:PERIOD)") from err
    names = [s.name for s in specs]
    return [s for i, s in enumerate(specs) if s.name not in names[:i]]  # drop repeats


def run_eval(args) -> int:
    from . import report, runner, suites, trajectory

    out = args.out
    os.makedirs(out, exist_ok=True)
    results_path = os.path.join(out, RESULTS_FILE)
    if args.merge:
        sources = [os.path.join(folder, RESULTS_FILE) for folder in args.merge]
        require_paths("--merge", sources)
        with user_input("--merge"):
            added = runner.merge_results(results_path, sources, manifest_name=MANIFEST_FILE)
        print(f"[oda eval] merged {added} records into {results_path}", file=sys.stderr)
        args.report_only = True
    if args.report_only:
        if not os.path.exists(results_path):
            raise UsageError(f"--report-only: {results_path} does not exist; run without --report-only first.")
        records = runner.current_records(runner.ResultsFile(results_path, repair=False).records.values())
        paths = report.write_report(records, out, args.primary_threshold, plots=not args.no_plots)
        print("\n".join(f"[oda eval] wrote {p}" for p in paths.values()), file=sys.stderr)
        return 0
    if not args.data:
        raise UsageError("--data is required (unless --report-only).")
    require_paths("--data", args.data)
    model, tokenizer = _load(args)
    thresholds = list(runner.PAPER_THRESHOLDS) if args.paper_sweep else \
        (args.thresholds if args.thresholds is not None else [model.oda_config.threshold])
    policies = build_policies(args.policies, thresholds, args.seeds)
    if any(p.kind == "oda" for p in policies) and model.recall_head is None:
        raise UsageError("ODA policies need --head (or evaluate only full/local/random:P/schedule policies).")
    with user_input("--data"):
        if args.suite == "jsonl":
            examples = []
            for path in args.data:
                examples += suites.load_examples(path, default_max_new_tokens=args.max_new_tokens)
            examples = suites.select_examples(examples, args.tasks, args.limit)
            if args.max_new_tokens is not None:
                for example in examples:
                    example.max_new_tokens = args.max_new_tokens
        elif args.suite == "ruler":
            examples = suites.load_ruler(args.data, max_new_tokens=args.max_new_tokens, tasks=args.tasks,
                                         limit=args.limit)
        else:
            examples = suites.load_longbench(args.data, tokenizer=tokenizer, max_length=args.max_input_tokens,
                                             max_new_tokens=args.max_new_tokens, tasks=args.tasks, limit=args.limit)
    records = runner.evaluate(model, tokenizer, examples, policies, results_path, chat_template=args.chat_template,
                              progress=not args.no_progress, share_prefill=not args.separate_prefills,
                              manifest_path=os.path.join(out, MANIFEST_FILE),
                              adopt_unlabeled=args.adopt_unlabeled_records)
    paths = report.write_report(records, out, args.primary_threshold, plots=not args.no_plots)
    if args.trajectories:
        primary = args.primary_threshold if args.primary_threshold is not None else \
            (0.0 if 0.0 in thresholds else thresholds[0])
        name = runner.oda(primary).name
        folder = os.path.join(out, "trajectories")
        os.makedirs(folder, exist_ok=True)
        per_task: dict[str, int] = {}
        for record in records:
            if record["policy"] != name or per_task.get(record["task"], 0) >= args.trajectories:
                continue
            per_task[record["task"]] = per_task.get(record["task"], 0) + 1
            stem = os.path.join(folder, record["id"].replace("/", "_"))
            trajectory.render_record(record, tokenizer, html_path=stem + ".html",
                                     png_path=None if args.no_plots else stem + ".png")
        paths["trajectories"] = folder
    print("\n".join(f"[oda eval] wrote {p}" for p in [results_path, *paths.values()]), file=sys.stderr)
    return 0


def run_diagnose(args) -> int:
    from . import diagnostics

    out = args.out
    os.makedirs(out, exist_ok=True)
    positions_path = os.path.join(out, POSITIONS_FILE)
    if args.report_only:
        if not os.path.exists(positions_path):
            raise UsageError(f"--report-only: {positions_path} does not exist; run without --report-only first.")
        records = diagnostics.load_positions(positions_path)
    else:
        if not args.data:
            raise UsageError("--data is required (unless --report-only).")
        require_paths("--data", args.data)
        if args.history == "selected" and not args.head:
            raise UsageError("--history selected commits the head's choice: give --head, or use --history full.")
        model, tokenizer = _load(args, threshold=args.threshold)
        with user_input("--data"):
            documents = diagnostics.load_reference_sequences(args.data, tokenizer)
        records = diagnostics.collect_reference_gains(model, documents, output_path=positions_path,
                                                      history=args.history, count=args.positions,
                                                      progress=not args.no_progress)
    kwargs = {} if args.budgets is None else {"budgets": args.budgets}
    result = diagnostics.analyze(records, main_budget=args.budget, n_resamples=args.bootstrap, seed=args.seed,
                                 progress=not args.no_progress, **kwargs)
    paths = diagnostics.write_diagnostics(result, out, plots=not args.no_plots)
    print("\n".join(f"[oda diagnose] wrote {p}" for p in [positions_path, *paths.values()]), file=sys.stderr)
    return 0
