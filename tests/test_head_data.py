"""benchmarks/smollm2/head_data.py: RULER training documents with gold or model-written answers."""

import importlib.util
import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from oda_hf.evaluation.runner import encode_prompt, greedy_config
from tiny_models import VOCAB, tiny_model

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "smollm2", "head_data.py")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.fixture(scope="module")
def head_data():
    spec = importlib.util.spec_from_file_location("head_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    """Words of the RULER prompts map to ids below the tiny models' vocabulary (eos = 2)."""
    words = ["<pad>", "<unk>", "<eos>", *(f"w{i}" for i in range(3, VOCAB))]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


class CountingModel:
    """A tiny model whose generate() calls are counted (reuse of stored answers is what is checked)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, **kwargs):
        self.calls += 1
        return self.model.generate(**kwargs)


def test_model_answers_are_the_models_greedy_continuation_and_are_reused(head_data, tokenizer, tmp_path):
    model = CountingModel(tiny_model("llama", seed=1).eval())
    store = tmp_path / "train.jsonl.answers.jsonl"
    answers = head_data.ModelAnswers(model, tokenizer, store)
    documents = head_data.ruler_documents(tokenizer, [640], 1, seed=0, tasks=["vt", "niah_single_1"],
                                          max_position_embeddings=1024, answers="both", model_answers=answers)
    assert model.calls == 2
    ids = [d["id"] for d in documents]
    assert ids == ["vt/640/train/0", "vt/640/train/0/model", "niah_single_1/640/train/0",
                   "niah_single_1/640/train/0/model"], ids
    from oda_hf.evaluation.ruler_synth import generate_suite

    examples = generate_suite(tokenizer, tasks=["vt", "niah_single_1"], lengths=[640], split="train", n=1,
                              haystack="kjv", seed=0, max_position_embeddings=1024)
    for example, gold, mine in zip(examples, documents[::2], documents[1::2], strict=True):
        prompt = encode_prompt(example, tokenizer, chat_template=True)
        assert gold["input_ids"] == prompt + head_data.answer_ids(example, tokenizer)
        expected = model.model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                        dtype=torch.long), generation_config=greedy_config(model, tokenizer,
                                        example.max_new_tokens))[0, len(prompt):].tolist()
        if 2 in expected:  # the continuation ends at its first EOS token
            expected = expected[:expected.index(2) + 1]
        assert mine["input_ids"] == prompt + expected and len(expected) >= 1
    assert len(store.read_text().splitlines()) == 2

    again = CountingModel(model.model)  # a rerun reads the stored answers instead of generating
    redone = head_data.ruler_documents(tokenizer, [640], 1, seed=0, tasks=["vt", "niah_single_1"],
                                       max_position_embeddings=1024, answers="model",
                                       model_answers=head_data.ModelAnswers(again, tokenizer, store))
    assert again.calls == 0
    assert [d["input_ids"] for d in redone] == [d["input_ids"] for d in documents[1::2]]
    assert [d["id"] for d in redone] == ["vt/640/train/0", "niah_single_1/640/train/0"]

    # A stored answer is tied to its prompt tokens: another prompt under the same id is generated anew.
    record = json.loads(store.read_text().splitlines()[0])
    store.write_text(json.dumps(record | {"prompt_sha256": "0" * 64}) + "\n" + store.read_text().splitlines()[1] + "\n")
    third = CountingModel(model.model)
    head_data.ruler_documents(tokenizer, [640], 1, seed=0, tasks=["vt", "niah_single_1"], max_position_embeddings=1024,
                              answers="model", model_answers=head_data.ModelAnswers(third, tokenizer, store))
    assert third.calls == 1
    # So is its output cap (--max-new-tokens): a capped run generates again, and its answers keep to the cap.
    capped = CountingModel(model.model)
    short = head_data.ruler_documents(tokenizer, [640], 1, seed=0, tasks=["vt", "niah_single_1"],
                                      max_position_embeddings=1024, answers="model",
                                      model_answers=head_data.ModelAnswers(capped, tokenizer, store, max_new_tokens=3))
    assert capped.calls == 2
    for document, full, example in zip(short, redone, examples, strict=True):
        start = len(encode_prompt(example, tokenizer, chat_template=True))
        answer = document["input_ids"][start:]
        assert len(full["input_ids"]) - start > 3  # the cap shortened it
        assert 1 <= len(answer) <= 3 and answer == full["input_ids"][start:start + len(answer)]


def test_model_answers_need_a_model(head_data, tokenizer):
    with pytest.raises(ValueError, match="needs model_answers"):
        head_data.ruler_documents(tokenizer, [640], 1, seed=0, answers="model")
    with pytest.raises(ValueError, match="answers must be one of"):
        head_data.ruler_documents(tokenizer, [640], 1, seed=0, answers="teacher")


def test_a_model_answer_ends_at_its_first_eos(head_data, tokenizer):
    class Fixed(CountingModel):  # a continuation with EOS (id 2) in the middle, as a capped generate() may return
        def generate(self, input_ids, **kwargs):
            return torch.cat([input_ids, torch.tensor([[5, 2, 7, 2]])], dim=1)

    model = Fixed(tiny_model("llama").eval())
    assert head_data.model_answer_ids(model, tokenizer, [3, 4], max_new_tokens=4) == [5, 2]
