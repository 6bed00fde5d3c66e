"""The organism corpus, tokenizer, metrics and training plumbing (fast: no real training)."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from oda_hf.organism import corpus as C
from oda_hf.organism.corpus import ANSWER, CONTENT, TASKS, OrganismCorpus, build_example, training_sequence
from oda_hf.organism.metrics import example_score, score_by_task, string_match_all, string_match_part, task_score

W, S = 64, 4
LENGTHS = (256, 512, 1024)


@pytest.fixture(scope="module")
def corpus():
    return OrganismCorpus(seed=0, window=W, heldout_size=8)


# -- determinism ---------------------------------------------------------------------------------------


def test_same_seed_same_examples_different_seed_different():
    a, b, c = OrganismCorpus(seed=3, heldout_size=4), OrganismCorpus(seed=3, heldout_size=4), \
        OrganismCorpus(seed=4, heldout_size=4)
    for task in TASKS:
        for split, index in (("test", 1), ("dev", 2), ("train", 11)):
            x, y, z = (k.example(task, 256, split, index) for k in (a, b, c))
            assert x == y and x.content_hash == y.content_hash
            assert x.prompt != z.prompt
    assert build_example("vt", 300, 7) == build_example("vt", 300, 7)
    assert build_example("vt", 300, 7).prompt != build_example("vt", 300, 8).prompt


# -- splits --------------------------------------------------------------------------------------------


def test_splits_are_disjoint_by_content_hash(corpus):
    for task in TASKS:
        for length in (256, 512):
            test = {corpus.example(task, length, "test", i).content_hash for i in range(corpus.heldout_size)}
            dev = {corpus.example(task, length, "dev", i).content_hash for i in range(corpus.heldout_size)}
            train = {corpus.example(task, length, "train", i).content_hash for i in range(24)}
            assert len(test) == len(dev) == corpus.heldout_size
            assert not (test & dev) and not (test & train) and not (dev & train)
            assert corpus.split_hashes("test", task, length) == test


def test_held_out_indices_are_bounded(corpus):
    with pytest.raises(IndexError):
        corpus.example("qa_1", 256, "test", corpus.heldout_size)
    with pytest.raises(ValueError):
        corpus.example("qa_1", 256, "test", 0, min_gap=8)  # held-out splits always use the window gap


def test_colliding_examples_are_rejected_deterministically():
    def rigged():
        corpus = OrganismCorpus(seed=1, heldout_size=4)
        fresh = corpus.example("niah_single_2", 256, "train", 5)
        # Pretend the test split holds this exact example, as a real collision would.
        corpus._hashes[("test", "niah_single_2", 256)] = frozenset({fresh.content_hash})
        corpus._hashes[("dev", "niah_single_2", 256)] = frozenset()
        return fresh, corpus.example("niah_single_2", 256, "train", 5)

    fresh, redrawn = rigged()
    assert fresh.attempt == 0 and redrawn.attempt == 1 and redrawn.content_hash != fresh.content_hash
    assert rigged()[1] == redrawn
    # dev rejects test hashes the same way.
    corpus = OrganismCorpus(seed=1, heldout_size=4)
    first_dev = build_example("qa_2", 256, C._derive_seed(1, "dev", "qa_2", 256, W, 0, 0), split="dev")
    corpus._hashes[("test", "qa_2", 256)] = frozenset({first_dev.content_hash})
    assert corpus.example("qa_2", 256, "dev", 0).attempt == 1


# -- placement and validity ----------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_task_examples_are_valid(corpus, task):
    for length in LENGTHS:
        for index in range(3):
            ex = corpus.example(task, length, "test", index)
            words = ex.prompt.split()
            assert ex.length == length == len(words) + 1 == len(ex.prompt_ids()) == len(ex.prompt_kinds)
            assert C.UNK_ID not in ex.prompt_ids() + ex.target_ids()
            assert ex.prompt.endswith("answer :")
            # Needles are outside the Local window at every decoding step and outside the sinks.
            assert ex.needle_spans
            for start, end in ex.needle_spans:
                assert S <= start < end <= ex.question_start
                assert ex.question_start - (end - 1) >= W
            assert ex.min_needle_distance() >= W
            # The reference target scores 100; the answers live in the needles, not near the question.
            assert example_score(ex.target, ex.answers, ex.metric) == 1.0
            assert len(ex.target_kinds) == len(ex.target.split()) and ANSWER in ex.target_kinds
            needle_text = " ".join(" ".join(words[a - 1:b - 1]) for a, b in ex.needle_spans)
            recent = " ".join(words[-W:])
            for answer in ex.answers:
                assert answer in needle_text
                assert f" {answer} " not in f" {recent} "
            # Random payload is marked CONTENT, the needles carry some.
            assert any(ex.prompt_kinds[a] == CONTENT for a, b in ex.needle_spans for a in range(a, b))


def test_frequency_tasks_have_unique_answers(corpus):
    for length in LENGTHS:
        ex = corpus.example("cwe", length, "test", 0)
        (a, b), = ex.needle_spans
        counts = Counter(ex.prompt.split()[a - 1:b - 1])
        common = min(counts[w] for w in ex.answers)
        assert len(ex.answers) == 5 and all(c < common for w, c in counts.items() if w not in ex.answers)
        ex = corpus.example("fwe", length, "test", 0)
        (a, b), = ex.needle_spans
        ranked = [w for w, _ in Counter(ex.prompt.split()[a - 1:b - 1]).most_common()]
        counts = Counter(ex.prompt.split()[a - 1:b - 1])
        assert list(ex.answers) == ranked[:3]
        assert counts[ranked[2]] > counts[ranked[3]]


def test_multi_answer_tasks():
    ex = build_example("niah_multiquery", 512, 0)
    assert len(ex.answers) == 4 and len(ex.needle_spans) == 4
    ex = build_example("niah_multivalue", 512, 0)
    assert len(set(ex.answers)) == 4
    assert [ex.prompt.find(a) for a in ex.answers] == sorted(ex.prompt.find(a) for a in ex.answers)
    ex = build_example("vt", 512, 0)
    assert len(ex.answers) == 5 and ex.target.endswith(" ".join(ex.answers))
    ex = build_example("qa_2", 512, 0)
    assert len(ex.needle_spans) == 2 and ex.target.endswith(ex.answers[0])


def test_training_sequence_masks():
    ex = build_example("niah_multikey_2", 256, 0)
    seq = training_sequence(ex, filler_weight=0.25, content_weight=0.0)
    n_prompt, n = ex.length, len(seq.input_ids)
    assert n == n_prompt + len(ex.target.split()) + 1 and seq.input_ids[-1] == C.EOS_ID
    assert len(seq.labels) == len(seq.weights) == len(seq.retrieved) == n
    assert all(label == -100 for label in seq.labels[:n_prompt])
    assert seq.labels[n_prompt:] == seq.input_ids[n_prompt:]
    assert seq.weights[0] == 0.0 and set(seq.weights[1:n_prompt]) == {0.0, 0.25}
    assert all(w == 1.0 for w in seq.weights[n_prompt:])
    assert sum(seq.retrieved) == 3 and all(seq.labels[i] != -100 for i, r in enumerate(seq.retrieved) if r)


def test_copy_sequence_repeats_its_first_half():
    for length in (128, 129):
        seq = C.copy_sequence(7, length)
        n = seq.prompt_length
        assert len(seq.input_ids) == len(seq.labels) == len(seq.weights) == length and seq.input_ids[0] == C.BOS_ID
        assert seq.input_ids[n:] == seq.input_ids[1:1 + length - n] and C.UNK_ID not in seq.input_ids
        assert all(label == -100 for label in seq.labels[:n]) and seq.labels[n:] == seq.input_ids[n:]
    assert C.copy_sequence(7, 128) == C.copy_sequence(7, 128) != C.copy_sequence(8, 128)


def test_filler_is_in_vocabulary():
    text = C.filler_text(0, 500)
    assert len(text.split()) == 500 and C.UNK_ID not in C.encode_words(text)
    assert C.filler_text(0, 500) == text != C.filler_text(1, 500)


# -- tokenizer -----------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_autotokenizer(tmp_path, corpus):
    from transformers import AutoTokenizer

    from oda_hf.organism.tokenizer import save_tokenizer

    save_tokenizer(tmp_path / "a")
    save_tokenizer(tmp_path / "b")
    names = sorted(os.listdir(tmp_path / "a"))
    assert "tokenizer.json" in names and names == sorted(os.listdir(tmp_path / "b"))
    for name in names:  # deterministic files
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == len(C.VOCAB)
    for task in ("niah_multikey_3", "cwe", "qa_2"):
        ex = corpus.example(task, 256, "test", 0)
        ids = tok(ex.prompt)["input_ids"]
        assert ids == ex.prompt_ids()
        assert tok.decode(ids, skip_special_tokens=True) == ex.prompt
        assert tok.decode(ex.target_ids(), skip_special_tokens=True) == ex.target
    assert tok("zzzz the")["input_ids"] == [C.BOS_ID, C.UNK_ID, C.TOKEN_TO_ID["the"]]


# -- metrics -------------------------------------------------------------------------------------------


def test_string_match_metrics_hand_computed():
    preds = ["The answer is A1 and c", "nothing here", "X"]
    refs = [["a1", "C", "z"], ["y"], ["x", "w"]]
    # all: (2/3 + 0 + 1/2) / 3 ; part: (1 + 0 + 1) / 3
    assert string_match_all(preds, refs) == pytest.approx(100 * (2 / 3 + 0 + 0.5) / 3)
    assert string_match_part(preds, refs) == pytest.approx(100 * 2 / 3)
    assert example_score("  12 34 56\n", ["12 34 56"]) == 1.0
    assert example_score("12 34", ["12 34 56"]) == 0.0
    assert example_score("b", "b", "part") == 1.0
    assert task_score("qa_1", ["foo bar"], [["bar", "baz"]]) == 100.0
    assert task_score("niah_multivalue", ["foo bar"], [["bar", "baz"]]) == 50.0
    scores = score_by_task(["qa_1", "vt", "vt"], ["a", "a b", "c"], [["a"], ["a", "b"], ["d"]])
    assert scores == {"qa_1": 100.0, "vt": 50.0, "avg": 75.0}


# -- training plumbing ---------------------------------------------------------------------------------


def _tiny_cfg(**kw):
    from oda_hf.organism.train_backbone import Stage, TrainConfig

    return TrainConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, intermediate_size=64, max_steps=4, warmup_steps=2, save_every=1,
                       eval_every=1000, heldout_size=2, threads=1,
                       curriculum=[Stage(until=2, lengths=(128,), min_gap=16, batch_tokens=384, copy_fraction=0.34),
                                   Stage(until=10**9, lengths=(160,), batch_tokens=320, local_view=0.5)], **kw)


def test_batches_are_a_function_of_the_step():
    from oda_hf.organism.train_backbone import batch_examples

    cfg = _tiny_cfg()
    a = batch_examples(OrganismCorpus(heldout_size=2), cfg, 3)
    b = batch_examples(OrganismCorpus(heldout_size=2), cfg, 3)
    assert a == b and all(e.length == 160 for e in a)
    assert batch_examples(OrganismCorpus(heldout_size=2), cfg, 0)[0].length == 128
    cfg.curriculum[0].tasks = ("qa_1", "qa_2")
    assert {e.task for e in batch_examples(OrganismCorpus(heldout_size=2), cfg, 1)} <= {"qa_1", "qa_2"}


def test_consecutive_batches_share_no_example():
    """Each step draws fresh training examples: if step s + 1 reused examples of step s, the backbone would see the
    same prompts over and over and the run would learn from fewer distinct examples than it reports."""
    from oda_hf.organism.train_backbone import batch_examples

    cfg = _tiny_cfg()
    cfg.curriculum[1].tasks = ("niah_single_1",)  # one task: only the example index tells draws apart
    corpus = OrganismCorpus(heldout_size=2)
    batches = [[e.content_hash for e in batch_examples(corpus, cfg, step)] for step in (2, 3, 4)]
    assert all(len(batch) == 2 for batch in batches)
    assert len({h for batch in batches for h in batch}) == 6


def test_batch_sequences_mix_copy_drills_and_local_views():
    from oda_hf.organism.train_backbone import batch_sequences

    cfg = _tiny_cfg()
    seqs, local = batch_sequences(OrganismCorpus(heldout_size=2), cfg, 0)  # 3 sequences, 1 of them a drill
    assert [s.task for s in seqs][-1] == "copy" and sum(s.task == "copy" for s in seqs) == 1
    assert {len(s.input_ids) for s in seqs if s.task == "copy"} == {128} and not any(local)
    seqs, local = batch_sequences(OrganismCorpus(heldout_size=2), cfg, 3)  # 2 task examples, one Local view
    assert local == [True, False] and all(s.task != "copy" for s in seqs)


def test_local_view_mask_and_loss():
    from transformers import Qwen3ForCausalLM

    from oda_hf.organism.train_backbone import batch_losses, collate, local_view_attention_mask

    examples = [build_example("niah_single_1", 128, s, min_gap=16) for s in (0, 1)]
    batch = collate([training_sequence(e) for e in examples], local_view=[True, False])
    P = examples[0].length
    m = local_view_attention_mask(batch, sinks=2, window=8)["full_attention"][:, 0]
    assert m[0, P - 1, : P].all() and m[1, P + 3, : P + 4].all()  # prefill rows and Full rows: causal
    assert m[0, P + 3].tolist() == [j < 2 or P - 5 < j <= P + 3 for j in range(m.shape[-1])]  # 2 sinks + 8 recent
    # The first target token's row is Local too (it is decoded after the Full prefill, like every later one).
    assert m[0, P].tolist() == [j < 2 or P - 8 < j <= P for j in range(m.shape[-1])]
    assert m[1, P, : P + 1].all()  # ... in Local-view rows only

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_tiny_cfg().model_config()).eval()
    out = batch_losses(model, batch, 0.0, sinks=2, window=8)
    mask = local_view_attention_mask(batch, sinks=2, window=8)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    target = batch["labels"][:, 1:] != -100
    retrieved = batch["retrieved"][:, 1:].bool()
    keep = target.clone()
    keep[0] &= ~retrieved[0]  # the Local-view row is not asked to retrieve
    assert retrieved[0].sum() == 3 and keep.sum() == target.sum() - 3
    torch.testing.assert_close(out["answer_loss"], (ce * keep).sum() / keep.sum())


def test_local_mask_matches_definition():
    from oda_hf.organism.train_backbone import local_attention_mask

    m = local_attention_mask(10, sinks=2, window=3)["full_attention"][0, 0]
    assert m[9].tolist() == [True, True] + [False] * 5 + [True] * 3
    assert m[3].tolist() == [True] * 4 + [False] * 6
    assert m.sum(1).tolist() == [1, 2, 3, 4, 5, 5, 5, 5, 5, 5]


def test_train_resume_is_exact_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oda_hf.organism.train_backbone import CHECKPOINT_NAME, ORGANISM_FILE, load_checkpoint, train

    straight, paused = tmp_path / "straight", tmp_path / "paused"
    train(str(straight), _tiny_cfg(), progress=False)
    train(str(paused), _tiny_cfg(), progress=False, stop_at=2)
    assert os.path.exists(paused / CHECKPOINT_NAME) and not os.path.exists(paused / ORGANISM_FILE)
    train(str(paused), _tiny_cfg(), resume=True, progress=False)
    (a, a_tensors), (b, b_tensors) = load_checkpoint(str(straight / CHECKPOINT_NAME)), \
        load_checkpoint(str(paused / CHECKPOINT_NAME))
    assert a["step"] == b["step"] == 4 and a["train_digest"] == b["train_digest"]
    assert a["python_rng"] == b["python_rng"] and a["scheduler"] == b["scheduler"]
    assert set(a_tensors) == set(b_tensors) and any(k.startswith("optimizer/") for k in a_tensors)
    for k in a_tensors:  # model, optimizer moments and the torch RNG state
        assert torch.equal(a_tensors[k], b_tensors[k]), k
    model = AutoModelForCausalLM.from_pretrained(str(paused))
    tok = AutoTokenizer.from_pretrained(str(paused))
    assert model.config.vocab_size == len(tok) and os.path.exists(paused / "generation_config.json")
    with pytest.raises(ValueError):
        train(str(paused), _tiny_cfg(lr=1e-4), resume=True, progress=False)


class _Payload:
    """Unpickling this runs code (creates a file): a planted checkpoint must never be unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_never_unpickles_a_planted_checkpoint(tmp_path):
    import pickle

    from oda_hf.organism.train_backbone import LEGACY_CHECKPOINT_NAME, train

    out, marker = tmp_path / "run", tmp_path / "payload-ran"
    out.mkdir()
    (out / LEGACY_CHECKPOINT_NAME).write_bytes(pickle.dumps({"model": _Payload(str(marker))}))
    with pytest.raises(ValueError, match="pickle checkpoint of an older oda_hf. It is not loaded"):
        train(str(out), _tiny_cfg(), resume=True, progress=False)
    assert not marker.exists()
    # A pickle under the new checkpoint name is not a safetensors file: refused, not executed.
    from oda_hf.organism.train_backbone import CHECKPOINT_NAME

    (out / CHECKPOINT_NAME).write_bytes(pickle.dumps({"model": _Payload(str(marker))}))
    with pytest.raises(ValueError, match="is not a readable safetensors checkpoint"):
        train(str(out), _tiny_cfg(), resume=True, progress=False)
    assert not marker.exists()


def test_train_backbone_command_takes_the_seed_of_its_config_unless_given(tmp_path, monkeypatch):
    """`--config` with a seed trains with that seed; `--seed` overrides it; neither gives 0."""
    import oda_hf.organism.train_backbone as tb

    seen = []
    monkeypatch.setattr(tb, "train", lambda output, cfg, **kwargs: seen.append(cfg.seed))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"seed": 5}))
    tb.main(["--output", str(tmp_path / "a"), "--config", str(config)])
    tb.main(["--output", str(tmp_path / "b"), "--config", str(config), "--seed", "7"])
    tb.main(["--output", str(tmp_path / "c")])
    assert seen == [5, 7, 0]


def test_head_data_is_training_split_only_at_every_head_length(tmp_path, monkeypatch):
    """The recall head is trained on training-split prompts of 256-1024 tokens: a held-out dev or test prompt in its
    data would inflate the organism's scores, and a missing length would leave the head untrained where it routes."""
    import hashlib

    import oda_hf.organism.train_head as th
    from oda_hf.organism.corpus import BOS_ID, EOS_ID, VOCAB, example_hash

    corpora = []

    def small_corpus(seed, window):  # held-out splits of 8 (not 100) per task and length: fast, same rule
        corpora.append(OrganismCorpus(seed=seed, window=window, heldout_size=8))
        return corpora[-1]

    monkeypatch.setattr(th, "OrganismCorpus", small_corpus)
    sha = th.write_head_data(str(tmp_path / "train.jsonl"), seed=0, per_task_and_length=1)
    text = (tmp_path / "train.jsonl").read_text()
    assert sha == hashlib.sha256(text.encode()).hexdigest()
    (corpus,) = corpora
    held_out = {h for split in ("test", "dev") for task in TASKS for length in (256, 512, 768, 1024)
                for h in corpus.split_hashes(split, task, length)}
    assert len(held_out) == 2 * len(TASKS) * 4 * 8
    lengths = Counter()
    for line in text.splitlines():
        row = json.loads(line)
        prompt_ids = [i for i, label in zip(row["input_ids"], row["labels"]) if label == -100]
        target_ids = [i for i, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert prompt_ids[0] == BOS_ID and target_ids[-1] == EOS_ID
        prompt, target = (" ".join(VOCAB[i] for i in ids) for ids in (prompt_ids[1:], target_ids[:-1]))
        assert example_hash(prompt, target) not in held_out
        lengths[len(prompt_ids)] += 1
    assert lengths == {length: len(TASKS) for length in (256, 512, 768, 1024)}  # every task fits every length
