"""Training documents for the SmolLM2-135M-Instruct recall head, from the library's public pieces.

The mix (why):
* RULER's *train* split (`oda ruler`'s generator, Old Testament prose and RULER's noise as haystacks,
  seeds disjoint from dev/test) with the gold answer appended after the answer prefix, as the model
  would write it, then `<|im_end|>`: the positions where Full pays at decode time on RULER are the
  retrieved tokens, and only teacher-forced answers put them into the supervision.
  With `--answers model` the answer is the base model's own greedy continuation (Full attention, the example's
  output cap) instead: the trajectory ODA decodes at test time. Gold answers can differ from it in ways that hide
  the positions where Full pays: Qwen2.5-Coder repeats vt's value before naming the variables, so the step after
  the value (Full names a variable, Local writes ",") never occurs in a gold document. `--answers both` keeps one
  document of each. Generated answers are kept in `<out>.answers.jsonl`, so a killed run resumes.
* Plain Old Testament prose (the train split of the KJV text, never used by dev/test prompts): the
  general long-context positions the paper trains on, so the head also learns where Full does *not* pay.

Evaluation prompts use the dev (Romans-Revelation) and test (Matthew-Acts) text and their own seeds.
`--split dev|test --reference-window K` writes held-out reference sequences for `oda diagnose`: each RULER
document's scored positions start K tokens before its answer (the question and the answer itself), as the
decode positions of an evaluation are there; prose documents keep the default window.

    python benchmarks/smollm2/head_data.py --tokenizer smollm2 --out train.jsonl
    python benchmarks/smollm2/head_data.py --tokenizer smollm2 --split dev --reference-window 32 \
        --n 2 2 --prose 8 --out dev_references.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random

from tqdm.auto import tqdm

from oda_hf.evaluation.haystacks import prose_words
from oda_hf.evaluation.ruler_synth import generate_suite
from oda_hf.evaluation.runner import (append_jsonl, encode_prompt, eos_token_ids, greedy_config, prompt_fingerprint,
                                      read_appended_jsonl)

ANSWER_SOURCES = ("gold", "model", "both")


def answer_ids(example, tokenizer) -> list[int]:
    """The gold answer as a continuation of the answer prefix, ending with the end-of-turn token."""
    text = " " + ", ".join(example.answers)
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


class ModelAnswers:
    """The base model's greedy continuations of prompts, kept in an append-only file so a rerun reuses them.

    A stored answer is reused only for the same example id, prompt tokens (SHA-256) and output cap.
    `max_new_tokens` replaces every example's cap, as ``oda eval --max-new-tokens`` does."""

    def __init__(self, model, tokenizer, path: str | os.PathLike, max_new_tokens: int | None = None):
        self.model, self.tokenizer, self.path, self.max_new_tokens = model, tokenizer, path, max_new_tokens
        records = read_appended_jsonl(path, kind="model answer", required=("id", "prompt_sha256"))
        self.stored = {(r["id"], r["prompt_sha256"], r.get("max_new_tokens")): r["answer_ids"] for r in records}

    def __call__(self, example, prompt: list[int]) -> list[int]:
        cap = self.max_new_tokens or example.max_new_tokens
        key = (example.id, prompt_fingerprint(prompt), cap)
        if key not in self.stored:
            self.stored[key] = model_answer_ids(self.model, self.tokenizer, prompt, cap)
            append_jsonl(self.path, {"id": key[0], "prompt_sha256": key[1], "max_new_tokens": cap,
                                     "answer_ids": self.stored[key]})
        return self.stored[key]


def model_answer_ids(model, tokenizer, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`model`'s greedy continuation of `prompt` (as `oda eval`'s Full policy decodes it), up to and including its
    first EOS token, or `max_new_tokens` long without one."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    with torch.no_grad():
        output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                generation_config=greedy_config(model, tokenizer, max_new_tokens))
    new_ids = output[0, len(prompt):].tolist()
    eos = set(eos_token_ids(model, tokenizer))
    first_eos = next((i for i, token in enumerate(new_ids) if token in eos), None)
    return new_ids if first_eos is None else new_ids[:first_eos + 1]


def ruler_documents(tokenizer, lengths, n, seed, split="train", reference_window=None, chat_template=True,
                    max_position_embeddings=8192, answers="gold", model_answers=None, tasks=None) -> list[dict]:
    """RULER prompts with an answer appended: the gold one, the model's own (`model_answers`, a `ModelAnswers`),
    or both (the model's document gets the id suffix ``/model``)."""
    if answers not in ANSWER_SOURCES:
        raise ValueError(f"answers must be one of {ANSWER_SOURCES}; got {answers!r}.")
    if answers != "gold" and model_answers is None:
        raise ValueError(f"answers={answers!r} needs model_answers (the base model that writes them).")
    examples = generate_suite(tokenizer, tasks, lengths=lengths, split=split, n=n, haystack="kjv", seed=seed,
                              max_position_embeddings=max_position_embeddings, chat_template=chat_template,
                              progress=True)
    documents = []
    for e in tqdm(examples, desc="model answers", unit="prompt", disable=model_answers is None):
        prompt = encode_prompt(e, tokenizer, chat_template=chat_template)
        continuations = []
        if answers in ("gold", "both"):
            continuations.append((e.id, answer_ids(e, tokenizer)))
        if answers in ("model", "both"):
            continuations.append((e.id + "/model" if answers == "both" else e.id, model_answers(e, prompt)))
        for identifier, answer in continuations:
            document = {"id": identifier, "input_ids": prompt + answer}
            if reference_window is not None:  # score the question's end and the answer (the decode positions)
                document |= {"start": len(prompt) - reference_window, "count": reference_window + len(answer) - 1}
            documents.append(document)
    return documents


def prose_documents(tokenizer, count, tokens, seed, split="train") -> list[dict]:
    words = prose_words("kjv", split)
    rng = random.Random(seed)
    documents = []
    for index in range(count):
        start = rng.randrange(len(words) - 2 * tokens)
        ids = tokenizer(" ".join(words[start:start + 2 * tokens]), add_special_tokens=False)["input_ids"][:tokens]
        documents.append({"id": f"kjv-{split}/{index}", "input_ids": ids})
    return documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    parser.add_argument("--n", nargs="+", type=int, default=[6, 4], help="prompts per task, one per length")
    parser.add_argument("--prose", type=int, default=16, help="prose documents")
    parser.add_argument("--prose-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=("train", "dev", "test"), default="train")
    parser.add_argument("--reference-window", type=int, default=None,
                        help="diagnostics files: score RULER documents from this many tokens before the answer")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                        help="RULER prompts inside the chat template (--no-chat-template for base models, e.g. Gemma)")
    parser.add_argument("--max-position-embeddings", type=int, default=8192, help="the model's context limit")
    parser.add_argument("--answers", choices=ANSWER_SOURCES, default="gold",
                        help="what follows each RULER prompt: the gold answer, the base model's own greedy "
                             "continuation (--tokenizer names the base; resumable), or one document of each")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="output cap of the model's answers instead of each task's (as oda eval's flag)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for --answers model/both")
    args = parser.parse_args()
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be a positive integer; got {value}.")
    from transformers import AutoTokenizer

    from oda_hf.known_models import resolve_base

    base = resolve_base(args.tokenizer)  # "smollm2" works
    tokenizer = AutoTokenizer.from_pretrained(base)
    model_answers = None
    if args.answers != "gold":
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        model = AutoModelForCausalLM.from_pretrained(base).eval()
        model_answers = ModelAnswers(model, tokenizer, args.out + ".answers.jsonl", args.max_new_tokens)
    documents = []
    for length, n in zip(args.lengths, args.n, strict=True):
        documents += ruler_documents(tokenizer, [length], n, args.seed, args.split, args.reference_window,
                                     args.chat_template, args.max_position_embeddings, args.answers, model_answers)
    documents += prose_documents(tokenizer, args.prose, args.prose_tokens, args.seed, args.split)
    partial = args.out + ".tmp"  # written whole, then renamed: a killed run never leaves a truncated file
    with open(partial, "w", encoding="utf-8") as f:
        for document in documents:
            f.write(json.dumps(document) + "\n")
    os.replace(partial, args.out)
    tokens = sum(len(d["input_ids"]) for d in documents)
    print(f"{len(documents)} documents, {tokens} tokens -> {args.out}")


if __name__ == "__main__":
    main()
