"""The `oda` command line: `oda generate`, plus the subcommands other modules register.

Building the parser imports no torch/transformers (subcommands import them when they run), so
``oda --help`` is instant. User errors end as one line and exit status 2 (`cli_common.UsageError`).
"""

from __future__ import annotations

import argparse
import sys

from .files import OutputLocked
from .cli_common import UsageError, check_context, dtype_name, load_tokenizer, require_model_source, torch_dtype, user_input
from .known_models import base_argument, head_argument
from .validation import MAX_SPAN, argument, integer, number, parse_policy_text, seed


def parse_policy(text: str):
    """argparse type for --policy: 'head', 'full', 'local', 'random:P[:SEED]' or 'schedule:K:PERIOD'."""
    try:
        spec = parse_policy_text(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if spec.kind == "random":
        from .policies import RandomPolicy

        return RandomPolicy(spec.p, spec.seed)
    if spec.kind == "schedule":
        from .policies import SchedulePolicy

        return SchedulePolicy(spec.k, spec.period)
    if spec.kind == "budget":
        from .policies import BudgetPolicy

        return BudgetPolicy(spec.p, spec.threshold)
    return spec.kind


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", type=base_argument, required=True, help="base causal LM: hub id, local folder, or smollm2 / organism")
    parser.add_argument("--head", type=head_argument, default=None, help="recall head: hub id, local folder, or a shipped one (organism, smollm2, "
                        "gemma3-270m, qwen2.5-coder-0.5b)")
    parser.add_argument("--tokenizer", type=base_argument, default=None, help="tokenizer id or folder (default: --base)")
    parser.add_argument("--sinks", type=argument(integer, "sinks", minimum=0, maximum=MAX_SPAN), default=None,
                        help="sink positions s (default: the head's or 4)")
    parser.add_argument("--window", type=argument(integer, "window", minimum=1, maximum=MAX_SPAN), default=None,
                        help="recent window w incl. current token")
    parser.add_argument("--threshold", type=argument(number, "threshold"), default=None,
                        help="head threshold theta (default: the head's saved one, else 0)")
    parser.add_argument("--policy", type=parse_policy, default=None,
                        help="head | full | local | random:P[:SEED] | schedule:K:PERIOD | budget:RATE[:THRESHOLD] "
                             "(default: head if --head)")
    parser.add_argument("--dtype", type=dtype_name, default="float32",
                        help="base model dtype: float32|fp32, bfloat16|bf16, float16|fp16 or auto (default float32)")


def check_threshold_is_read(threshold: float, policy) -> None:
    """UsageError unless `policy` reads the head threshold --threshold sets: `head`, or a budget without its own."""
    from .policies import BudgetPolicy

    if isinstance(policy, BudgetPolicy):
        if policy.threshold is not None:
            raise UsageError(f"--threshold {threshold:g} and --policy budget:{policy.rate:g}:{policy.threshold:g} give "
                             "two thresholds: give it once (--policy budget:RATE with --threshold, or "
                             "budget:RATE:THRESHOLD alone).")
        return
    if policy != "head":
        raise UsageError(f"--threshold {threshold:g} is the recall head's threshold, but --policy {policy!r} does not "
                         "ask the head: drop --threshold, or use --policy head.")


def load_model_from_args(args):
    from .modeling import OdaForCausalLM

    routing = {key: getattr(args, key) for key in ("sinks", "window", "threshold", "policy")
               if getattr(args, key) is not None}
    if args.head is None:
        if args.threshold is not None:  # only the head reads it: a run without one would silently ignore it
            raise UsageError(f"--threshold {args.threshold:g} is the recall head's threshold, but no --head is given: "
                             "add --head, or drop --threshold.")
        routing.setdefault("policy", "local")
    else:
        # --policy's documented default with a head; a policy saved in the head folder ('local' or 'full') would
        # otherwise win, leaving the head and --threshold unused
        routing.setdefault("policy", "head")
        if args.threshold is not None:
            check_threshold_is_read(args.threshold, routing["policy"])
    require_model_source("--base", args.base)
    require_model_source("--head", args.head)
    with user_input("loading the model (--base/--head)",
                    "give a local folder written by save_pretrained or a hub id available offline"):
        return OdaForCausalLM.from_pretrained(args.base, head=args.head, dtype=torch_dtype(args.dtype), **routing)


def check_local_matters(model, positions: int, window_source: str) -> None:
    """When every query position of the request is <= s + w, Local reads the whole history and equals Full.
    The baselines (`local`, `random`, `schedule`) would silently be the Full model: refuse them. The learned
    head still gives the right text (only its Full calls are wasted): say so on stderr."""
    config, policy = model.oda_config, model.oda_config.routing_policy().name
    if positions > config.local_span or policy == "full":
        return
    reason = (f"this request never goes past position {positions}, within s + w = {config.sinks} + {config.window} "
              f"({window_source}), so Local reads the whole history and equals Full at every step")
    if policy in ("head", "budget"):
        print(f"[oda] note: {reason}; the head's Full calls change nothing here.", file=sys.stderr)
        return
    smaller = positions - config.sinks
    fixes = ([f"a --window below {smaller}"] if smaller > 1 else []) + ["a longer prompt or more --max-new-tokens"]
    raise UsageError(f"--policy {policy}: {reason}. Use {' or '.join(fixes)}, or --policy full.")


def run_generate(args) -> int:
    import torch

    tokenizer = load_tokenizer(args.tokenizer, args.base)
    model = load_model_from_args(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    if inputs["input_ids"].shape[1] == 0:
        raise UsageError("the prompt is empty (it tokenizes to no token); give --prompt or text on standard input.")
    check_context(model.config, inputs["input_ids"].shape[1], args.max_new_tokens)
    # The last output comes from query position L + N - 1 (prefill's output is position L).
    window_source = "--window" if args.window is not None else "the head's window" if args.head else \
        "the default window"
    generate_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if not args.exact:
        for flag, value in (("--max-draft", args.max_draft), ("--verify-threshold", args.verify_threshold)):
            if value is not None:
                raise UsageError(f"{flag} only applies with --exact; add --exact or drop {flag}.")
        check_local_matters(model, inputs["input_ids"].shape[1] + args.max_new_tokens - 1, window_source)
    else:  # exact mode's output is Full's whatever the window: no baseline to protect from Local == Full
        from .exact import check_exact_settings

        with user_input("--exact"):  # before the prefill, as a one-line error
            check_exact_settings(model, args.max_draft, args.verify_threshold)
        generate_kwargs.update(oda_mode="exact", max_draft=args.max_draft, verify_threshold=args.verify_threshold)
    if args.fast:
        from .engine.routing import plan_for
        from .engine.support import check_model_supported

        with user_input("--fast"):  # before the prefill, as a one-line error
            check_model_supported(model)
            if not args.exact:
                plan_for(model.oda_config.routing_policy(), model.recall_head is not None)
        generate_kwargs["oda_fast"] = True
    if args.temperature > 0:
        generate_kwargs["temperature"] = args.temperature
        torch.manual_seed(args.seed)
    if tokenizer.pad_token_id is not None:
        generate_kwargs["pad_token_id"] = tokenizer.pad_token_id
    with torch.no_grad():
        output = model.generate(**inputs, **generate_kwargs)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(text)
    config = model.oda_config
    mode = "exact" if args.exact else f"policy={config.routing_policy()!r}"  # the same on the fast path
    print(f"[oda] {mode} sinks={config.sinks} window={config.window} | {model.routing.summary()}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oda", description="On-Demand Attention for Hugging Face Transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True)

    generate = subparsers.add_parser("generate", help="generate text with ODA routing and print a routing summary")
    add_routing_arguments(generate)
    generate.add_argument("--prompt", default=None, help="prompt text (default: read standard input)")
    generate.add_argument("--max-new-tokens", type=argument(integer, "max-new-tokens", minimum=1), default=128)
    generate.add_argument("--temperature", type=argument(number, "temperature", minimum=0.0), default=0.0,
                          help="0 = greedy")
    generate.add_argument("--seed", type=argument(seed, "seed"), default=0)
    generate.add_argument("--exact", action="store_true",
                          help="exact mode: Local drafts, Full verifies when the head asks; the output is Full's")
    generate.add_argument("--max-draft", type=argument(integer, "max-draft", minimum=1, maximum=1024), default=None,
                          help="with --exact: drafted tokens per verification at most (default 3)")
    generate.add_argument("--verify-threshold", type=argument(number, "verify-threshold", finite=False), default=None,
                          help="with --exact: verify when the head's score passes this (default: the routing "
                               "threshold; inf = fixed drafts of --max-draft, no head)")
    generate.add_argument("--fast", action="store_true",
                          help="run on the static decode engine (Llama, Mistral, Qwen2, Qwen3, Gemma 3)")
    generate.set_defaults(func=run_generate)

    for add_cli in _subcommands():
        add_cli(subparsers)
    return parser


def _subcommands() -> list:
    """Subcommands defined next to the code they drive (each module has add_cli(subparsers))."""
    from . import cost, known_models, text_model
    from .evaluation import calibrate_cli
    from .evaluation import cli as evaluation_cli
    from .evaluation import ruler_synth
    from .organism import demo
    from .training import cache_cli
    from .training import cli as training_cli
    from .vllm import server

    return [demo.add_cli, known_models.add_cli, cost.add_cli, training_cli.add_cli, cache_cli.add_cli,
            evaluation_cli.add_cli, calibrate_cli.add_cli, ruler_synth.add_cli, server.add_cli, text_model.add_cli]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (UsageError, OutputLocked) as err:
        print(f"oda {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
