"""``oda train-head``: train a recall head for a base model on token or text data.

    oda train-head --base Qwen/Qwen3-1.7B --data corpus.jsonl --output heads/qwen3 \
        --window 2048 --seq-len 8192 --max-steps 2000 --save-steps 200 [--resume]

`add_cli(subparsers)` registers the subcommand; `run_cli(args)` runs it. Data: a JSON-lines file of
``{"input_ids": [...]}`` (optionally ``"labels"``) or ``{"text": ...}`` records (tokenized with
``--tokenizer``, default ``--base``'s), or a ``datasets.save_to_disk`` folder with one of those columns.
Documents are packed into rows of ``--seq-len`` tokens (`oda_hf.training.data`). Checkpoints (every ``--save-steps``
updates) and the final result in ``--output`` hold only the head and its routing defaults.
With ``--from-cache CACHE`` (written by ``oda cache-supervision``) the head trains on stored
supervision instead (`supervision_cache.py`), e.g. ``--epochs 20``; s, w and tau_hist are the cache's.
Multi-GPU: launch the same command with ``torchrun --nproc-per-node N -m oda_hf.cli train-head ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from ..cli_common import (UsageError, context_limit, data_tokenizer, dtype_name, require_model_source, require_paths,
                          thread_count, torch_dtype, user_input)
from ..known_models import base_argument
from ..validation import MAX_SPAN, argument, integer, number

#: Head input variants (`oda_hf.head.INPUT_VARIANTS`; spelled out so that building the parser imports no torch).
INPUT_VARIANTS = ("H", "E", "L", "HE", "HL", "EL", "HEL")
MAX_WIDTH = 1 << 20  # = oda_hf.head.MAX_WIDTH


def path_argument(text: str) -> str:
    """argparse type for a file or folder flag: an empty string names nothing (it would mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file or folder path; got an empty string.")
    return text


def add_cli(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train-head", help="train a recall head on paired supervision (head-only checkpoints)",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=base_argument, required=True, help="base causal LM: hub id, local folder, or smollm2 / organism")
    parser.add_argument("--data", type=path_argument, default=None,
                        help=".jsonl of {input_ids} or {text} records, or a save_to_disk folder")
    parser.add_argument("--from-cache", type=path_argument, nargs="+", default=None, metavar="CACHE",
                        help="train on supervision caches from `oda cache-supervision` instead of --data (no backbone "
                             "pass per update; s, w and tau_hist come from the cache); several caches (one base, one "
                             "s / w / tau_hist) are trained on as one")
    parser.add_argument("--output", type=path_argument, required=True,
                        help="output folder (checkpoints and the final head)")
    parser.add_argument("--tokenizer", type=base_argument, default=None,
                        help="tokenizer id or folder for text records (default: --base's, if it has one)")
    parser.add_argument("--sinks", type=argument(integer, "sinks", minimum=0, maximum=MAX_SPAN), default=None,
                        help="sink positions s (default 4)")
    parser.add_argument("--window", type=argument(integer, "window", minimum=1, maximum=MAX_SPAN), default=None,
                        help="recent window w incl. current token (default 2048)")
    parser.add_argument("--lambda", dest="oda_lambda", type=argument(number, "lambda", minimum=0.0), default=0.0,
                        help="Full-call penalty lambda (default 0)")
    parser.add_argument("--tau-hist", type=argument(number, "tau-hist"), default=None,
                        help="history threshold tau_hist (default 0.001)")
    parser.add_argument("--loss-reduction", choices=("micro", "step"), default="micro",
                        help="micro: mean of microbatch means; step: sum / eligible tokens of the update")
    parser.add_argument("--max-steps", type=argument(integer, "max-steps", minimum=1), default=None,
                        help="optimizer updates (default 1000, or --epochs)")
    parser.add_argument("--epochs", type=argument(number, "epochs", minimum=0.0, exclusive_minimum=True, maximum=1e6),
                        default=None,
                        help="passes over the data instead of --max-steps (natural with --from-cache)")
    parser.add_argument("--lr", type=argument(number, "lr", minimum=0.0, exclusive_minimum=True), default=3e-4,
                        help="peak learning rate (default 3e-4)")
    parser.add_argument("--warmup-steps", type=argument(integer, "warmup-steps", minimum=0), default=102,
                        help="linear warm-up updates (default 102)")
    parser.add_argument("--batch-size", type=argument(integer, "batch-size", minimum=1), default=1,
                        help="rows per microbatch and device (default 1)")
    parser.add_argument("--grad-accum", type=argument(integer, "grad-accum", minimum=1), default=1,
                        help="microbatches per update (default 1)")
    parser.add_argument("--seq-len", type=argument(integer, "seq-len", minimum=2, maximum=MAX_SPAN), default=None,
                        help="tokens per packed row (default 8192; with --from-cache, the cache's: it holds the rows)")
    parser.add_argument("--save-steps", type=argument(integer, "save-steps", minimum=1), default=200,
                        help="updates between head checkpoints (default 200)")
    parser.add_argument("--logging-steps", type=argument(integer, "logging-steps", minimum=1), default=10,
                        help="updates between log lines (default 10)")
    parser.add_argument("--head-width", type=argument(integer, "head-width", minimum=1, maximum=MAX_WIDTH),
                        default=None, help="head tower width m (default hidden/2)")
    parser.add_argument("--input-variant", default=None, choices=INPUT_VARIANTS,
                        help="head inputs: H, E, L, HE, HL, EL or HEL (default HEL)")
    parser.add_argument("--dtype", type=dtype_name, default="auto",
                        help="backbone dtype: auto (checkpoint's), float32|fp32, bfloat16|bf16, float16|fp16")
    parser.add_argument("--seed", type=argument(integer, "seed", minimum=0, maximum=2**32 - 1), default=42)
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 avoids oversubscription beside other jobs")
    parser.add_argument("--resume", action="store_true", help="resume from the newest complete checkpoint in --output")
    parser.add_argument("--allow-changed-settings", action="store_true",
                        help="resume even if the checkpoint was trained with other supervision settings (sinks, window, "
                             "lambda, tau-hist, loss reduction, seq-len, base, tokenizer); recorded in oda_training.json")
    parser.set_defaults(func=run_cli)
    return parser


def run_cli(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    from ..config import OdaConfig
    from ..files import output_lock
    from ..head import RecallHead, RecallHeadConfig
    from ..modeling import OdaForCausalLM
    from .data import (OdaDataCollator, PackedDataset, check_positions, check_token_ids, min_document_length,
                       pack_documents, read_documents)
    from .trainer import OdaTrainer, OdaTrainingArguments, last_complete_checkpoint

    check_output_folder("--output", args.output)
    if args.max_steps is not None and args.epochs is not None:  # one would silently win over the other
        raise UsageError(f"--max-steps {args.max_steps} and --epochs {args.epochs:g} both set how long training "
                         "runs: give one of them.")
    cache = _data_source(args)  # fills in sinks / window / tau_hist (from the cache if training from one)
    with user_input("--sinks/--window"):
        OdaConfig(sinks=args.sinks, window=args.window)  # validate before any loading
    if cache is None:
        require_paths("--data", args.data)
    min_length = min_document_length(args.sinks, args.window)
    if cache is None and args.seq_len < min_length:
        raise UsageError(f"--seq-len {args.seq_len} is shorter than s + w + 2 = {min_length} tokens, the shortest row "
                         f"with an eligible position: use --seq-len >= {min_length} or a smaller --window/--sinks.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    set_seed(args.seed)
    if args.resume and last_complete_checkpoint(args.output, clean=False) is None:  # before the data is read
        raise UsageError(f"--resume: no complete checkpoint-* folder in {args.output}; run without --resume to start.")

    tokenizer = data_tokenizer(args.tokenizer, args.base) if cache is None else None
    if cache is not None:
        rows = None
        print(f"[oda] supervision cache {cache.path}: {len(cache)} rows, {cache.num_positions} eligible "
              f"positions, s={args.sinks} w={args.window} tau_hist={args.tau_hist}", file=sys.stderr)
    else:
        with user_input("--data"), _needs_datasets():
            rows, stats = pack_documents(read_documents(args.data, tokenizer), args.seq_len, min_length=min_length)
        print(f"[oda] {stats.documents} documents -> {stats.rows} rows of <= {args.seq_len} tokens, {stats.segments} "
              f"segments, {stats.tokens} tokens; {stats.dropped_pieces} pieces shorter than "
              f"{min_length} tokens dropped (no eligible position).", file=sys.stderr)
        if warning := stats.split_warning(args.seq_len, min_length):
            print(f"[oda] warning: {warning}", file=sys.stderr)
        if stats.documents == 0:
            raise UsageError(f"No training document in {args.data}: it is empty (or holds only blank lines).")
        if not rows:
            raise UsageError(f"No training row: every document is shorter than s + w + 2 = {min_length} tokens. Use "
                             "longer documents or a smaller --window.")

    # One writer per output folder: two runs into it would interleave checkpoints and the final head.
    with contextlib.ExitStack() as held:
        with user_input("--output", "give a folder you can write to"):  # e.g. a parent that is a file
            held.enter_context(output_lock(args.output, "this head"))
        remove_interrupted_writes(args.output)
        checkpoint = None
        if args.resume:
            checkpoint = last_complete_checkpoint(args.output)
            if checkpoint is None:
                raise UsageError(f"--resume: no complete checkpoint-* folder in {args.output}; run without --resume to "
                                 "start.")

        require_model_source("--base", args.base)
        with user_input("--base", "give a local model folder or a hub id available offline"):
            base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch_dtype(args.dtype),
                                                        attn_implementation="sdpa")
        if rows is not None:
            with user_input("--data", "tokenize it with --base's tokenizer"):
                check_token_ids(rows, base.config.get_text_config(decoder=True).vocab_size)
            with user_input("--seq-len", "or give shorter documents"):
                check_positions(rows, context_limit(base.config))
        if checkpoint is not None:
            with user_input(f"--resume: {checkpoint}", "start a new --output, or delete that checkpoint"):
                head = RecallHead.from_pretrained(checkpoint)  # its config (width, variant); weights reload on resume
            for option, key in (("--head-width", "head_width"), ("--input-variant", "input_variant")):
                asked, trained = getattr(args, key), getattr(head.config, key)
                if asked is not None and asked != trained:
                    raise UsageError(f"--resume: {checkpoint} holds a head with {key}={trained!r}, but {option} asks "
                                     f"for {asked!r}. Drop {option} to resume it, or start a new --output.")
        else:
            with user_input("--head-width/--base"):
                head = RecallHead(RecallHeadConfig.for_base(base, head_width=args.head_width,
                                                            input_variant=args.input_variant or "HEL"))
        with user_input("--resume" if checkpoint is not None else "--base", "start a new --output"):
            model = OdaForCausalLM(base, head, OdaConfig(sinks=args.sinks, window=args.window, policy="head"))

        with user_input("train-head"):
            training_args = OdaTrainingArguments(
                output_dir=args.output, max_steps=-1 if args.epochs is not None else (args.max_steps or 1000),
                num_train_epochs=args.epochs if args.epochs is not None else 3.0,
                per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
                learning_rate=args.lr, warmup_steps=args.warmup_steps, save_strategy="steps",
                save_steps=args.save_steps, logging_steps=args.logging_steps, seed=args.seed, disable_tqdm=False,
                oda_lambda=args.oda_lambda, oda_tau_hist=args.tau_hist, oda_loss_reduction=args.loss_reduction,
                oda_sinks=args.sinks, oda_window=args.window, use_cpu=not torch.cuda.is_available(),
                oda_allow_changed_settings=args.allow_changed_settings,
            )
        pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else \
            base.config.get_text_config(decoder=True).pad_token_id
        data_flag = "--from-cache" if cache is not None else "--data"
        with user_input(data_flag):
            if cache is not None:
                from .supervision_cache import OdaCacheTrainer

                trainer = OdaCacheTrainer(model=model, args=training_args, cache=cache)
            else:
                from .supervision_cache import rows_sha256

                # the rows' content hash, as --from-cache records its caches': resuming on other data (or a fresh
                # run over another run's checkpoints) is refused, not mixed into one head
                trainer = OdaTrainer(model=model, args=training_args, train_dataset=PackedDataset(rows),
                                     data_collator=OdaDataCollator(pad_token_id=pad if pad is not None else 0),
                                     supervision_settings={"seq_len": args.seq_len, "tokenizer": args.tokenizer,
                                                           "rows_sha256": rows_sha256(rows)})
        if checkpoint is None:
            check_fresh_output(args.output, trainer.supervision_settings, trainer.args.to_dict())
        # The resume and supervision checks of train(), run first so that a mistake reads as one line.
        with user_input("--resume" if checkpoint is not None else data_flag):
            checkpoint = trainer.check_before_training(checkpoint)
        result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model(args.output)
    print(f"[oda] {result.global_step} updates ({trainer.skipped_updates} skipped without eligible tokens), "
          f"final loss {result.training_loss:.5f}; recall head saved to {args.output}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _needs_datasets():
    """Reading a save_to_disk folder needs the optional `datasets` package: a missing one is a one-line error."""
    try:
        yield
    except ImportError as err:
        raise UsageError(f"--data: {err}") from None


def check_output_folder(flag: str, path: str) -> None:
    """An output folder flag must not name an existing file (the lock and every save would fail on it)."""
    import os

    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a file, not a folder: give a new or existing folder.")


#: Training arguments that make two runs different runs (a checkpoint of one must not be mixed with the other's).
RUN_ARGUMENTS = ("max_steps", "num_train_epochs", "learning_rate", "warmup_steps", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "seed", "lr_scheduler_type", "weight_decay", "save_steps")


def check_fresh_output(output: str, settings: dict, training_args: dict | None = None) -> None:
    """A run without --resume writes checkpoint-N folders and the final head into `output`: refuse a folder holding
    another run's (other supervision settings or training arguments, or a head `oda train-head` did not write),
    which this run would overwrite or leave mixed with its own (e.g. a longer run's later checkpoint, which
    --resume would then pick). The same command again (after a kill) passes: everything is equal."""
    import json
    import os

    from .trainer import SETTINGS_NAME, TRAINING_ARGS_NAME, _differences

    fix = "give a new --output folder, resume that run with --resume, or delete it first"
    folders = [output] + sorted(os.path.join(output, name) for name in os.listdir(output)
                                if name.startswith("checkpoint-") and os.path.isdir(os.path.join(output, name)))
    for folder in folders:
        path = os.path.join(folder, SETTINGS_NAME)
        if not os.path.isfile(path):
            marker = os.path.join(folder, "config.json")
            if os.path.isfile(marker) and os.path.getsize(marker) > 0:
                raise UsageError(f"--output {folder} holds a recall head without {SETTINGS_NAME} (not written by this "
                                 f"oda train-head), which this run would overwrite: {fix}.")
            continue
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)["settings"]
            differences = _differences(saved, settings)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            differences = [f"{path} is unreadable"]
        arguments_path = os.path.join(folder, TRAINING_ARGS_NAME)
        if not differences and training_args is not None and os.path.isfile(arguments_path):
            try:
                with open(arguments_path, encoding="utf-8") as f:
                    saved_args = json.load(f)
                differences = [f"{key}: {saved_args.get(key)!r} there, {training_args.get(key)!r} now"
                               for key in RUN_ARGUMENTS if saved_args.get(key) != training_args.get(key)]
            except (OSError, ValueError, AttributeError):
                differences = [f"{arguments_path} is unreadable"]
        if differences:
            raise UsageError(f"--output {folder} holds another training run ({'; '.join(differences)}); without "
                             f"--resume this run would mix its checkpoints and head with that run's: {fix}.")


def remove_interrupted_writes(output: str) -> None:
    """Leftovers of a killed run into `output` (staged checkpoints, partial files, a staged final head beside
    it), so that running the same command again leaves exactly what an uninterrupted run leaves. Call only
    while holding `output`'s lock."""
    import os
    import shutil

    from ..files import remove_stale_partials
    from .trainer import STAGING_PREFIX

    output = os.path.abspath(output)
    remove_stale_partials(output)
    remove_stale_partials(os.path.dirname(output), names=[os.path.basename(output)])
    for name in os.listdir(output):
        if name.startswith(STAGING_PREFIX) and os.path.isdir(os.path.join(output, name)):
            shutil.rmtree(os.path.join(output, name), ignore_errors=True)


SETTING_DEFAULTS = {"sinks": 4, "window": 2048, "tau_hist": 0.001, "seq_len": 8192}


def _data_source(args):
    """The supervision cache of ``--from-cache`` (or None for ``--data``); sets args.sinks/window/tau_hist.

    A cache fixes s, w and tau_hist (its hidden states were computed with them): flags that disagree
    with it are an error, absent flags take the cache's values.
    """
    if (args.data is None) == (args.from_cache is None):
        raise UsageError("Give the training data as exactly one of --data (token or text records) or --from-cache "
                         "(a folder written by `oda cache-supervision`).")
    if args.from_cache is None:
        for key, value in SETTING_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        return None
    if args.tokenizer is not None:   # (ignored: the cache holds hidden states, not text)
        raise UsageError(f"--tokenizer {args.tokenizer} tokenizes the text records of --data, but --from-cache trains "
                         "on cached hidden states: drop --tokenizer (the cache was made with its own).")
    from .supervision_cache import open_cache

    try:
        cache = open_cache(args.from_cache)
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(str(err)) from err
    for key in SETTING_DEFAULTS:
        given, cached = getattr(args, key), cache.manifest.get(key)   # (caches of an older oda_hf: no seq_len)
        if given is not None and cached is not None and given != cached:   # given and unused, it would look applied
            flag = "--" + key.replace("_", "-")
            raise UsageError(f"{flag} {given} differs from the cache's {key} {cached}: a cache fixes s, w, "
                             f"tau_hist and the rows' length. Drop {flag} or cache again with the new value.")
        setattr(args, key, cached)
    return cache
