"""``oda eval`` and ``oda diagnose``: register with `add_cli(subparsers)`.

    oda eval --base Qwen/Qwen3-1.7B --head ./head --suite ruler --data ruler16k/ --policies full local oda random \\
        --paper-sweep --max-new-tokens 512 --chat-template --out runs/ruler16k
    oda diagnose --base Qwen/Qwen3-1.7B --head ./head --data refs.jsonl --positions 128 --out runs/diag
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator

from ..cli_common import (UsageError, dtype_name, first_line, load_tokenizer, require_model_source, require_paths,
                          torch_dtype, user_input)
from ..files import output_lock
from ..known_models import base_argument, head_argument
from ..validation import argument, integer, number, parse_float, parse_int, probability, seed

RESULTS_FILE = "results.jsonl"
MANIFEST_FILE = "manifest.json"
POSITIONS_FILE = "positions.jsonl"


def add_cli(subparsers) -> None:
    """Add the ``eval`` and ``diagnose`` subcommands to an argparse subparsers object."""
    evaluate = subparsers.add_parser(
        "eval", help="generation quality against Full-call rate (Full, StreamingLLM, ODA, Random, schedules)",
        description="Greedy generation of every policy on a task suite; writes results.jsonl (resumable), "
                    "manifest.json (the settings of the run), report.md and plots into --out. A rerun into the same "
                    "--out reuses finished records only if they were made with the same settings; records whose "
                    "answers, task or metric changed are rescored from their stored outputs.")
    _model_arguments(evaluate, required=False)
    evaluate.add_argument("--suite", choices=("jsonl", "ruler", "longbench"), default="jsonl",
                          help="jsonl: {id, task, prompt, answers, max_new_tokens} records; ruler: RULER's generated "
                               "files; longbench: LongBench v1 files (default: jsonl)")
    evaluate.add_argument("--data", nargs="+", help="suite files or directories")
    evaluate.add_argument("--tasks", nargs="+", default=None, help="only these tasks")
    evaluate.add_argument("--limit", type=argument(integer, "limit", minimum=1), default=None,
                          help="N examples per task, spread evenly over the suite's order (first and last included)")
    evaluate.add_argument("--max-new-tokens", type=argument(integer, "max-new-tokens", minimum=1), default=None,
                          help="output cap for every example (default: the suite's per-task caps; the paper uses 512)")
    evaluate.add_argument("--max-input-tokens", type=argument(integer, "max-input-tokens", minimum=2), default=None,
                          help="LongBench input budget with middle truncation (the paper uses 40960)")
    evaluate.add_argument("--chat-template", action="store_true",
                          help="wrap prompts in the tokenizer's chat template (thinking disabled)")
    evaluate.add_argument("--policies", nargs="+", default=["full", "local", "oda"], type=_policy_word,
                          help="any of: full, local (StreamingLLM), oda, random (matched to each ODA threshold), "
                               "random:P (fixed probability), schedule:K:PERIOD, budget:R (the head within a Full-call "
                               "budget R per request, at each ODA threshold) (default: full local oda)")
    evaluate.add_argument("--thresholds", nargs="+", type=argument(number, "thresholds"), default=None,
                          help="ODA thresholds (default: the head's configured threshold)")
    evaluate.add_argument("--paper-sweep", action="store_true",
                          help="ODA thresholds -0.01 -0.005 -0.001 0 0.001 0.005 0.01 0.05")
    evaluate.add_argument("--seeds", nargs="+", type=argument(seed, "seeds"), default=None,
                          help="Random seeds (default 42 43 44)")
    evaluate.add_argument("--primary-threshold", type=argument(number, "primary-threshold"), default=None,
                          help="the ODA threshold of the main table (default: 0 if run, else the first)")
    evaluate.add_argument("--trajectories", type=argument(integer, "trajectories", minimum=0), default=0,
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
    # (what the flags that --report-only / --merge do not read are when not given: `_given_flags`)
    evaluate.set_defaults(func=run_eval, unread_defaults={name: evaluate.get_default(name) for name in REPORT_UNREAD})

    diagnose = subparsers.add_parser(
        "diagnose", help="fixed-reference diagnostics: gains, AUROC/AP, budget curves with bootstrap intervals",
        description="Per-position access gains g_t = log pF - log pL on held-out reference sequences, ranked by "
                    "the head and Local-confidence baselines; writes positions.jsonl (resumable), diagnostics.md, "
                    "diagnostics.json and budget_curve.png into --out.")
    _model_arguments(diagnose, required=False)
    diagnose.add_argument("--threshold", type=argument(number, "threshold"), default=None,
                          help="head threshold for --history selected")
    diagnose.add_argument("--data", help="JSONL of reference sequences: {id, input_ids | text[, start, count]}")
    diagnose.add_argument("--history", choices=("selected", "full"), default="selected",
                          help="commit the head's branch (paper protocol; default) or always Full")
    diagnose.add_argument("--positions", type=argument(integer, "positions", minimum=1), default=None,
                          help="positions per sequence from the first eligible one (the paper uses 128)")
    diagnose.add_argument("--budget", type=argument(probability, "budget"), default=0.4,
                          help="main offline budget, a fraction in [0, 1] (default 0.4)")
    diagnose.add_argument("--budgets", nargs="+", type=argument(probability, "budgets"), default=None,
                          help="budget grid of the curves, fractions in [0, 1] (default 0, 0.05, ..., 1)")
    diagnose.add_argument("--bootstrap", type=argument(integer, "bootstrap", minimum=0), default=2000,
                          help="document-bootstrap resamples, 0 for none (default 2000)")
    diagnose.add_argument("--seed", type=argument(integer, "seed", minimum=0), default=20260910,
                          help="bootstrap seed (default: the paper's)")
    diagnose.add_argument("--out", required=True, help="output directory")
    diagnose.add_argument("--report-only", action="store_true",
                          help="no model: rebuild the report from --out/positions.jsonl")
    diagnose.add_argument("--no-plots", action="store_true")
    diagnose.add_argument("--no-progress", action="store_true")
    diagnose.set_defaults(func=run_diagnose,
                          unread_defaults={name: diagnose.get_default(name) for name in DIAGNOSE_REPORT_UNREAD})


def _model_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--base", type=base_argument, required=required, help="base causal LM: hub id, local folder, or smollm2 / organism")
    parser.add_argument("--head", type=head_argument, default=None, help="recall head: hub id, local folder, or a shipped one (organism, smollm2, "
                        "gemma3-270m, qwen2.5-coder-0.5b)")
    parser.add_argument("--tokenizer", type=base_argument, default=None, help="tokenizer id or folder (default: --base)")
    parser.add_argument("--sinks", type=argument(integer, "sinks", minimum=0), default=None,
                        help="sink positions s (default: the head's or 4)")
    parser.add_argument("--window", type=argument(integer, "window", minimum=1), default=None,
                        help="recent window w incl. the current token")
    parser.add_argument("--dtype", type=dtype_name, default="float32",
                        help="base model dtype: float32|fp32, bfloat16|bf16, float16|fp16 or auto (default float32)")


def _policy_word(text: str) -> str:
    """A ``--policies`` word, checked whole at parse time (``random:`` or ``schedule:2.9:3`` are errors, not
    defaults)."""
    kind, colon, rest = text.partition(":")
    usage = ("use full, local, oda, random, random:P (0 <= P <= 1), schedule:K:PERIOD (0 <= K <= PERIOD) or "
             "budget:R (0 <= R <= 1)")
    try:
        if kind in ("full", "local", "streamingllm", "oda", "random") and not colon:
            return text
        if kind in ("random", "budget") and rest:
            probability(f"{kind}:{'P' if kind == 'random' else 'R'}", parse_float(rest))
            return text
        if kind == "schedule" and rest.count(":") == 1:
            k, period = rest.split(":")
            period = integer("schedule:K:PERIOD", parse_int(period), minimum=1)
            integer("schedule:K", parse_int(k), minimum=0, maximum=period)
            return text
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"bad policy {text!r}: {err} ({usage})") from None
    raise argparse.ArgumentTypeError(f"unknown policy {text!r}: {usage}")


@contextlib.contextmanager
def locked_output(folder: str, what: str, flag: str = "--out") -> Iterator[None]:
    """Hold `folder`'s `files.output_lock` for the block (two runs never write into one folder); a path that is a
    file or cannot be written is a `UsageError` naming `flag`."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"{flag} {folder} is a file; give a folder (it is created if missing).")
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(output_lock(folder, what))
    except OSError as err:
        raise UsageError(f"{flag} {folder}: cannot write there ({first_line(err)}); give a writable folder.") from None
    with stack:
        yield


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
    thresholds = [t + 0.0 for t in thresholds]   # -0 is 0 (named "oda@-0", it would run twice)
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
                specs += [runner.random_fixed(parse_float(rest) + 0.0, s) for s in seeds]
            except ValueError as err:
                raise UsageError(f"bad policy {word!r}: {err} (use random:P with 0 <= P <= 1)") from err
        elif kind == "budget":  # the head at each ODA threshold of the run, under a Full-call budget that holds
            specs += [runner.budget(parse_float(rest) + 0.0, t) for t in thresholds]
        elif kind == "schedule":
            k, _, period = rest.partition(":")
            try:
                specs.append(runner.schedule(parse_int(k), parse_int(period)))
            except ValueError as err:
                raise UsageError(f"bad schedule {word!r}: {err} (use schedule:K:PERIOD)") from err
    kept: dict = {}
    for spec in specs:   # a word or value given twice runs once; two values that print alike are an error
        first = kept.setdefault(spec.name, spec)
        if first != spec:   # (records are keyed by name: the second would have been dropped, or taken for the first)
            values = [(name, getattr(first, name), getattr(spec, name)) for name in ("threshold", "p")
                      if getattr(first, name) != getattr(spec, name)]
            raise UsageError(f"two policies would be recorded as {spec.name!r} ("
                             + ", ".join(f"{name} {a!r} and {b!r}" for name, a, b in values)
                             + "): policy names keep 6 significant digits; give values that differ in them.")
    return list(kept.values())


def run_eval(args) -> int:
    with locked_output(args.out, "this evaluation"):
        return _run_eval(args)


def _primary_threshold(args, thresholds: list[float] | None) -> float | None:
    """--primary-threshold must be one of the thresholds run (else the main table would silently lose ODA);
    `thresholds` None: this run has no ODA policy."""
    if args.primary_threshold is None:
        return None
    if thresholds is None or not any(word in ("oda", "random") for word in args.policies):   # (budget:R alone)
        raise UsageError(f"--primary-threshold {args.primary_threshold:g} picks the ODA threshold of the main table, "
                         "but --policies runs no ODA: add oda to --policies, or drop --primary-threshold.")
    if args.primary_threshold not in thresholds:
        raise UsageError(f"--primary-threshold {args.primary_threshold:g} is not among the ODA thresholds of this run "
                         f"({', '.join(f'{t:g}' for t in thresholds)}): give one of them, or add it to --thresholds.")
    return args.primary_threshold + 0.0   # -0 names oda@0, as build_policies does


def _write_report(report, records, out, primary, plots):
    try:
        return report.write_report(records, out, primary, plots=plots)
    except ValueError as err:  # e.g. a --primary-threshold the records do not have
        raise UsageError(first_line(err)) from None


#: Flags that only a run that generates (collects) reads: --report-only and --merge would ignore them, and the
#: report would look made with them.
REPORT_UNREAD = ("base", "head", "tokenizer", "sinks", "window", "data", "tasks", "limit", "max_new_tokens",
                 "max_input_tokens", "chat_template", "thresholds", "paper_sweep", "seeds", "trajectories",
                 "separate_prefills", "adopt_unlabeled_records")
DIAGNOSE_REPORT_UNREAD = ("base", "head", "tokenizer", "sinks", "window", "data", "positions", "threshold", "history")


def _given_flags(args, names) -> str:
    """Those of `names` the command line set (a value other than the parser's default, `unread_defaults`), as
    ``--a, --b``; "" for none."""
    return ", ".join("--" + name.replace("_", "-") for name in names
                     if getattr(args, name) != args.unread_defaults[name])


def _run_eval(args) -> int:
    from . import report, runner, suites, trajectory

    out = args.out
    results_path = os.path.join(out, RESULTS_FILE)
    if (args.merge or args.report_only) and (unread := _given_flags(args, REPORT_UNREAD)):
        raise UsageError(f"{unread}: {'--merge' if args.merge else '--report-only'} "
                         "rebuilds the report from the records as they are and generates nothing; drop them (to "
                         "report a subset, run into another --out).")
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
        with user_input(f"--report-only: {results_path}"):
            records = runner.ResultsFile(results_path, repair=False).current()
        if not records:
            raise UsageError(f"--report-only: {results_path} holds no records; run without --report-only first.")
        primary = args.primary_threshold
        last = runner.read_last_run(os.path.join(out, MANIFEST_FILE))
        if last is not None:
            kept = last.get("primary_threshold")
            if primary is None and kept is not None and any(r["kind"] == "oda" and r["threshold"] == kept
                                                            for r in records):
                primary = kept   # the run's main table, not the lowest threshold held
            others = {r["id"] for r in records} - set(last["examples"])
            if others and not args.merge:   # (merged examples are the point of --merge)
                print(f"[oda eval] --report-only: {len(others)} of the {len({r['id'] for r in records})} examples "
                      "reported were not in the last run (records of earlier runs into this folder); the last run's "
                      "report covered its own only.", file=sys.stderr)
        paths = _write_report(report, records, out, primary, not args.no_plots)
        print("\n".join(f"[oda eval] wrote {p}" for p in paths.values()), file=sys.stderr)
        return 0
    if not args.data:
        raise UsageError("--data is required (unless --report-only).")
    if args.paper_sweep and args.thresholds is not None:
        raise UsageError("--paper-sweep runs the paper's thresholds: drop --thresholds, or drop --paper-sweep.")
    if args.max_input_tokens is not None and args.suite != "longbench":
        raise UsageError(f"--max-input-tokens truncates LongBench prompts; it does nothing with --suite {args.suite}: "
                         "drop it.")
    require_paths("--data", args.data)
    oda_words = any(word.partition(":")[0] in ("oda", "random") and ":" not in word or word.startswith("budget:")
                    for word in args.policies)
    # Flags no policy of this run reads would be silently ignored: refuse them.
    if (args.thresholds is not None or args.paper_sweep) and not oda_words:
        raise UsageError(f"{'--thresholds' if args.thresholds is not None else '--paper-sweep'} sets the thresholds of "
                         "oda (and of random matched to it), but --policies runs neither: add oda to --policies, or "
                         "drop it.")
    if args.seeds is not None and not any(word.partition(":")[0] == "random" for word in args.policies):
        raise UsageError("--seeds seeds the random policies, but --policies runs none: add random or random:P to "
                         "--policies, or drop --seeds.")
    if args.seeds is None:
        args.seeds = list(runner.PAPER_SEEDS)
    if args.paper_sweep or args.thresholds is not None or not oda_words:  # known before the model loads
        _primary_threshold(args, None if not oda_words else
                           list(runner.PAPER_THRESHOLDS) if args.paper_sweep else args.thresholds)
    model, tokenizer = _load(args)
    thresholds = list(runner.PAPER_THRESHOLDS) if args.paper_sweep else \
        (args.thresholds if args.thresholds is not None else [model.oda_config.threshold])
    primary = _primary_threshold(args, thresholds if oda_words else None)
    policies = build_policies(args.policies, thresholds, args.seeds)
    if primary is None and any(p.kind == "oda" for p in policies):  # one default for the table and the trajectories
        primary = 0.0 if 0.0 in thresholds else thresholds[0]
    if any(p.kind in ("oda", "budget") for p in policies) and model.recall_head is None:
        raise UsageError("ODA and budget policies need --head (or evaluate only full/local/random:P/schedule "
                         "policies).")
    if args.trajectories and not any(p.kind == "oda" for p in policies):
        raise UsageError("--trajectories renders ODA runs: add oda to --policies, or drop --trajectories.")
    with user_input("--data"):
        if args.suite == "jsonl":
            examples = []
            for path in args.data:
                examples += suites.load_examples(path, default_max_new_tokens=args.max_new_tokens)
            examples = suites.select_examples(examples, args.tasks, args.limit)
            if args.max_new_tokens is not None:  # a copy through __post_init__, so the cap is checked too
                examples = [dataclasses.replace(e, max_new_tokens=args.max_new_tokens) for e in examples]
        elif args.suite == "ruler":
            examples = suites.load_ruler(args.data, max_new_tokens=args.max_new_tokens, tasks=args.tasks,
                                         limit=args.limit)
        else:
            examples = suites.load_longbench(args.data, tokenizer=tokenizer, max_length=args.max_input_tokens,
                                             max_new_tokens=args.max_new_tokens, tasks=args.tasks, limit=args.limit)
    try:
        records = runner.evaluate(model, tokenizer, examples, policies, results_path,
                                  chat_template=args.chat_template, progress=not args.no_progress,
                                  share_prefill=not args.separate_prefills,
                                  manifest_path=os.path.join(out, MANIFEST_FILE),
                                  adopt_unlabeled=args.adopt_unlabeled_records)
    except ValueError as err:  # the data, --out's records or manifest disagree with this run: the message says how
        raise UsageError(first_line(err)) from None
    paths = _write_report(report, records, out, primary, not args.no_plots)
    runner.record_last_run(os.path.join(out, MANIFEST_FILE), [r["id"] for r in records], primary)
    if args.trajectories:
        name = runner.oda(primary).name
        folder = os.path.join(out, "trajectories")
        os.makedirs(folder, exist_ok=True)
        per_task: dict[str, int] = {}
        owners: dict[str, str] = {}   # file stem -> the id written under it
        for record in records:
            if record["policy"] != name or per_task.get(record["task"], 0) >= args.trajectories:
                continue
            per_task[record["task"]] = per_task.get(record["task"], 0) + 1
            stem = trajectory.file_stem(record["id"])
            if owners.setdefault(stem, record["id"]) != record["id"]:   # "qa/1" wrote qa_1: "qa_1" must not
                stem = trajectory.file_stem(record["id"], hashed=True)
            stem = os.path.join(folder, stem)
            trajectory.render_record(record, tokenizer, html_path=stem + ".html",
                                     png_path=None if args.no_plots else stem + ".png")
        paths["trajectories"] = folder
    print("\n".join(f"[oda eval] wrote {p}" for p in [results_path, *paths.values()]), file=sys.stderr)
    return 0


def run_diagnose(args) -> int:
    with locked_output(args.out, "these diagnostics"):
        return _run_diagnose(args)


# Each resample is kept (an array per measure): 10**12 resamples ran for hours, then ran out of memory.
MAX_BOOTSTRAP = 100_000


def _run_diagnose(args) -> int:
    from . import diagnostics

    if args.bootstrap > MAX_BOOTSTRAP:
        raise UsageError(f"--bootstrap {args.bootstrap} is more resamples than the intervals need (the paper uses 2000): "
                         f"give at most {MAX_BOOTSTRAP:,}.")
    out = args.out
    positions_path = os.path.join(out, POSITIONS_FILE)
    if args.report_only:
        if unread := _given_flags(args, DIAGNOSE_REPORT_UNREAD):
            raise UsageError(f"{unread}: --report-only rebuilds the report from "
                             f"{positions_path} as it is and runs no model; drop them.")
        if not os.path.exists(positions_path):
            raise UsageError(f"--report-only: {positions_path} does not exist; run without --report-only first.")
        with user_input(f"--report-only: {positions_path}"):
            records = diagnostics.load_positions(positions_path)
    else:
        if not args.data:
            raise UsageError("--data is required (unless --report-only).")
        require_paths("--data", args.data)
        if os.path.isdir(args.data):
            raise UsageError(f"--data {args.data} is a folder; give the JSONL file of reference sequences.")
        if args.history == "selected" and not args.head:
            raise UsageError("--history selected commits the head's choice: give --head, or use --history full.")
        if args.history == "full" and args.threshold is not None:   # (ignored, it was recorded as if applied)
            raise UsageError(f"--threshold {args.threshold:g} picks the branch --history selected commits, but "
                             "--history full always commits Full: drop --threshold, or use --history selected.")
        model, tokenizer = _load(args, threshold=args.threshold)
        with user_input("--data"):
            documents = diagnostics.load_reference_sequences(args.data, tokenizer)
        try:
            records = diagnostics.collect_reference_gains(model, documents, output_path=positions_path,
                                                          history=args.history, count=args.positions,
                                                          progress=not args.no_progress)
        except ValueError as err:  # a sequence the model cannot take, or --out holds other settings' positions
            raise UsageError(first_line(err)) from None
    kwargs = {} if args.budgets is None else {"budgets": args.budgets}
    try:
        result = diagnostics.analyze(records, main_budget=args.budget, n_resamples=args.bootstrap, seed=args.seed,
                                     progress=not args.no_progress, **kwargs)
    except ValueError as err:  # e.g. no eligible position: sequences no longer than s + w + 1
        raise UsageError(first_line(err)) from None
    paths = diagnostics.write_diagnostics(result, out, plots=not args.no_plots)
    print("\n".join(f"[oda diagnose] wrote {p}" for p in [positions_path, *paths.values()]), file=sys.stderr)
    return 0
