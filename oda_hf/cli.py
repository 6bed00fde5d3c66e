"""The `oda` command line: `oda generate`, plus the subcommands other modules register."""

from __future__ import annotations

import argparse
import sys

from .policies import RandomPolicy, SchedulePolicy


def parse_policy(text: str):
    """'head', 'full', 'local', 'random:P[:SEED]' or 'schedule:K:PERIOD'."""
    kind, _, rest = text.partition(":")
    args = [a for a in rest.split(":") if a]
    try:
        if kind == "random" and 1 <= len(args) <= 2:
            return RandomPolicy(float(args[0]), int(args[1]) if len(args) > 1 else 42)
        if kind == "schedule" and len(args) == 2:
            return SchedulePolicy(int(args[0]), int(args[1]))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if kind in ("head", "full", "local") and not args:
        return kind
    raise argparse.ArgumentTypeError(
        f"unknown policy {text!r}: use head, full, local, random:P[:SEED] or schedule:K:PERIOD"
    )


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, help="base causal LM: hub id or local folder")
    parser.add_argument("--head", default=None, help="recall head: hub id or local folder")
    parser.add_argument("--tokenizer", default=None, help="tokenizer id or folder (default: --base)")
    parser.add_argument("--sinks", type=int, default=None, help="sink positions s (default: the head's or 4)")
    parser.add_argument("--window", type=int, default=None, help="recent window w incl. current token")
    parser.add_argument("--threshold", type=float, default=None, help="head threshold theta (default: the head's saved one, else 0)")
    parser.add_argument("--policy", type=parse_policy, default=None,
                        help="head | full | local | random:P[:SEED] | schedule:K:PERIOD (default: head if --head)")
    parser.add_argument("--dtype", default="float32", help="base model dtype (float32, bfloat16, ...)")


def load_model_from_args(args):
    import torch

    from .modeling import OdaForCausalLM

    routing = {key: getattr(args, key) for key in ("sinks", "window", "threshold", "policy")
               if getattr(args, key) is not None}
    if args.head is None:
        routing.setdefault("policy", "local")
    return OdaForCausalLM.from_pretrained(args.base, head=args.head, dtype=getattr(torch, args.dtype), **routing)


def run_generate(args) -> int:
    import torch
    from transformers import AutoTokenizer

    model = load_model_from_args(args)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.base)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    generate_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
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
    print(f"[oda] policy={model._policy!r} sinks={config.sinks} window={config.window} | {model.routing.summary()}",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oda", description="On-Demand Attention for Hugging Face Transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True)

    generate = subparsers.add_parser("generate", help="generate text with ODA routing and print a routing summary")
    add_routing_arguments(generate)
    generate.add_argument("--prompt", default=None, help="prompt text (default: read standard input)")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--seed", type=int, default=0)
    generate.set_defaults(func=run_generate)

    for add_cli in _subcommands():
        add_cli(subparsers)
    return parser


def _subcommands() -> list:
    """Subcommands defined next to the code they drive (each module has add_cli(subparsers))."""
    from . import cost
    from .evaluation import cli as evaluation_cli
    from .evaluation import ruler_synth
    from .organism import demo
    from .training import cli as training_cli

    return [demo.add_cli, cost.add_cli, training_cli.add_cli, evaluation_cli.add_cli, ruler_synth.add_cli]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
