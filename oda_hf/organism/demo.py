"""`oda demo`: the shipped model organism answering held-out prompts with Full, StreamingLLM and ODA.

Loads the organism (backbone, tokenizer, recall head) offline from the package's ``assets`` folder
(or ``--organism DIR``), answers a handful of held-out *test* prompts with each method, prints the
answers, each method's score and ODA's Full-call rate, and writes the routing trajectory of one
ODA answer (tokens coloured Local / Full as in the paper's Figure 3) to HTML and PNG.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from importlib import resources

from ..cli_common import UsageError, thread_count, user_input
from ..files import write_text
from ..validation import argument, number
from .corpus import BOS_ID, EOS_ID, PAD_ID, VOCAB, OrganismCorpus
from .metrics import example_score

#: One prompt per family, 4-16x the window (w = 64), all from the held-out test split.
DEMO_PROMPTS = (("niah_single_2", 512), ("niah_multikey_1", 512), ("niah_multivalue", 768), ("vt", 512),
                ("fwe", 512), ("qa_1", 1024))
METHODS = (("Full", "full"), ("StreamingLLM", "local"), ("ODA", "head"))


def shipped_organism_dir() -> str:
    """Folder of the organism shipped inside the package (``backbone/`` and ``head/``)."""
    return str(resources.files("oda_hf.organism").joinpath("assets"))


def organism_problem(path: str) -> str | None:
    """Why `path` is not an organism folder (with ``backbone/`` and ``head/``), or None if it is one."""
    missing = [p for p in (os.path.join(path, "backbone"), os.path.join(path, "head")) if not os.path.isdir(p)]
    if not missing:
        return None
    return (f"No model organism at {path} (missing {', '.join(missing)}). Train one with "
            "`python -m oda_hf.organism.train_backbone` and `python -m oda_hf.organism.train_head`, or pass "
            "--organism <folder with backbone/ and head/>.")


def load_organism(path: str | None = None, threshold: float | None = None):
    """The organism as ``(OdaForCausalLM, tokenizer, info)``, loaded from local files only.
    `threshold` None keeps the head's saved routing threshold."""
    from transformers import AutoTokenizer

    from ..modeling import OdaForCausalLM

    path = path or shipped_organism_dir()
    backbone, head = os.path.join(path, "backbone"), os.path.join(path, "head")
    problem = organism_problem(path)
    if problem:
        raise FileNotFoundError(problem)
    routing = {} if threshold is None else {"threshold": threshold}
    model = OdaForCausalLM.from_pretrained(backbone, head=head, local_files_only=True,
                                           head_kwargs={"local_files_only": True}, **routing)
    tokenizer = AutoTokenizer.from_pretrained(backbone, local_files_only=True)
    info_path = os.path.join(backbone, "organism.json")
    info = json.load(open(info_path)) if os.path.exists(info_path) else {}
    return model.eval(), tokenizer, info


def _words(ids) -> list[str]:
    return [VOCAB[i] for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)]


def run_demo(organism: str | None = None, output: str = "oda_demo", prompts=DEMO_PROMPTS, threshold: float | None = None,
             verbose: bool = True) -> dict:
    """Answer `prompts` with each method; returns scores, ODA's rate and the trajectory file paths."""
    import torch

    start = time.perf_counter()
    model, _, info = load_organism(organism, threshold)
    corpus = OrganismCorpus(seed=info.get("seed", 0), window=model.oda_config.window)
    examples = [corpus.example(task, length, "test", 0) for task, length in prompts]
    say = print if verbose else (lambda *a, **k: None)
    say(f"ODA demo: model organism (s={model.oda_config.sinks}, w={model.oda_config.window}, "
        f"threshold={model.oda_config.threshold}), {len(examples)} held-out test prompts\n")
    scores = {name: [] for name, _ in METHODS}
    full_calls = routed = decided = 0
    trajectory = None
    for example in examples:
        ids = torch.tensor([example.prompt_ids()])
        say(f"[{example.task}, {ids.shape[1]} prompt tokens] reference: {' | '.join(example.answers)}")
        for name, policy in METHODS:
            model.set_routing(policy=policy)
            with torch.no_grad():
                out = model.generate(input_ids=ids, max_new_tokens=len(example.target_ids()) + 4, do_sample=False,
                                     eos_token_id=EOS_ID, pad_token_id=PAD_ID)
            new = out[0, ids.shape[1]:].tolist()
            text = " ".join(_words(new))
            score = 100.0 * example_score(text, example.answers, example.metric)
            scores[name].append(score)
            rate = ""
            if policy == "head":
                steps, calls = int(model.routing.steps_per_row.sum()), int(model.routing.full_calls_per_row.sum())
                past = int(model.routing.decided_steps_per_row.sum())  # the head never recalls within s + w
                routed, full_calls, decided = routed + steps, full_calls + calls, decided + past
                rate = f"  (Full calls {calls}/{past} steps past the window, {steps} routed)"
                if trajectory is None or (calls and not trajectory["calls"]):
                    trajectory = {"example": example, "new": new, "calls": calls,
                                  "decisions": model.routing.decisions[0].tolist(),
                                  "scores": model.routing.scores[0].tolist()}
            say(f"  {name:>12} [{score:5.1f}] {text}{rate}")
        say("")
    means = {name: sum(v) / len(v) for name, v in scores.items()}
    rate = full_calls / decided if decided else float("nan")
    paper_rate = full_calls / routed if routed else float("nan")
    say("score (RULER string match, mean over prompts): " +
        ", ".join(f"{name} {means[name]:.1f}" for name, _ in METHODS) +
        f" | ODA Full-call rate {rate:.1%} past the window ({paper_rate:.1%} over all routed steps, the paper's count)")
    paths = _write_trajectory(trajectory, output) if trajectory else {}
    for kind, path in paths.items():
        say(f"routing trajectory ({kind}): {path}")
    say(f"done in {time.perf_counter() - start:.1f} s")
    return {"scores": means, "per_prompt": scores, "full_call_rate": rate, "paper_full_call_rate": paper_rate,
            "files": paths}


def _write_trajectory(trajectory: dict, output: str) -> dict:
    from ..evaluation.trajectory import render_html, render_png

    os.makedirs(output, exist_ok=True)
    example = trajectory["example"]
    tokens = [" " + VOCAB[i] for i in trajectory["new"]]
    prompt_tail = [" " + w for w in _words(example.prompt_ids())[-48:]]  # the question and a little context
    title = f"ODA on the organism: {example.task}"
    html_path, png_path = os.path.join(output, "trajectory.html"), os.path.join(output, "trajectory.png")
    kwargs = dict(answers=[" " + a for a in example.answers], prompt_tokens=prompt_tail)
    write_text(html_path, render_html(tokens, trajectory["decisions"], head_scores=trajectory["scores"], title=title,
                                      **kwargs))
    render_png(tokens, trajectory["decisions"], png_path, title=title, **kwargs)
    return {"html": html_path, "png": png_path}


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="Full vs StreamingLLM vs ODA on held-out prompts: SmolLM2 with its shipped head, else the organism",
        description="With a SmolLM2 head (shipped, or --head) the demo runs the real SmolLM2-135M-Instruct on RULER "
                    "test prompts (fetching the model on first use); otherwise, or offline, the shipped model organism.")
    parser.add_argument("--model", choices=("auto", "smollm2", "organism"), default="auto",
                        help="auto (default): smollm2 when a SmolLM2 head is available and the model can be had, else "
                             "the organism")
    parser.add_argument("--head", default=None, help="recall head folder for --model smollm2 (default: the shipped one)")
    parser.add_argument("--organism", default=None, help="organism folder (default: the one shipped in the package)")
    parser.add_argument("--output", default="oda_demo", help="folder for trajectory.html / trajectory.png")
    parser.add_argument("--threshold", type=argument(number, "threshold"), default=None,
                        help="ODA threshold theta (default: the head's saved one, chosen on dev)")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated task families: for SmolLM2 any RULER task (default niah_single_2, "
                             "niah_multikey_1, vt), for the organism a subset of its six")
    parser.add_argument("--threads", type=thread_count, default=1,
                        help="torch threads (a tiny model gains nothing from more)")
    parser.set_defaults(func=_run_demo_command)


def _run_demo_command(args) -> int:
    import torch

    from ..evaluation.ruler_synth import TASKS as RULER_TASKS

    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise UsageError(f"--output {args.output} is a file; give a folder for trajectory.html and trajectory.png.")
    wanted = [task.strip() for task in args.tasks.split(",") if task.strip()] if args.tasks is not None else None
    if wanted is not None and not wanted:
        raise UsageError("--tasks is empty; give comma-separated task names or leave it out.")
    organism_tasks = [task for task, _ in DEMO_PROMPTS]
    if args.organism is not None and args.model == "smollm2":  # --organism chose the organism over it, exit 0
        raise UsageError("--organism runs the model organism but --model smollm2 asks for SmolLM2: drop one of them.")
    smollm2 = args.model != "organism" and args.organism is None
    if wanted:  # checked before anything is fetched or loaded
        ruler, organism = set(RULER_TASKS), set(organism_tasks)
        known = organism if not smollm2 else ruler if args.model == "smollm2" else ruler | organism
        unknown = sorted(set(wanted) - known)
        if unknown:
            raise UsageError(f"--tasks: unknown demo tasks {unknown}; choose from {sorted(known)}")
        if smollm2 and not set(wanted) <= ruler:  # auto: organism-only tasks choose the organism
            print(f"[oda demo] {sorted(set(wanted) - ruler)} are organism tasks only: running the model organism.\n")
            smollm2 = False
    if args.head is not None and not smollm2:  # the organism has its own head: --head would go unread
        raise UsageError(f"--head is SmolLM2's recall head, but this demo runs the model organism (its head is in "
                         f"--organism's folder): drop --head, or use --model smollm2 with SmolLM2 tasks.")
    torch.set_num_threads(args.threads)
    if smollm2 and _run_smollm2(args, wanted):
        return 0
    prompts = DEMO_PROMPTS
    if wanted:
        prompts = tuple(p for p in DEMO_PROMPTS if p[0] in wanted)
        if not prompts:
            raise UsageError(f"--tasks: none of {wanted} is an organism demo task; choose from {organism_tasks}")
    problem = organism_problem(args.organism) if args.organism else None
    if problem:
        raise UsageError(f"--organism: {problem}")
    run_demo(args.organism, args.output, prompts=prompts, threshold=args.threshold)
    return 0


def _run_smollm2(args, tasks=None) -> bool:
    """Run the SmolLM2 demo if it can run; say why not (and fall back to the organism) where it cannot."""
    from ..known_models import FetchError, resolve_head

    head = args.head
    if head is None:
        try:
            head = resolve_head("smollm2")
        except FileNotFoundError as err:
            if args.model == "smollm2":
                raise UsageError(f"{err} Pass --head <folder>.") from None
            print(f"[oda demo] {err} Running the model organism instead.\n")
            return False
    elif not os.path.isdir(head):
        raise UsageError(f"--head {head} does not exist.")
    else:
        from ..loading import check_head_folder

        with user_input(f"--head {head}", "give a folder written by RecallHead.save_pretrained or oda train-head"):
            check_head_folder(head)  # before the model is fetched or loaded
    from ..smollm2_demo import DEMO_LENGTH, DEMO_PROMPTS as SMOLLM2_PROMPTS, run_smollm2_demo

    prompts = tuple((task, DEMO_LENGTH) for task in tasks) if tasks else SMOLLM2_PROMPTS
    try:
        # A --head for another base fails when the model loads (ValueError naming both shapes): one line, not a
        # traceback. FetchError is a RuntimeError, so it still reaches the fallback below.
        with user_input(f"--head {head}", "give a head trained for SmolLM2-135M-Instruct") if args.head else \
                contextlib.nullcontext():
            run_smollm2_demo(head, args.output, prompts=prompts, threshold=args.threshold)
    except FetchError as err:
        if args.model == "smollm2" or args.head:   # (the organism would not read --head: another head, exit 0)
            raise UsageError(str(err)) from None
        print(f"[oda demo] SmolLM2 is not available here ({err}). Running the model organism instead.\n")
        return False
    return True


def main(argv=None) -> int:
    from ..cli import main as oda_main

    return oda_main(["demo", *(argv or [])])
