"""The offline RULER generator: determinism, exact lengths, depths, split disjointness, task
definitions, metrics on hand-made cases and bad inputs. A tiny word-level tokenizer with a simple
chat template stands in for a real one (one token per word or punctuation run)."""

import json
import lzma
import re
import shutil
from collections import Counter

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from oda_hf.cli import main
from oda_hf.evaluation import haystacks, ruler_synth
from oda_hf.evaluation.metrics import score_example, string_match_all, string_match_part
from oda_hf.evaluation.runner import encode_prompt
from oda_hf.evaluation.suites import load_examples

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
NIAH = [t for t in ruler_synth.TASK_NAMES if t.startswith("niah")]


def tiny_tokenizer(chat_template=True):
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def suite(tok):
    return ruler_synth.generate_suite(tok, lengths=[1024, 2048], split="test", n=3, haystack="kjv", seed=0)


def haystack_sentence(example):
    """A long sentence of a prose haystack that is not a needle."""
    sentences = [s for s in re.split(r"(?<=[.!?]) ", example.prompt.split("\n")[1])
                 if len(s.split()) >= 8 and "special magic" not in s]
    assert sentences, example.id
    return sentences[0]


def by_task(examples):
    out = {}
    for example in examples:
        out.setdefault(example.task, []).append(example)
    return out


def test_all_eleven_tasks_with_ruler_caps_and_metrics(suite):
    tasks = by_task(suite)
    assert sorted(tasks) == sorted(ruler_synth.TASK_NAMES) and len(tasks) == 11
    caps = {"vt": 30, "cwe": 120, "fwe": 50}
    for example in suite:
        assert example.max_new_tokens == caps.get(example.task, 128)
        assert example.metric == "string_match_all"
        assert example.meta["split"] == "test" and example.meta["chat_template"] is True
        assert example.meta["generator"] == ruler_synth.GENERATOR
    assert len({e.id for e in suite}) == len(suite) == 11 * 2 * 3


#: RULER's scripts/synthetic.yaml, spelled out: (task class, its fields in order).
RULER_TABLE = {
    "niah_single_1": ("NiahTask", "noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("NiahTask", "essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("NiahTask", "essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("NiahTask", "essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("NiahTask", "needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("NiahTask", "needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("NiahTask", "essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("NiahTask", "essay", "words", "numbers", 1, 1, 4),
    "vt": ("VariableTrackingTask", 1, 4),
    "cwe": ("CommonWordsTask", 30, 3, 10),
    "fwe": ("FrequentWordsTask", 2.0, 6),
}
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def test_task_table_is_rulers(tok):
    """Found by a mutation audit: the tests read their expectations back from TASKS, so a wrong entry (multikey_1
    with 2 keys, cwe repeating 20 times, multikey_3 with word keys, single_1 in prose) passed."""
    import dataclasses

    assert {task: (type(spec).__name__, *dataclasses.astuple(spec)) for task, spec in ruler_synth.TASKS.items()} \
        == RULER_TABLE
    examples = {e.task: e for e in ruler_synth.generate_suite(
        tok, tasks=["niah_single_1", "niah_multikey_1", "niah_multikey_3"], lengths=[1024], n=1, haystack="kjv")}
    assert len(re.findall(r"One of the special magic numbers for ", examples["niah_multikey_1"].prompt)) == 4
    single_1 = examples["niah_single_1"]
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    lines = [line for line in single_1.prompt.split("\n")[1:-1] if "special magic" not in line]
    assert single_1.meta["haystack"] == "noise" and len(lines) > 20 and all(noise.startswith(x) for x in lines)
    keys = re.findall(r"One of the special magic uuids for (\S+) is: (\S+)\.", examples["niah_multikey_3"].prompt)
    assert len(keys) > 10 and all(UUID.fullmatch(k) and UUID.fullmatch(v) for k, v in keys)


def test_same_arguments_give_identical_examples_and_other_seeds_differ(tok, suite):
    again = ruler_synth.generate_suite(tok, lengths=[1024, 2048], split="test", n=3, haystack="kjv", seed=0)
    assert [e.to_dict() for e in again] == [e.to_dict() for e in suite]
    other = ruler_synth.generate_suite(tok, tasks=["niah_single_2", "vt"], lengths=[1024], n=3, seed=1)
    same_seed = [e for e in suite if e.task in ("niah_single_2", "vt") and e.meta["length"] == 1024]
    assert all(a.answers != b.answers and a.prompt != b.prompt for a, b in zip(other, same_seed))


def test_every_length_draws_its_own_needles(tok):
    """Found by a mutation audit: nothing failed with the length left out of a prompt's seed (every length reused
    the same keys and values)."""
    examples = ruler_synth.generate_suite(tok, tasks=["niah_single_1"], lengths=[512, 600], n=2)
    for short, long in zip(examples[:2], examples[2:]):
        assert short.meta["index"] == long.meta["index"] and short.meta["example_seed"] != long.meta["example_seed"]
        assert short.answers != long.answers


@pytest.mark.parametrize("chat_template", [True, False])
def test_prompt_lengths_within_two_percent_as_eval_encodes_them(chat_template):
    tok = tiny_tokenizer()
    examples = ruler_synth.generate_suite(tok, lengths=[700, 1500, 3000], n=2, haystack="noise",
                                          chat_template=chat_template)
    for example in examples:
        measured = len(encode_prompt(example, tok, chat_template=chat_template))
        assert measured == example.meta["tokens"]
        assert abs(measured - example.meta["length"]) <= 0.02 * example.meta["length"], example.id


def test_distractor_draws_are_tried_when_their_token_counts_differ():
    """Found by a mutation audit: with the suite's word-level tokenizer every UUID distractor has the same count, so
    nothing failed with the filler variants all alike or never tried; digits split one by one tell them apart."""
    tok = tiny_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    examples = ruler_synth.generate_suite(tok, tasks=["niah_multikey_3"], lengths=[1500], n=3, tolerance=0.05)
    assert any(e.meta["filler_variant"] for e in examples)
    assert all(abs(e.meta["tokens"] - 1500) <= 0.015 * 1500 for e in examples), [e.meta["tokens"] for e in examples]


def test_lengths_with_the_prose_haystack(suite, tok):
    for example in suite:
        measured = len(encode_prompt(example, tok, chat_template=True))
        assert measured == example.meta["tokens"]
        assert abs(measured - example.meta["length"]) <= 0.02 * example.meta["length"], example.id


def test_needle_depths_spread_over_the_context(tok):
    examples = ruler_synth.generate_suite(tok, tasks=["niah_single_1", "niah_single_2", "niah_multikey_2"],
                                          lengths=[2048], n=5)
    for task, group in by_task(examples).items():
        assert [e.meta["depth"] for e in group] == [0, 25, 50, 75, 100]
        # Where the needle really is: its share of the haystack, between the instruction and the question.
        shares = []
        for example in group:
            needle = f"is: {example.answers[0]}."
            first, last = example.prompt.index("\n") + 1, example.prompt.rindex("\n")
            shares.append((example.prompt.index(needle) - first) / (last - first))
        assert shares == sorted(shares), (task, shares)
        assert shares[0] < 0.05 and shares[-1] > 0.93 and abs(shares[2] - 0.5) < 0.08, (task, shares)
    # --limit takes prompts spread over the suite's order: the first 3 would hold only the shallow needles
    from oda_hf.evaluation.suites import select_examples

    assert [e.meta["depth"] for e in select_examples(examples, ["niah_single_2"], 3)] == [0, 50, 100]


def test_splits_are_disjoint_in_seeds_needles_and_haystack_text(tok):
    splits = {split: ruler_synth.generate_suite(tok, lengths=[1024], split=split, n=4, haystack="kjv")
              for split in haystacks.SPLITS}
    seeds = [e.meta["example_seed"] for examples in splits.values() for e in examples]
    assert len(set(seeds)) == len(seeds)
    # Needle values and variable names never repeat across splits (cwe/fwe draw from small word
    # pools, so single words may; their answer lists still differ).
    answers = {split: {a for e in examples for a in e.answers if e.task not in ("cwe", "fwe")}
               for split, examples in splits.items()}
    assert not answers["train"] & answers["test"] and not answers["train"] & answers["dev"]
    assert not answers["dev"] & answers["test"]
    lists = [tuple(e.answers) for examples in splits.values() for e in examples]
    assert len(set(lists)) == len(lists)
    texts = {split: " ".join(haystacks.prose_words("kjv", split)) for split in haystacks.SPLITS}
    for split, examples in splits.items():
        for example in examples:
            if example.meta["haystack"] != "kjv":
                continue
            # A stretch of the haystack (a sentence away from the needles) comes from its own split only.
            owners = [other for other, text in texts.items() if haystack_sentence(example) in text]
            assert owners == [split], (example.id, owners)


def test_essay_tasks_use_the_haystack_asked_for(tok):
    """Found by a mutation audit: nothing failed when the essay tasks ignored `haystack` (noise for all), since the
    split test skips every example whose meta does not say kjv."""
    text = " ".join(haystacks.prose_words("kjv", "test"))
    essay = ["niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"]
    examples = ruler_synth.generate_suite(tok, tasks=essay, lengths=[512], n=1, haystack="kjv")
    assert [e.task for e in examples] == essay
    for example in examples:
        assert example.meta["haystack"] == "kjv" and haystack_sentence(example) in text, example.id
        assert "The grass is green." not in example.prompt


def test_a_prose_haystack_opens_at_a_sentence_start(tok):
    """Found by a mutation audit: nothing failed when a prose haystack started at any word, mid-sentence."""
    words = haystacks.prose_words("kjv", "test")
    for example in ruler_synth.generate_suite(tok, tasks=["niah_single_2"], lengths=[512], n=4, haystack="kjv"):
        start = example.meta["haystack_start_word"]
        assert start == 0 or words[start - 1].endswith((".", "!", "?")), (example.id, words[start - 1])
        prose = re.sub(r"One of the special magic numbers for \S+ is: \d+\. ?", "", example.prompt.split("\n")[1])
        assert prose.startswith(" ".join(words[start:start + 3]))


def test_kjv_text_is_checked_and_split_by_testament():
    verses = haystacks.kjv_verses()
    assert len(verses) == 31102 and verses[0][1].startswith("In the beginning God created")
    books = [book for book, _ in verses]
    assert sorted(set(books)) == sorted(sum(haystacks.KJV_SPLIT_BOOKS.values(), ()))
    split_books = [set(b) for b in haystacks.KJV_SPLIT_BOOKS.values()]
    assert sum(len(b) for b in split_books) == len(set().union(*split_books)) == 66
    sizes = {split: len(haystacks.prose_words("kjv", split)) for split in haystacks.SPLITS}
    assert sizes["train"] > 500_000 and sizes["test"] > 100_000 and sizes["dev"] > 70_000


def test_niah_needles_and_queries_follow_ruler(suite):
    for example in (e for e in suite if e.task.startswith("niah")):
        spec = ruler_synth.TASKS[example.task]
        kind = spec.value_type
        needles = re.findall(rf"One of the special magic {kind} for (\S+) is: (\S+)\.", example.prompt)
        values = {value for _, value in needles}
        assert set(example.answers) <= values, example.id
        assert len(example.answers) == spec.num_values * spec.num_queries
        single = len(example.answers) == 1
        head = "A special magic" if single else "Some special magic"
        assert example.prompt.startswith(f"{head} {kind[:-1] if single else kind} ")
        assert example.answer_prefix.endswith(" is" if single else " are")
        queried = [key for key, value in needles if value in example.answers]
        for key in queried:
            assert key in example.answer_prefix and key in example.prompt.rsplit("\n", 1)[1]
        if spec.haystack == "needle":  # distractors: many needles, only the queried one answers
            assert len(needles) > 10 and len({k for k, _ in needles}) == len(needles)
        else:
            assert len(needles) == max(spec.num_keys, spec.num_queries) * spec.num_values
        if kind == "numbers":
            assert all(re.fullmatch(r"\d{7}", a) for a in example.answers)
        depths = example.meta["needle_depths"]
        assert len(set(depths)) == len(depths) and example.meta["depth"] in depths


def test_niah_question_answer_prefix_and_single_depth_are_rulers(tok):
    """Found by a mutation audit: nothing failed with the queried keys joined without RULER's ", and", the answer
    prefix without its leading space, or the one prompt of n = 1 at depth 0 instead of 50."""
    examples = {e.task: e for e in ruler_synth.generate_suite(
        tok, tasks=["niah_single_2", "niah_multiquery"], lengths=[512], n=1, haystack="noise")}
    multiquery = examples["niah_multiquery"]
    needles = dict((v, k) for k, v in re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.",
                                                 multiquery.prompt))
    a, b, c, d = [needles[answer] for answer in multiquery.answers]
    query = f"{a}, {b}, {c}, and {d}"
    assert multiquery.prompt.rsplit("\n", 1)[1] == \
        f"What are all the special magic numbers for {query} mentioned in the provided text?"
    assert multiquery.answer_prefix == f" The special magic numbers for {query} mentioned in the provided text are"
    single = examples["niah_single_2"]
    (key,) = re.findall(r"One of the special magic numbers for (\S+) is: ", single.prompt)
    assert single.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert single.meta["depth"] == 50 and multiquery.meta["depth"] == 50


def test_distractor_needles_have_the_value_type(tok):
    """Found by a mutation audit: nothing failed when multikey_2's distractors got word values (the one number among
    them gives the answer away)."""
    examples = {e.task: e for e in ruler_synth.generate_suite(
        tok, tasks=["niah_multikey_2", "niah_multikey_3"], lengths=[1024], n=1)}
    numbers = re.findall(r"One of the special magic numbers for (\S+) is: (\S+)\.", examples["niah_multikey_2"].prompt)
    assert len(numbers) > 10 and all("-" in k and re.fullmatch(r"\d{7}", v) for k, v in numbers)
    uuids = re.findall(r"One of the special magic uuids for (\S+) is: (\S+)\.", examples["niah_multikey_3"].prompt)
    assert len(uuids) > 10 and all(UUID.fullmatch(k) and UUID.fullmatch(v) for k, v in uuids)


def test_needle_keys_never_repeat_even_from_a_small_word_list(monkeypatch):
    """Found by a mutation audit: with the real word lists a repeated key is rare, and nothing failed when drawn keys
    were not set aside or distractors could repeat the queried key; 3 x 3 words (9 keys) force a repeat there."""
    monkeypatch.setitem(ruler_synth._WORDS, "adjectives", ("red", "big", "old"))
    monkeypatch.setitem(ruler_synth._WORDS, "nouns", ("cat", "dog", "hat"))
    for task, size in (("niah_multikey_2", 8), ("niah_multikey_1", 50)):
        for seed in range(20):
            ctx = ruler_synth._Context(task, "test", 1024, 0, 1, "noise", seed)
            build, _, _ = ruler_synth._niah(ruler_synth.TASKS[task], ctx)
            keys = [k for k, _ in re.findall(r"magic numbers for (\S+) is: (\S+)\.", build(size).prompt)]
            assert len(keys) == (9 if task == "niah_multikey_2" else 4) and len(set(keys)) == len(keys), (task, keys)


def test_vt_chain_is_in_the_prompt(suite):
    for example in by_task(suite)["vt"]:
        names = example.answers
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        value = re.search(r"assigned the value (\d{5}) in the text above\.$", example.prompt).group(1)
        main_prompt = example.prompt.split("\n\nMemorize and track")[1]  # after the solved example
        lines = main_prompt.split("\n")
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(4)]
        positions = [lines.index(line) for line in chain]
        assert positions == sorted(positions)
        assert f"5 variables are assigned the value {value}, they are: " in example.answer_prefix
        # The solved example in front answers its own chain of 3-letter names.
        assert re.search(r"they are: [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}\n", example.prompt)


def test_vt_example_answers_its_chain_in_order(tok):
    """Found by a mutation audit: nothing failed when the solved example listed its chain's variables reversed."""
    example = ruler_synth.generate_suite(tok, tasks=["vt"], lengths=[1024], n=1)[0]
    solved = example.prompt.split("\n\nMemorize and track")[0]
    chain = re.findall(r"VAR ([A-Z]{3}) = ", solved)
    assert len(chain) == 5
    assert solved.rsplit("they are: ", 1)[1].split() == chain


def test_cwe_common_words_are_the_most_frequent(suite):
    for example in by_task(suite)["cwe"]:
        main_list = example.prompt.rsplit("Memorize the ones that appear most often.\n", 1)[1].split("\nQuestion")[0]
        counts = Counter(re.findall(r"\d+\. (\S+)", main_list))
        small = example.meta["length"] + 120 < 4096
        common, uncommon = (6, 1) if small else (30, 3)
        assert sorted(example.answers) == sorted(w for w, c in counts.items() if c == common)
        assert all(c == uncommon for w, c in counts.items() if w not in example.answers)
        assert example.prompt.count("Question: What are the 10 most common words in the above list?") == 2


@pytest.mark.parametrize("length, setting", [(3975, "small"), (3976, "large"), (4096, "large")])
def test_cwe_setting_switches_where_rulers_does(tok, length, setting):
    """Found by a mutation audit: no test generated cwe's large setting (prompt + 120-token cap >= 4096), so nothing
    failed with the switch moved, 20 repeats instead of 30, or a 20-word solved example at large lengths."""
    example = ruler_synth.generate_suite(tok, tasks=["cwe"], lengths=[length], n=1)[0]
    assert example.meta["setting"] == setting
    solved, main_list = example.prompt.split("\nBelow is a numbered list", 1)
    solved_list, solved_answer = solved.split("Answer: The top 10 words that appear most often in the list are: ")
    listed = re.findall(r"\d+\. (\S+)", solved_list)
    answer = re.findall(r"\d+\. (\S+)", solved_answer)
    counts, main_counts = Counter(listed), Counter(re.findall(r"\d+\. (\S+)", main_list))
    (common, uncommon), (example_common, example_uncommon), words = \
        ((6, 1), (3, 1), 20) if setting == "small" else ((30, 3), (10, 3), 40)
    assert sorted(set(main_counts.values())) == [uncommon, common]
    assert sorted(w for w, c in main_counts.items() if c == common) == sorted(example.answers)
    # the solved example: its stated answer words repeat most, and the list is shuffled
    assert len(counts) == words and len(answer) == 10
    assert [counts[w] for w in answer] == [example_common] * 10
    assert all(c == example_uncommon for w, c in counts.items() if w not in answer)
    positions = [i for i, w in enumerate(listed) if w in answer]
    assert max(positions) >= 10 * example_common and listed[:10] != answer


def test_cwe_list_is_shuffled(tok):
    """Found by a mutation audit: nothing failed with the numbered list unshuffled (the answer words first)."""
    example = ruler_synth.generate_suite(tok, tasks=["cwe"], lengths=[1024], n=1)[0]
    main_list = example.prompt.rsplit("Memorize the ones that appear most often.\n", 1)[1].split("\nQuestion")[0]
    listed = re.findall(r"\d+\. (\S+)", main_list)
    positions = [i / (len(listed) - 1) for i, w in enumerate(listed) if w in example.answers]
    assert len(positions) == 60 and abs(sum(positions) / len(positions) - 0.5) < 0.1


def test_fwe_answers_are_the_three_most_frequent_coded_words(suite):
    for example in by_task(suite)["fwe"]:
        text = example.prompt.split("coded words. ", 1)[1].split("\nQuestion")[0]
        ranked = [w for w, _ in Counter(text.split()).most_common()]
        assert ranked[0] == "..." and ranked[1:4] == example.answers
        counts = Counter(text.split())
        assert counts[example.answers[0]] > counts[example.answers[1]] > counts[example.answers[2]] > counts[ranked[4]]


def test_fwe_text_is_shuffled_over_rulers_vocabulary(tok):
    """Found by a mutation audit: nothing failed with the coded text unshuffled (the words in rank order) or with a
    vocabulary of length // 500 words (RULER: max(length // 50, 8))."""
    example = ruler_synth.generate_suite(tok, tasks=["fwe"], lengths=[1024], n=1)[0]
    text = example.prompt.split("coded words. ", 1)[1].split("\nQuestion")[0].split()
    assert len(set(text)) == max(1024 // 50, 8) == 20
    for words in (["..."], example.answers):
        positions = [i / (len(text) - 1) for i, w in enumerate(text) if w in words]
        assert len(positions) > 100 and abs(sum(positions) / len(positions) - 0.5) < 0.1, words


def test_ruler_metrics_on_hand_made_cases():
    assert string_match_all(" 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("only 1234567", ["1234567", "7654321", "1111111", "2222222"]) == 0.25
    assert string_match_all("  ABCDE\x00bcdef ", ["abcde", "BCDEF", "XYZZY"]) == pytest.approx(2 / 3)
    assert string_match_all("nothing", ["1234567"]) == 0.0
    assert string_match_part("the answer is Paris", ["London", "paris"]) == 1.0
    assert string_match_part("the answer is Rome", ["London", "paris"]) == 0.0


def test_generated_records_score_as_ruler_would(suite):
    for example in suite:
        full = " " + ", ".join(example.answers) + "."
        assert score_example(example.metric, full, example.answers) == 1.0
        if len(example.answers) > 1:
            partial = " ".join(example.answers[1:])
            expected = (len(example.answers) - 1) / len(example.answers)
            assert score_example(example.metric, partial, example.answers) == pytest.approx(expected)


def test_written_suite_loads_back_for_oda_eval(tmp_path, suite):
    paths = ruler_synth.write_suite(suite, tmp_path, manifest={"tokenizer": "tiny"})
    assert sorted(p.split("/")[-2] for p in paths) == ["1024"] * 11 + ["2048"] * 11
    loaded = load_examples(tmp_path / "2048" / "vt.jsonl")
    original = [e for e in suite if e.task == "vt" and e.meta["length"] == 2048]
    assert [e.to_dict() for e in loaded] == [e.to_dict() for e in original]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["examples"] == len(suite) and manifest["max_length_deviation"] <= 0.02


def test_cli_writes_a_suite(tmp_path, capsys):
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    out = tmp_path / "suite"
    assert main(["ruler", "--tokenizer", str(tmp_path / "tok"), "--lengths", "1024", "--n", "2", "--tasks",
                 "niah_single_1", "vt", "--max-positions", "2048", "--out", str(out), "--no-progress"]) == 0
    examples = load_examples(out / "1024" / "niah_single_1.jsonl")
    assert [e.meta["depth"] for e in examples] == [0, 100]
    assert main(["ruler", "--tokenizer", str(tmp_path / "tok"), "--lengths", "1024", "--tasks", "niah_single_4",
                 "--out", str(out), "--no-progress"]) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("oda ruler: error:") and "valid tasks: niah_single_1" in last_line


def test_manifest_names_a_known_base_by_its_short_name(tmp_path, monkeypatch):
    """`--tokenizer NAME` resolves to a folder on this machine; the manifest records the name, not the folder."""
    import oda_hf.known_models as known_models

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    folder = str(tmp_path / "tok")
    monkeypatch.setattr(known_models, "short_name_of", lambda path: "tiny-base" if path == folder else None)
    assert main(["ruler", "--tokenizer", folder, "--lengths", "1024", "--n", "1", "--tasks", "vt", "--max-positions",
                 "2048", "--out", str(tmp_path / "suite"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "suite" / "manifest.json").read_text())["tokenizer"] == "tiny-base"


def test_a_prompt_written_past_its_length_still_fits_the_context(tok):
    """The nominal length passed the context check while the written prompt (up to `tolerance` longer) did not:
    prompt + output cap past max_position_embeddings, exit 0."""
    cap = ruler_synth.ruler_max_new_tokens("vt")
    over = next((ex for length in range(1000, 1040)
                 for ex in ruler_synth.generate_suite(tok, tasks=["vt"], lengths=[length], n=1, progress=False)
                 if ex.meta["tokens"] > length), None)
    assert over is not None, "no prompt longer than its length: the case below would not be exercised"
    length, tokens = over.meta["length"], over.meta["tokens"]
    with pytest.raises(ValueError, match=f"the prompt has {tokens} tokens.*max_position_embeddings={length + cap}"):
        ruler_synth.generate_suite(tok, tasks=["vt"], lengths=[length], n=1, progress=False,
                                   max_position_embeddings=length + cap)
    assert ruler_synth.generate_suite(tok, tasks=["vt"], lengths=[length], n=1, progress=False,
                                      max_position_embeddings=tokens + cap)[0].meta["tokens"] == tokens


def test_bad_inputs_have_clear_errors(tok):
    with pytest.raises(ValueError, match=r"max_position_embeddings=2048.*longest usable length for niah_single_1 is 1920"):
        ruler_synth.generate_suite(tok, tasks=["niah_single_1"], lengths=[2000], max_position_embeddings=2048)
    with pytest.raises(ValueError, match="valid tasks: niah_single_1, .*, fwe"):
        ruler_synth.generate_suite(tok, tasks=["niah_single_9"], lengths=[1024])
    with pytest.raises(ValueError, match="SQuAD/HotpotQA"):
        ruler_synth.generate_suite(tok, tasks=["qa_1"], lengths=[1024])
    with pytest.raises(ValueError, match="vt needs at least .* too small"):
        ruler_synth.generate_suite(tok, tasks=["vt"], lengths=[100])
    with pytest.raises(ValueError, match="Unknown split"):
        ruler_synth.generate_suite(tok, lengths=[1024], split="validation")
    with pytest.raises(ValueError, match="Unknown haystack"):
        ruler_synth.generate_suite(tok, lengths=[1024], haystack="essay")
    with pytest.raises(ValueError, match="no chat template"):
        ruler_synth.generate_suite(tiny_tokenizer(chat_template=False), lengths=[1024])
    with pytest.raises(ValueError, match="positive integer"):
        ruler_synth.generate_suite(tok, lengths=[1024], n=0)


def test_a_length_folder_loads_as_one_suite(tmp_path, suite):
    ruler_synth.write_suite(suite, tmp_path)
    loaded = load_examples(tmp_path / "1024")
    assert sorted(e.id for e in loaded) == sorted(e.id for e in suite if e.meta["length"] == 1024)
    # the folder of every length: each task would average its 1,024- and 2,048-token prompts into one score
    with pytest.raises(ValueError, match=r"holds prompts of several lengths \(1024, 2048; 11 task\(s\) so\)"):
        load_examples(tmp_path)
    from oda_hf.evaluation.suites import select_examples   # as `oda eval --data A B` joins its paths
    with pytest.raises(ValueError, match="several lengths"):
        select_examples(loaded + load_examples(tmp_path / "2048"), None, None)


def test_kjv_export_names_the_debian_packages_when_the_program_is_missing():
    with pytest.raises(FileNotFoundError, match="apt-get install bible-kjv bible-kjv-text"):
        haystacks.export_kjv(program="no-such-bible-program")


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed")
def test_kjv_export_reproduces_the_shipped_text(tmp_path):
    text = haystacks.export_kjv(tmp_path / "kjv.txt.xz")
    with lzma.open(tmp_path / "kjv.txt.xz", "rt", encoding="utf-8") as f:
        assert f.read() == text
    assert len(text.splitlines()) == len(haystacks.kjv_verses())


def test_python_docs_haystack_names_the_debian_package_when_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(haystacks, "PYTHON_DOCS_GLOB", str(tmp_path / "python3.*" / "html"))
    with pytest.raises(FileNotFoundError, match=r"apt-get install python3\.11-doc"):
        haystacks.python_docs_root()


def test_python_docs_root_picks_the_newest_version(monkeypatch, tmp_path):
    for version in ("3.9", "3.11", "3.10"):
        (tmp_path / f"python{version}" / "html").mkdir(parents=True)
    monkeypatch.setattr(haystacks, "PYTHON_DOCS_GLOB", str(tmp_path / "python3.*" / "html"))
    assert haystacks.python_docs_root() == str(tmp_path / "python3.11" / "html")


def test_python_docs_prose_leaves_out_code_and_keeps_splits_apart(monkeypatch, tmp_path):
    """Found by a mutation audit: the python-docs text was only tested with python3.X-doc installed (not in CI), and
    nothing failed with <pre> code kept as prose or the tutorial in both dev and test. A small fake tree here."""
    html = tmp_path / "python3.12" / "html"
    for section in ("tutorial", "howto", "library"):
        (html / section).mkdir(parents=True)
        (html / section / "index.html").write_text(
            f"<html><body><p>{section} prose {section}1 {section}2 {section}3 {section}4."
            "<pre>import os; secret_code = 1 + 2 + 3</pre></p><p>Too short to be prose.</p></body></html>")
    monkeypatch.setattr(haystacks, "PYTHON_DOCS_GLOB", str(tmp_path / "python3.*" / "html"))
    haystacks.prose_words.cache_clear()  # cached by (haystack, split): another test's docs must not answer
    try:
        words = {split: haystacks.prose_words("python-docs", split) for split in haystacks.SPLITS}
    finally:
        haystacks.prose_words.cache_clear()
    assert words["test"] == ("tutorial", "prose", "tutorial1", "tutorial2", "tutorial3", "tutorial4.")
    assert words["dev"] == ("howto", "prose", "howto1", "howto2", "howto3", "howto4.")
    assert set(words["dev"]) & set(words["test"]) == {"prose"}
    assert all("secret_code" not in w for split in words.values() for w in split)


@pytest.mark.skipif(not __import__("glob").glob(haystacks.PYTHON_DOCS_GLOB), reason="no python3.X-doc installed")
def test_python_docs_haystack_uses_its_split_sections(tok):
    examples = ruler_synth.generate_suite(tok, tasks=["niah_single_2"], lengths=[1024], n=2, haystack="python-docs")
    test_text = " ".join(haystacks.prose_words("python-docs", "test"))
    for example in examples:
        assert example.meta["haystack"] == "python-docs" and len(example.meta["haystack_sha256"]) == 64
        assert abs(example.meta["tokens"] - 1024) <= 0.02 * 1024
        assert haystack_sentence(example) in test_text
