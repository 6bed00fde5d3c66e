"""Training documents for the SmolLM2-135M-Instruct recall head, from the library's public pieces.

The mix (why):
* RULER's *train* split (`oda ruler`'s generator, Old Testament prose and RULER's noise as haystacks,
  seeds disjoint from dev/test) with the gold answer appended after the answer prefix, as the model
  would write it, then `<|im_end|>`: the positions where Full pays at decode time on RULER are the
  retrieved tokens, and only teacher-forced answers put them into the supervision.
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
import random

from oda_hf.evaluation.haystacks import prose_words
from oda_hf.evaluation.ruler_synth import generate_suite
from oda_hf.evaluation.runner import encode_prompt


def answer_ids(example, tokenizer) -> list[int]:
    """The gold answer as a continuation of the answer prefix, ending with the end-of-turn token."""
    text = " " + ", ".join(example.answers)
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def ruler_documents(tokenizer, lengths, n, seed, split="train", reference_window=None, chat_template=True,
                    max_position_embeddings=8192) -> list[dict]:
    examples = generate_suite(tokenizer, lengths=lengths, split=split, n=n, haystack="kjv", seed=seed,
                              max_position_embeddings=max_position_embeddings, chat_template=chat_template,
                              progress=True)
    documents = []
    for e in examples:
        prompt, answer = encode_prompt(e, tokenizer, chat_template=chat_template), answer_ids(e, tokenizer)
        document = {"id": e.id, "input_ids": prompt + answer}
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
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from oda_hf.known_models import resolve_base

    tokenizer = AutoTokenizer.from_pretrained(resolve_base(args.tokenizer))  # "smollm2" works
    documents = []
    for length, n in zip(args.lengths, args.n, strict=True):
        documents += ruler_documents(tokenizer, [length], n, args.seed, args.split, args.reference_window,
                                     args.chat_template, args.max_position_embeddings)
    documents += prose_documents(tokenizer, args.prose, args.prose_tokens, args.seed, args.split)
    with open(args.out, "w", encoding="utf-8") as f:
        for document in documents:
            f.write(json.dumps(document) + "\n")
    tokens = sum(len(d["input_ids"]) for d in documents)
    print(f"{len(documents)} documents, {tokens} tokens -> {args.out}")


if __name__ == "__main__":
    main()
