"""Evaluation harness: metrics, suites, rates, the Random control, ranking statistics, the runner,
reports, trajectories and fixed-reference diagnostics (all on tiny models and files written here)."""

import argparse
import itertools
import hashlib
import json
import math
import os

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from oda_hf import OdaConfig, OdaForCausalLM, RandomPolicy, RecallHead, RecallHeadConfig
from oda_hf.evaluation import diagnostics, metrics, report, runner, stats, suites, trajectory
from oda_hf.evaluation.cli import add_cli
from oda_hf.cli_common import UsageError
from oda_hf.head import base_config_fingerprint, base_fingerprint
from reference import replay_logits
from tiny_models import VOCAB, tiny_model

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def word_tokenizer(words=None):
    """Word-level tokenizer: specials 0-3, then `words` (default w4..w96, the tiny models' vocabulary)."""
    words = list(words) if words is not None else [f"w{i}" for i in range(4, VOCAB)]
    vocab = {token: i for i, token in enumerate(SPECIAL + list(dict.fromkeys(words)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def oda_model(family="llama", sinks=2, window=4, seed=0):
    base = tiny_model(family)
    torch.manual_seed(seed)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    return OdaForCausalLM(base, head, OdaConfig(sinks=sinks, window=window, policy="head"))


def words(rng, n):
    return " ".join(f"w{int(i)}" for i in rng.integers(4, VOCAB, size=n))


# -- metrics ------------------------------------------------------------------------------------------


def test_ruler_string_match():
    prediction = "  The numbers are 123 and\x07 456. "
    assert metrics.string_match_all(prediction, ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert metrics.string_match_all("ABC", ["abc"]) == 1.0  # case-insensitive
    assert metrics.string_match_all("the key is abc", ["ABC"]) == 1.0   # both sides lowered
    assert metrics.string_match_part(prediction, ["789", "456"]) == 1.0
    assert metrics.string_match_part(prediction, ["789"]) == 0.0
    assert metrics.ruler_postprocess(" a\x07b ") == "a\nb"
    assert metrics.default_metric("qa_2") == "string_match_part"
    assert metrics.default_metric("niah_multivalue") == "string_match_all"


def test_ruler_metrics_count_every_reference_and_default_niah_names():
    """Found by a mutation audit: nothing failed with string_match_all dividing by the distinct references (a repeated
    one scored above its share) or with niah_* names outside RULER's list left without a default metric."""
    assert metrics.string_match_all("1234567", ["1234567", "1234567", "7654321"]) == pytest.approx(2 / 3)
    assert metrics.string_match_all("7654321", ["1234567", "1234567", "7654321"]) == pytest.approx(1 / 3)
    assert metrics.default_metric("niah_custom") == "string_match_all"
    assert metrics.default_metric("qa_custom") == "string_match_part"


def test_longbench_english_f1():
    # normalized prediction "eiffel tower paris" (3 tokens) vs "eiffel tower" (2): P = 2/3, R = 1.
    assert metrics.qa_f1_score("The Eiffel Tower, Paris!", "eiffel tower") == pytest.approx(0.8)
    assert metrics.qa_f1_score("an apple", "the banana") == 0.0
    # a multiset overlap: "paris" twice on both sides counts twice (P = R = 2/3), not once
    assert metrics.token_f1(["paris", "paris", "rome"], ["paris", "paris", "oslo"]) == pytest.approx(2 / 3)
    assert metrics.normalize_answer("A  Tale, of the Cities.") == "tale of cities"
    # the suite metric takes the best reference
    assert metrics.score_example("qa_f1_score", "paris", ["london", "Paris"]) == 1.0


def test_a_limit_spreads_the_examples_over_the_suite():
    """`--limit N` takes examples spread over the suite's order (needle depth grows along it), rounded to the
    nearest, and the middle one alone for N = 1 (a mutation audit: truncation and the first item passed)."""
    items = list(range(10))
    assert suites.spread_subset(items, 4) == [0, 3, 6, 9] and suites.spread_subset(items, 3) == [0, 5, 9]
    assert suites.spread_subset(items, 1) == [4] and suites.spread_subset(items[:3], 5) == [0, 1, 2]


def test_tasks_keep_only_those_tasks():
    """Found by a mutation audit: `select_examples` and `load_examples` dropped the `tasks=` filter (its unknown-task
    check kept), so `--tasks a` evaluated every task."""
    examples = [suites.EvalExample(id=f"{task}/{i}", task=task, answers=["w5"], max_new_tokens=4,
                                   metric="string_match_all", prompt="w9") for task in ("a", "b") for i in range(3)]
    assert [e.id for e in suites.select_examples(examples, ["a"], None)] == ["a/0", "a/1", "a/2"]
    assert [e.id for e in suites.select_examples(examples, ["a"], 2)] == ["a/0", "a/2"]
    loaded = suites.load_examples([e.to_dict() for e in examples], tasks=["a"])
    assert [e.id for e in loaded] == ["a/0", "a/1", "a/2"]


def test_longbench_chinese_f1():
    # Character level: 北 京 大 学 (the 。 is punctuation) vs 北 京: P = 1/2, R = 1.
    assert metrics.qa_f1_zh_score("北京大学。", "北京", segmentation="char") == pytest.approx(2 / 3)
    # 11 characters vs 4, all 4 shared: P = 4/11, R = 1.
    assert metrics.qa_f1_zh_score("我们今天去北京大学参观", "北京大学", segmentation="char") == pytest.approx(8 / 15)
    pytest.importorskip("jieba")
    # jieba: 我们 / 今天 / 去 / 北京大学 / 参观 vs 北京大学: P = 1/5, R = 1.
    assert metrics.qa_f1_zh_score("我们今天去北京大学参观", "北京大学", segmentation="jieba") == pytest.approx(1 / 3)


def test_rouge_l_as_the_rouge_package():
    # One sentence; distinct words {the, cat, sat, on, mat} vs {the, cat, is, on, mat}; LCS words {the, cat, on, mat}.
    assert metrics.rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-7)
    # Sentences split at "."; the union LCS over sentence pairs covers all four words: P = R = 1.
    assert metrics.rouge_score("a b. c d", "a c. b d") == pytest.approx(1.0, abs=1e-7)
    # Distinct words: hypothesis {a} (n = 1), reference {a, b} (m = 2), union LCS {a}: P = 1, R = 1/2.
    assert metrics.rouge_score("a a a", "a b") == pytest.approx(2 / 3, abs=1e-7)
    assert metrics.rouge_score("", "a b") == 0.0 and metrics.rouge_score("...", "a") == 0.0
    # text after the last "." is a sentence even when blank: rouge 1.0.1 gives 0.8571428522448981 (run beside it)
    assert metrics.rouge_score("the cat sat. ", "the cat sat") == pytest.approx(6 / 7, abs=1e-7)
    # Chinese, character level: 会议讨论预算 vs 讨论预算问题 share 讨论预算: P = R = 4/6.
    assert metrics.rouge_zh_score("会议讨论预算", "讨论预算问题", segmentation="char") == pytest.approx(2 / 3, abs=1e-7)
    pytest.importorskip("jieba")
    # jieba: 会议/讨论/预算 vs 讨论/预算/问题: P = R = 2/3.
    assert metrics.rouge_zh_score("会议讨论预算", "讨论预算问题", segmentation="jieba") == pytest.approx(2 / 3, abs=1e-7)


def test_retrieval_zh():
    assert metrics.retrieval_zh_score("答案是：段落3", "段落3") == 1.0
    assert metrics.retrieval_zh_score("段落3和段落13", "段落3") == 0.5
    assert metrics.retrieval_zh_score("不知道", "段落3") == 0.0
    with pytest.raises(ValueError, match="段落"):
        metrics.retrieval_zh_score("3", "paragraph 3")


# -- suites -------------------------------------------------------------------------------------------


def _write_jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def test_ruler_adapter(tmp_path):
    _write_jsonl(tmp_path / "niah_single_1" / "validation.jsonl", [
        {"index": 0, "input": "text one", "outputs": ["123"], "length": 10, "answer_prefix": " The answer is"},
        {"index": 1, "input": "text two", "outputs": ["456"], "length": 11}])
    _write_jsonl(tmp_path / "qa_2.jsonl", [{"index": 0, "input": "q", "outputs": ["x", "y"], "length": 3}])
    examples = suites.load_ruler(tmp_path)
    by_id = {e.id: e for e in examples}
    assert sorted(by_id) == ["niah_single_1/0", "niah_single_1/1", "qa_2/0"]
    niah = by_id["niah_single_1/0"]
    assert (niah.task, niah.metric, niah.max_new_tokens) == ("niah_single_1", "string_match_all", 128)
    assert niah.prompt == "text one" and niah.answer_prefix == " The answer is"
    qa = by_id["qa_2/0"]
    assert (qa.metric, qa.max_new_tokens, qa.answers) == ("string_match_part", 32, ["x", "y"])
    assert all(e.max_new_tokens == 512 for e in suites.load_ruler(tmp_path, max_new_tokens=512))
    assert [e.id for e in suites.load_ruler(tmp_path, limit=1)] == ["niah_single_1/0", "qa_2/0"]
    _write_jsonl(tmp_path / "odd" / "mystery.jsonl", [{"index": 0, "input": "q", "outputs": ["x"]}])
    with pytest.raises(ValueError, match="Cannot tell the RULER task"):
        suites.load_ruler(tmp_path / "odd")


def test_ruler_adapter_reads_a_task_folder_of_test_jsonl(tmp_path):
    """Found by a mutation audit: nothing failed when RULER's <task>/test.jsonl layout (beside validation.jsonl) no
    longer named its task from the folder."""
    _write_jsonl(tmp_path / "niah_multikey_2" / "test.jsonl", [{"index": 0, "input": "x", "outputs": ["1"]}])
    (example,) = suites.load_ruler(tmp_path)
    assert (example.id, example.task, example.max_new_tokens) == ("niah_multikey_2/0", "niah_multikey_2", 128)


def test_longbench_adapter_templates_caps_and_middle_truncation(tmp_path):
    assert set(suites.LONGBENCH_PROMPTS) == set(metrics.LONGBENCH_TASKS) and len(metrics.LONGBENCH_TASKS) == 10
    assert suites.LONGBENCH_MAX_NEW_TOKENS["qmsum"] == 512 and suites.LONGBENCH_MAX_NEW_TOKENS["qasper"] == 128
    context = " ".join(f"c{i}" for i in range(30))
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [
        {"input": "who?", "context": context, "answers": ["c3"], "all_classes": None, "length": 30,
         "dataset": "hotpotqa", "_id": "h1"}])
    _write_jsonl(tmp_path / "passage_retrieval_zh.jsonl", [
        {"input": "摘要", "context": "段落1：甲。段落2：乙。", "answers": ["段落2"], "all_classes": None, "length": 5,
         "dataset": "passage_retrieval_zh", "_id": "p1"}])
    examples = {e.id: e for e in suites.load_longbench(tmp_path)}
    hotpot, retrieval = examples["hotpotqa/h1"], examples["passage_retrieval_zh/p1"]
    assert hotpot.prompt == suites.LONGBENCH_PROMPTS["hotpotqa"].format(context=context, input="who?")
    assert hotpot.prompt.endswith("Question: who?\nAnswer:")
    assert (hotpot.metric, hotpot.max_new_tokens) == ("qa_f1_score", 32)
    assert (retrieval.metric, retrieval.max_new_tokens) == ("retrieval_zh_score", 32)
    assert retrieval.prompt.startswith("以下是若干段落文字") and retrieval.prompt.endswith("答案是：")

    prompt_words = hotpot.prompt.split()
    tokenizer = word_tokenizer(prompt_words)
    assert len(tokenizer(hotpot.prompt)["input_ids"]) == len(prompt_words) + 1  # + <bos>
    truncated = suites.load_longbench(tmp_path / "hotpotqa.jsonl", tokenizer=tokenizer, max_length=10)[0].prompt
    # LongBench: decode(first 5 tokens) + decode(last 5 tokens), special tokens skipped (<bos> is token 0).
    assert truncated == " ".join(prompt_words[:4]) + " ".join(prompt_words[-5:])
    untouched = suites.load_longbench(tmp_path / "hotpotqa.jsonl", tokenizer=tokenizer, max_length=10_000)[0]
    assert untouched.prompt == hotpot.prompt
    with pytest.raises(ValueError, match="needs the tokenizer"):
        suites.load_longbench(tmp_path, max_length=10)


def test_generic_suite_records_and_errors(tmp_path):
    good = {"id": "a", "task": "niah_single_1", "prompt": "w5 w6", "answers": ["w7"], "max_new_tokens": 4}
    example = suites.load_examples([good, {**good, "id": "b", "prompt": [1, 5, 6], "task": "mine",
                                           "metric": "qa_f1_score"}])
    assert example[0].metric == "string_match_all" and example[1].input_ids == [1, 5, 6]
    with pytest.raises(ValueError, match="missing field"):
        suites.load_examples([{"id": "a", "task": "x"}])
    with pytest.raises(ValueError, match="no default metric"):
        suites.load_examples([{**good, "task": "mine"}])
    with pytest.raises(ValueError, match="unique"):
        suites.load_examples([good, good])
    with pytest.raises(ValueError, match="answers"):
        suites.load_examples([{**good, "answers": []}])
    with pytest.raises(ValueError, match="max_new_tokens"):
        suites.load_examples([{**good, "max_new_tokens": 0}])
    path = tmp_path / "suite.jsonl"
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match="suite.jsonl:2"):
        suites.load_examples(path)


def test_blank_answers_are_refused_and_meta_cannot_overwrite_record_fields(tmp_path):
    """Found by a mutation audit: nothing failed with a whitespace-only answer accepted (" " is in almost any output,
    a wrong one scored 1.0) or with meta keys overwriting a written record's id, task or metric."""
    good = {"id": "a", "task": "niah_single_1", "prompt": "p", "answers": ["w7"], "max_new_tokens": 4}
    for answers in ([" "], ["w7", "\t"]):
        with pytest.raises(ValueError, match="answers"):
            suites.load_examples([{**good, "answers": answers}])
    example = suites.EvalExample(id="a", task="t", answers=["1"], max_new_tokens=1, metric="string_match_all",
                                 prompt="p", meta={"id": "b", "task": "other", "metric": "qa_f1_score", "length": 7})
    suites.write_examples([example], tmp_path / "s.jsonl")
    (back,) = suites.load_examples(tmp_path / "s.jsonl")
    assert (back.id, back.task, back.metric, back.meta["length"]) == ("a", "t", "string_match_all", 7)


def test_organism_examples_round_trip_through_jsonl(tmp_path):
    from oda_hf.organism import OrganismCorpus

    corpus = OrganismCorpus(seed=0, window=16, heldout_size=2)
    organism = [corpus.example(task, 128, "test", i) for task in ("niah_single_1", "qa_1") for i in range(2)]
    examples = suites.examples_from_organism(organism, task_with_length=True)
    first = examples[0]
    assert first.input_ids == organism[0].prompt_ids() and first.task == "niah_single_1@128"
    assert first.metric == "string_match_all" and examples[2].metric == "string_match_part"
    assert first.max_new_tokens == len(organism[0].target_ids()) + 8
    # The organism's own target, as an output, scores 1 under RULER's metric.
    assert metrics.score_example(first.metric, organism[0].target, first.answers) == 1.0
    suites.write_examples(examples, tmp_path / "organism.jsonl")
    assert suites.load_examples(tmp_path / "organism.jsonl") == examples


# -- rates and the Random control -------------------------------------------------------------------------


def _record(task, policy, full_calls, steps, score, kind=None, group=None, threshold=None, seed=None, hit_cap=False):
    kind = kind or policy
    return {"id": f"{task}-{policy}-{seed}", "task": task, "policy": policy, "group": group or policy, "kind": kind,
            "threshold": threshold, "seed": seed, "score": score, "full_calls": full_calls, "routed_steps": steps,
            "hit_cap": hit_cap, "metric": "string_match_all"}


def test_pooled_and_task_averaged_rates_differ():
    records = [_record("short", "oda@0", 9, 10, 1.0, kind="oda", threshold=0.0),
               _record("long", "oda@0", 0, 90, 0.5, kind="oda", threshold=0.0, hit_cap=True)]
    oda = report.summarize(records)["oda@0"]
    assert oda.pooled_rate.mean == pytest.approx(9 / 100)  # sum F / sum N
    assert oda.task_averaged_rate.mean == pytest.approx((0.9 + 0.0) / 2)  # mean of F_d / N_d
    assert oda.score.mean == pytest.approx(75.0) and oda.cap_hits == 1
    text = report.markdown_report(records)
    assert "task-avg 45.00%" in text and "pooled 9.00%" in text


def test_window_steps_are_set_apart_and_both_rates_named():
    # 10 routed steps, 4 of them within sinks + window (Local, not decided), 3 Full calls past the window.
    windowed = {**_record("short", "oda@0", 3, 10, 1.0, kind="oda", threshold=0.0), "window_steps": 4,
                "window_full_calls": 0}
    oda = report.summarize([windowed])["oda@0"]
    assert oda.pooled_rate.mean == pytest.approx(3 / 6) and oda.paper_pooled_rate.mean == pytest.approx(3 / 10)
    assert oda.window_steps == 4 and runner.task_rates([windowed])["short"] == pytest.approx(3 / 6)
    full = {**_record("short", "full", 10, 10, 1.0), "window_steps": 4, "window_full_calls": 4}
    assert report.summarize([full])["full"].pooled_rate.mean == 1.0
    # Older records have no window fields: every step was decided.
    old = _record("short", "oda@0", 3, 10, 1.0, kind="oda", threshold=0.0)
    assert report.summarize([old])["oda@0"].pooled_rate.mean == pytest.approx(3 / 10)
    text = report.markdown_report([windowed])
    assert "In window" in text and "Paper rate (pooled)" in text and "| 4 | 3 | 50.00% |" in text


def test_full_calls_count_the_full_calls_within_sinks_and_window():
    """Found by a mutation audit: a record's full_calls left out the Full calls made within sinks + window (a short
    prompt), so the Full control's decided rate fell below 1."""
    model = oda_model()  # sinks=2, window=4
    example = suites.EvalExample(id="s/0", task="s", answers=["w5"], max_new_tokens=8, metric="string_match_all",
                                 input_ids=[10, 11, 12])
    record = runner.generate_record(model, None, example, runner.full(), example.input_ids)
    assert record["window_steps"] > 0 and record["window_full_calls"] == record["window_steps"]
    assert record["full_calls"] == sum(record["decisions"]) == record["routed_steps"] == 7
    calls, decided = runner.decided_counts(record)
    assert calls == decided > 0


def test_the_report_averages_over_tasks_and_rates_over_decided_steps():
    """Numbers a mutation audit could change with every test passing: a task's rate over the steps past the window
    (Full's in-window calls set apart), Avg as the mean over tasks (not over examples), task-averaged rates over the
    tasks that decided a step, the highest request rate, and the sweep table's Random columns in its header's order."""
    def oda(task, calls, steps, score, window=2, **fields):
        return {**_record(task, "oda@0", calls, steps, score, kind="oda", threshold=0.0, **fields),
                "window_steps": window, "window_full_calls": 0}

    records = [oda("a", 4, 10, 1.0)] + [oda("b", 1, 10, 0.0, seed=k) for k in range(3)] + [oda("c", 0, 3, 0.5, 3)]
    records.append({**_record("a", "full", 10, 10, 1.0), "window_steps": 2, "window_full_calls": 2})
    for seed, calls in ((42, 2), (43, 4)):
        for task, task_calls, steps in (("a", calls, 10), ("b", 0, 34)):
            records.append({**_record(task, f"random~oda@0/seed{seed}", task_calls, steps, 0.0, kind="random",
                                      group="random~oda@0", threshold=0.0, seed=seed), "window_steps": 2,
                            "window_full_calls": 0})
    groups = report.summarize(records)
    assert groups["full"].runs[0].tasks["a"].rate == 1.0   # (10 - 2) / (10 - 2), not 10 / 8
    oda_group = groups["oda@0"]
    assert oda_group.score.mean == pytest.approx((100 + 0 + 50) / 3)   # over tasks; over examples it is 30
    assert oda_group.task_averaged_rate.mean == pytest.approx((4 / 8 + 1 / 8) / 2)   # task c decided no step
    assert oda_group.pooled_rate.mean == pytest.approx(7 / 32) and oda_group.max_request_rate == 0.5
    random = groups["random~oda@0"]
    assert random.task_averaged_rate.mean == pytest.approx((2 / 8 / 2 + 4 / 8 / 2) / 2)   # per seed, then over seeds
    assert random.pooled_rate.mean == pytest.approx((2 / 40 + 4 / 40) / 2)
    sweep = report.sweep_table(groups).splitlines()
    assert sweep[0].endswith("| Random score | Random Full (task-avg) | Random Full (pooled) |")
    assert sweep[2] == "| 0 | 50.00 | 31.25% | 21.88% | 0.00 ± 0.00 | 18.75 ± 8.84% | 7.50 ± 3.54% |"


def test_matched_random_rates_and_percentile_intervals():
    """A task where ODA made no routed step past the window gets a Random control at p = 0; a 95% interval cuts
    2.5% off each tail (a mutation audit's p = 1 and 5% tails passed every test)."""
    records = [{**_record("a", "oda@0", 3, 10, 1.0, kind="oda", threshold=0.0), "window_steps": 2},
               {**_record("b", "oda@0", 0, 4, 1.0, kind="oda", threshold=0.0), "window_steps": 4}]
    assert runner.matched_rates(records, 0.0) == {"a": 3 / 8, "b": 0.0}
    low, high = stats.percentile_interval(np.arange(201.0)[:, None], level=0.95)
    assert (float(low[0]), float(high[0])) == (pytest.approx(5.0), pytest.approx(195.0))


def test_random_groups_report_mean_and_sample_std_across_seeds():
    records = []
    for seed, (score, calls) in {42: (1.0, 4), 43: (0.0, 6)}.items():
        for task in ("a", "b"):
            records.append(_record(task, f"random~oda@0/seed{seed}", calls, 10, score, kind="random",
                                   group="random~oda@0", threshold=0.0, seed=seed))
    group = report.summarize(records)["random~oda@0"]
    assert group.seeds == 2
    assert group.score.mean == pytest.approx(50.0) and group.score.std == pytest.approx(math.sqrt(2) * 50)
    assert group.task_averaged_rate.mean == pytest.approx(0.5)
    assert group.task_averaged_rate.std == pytest.approx(np.std([0.4, 0.6], ddof=1))
    assert "50.00 ± 70.71" in report.markdown_report(records)


def test_report_warns_when_policies_ran_on_different_examples():
    """A kill mid-run, a rerun over fewer prompts or other tasks into the folder, or a merge leaves policies over
    different examples; the tables averaged each over its own (ODA led Random by 13 points in a sweep table where, per
    task, they were equal: Random had one task of two). The report says so, per policy and task."""
    def run(policy, kind, examples, seed=None):
        return [{**_record(task, policy, 1, 4, 1.0, kind=kind, threshold=0.0 if kind != "full" else None,
                           group=policy.split("/")[0], seed=seed), "id": f"{task}/{i}"} for task, i in examples]

    both = [("a", 0), ("a", 1), ("b", 0)]
    complete = run("full", "full", both) + run("oda@0", "oda", both)
    assert report.coverage_note(complete) is None
    assert "not all run on the same examples" not in report.markdown_report(complete)
    partial = complete + run("random~oda@0/seed42", "random", both) + run("random~oda@0/seed43", "random", both[:1])
    note = report.coverage_note(partial)
    assert "random~oda@0/seed43: a 1 of 2, b 1 of 1" in note and "seed42" not in note and "full" not in note
    assert note in report.markdown_report(partial)


def test_random_policy_realizes_its_rate():
    policy = RandomPolicy(0.3, seed=42)
    draws = torch.stack([policy.decide(None, step, 4, "cpu") for step in range(1, 5001)])
    assert abs(draws.float().mean().item() - 0.3) < 0.01
    policy.reset()
    assert torch.equal(torch.stack([policy.decide(None, s, 4, "cpu") for s in range(1, 5001)]), draws)
    # Through the model: per-step draws over 4 rows x 119 routed steps.
    model = OdaForCausalLM(tiny_model("llama"), oda_config=OdaConfig(sinks=2, window=4, policy=RandomPolicy(0.37, 43)))
    model.generate(input_ids=torch.randint(3, VOCAB, (4, 8)), max_new_tokens=120, do_sample=False, pad_token_id=0)
    assert model.routing.decisions.shape == (4, 119)
    assert abs(model.routing.full_call_rate - 0.37) < 0.07  # ~3.5 standard deviations of 476 draws


# -- ranking statistics --------------------------------------------------------------------------------------


def _pairs_auroc(scores, labels):
    pos, neg = scores[labels], scores[~labels]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _threshold_ap(scores, labels):
    ap, previous_recall = 0.0, 0.0
    for tau in sorted(set(scores.tolist()), reverse=True):
        chosen = scores >= tau
        recall = (labels & chosen).sum() / labels.sum()
        ap += (recall - previous_recall) * (labels & chosen).sum() / chosen.sum()
        previous_recall = recall
    return ap


def test_auroc_and_ap_against_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(5, 40))
        scores = np.round(rng.normal(size=n), 1)  # rounding makes ties
        labels = rng.random(n) < 0.4
        if labels.all() or not labels.any():
            continue
        assert stats.auroc(scores, labels) == pytest.approx(_pairs_auroc(scores, labels))
        assert stats.average_precision(scores, labels) == pytest.approx(_threshold_ap(scores, labels))
    distinct = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    labels = np.array([True, False, True, False, False])
    assert stats.average_precision(distinct, labels) == pytest.approx((1 / 1 + 2 / 3) / 2)
    assert math.isnan(stats.auroc(distinct, np.ones(5, dtype=bool)))
    # the head policy calls Full on any non-finite score: -inf ranks first, as NaN and +inf do (it ranked last)
    for odd in (math.nan, math.inf, -math.inf):
        assert stats.auroc([odd, 0.5, 0.1], [True, False, False]) == 1.0
        assert stats.net_gain([odd, 0.5, 0.1], [2.0, -1.0, -1.0], 1 / 3) == pytest.approx(2 / 3)


def test_net_gain_random_expectation_and_oracle():
    rng = np.random.default_rng(1)
    gains = np.round(rng.normal(size=9), 3)
    scores = rng.permutation(9).astype(float)
    for budget in (0.0, 0.25, 0.4, 0.5, 1.0):
        k = math.floor(budget * 9)
        top = np.argsort(-scores)[:k]
        assert stats.net_gain(scores, gains, budget) == pytest.approx(gains[top].sum() / 9)
        best = max((sum(c) for c in itertools.combinations(gains.tolist(), k)), default=0.0)
        assert stats.oracle_net_gain(gains, budget) == pytest.approx(best / 9)  # best K-subset
        assert stats.random_expectation(gains, budget) == pytest.approx(k / 9 * gains.mean())
        d = stats.gain_decomposition(scores, gains, budget)
        assert d["calls"] == k
        assert d["positive_gain"] - d["negative_cost"] == pytest.approx(gains[top].sum())
    curve = stats.net_gain_curve(scores, gains, [0.0, 0.4, 1.0])
    assert curve.tolist() == pytest.approx([stats.net_gain(scores, gains, b) for b in (0.0, 0.4, 1.0)])
    assert stats.budget_count(0.29, 100) == 29 and stats.budget_count(0.4, 2048) == 819
    # K = floor(b |S|) for the decimal typed: never one more call (a realised 0.25 for a budget of 0.2499999999)
    assert stats.budget_count(0.2499999999, 4) == 0 and stats.budget_count(0.3333333333, 3) == 0
    assert stats.budget_count(1 / 3, 3) == 1 and stats.budget_count(0.7000000000000001, 10) == 7
    for eps in (0.0, 0.1):
        counts = stats.sign_counts(gains, eps)
        assert sum(counts.values()) == 9 and counts["positive"] == int((gains > eps).sum())


def test_bootstrap_is_paired_and_reproducible():
    documents = [np.arange(0, 3), np.arange(3, 7), np.arange(7, 8)]
    values = np.arange(8.0)

    def measure(rows):
        return {"a": values[rows].sum(), "b": values[rows].sum(), "n": len(rows)}

    first = stats.paired_bootstrap(documents, measure, n_resamples=50, seed=7)
    again = stats.paired_bootstrap(documents, measure, n_resamples=50, seed=7)
    other = stats.paired_bootstrap(documents, measure, n_resamples=50, seed=8)
    assert np.array_equal(first["a"], again["a"]) and not np.array_equal(first["a"], other["a"])
    assert np.array_equal(first["a"], first["b"])  # every statistic sees the same resample


# -- fixed-reference diagnostics ------------------------------------------------------------------------------


@pytest.mark.parametrize("family,history", [("qwen3", "full"), ("gemma3", "selected")])
def test_reference_gains_equal_masked_brute_force(family, history):
    sinks, window = 2, 4
    model = oda_model(family, sinks, window)
    model.set_routing(threshold=0.0)
    ids = torch.randint(3, VOCAB, (18,), generator=torch.Generator().manual_seed(1))
    record = diagnostics.reference_gains(model, ids, history=history)
    assert model.oda_config.policy == "head"  # routing restored
    start = sinks + window + 1
    assert record.positions.tolist() == list(range(start, 18))  # eligible: t > s + w, x_{t+1} known
    if history == "selected":
        assert record.selected_full.any() and not record.selected_full.all()  # a real mix of histories
        assert np.array_equal(record.selected_full, record.head_scores > 0)
    else:
        assert record.selected_full.all()
    for i, t in enumerate(record.positions):
        earlier = record.selected_full[:i].tolist()
        logp = {}
        for branch in (True, False):
            decisions = torch.tensor([earlier + [branch]])
            logits = replay_logits(model.base_model, ids[None, :t], torch.ones(1, start - 1, dtype=torch.long),
                                   decisions, sinks, window)[0, t - 1].double()
            logp[branch] = torch.log_softmax(logits, -1)
        target = int(ids[t])
        assert record.gains[i] == pytest.approx(float(logp[True][target] - logp[False][target]), abs=2e-5)
        local = logp[False]
        assert record.entropy[i] == pytest.approx(float(-(local.exp() * local).sum()), abs=2e-5)
        top = torch.topk(local.exp(), 2).values
        assert record.margin[i] == pytest.approx(float(top[0] - top[1]), abs=2e-5)
        assert record.local_top1[i] == int(local.argmax())


def test_diagnostics_analysis_and_report(tmp_path):
    pytest.importorskip("matplotlib")
    model = oda_model("qwen3")
    sequences = [torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    documents = [{"id": f"doc{i}", "input_ids": ids.tolist()} for i, ids in enumerate(sequences)]
    path = tmp_path / "positions.jsonl"
    records = diagnostics.collect_reference_gains(model, documents, output_path=path, history="full", count=6,
                                                  progress=False)
    assert [len(r) for r in records] == [6, 6, 6]
    reloaded = diagnostics.load_positions(path)
    assert np.allclose(reloaded[1].gains, records[1].gains)
    result = diagnostics.analyze(records, n_resamples=40, seed=3, progress=False)
    again = diagnostics.analyze(reloaded, n_resamples=40, seed=3, progress=False)
    head = result["subsets"]["all"]["methods"]["head"]
    assert head["auroc_ci"] == again["subsets"]["all"]["methods"]["head"]["auroc_ci"]  # seeded bootstrap
    assert result["history"] == "full" and result["threshold"] is None   # always Full reads no threshold
    gains = np.concatenate([r.gains for r in records])
    scores = np.concatenate([r.head_scores for r in records])
    assert head["auroc"] == pytest.approx(stats.auroc(scores, gains > 0))
    assert head["net_gain"] == pytest.approx(stats.net_gain(scores, gains, 0.4))
    oracle = result["subsets"]["all"]["methods"]["oracle"]["net_gain"]
    assert oracle >= head["net_gain"] - 1e-12
    assert sum(result["correctness"].values()) == len(gains) == result["positions"]
    assert sum(result["sign_counts"]["0.001"].values()) == len(gains)
    paths = diagnostics.write_diagnostics(result, tmp_path / "out")
    text = open(paths["markdown"], encoding="utf-8").read()
    assert "Benefit-sign discrimination" in text and "Local incorrect" in text and "Oracle" in text
    assert os.path.getsize(paths["budget_curve"]) > 1000


def test_diagnostics_count_the_resamples_behind_an_auroc_interval():
    """A resample holding positions of one sign has no AUROC; the interval over the others was reported with no word
    that it rests on fewer resamples than the report's count."""
    model = oda_model("qwen3")
    records = [diagnostics.reference_gains(model, torch.randint(3, VOCAB, (16,), generator=torch.Generator()
                                                                .manual_seed(seed)).tolist(), history="full")
               for seed in range(2)]
    for record, sign in zip(records, (1.0, -1.0)):   # one document all positive, the other all negative
        record.full_logp = record.local_logp + sign * (0.1 + np.abs(record.gains))
    result = diagnostics.analyze(records, n_resamples=60, seed=3, progress=False)
    documents = diagnostics.Pooled.of(records).documents
    draws = stats.paired_bootstrap(documents, lambda rows: {"n": np.array(len(set(rows)))}, 60, 3, False)["n"]
    both = result["subsets"]["all"]["resamples_with_both_classes"]
    assert 0 < both < 60 and both == int(np.sum(draws > 9))   # resamples drawing both documents (9 positions each)
    text = diagnostics.markdown(result)
    assert f"AUROC intervals are over the resamples that hold positions of both signs, fewer than 60 in: All {both}," \
        in text
    # AP needs a positive only: the resamples of the positive document alone count for it (AP 1.0 there)
    positives = result["subsets"]["all"]["resamples_with_positives"]
    first_only = stats.paired_bootstrap(documents, lambda rows: {"n": np.array(int(rows.max() < 9))}, 60, 3, False)
    assert positives == both + int(first_only["n"].sum()) < 60
    assert f"AP intervals are over the resamples that hold a position with g > 0, fewer than 60 in: All {positives}," \
        in text


def test_diagnostics_say_what_they_could_not_score():
    """A sequence within s + w + 1 tokens has no eligible position and a start past a sequence's end none either:
    both were dropped with exit 0 and the report counted only the rest."""
    model = oda_model("qwen3")   # s + w = 6
    ids = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    with pytest.raises(ValueError, match=r"reference 'long': start 40 is past its last position with a next token "
                                         r"\(15; it has 16 tokens\)"):
        diagnostics.reference_gains(model, ids, start=40, history="full", doc_id="long")
    records = [diagnostics.reference_gains(model, ids, history="full"),
               diagnostics.reference_gains(model, ids[:7], history="full")]
    assert [len(r) for r in records] == [9, 0]
    result = diagnostics.analyze(records, n_resamples=10, seed=3, progress=False)
    assert result["documents"] == 1 and result["documents_without_positions"] == 1
    assert "(1 more sequences had none: at most s + w + 1 tokens)" in diagnostics.markdown(result)


def test_diagnostics_warn_of_positions_written_before_the_config_fingerprint(tmp_path, caplog):
    """Positions written before they recorded the base's config fingerprint were reused with no word (oda eval
    warns of its records alike): a config.json changed since would go unseen."""
    model = oda_model("qwen3")
    documents = [{"id": "doc0", "input_ids": list(range(4, 20))}]
    path = tmp_path / "positions.jsonl"
    diagnostics.collect_reference_gains(model, documents, output_path=path, history="full", count=4, progress=False)
    with caplog.at_level("WARNING", logger="oda_hf"):
        diagnostics.collect_reference_gains(model, documents, output_path=path, history="full", count=4,
                                            progress=False)
    assert "written before" not in caplog.text
    data = json.loads(path.read_text())
    del data["settings"]["base_config_sha256"]
    path.write_text(json.dumps(data) + "\n")
    with caplog.at_level("WARNING", logger="oda_hf"):
        again = diagnostics.collect_reference_gains(model, documents, output_path=path, history="full", count=4,
                                                    progress=False)
    assert f"{path} was written before oda_hf recorded base_config_sha256" in caplog.text and len(again[0]) == 4


def test_diagnostics_keep_one_run_per_positions_file(tmp_path):
    """New documents computed with another geometry into a positions file are refused, and a file that mixes runs
    anyway (written by hand, or by an older oda_hf) is refused on reading, so no analysis pools them."""
    model = oda_model("qwen3")
    documents = [{"id": f"doc{i}", "input_ids": list(range(4 + i, 20 + i))} for i in range(2)]
    path = tmp_path / "positions.jsonl"
    diagnostics.collect_reference_gains(model, documents[:1], output_path=path, history="full", count=4,
                                        progress=False)
    model.set_routing(sinks=1, window=8)
    with pytest.raises(ValueError, match="doc0.*other settings.*sinks: 2 there, 1 now"):
        diagnostics.collect_reference_gains(model, documents[1:], output_path=path, history="full", count=4,
                                            progress=False)
    other = tmp_path / "other.jsonl"
    diagnostics.collect_reference_gains(model, documents[1:], output_path=other, history="full", count=4,
                                        progress=False)
    with open(path, "a", encoding="utf-8") as f:
        f.write(other.read_text())
    with pytest.raises(ValueError, match="doc1.*other settings"):
        diagnostics.load_positions(path)


# -- the runner, reports and trajectories ------------------------------------------------------------------------


def _suite(n_per_task=2, length=10, max_new_tokens=6):
    rng = np.random.default_rng(0)
    return [suites.EvalExample(id=f"{task}/{i}", task=task, answers=[f"w{5 + i}"], max_new_tokens=max_new_tokens,
                               metric=metrics.default_metric(task), prompt=words(rng, length))
            for task in ("niah_single_1", "qa_1") for i in range(n_per_task)]


def test_hit_output_cap():
    assert runner.hit_output_cap([5, 6, 7], 3, [2])
    assert not runner.hit_output_cap([5, 2], 3, [2])
    assert not runner.hit_output_cap([5, 6, 2], 3, [2])
    assert not runner.hit_output_cap([5, 6], 3, [2])


def test_evaluate_end_to_end(tmp_path):
    model, tokenizer = oda_model(), word_tokenizer()
    examples = _suite()
    policies = ([runner.full(), runner.streaming_llm(), runner.oda(0.0), runner.oda(0.05)]
                + [runner.random_matched(t, s) for t in (0.0, 0.05) for s in (42, 43)] + [runner.schedule(1, 2)])
    path = tmp_path / "run" / "results.jsonl"
    records = runner.evaluate(model, tokenizer, examples, policies, path, progress=False)
    assert len(records) == len(examples) * len(policies)
    assert len(path.read_text().splitlines()) == len(records)
    by_key = {(r["id"], r["policy"]): r for r in records}
    for example in examples:
        full, local = by_key[(example.id, "full")], by_key[(example.id, "streamingllm")]
        assert full["routed_steps"] == 5 and full["full_calls"] == 5 and local["full_calls"] == 0
        assert len(full["decisions"]) == full["routed_steps"] and full["hit_cap"]  # the tiny model never emits EOS
        ids = torch.tensor([tokenizer(example.prompt)["input_ids"]])
        stock = model.base_model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert full["output_ids"] == stock[0, ids.shape[1]:].tolist()  # Full = the stock model
        assert by_key[(example.id, "schedule:1/2")]["decisions"] == [1, 0, 1, 0, 1]
        oda_record = by_key[(example.id, "oda@0")]
        assert oda_record["decisions"] == [int(q > 0) for q in oda_record["head_scores"]]
    # Matched Random uses ODA's unrounded per-task rate at its threshold.
    oda_rates = runner.task_rates(r for r in records if r["policy"] == "oda@0")
    for r in records:
        if r["group"] == "random~oda@0":
            assert r["p"] == pytest.approx(oda_rates[r["task"]])
    text = report.markdown_report(records)
    for piece in ("| Task |", "| **Avg** |", "StreamingLLM", "ODA (θ=0)", "Random (matched to ODA θ=0, 2 seeds)",
                  "Schedule 1/2", "threshold sweep", "Output-cap hits", "niah_single_1: string_match_all"):
        assert piece in text
    groups = report.summarize(records)
    assert groups["full"].pooled_rate.mean == 1.0 and groups["streamingllm"].pooled_rate.mean == 0.0
    pytest.importorskip("matplotlib")
    paths = report.write_report(records, tmp_path / "run")
    for key in ("quality_vs_rate", "per_task"):
        assert os.path.getsize(paths[key]) > 1000


SHARED_PREFILL_POLICIES = [runner.full(), runner.streaming_llm(), runner.oda(0.0), runner.random_fixed(0.5, 7),
                           runner.schedule(1, 3)]


def _separate_and_shared(model, example, policies=SHARED_PREFILL_POLICIES):
    """Records of separate generate() calls, and of continuations of one shared prefill."""
    ids = list(example.input_ids)
    separate = [runner.generate_record(model, None, example, spec, ids) for spec in policies]
    prefill = runner.SharedPrefill(model, None, ids, example.max_new_tokens)
    shared = [runner.generate_record(model, None, example, spec, ids, prefill=prefill, last=i == len(policies) - 1)
              for i, spec in enumerate(policies)]
    return separate, shared


def test_a_shared_prefill_copies_the_cache_not_the_model():
    """Each policy but the last continues a deep copy of the prefilled cache; its beam-reorder callback (the model's
    bound method) was deep-copied too, and with it the whole model, weights included."""
    model = oda_model("llama")
    prefill = runner.SharedPrefill(model, None, list(range(3, 20)), 4)
    cache, _ = prefill.take()
    assert cache is not prefill._cache and cache.on_reorder[0].__self__ is model
    assert cache.global_layers[0].keys.data_ptr() != prefill._cache.global_layers[0].keys.data_ptr()


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4", "qwen3_5"])
def test_shared_prefill_equals_separate_generate_calls(family):
    model = oda_model(family)
    rng = np.random.default_rng(1)
    example = suites.EvalExample(id="x/0", task="x", answers=["w5"], max_new_tokens=9, metric="string_match_all",
                                 input_ids=[int(i) for i in rng.integers(3, VOCAB, size=15)])
    separate, shared = _separate_and_shared(model, example)
    assert shared == separate  # output tokens, decisions, head scores: every field
    by_policy = {r["policy"]: r for r in shared}
    assert by_policy["full"]["output_ids"] != by_policy["streamingllm"]["output_ids"]  # the policies really differ
    assert by_policy["full"]["routed_steps"] == example.max_new_tokens - 1 and by_policy["streamingllm"]["full_calls"] == 0
    assert by_policy["schedule:1/3"]["decisions"] == [1, 0, 0, 1, 0, 0, 1, 0]


def test_shared_prefill_stops_at_eos_like_generate():
    model = oda_model()
    example = suites.EvalExample(id="x/0", task="x", answers=["w5"], max_new_tokens=6, metric="string_match_all",
                                 input_ids=list(range(10, 24)))
    full_ids = runner.generate_record(model, None, example, runner.full(), example.input_ids)["output_ids"]
    for eos in (full_ids[0], full_ids[2]):  # EOS as the prefill's own token, and EOS during decoding
        model.generation_config.eos_token_id = eos
        separate, shared = _separate_and_shared(model, example)
        assert shared == separate
        assert shared[0]["output_ids"][-1] == eos and shared[0]["routed_steps"] == full_ids.index(eos)
    one_token = suites.EvalExample(id="x/1", task="x", answers=["w5"], max_new_tokens=1, metric="string_match_all",
                                   input_ids=list(range(10, 24)))
    separate, shared = _separate_and_shared(model, one_token)
    assert shared == separate and all(r["routed_steps"] == 0 for r in shared)


@pytest.mark.filterwarnings("error:Unfeasible length constraints")   # nor warns of min vs max on its one-token call
def test_shared_prefill_keeps_min_new_tokens_like_generate():
    """Found by a mutation audit: the continuation after a shared prefill kept the whole min_new_tokens (not less the
    prefill's token), so it ran past an EOS that a separate generate() stops at."""
    model = oda_model()
    example = suites.EvalExample(id="x/0", task="x", answers=["w5"], max_new_tokens=6, metric="string_match_all",
                                 input_ids=list(range(10, 24)))
    full_ids = runner.generate_record(model, None, example, runner.full(), example.input_ids)["output_ids"]
    model.generation_config.eos_token_id = full_ids[2]  # Full's 3rd token, which min_new_tokens=2 allows
    model.generation_config.min_new_tokens = 2
    separate, shared = _separate_and_shared(model, example)
    assert shared == separate
    assert shared[0]["output_ids"] == full_ids[:3] and not shared[0]["hit_cap"]


def _answer_example():
    return suites.EvalExample(id="q/0", task="q", answers=["w8 w85"], max_new_tokens=6, metric="qa_f1_score",
                              input_ids=list(range(10, 24)))


def test_output_text_leaves_out_special_tokens():
    """Found by a mutation audit: the output was decoded with its special tokens, so the tiny model's <bos> showed in
    the text and was scored against the answers."""
    model, tokenizer = oda_model(), word_tokenizer()
    example = _answer_example()
    record = runner.generate_record(model, tokenizer, example, runner.full(), example.input_ids)
    assert tokenizer.bos_token_id in record["output_ids"]
    assert not any(token in record["output"] for token in SPECIAL)
    assert record["output"] == tokenizer.decode(record["output_ids"], skip_special_tokens=True)


def test_generation_stops_at_the_models_eos_before_the_tokenizers():
    """Found by a mutation audit: the tokenizer's EOS was taken before the model's generation config, so generation
    ran past the model's EOS to the output cap."""
    model, tokenizer = oda_model(), word_tokenizer()
    example = _answer_example()
    full_ids = runner.generate_record(model, tokenizer, example, runner.full(), example.input_ids)["output_ids"]
    model.generation_config.eos_token_id = full_ids[2]
    assert full_ids[2] != tokenizer.eos_token_id and tokenizer.eos_token_id not in full_ids
    record = runner.generate_record(model, tokenizer, example, runner.full(), example.input_ids)
    assert record["output_ids"] == full_ids[:3] and not record["hit_cap"] and record["routed_steps"] == 2
    assert record["output"] == "w8 w85" and record["score"] == 1.0


def test_chat_template_is_applied_without_thinking():
    """Found by a mutation audit: the chat template was applied without enable_thinking=False (a Qwen3-style template
    then leaves out its empty think block)."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}w7 {{ m['content'] }} w8{% endfor %}"
                               "{% if add_generation_prompt %} w9{% if enable_thinking is defined and "
                               "enable_thinking is false %} w10 w11{% endif %}{% endif %}")
    example = suites.EvalExample(id="c/0", task="c", answers=["w5"], max_new_tokens=4, metric="string_match_all",
                                 prompt="w20 w21 w22", answer_prefix=" w30")
    assert runner.encode_prompt(example, tokenizer, chat_template=True) == [7, 20, 21, 22, 8, 9, 10, 11, 30]


def test_token_id_prompts_keep_their_answer_prefix():
    """Found by a mutation audit: a prompt given as token ids lost its answer prefix."""
    example = suites.EvalExample(id="i/0", task="i", answers=["w5"], max_new_tokens=4, metric="string_match_all",
                                 input_ids=[20, 21, 22], answer_prefix=" w30 w31")
    assert runner.encode_prompt(example, word_tokenizer()) == [20, 21, 22, 30, 31]


def test_evaluate_shares_one_prefill_per_prompt(tmp_path, monkeypatch):
    model, tokenizer = oda_model(), word_tokenizer()
    examples = _suite(n_per_task=1)
    policies = [runner.full(), runner.streaming_llm(), runner.oda(0.0), runner.random_matched(0.0, 42),
                runner.random_matched(0.0, 43)]
    separate = runner.evaluate(model, tokenizer, examples, policies, tmp_path / "a.jsonl", progress=False,
                               share_prefill=False)
    made, takes = [], []
    init, take = runner.SharedPrefill.__init__, runner.SharedPrefill.take
    monkeypatch.setattr(runner.SharedPrefill, "__init__", lambda self, *a: made.append(1) or init(self, *a))
    monkeypatch.setattr(runner.SharedPrefill, "take", lambda self, last=False: takes.append(last) or take(self, last))
    shared = runner.evaluate(model, tokenizer, examples, policies, tmp_path / "b.jsonl", progress=False)
    assert shared == separate
    # One prefill per prompt and pass (direct policies, then the matched Random ones), the original used last.
    assert len(made) == 2 * len(examples) and sum(takes) == len(made) and len(takes) == len(examples) * len(policies)


@pytest.mark.parametrize("key", ["forced_eos_token_id", "begin_suppress_tokens"])
def test_generation_keys_counted_from_a_calls_start_get_a_prefill_per_policy(tmp_path, key):
    """Found by an audit: a shared prefill's first token comes from a generate() call of its own and the continuation
    starts one token later, so processors counted from a call's start acted elsewhere (forced_eos_token_id: every
    shared output empty; begin_suppress_tokens: suppressed again at the second token), exit 0. With such a key set,
    `evaluate` gives each policy its own prefill, and the records equal separate generate() calls."""
    model, tokenizer = oda_model(), word_tokenizer()
    examples = _suite(n_per_task=1)
    policies = [runner.full(), runner.streaming_llm(), runner.oda(0.0)]
    first = runner.generate_record(model, tokenizer, examples[0], runner.full(),
                                   runner.encode_prompt(examples[0], tokenizer, False))["output_ids"]
    value = {"forced_eos_token_id": first[0], "begin_suppress_tokens": [first[1]]}[key]
    setattr(model.generation_config, key, value)
    separate = runner.evaluate(model, tokenizer, examples, policies, tmp_path / "a.jsonl", progress=False,
                               share_prefill=False)
    shared = runner.evaluate(model, tokenizer, examples, policies, tmp_path / "b.jsonl", progress=False)
    assert shared == separate
    by_policy = {r["policy"]: r for r in shared if r["id"] == examples[0].id}
    assert by_policy["full"]["output_ids"] != [first[0]]   # not cut to the forced EOS at the first token
    assert by_policy["full"]["output_ids"][1] == first[1] or key == "forced_eos_token_id"


def test_resume_skips_finished_records(tmp_path, monkeypatch):
    model, tokenizer = oda_model(), word_tokenizer()
    examples, policies = _suite(n_per_task=1), [runner.full(), runner.oda(0.0), runner.random_matched(0.0, 42)]
    calls = []
    original = runner.generate_record

    def counting_generate(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "generate_record", counting_generate)
    path = tmp_path / "results.jsonl"
    first = runner.evaluate(model, tokenizer, examples, policies, path, progress=False)
    assert len(calls) == len(examples) * len(policies)
    calls.clear()
    second = runner.evaluate(model, tokenizer, examples, policies, path, progress=False)
    assert calls == [] and second == first  # nothing regenerated
    # An interrupted run: the last record is half written. Only that pair is redone.
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    third = runner.evaluate(model, tokenizer, examples, policies, path, progress=False)
    assert len(calls) == 1 and third == first


def test_matched_random_is_redone_when_odas_rate_moves(tmp_path, monkeypatch):
    """A larger run (more prompts per task) changes ODA's per-task rate: matched Random records follow it."""
    model, tokenizer = oda_model(), word_tokenizer()
    policies = [runner.oda(0.0), runner.random_matched(0.0, 42)]
    path = tmp_path / "results.jsonl"
    suite = _suite(n_per_task=3)
    small = runner.evaluate(model, tokenizer, [e for e in suite if e.id.endswith("/0")], policies, path, progress=False)
    calls = []
    original = runner.generate_record
    monkeypatch.setattr(runner, "generate_record", lambda *a, **k: calls.append(a[3].name) or original(*a, **k))
    larger = runner.evaluate(model, tokenizer, suite, policies, path, progress=False)
    old_rates = runner.task_rates(r for r in small if r["policy"] == "oda@0")
    new_rates = runner.task_rates(r for r in larger if r["policy"] == "oda@0")
    moved = [task for task in new_rates if new_rates[task] != old_rates[task]]
    assert moved, "the suite must move some task's rate for this test to mean anything"
    # Every matched record carries its task's current rate and equals a fresh run over the larger suite.
    assert all(r["p"] == new_rates[r["task"]] for r in larger if r["kind"] == "random")
    monkeypatch.setattr(runner, "generate_record", original)
    fresh = runner.evaluate(model, tokenizer, suite, policies, tmp_path / "fresh.jsonl", progress=False)
    assert larger == fresh
    # Only the new prompts' ODA records and the matched records were generated (the first prompts' were redone
    # only on tasks whose rate moved); reading the file back keeps the newest record of each pair.
    assert calls.count("oda@0") == 4 and calls.count("random~oda@0/seed42") == 4 + len(moved)
    reread = runner.ResultsFile(path, repair=False).records
    assert [reread[(r["id"], r["policy"])] for r in larger] == larger


def test_a_matched_random_record_is_finished_only_at_the_very_same_rate(tmp_path):
    """Found by a mutation audit: `_finished` reused a matched Random record whose p was only close to ODA's rate
    (rounded, or within a tolerance); the reports compare p exactly and then drop it."""
    spec = runner.random_matched(0.0, 42)
    example = suites.EvalExample(id="x/0", task="x", answers=["w5"], max_new_tokens=6, metric="string_match_all",
                                 input_ids=list(range(10, 24)))
    path = tmp_path / "results.jsonl"
    runner.append_jsonl(path, {"id": example.id, "policy": spec.name, "kind": "random", "threshold": 0.0, "task": "x",
                               "p": 1 / 3, "settings": {"random_draws": runner.RANDOM_DRAWS}})
    results = runner.ResultsFile(path)
    assert runner._finished(results, example, spec, 1 / 3)
    assert not runner._finished(results, example, spec, 0.331)
    assert not runner._finished(results, example, spec, 1 / 3 + 1e-12)


def test_reports_leave_out_matched_random_records_drawn_at_an_outdated_rate(tmp_path):
    """ODA run over more prompts without its control: the control's old records no longer match ODA's rate."""
    model, tokenizer = oda_model(), word_tokenizer()
    suite, path = _suite(n_per_task=3), tmp_path / "results.jsonl"
    first = runner.evaluate(model, tokenizer, [e for e in suite if e.id.endswith("/0")],
                            [runner.oda(0.0), runner.random_matched(0.0, 42)], path, progress=False)
    assert runner.current_records(first) == first
    larger = runner.evaluate(model, tokenizer, suite, [runner.oda(0.0)], path, progress=False)
    rates = runner.task_rates(larger)
    held = list(runner.ResultsFile(path).records.values())
    stale = [r for r in held if r["kind"] == "random" and r["p"] != rates[r["task"]]]
    assert stale, "the larger run must move some task's rate for this test to mean anything"
    kept = runner.current_records(held)
    assert [r for r in held if r not in stale] == kept
    assert all(r["p"] == rates[r["task"]] for r in kept if r["kind"] == "random")


def test_reports_leave_out_random_records_of_shared_draws_beside_per_example_ones(tmp_path):
    """A fixed-rate Random policy run before per-example draws (one generator seed for every prompt) and again over
    other prompts since: one report row averaged the two protocols (SmolLM2's budget folder: 33 records of each
    seed drawn the old way beside 55 drawn the new way, reported together, with exit 0)."""
    model, tokenizer = oda_model(), word_tokenizer()
    suite, path = _suite(n_per_task=3), tmp_path / "results.jsonl"
    records = runner.evaluate(model, tokenizer, suite, [runner.random_fixed(0.5, 42)], path, progress=False)
    assert all(runner.draws_per_example(r) for r in records)
    older = [{**r, "settings": {k: v for k, v in r["settings"].items() if k != "random_draws"}}
             for r in records if not r["id"].endswith("/0")]   # as a run before per-example draws wrote them
    newer = [r for r in records if r["id"].endswith("/0")]
    assert runner.current_records(older + newer) == newer
    assert runner.current_records(older) == older   # alone, the older protocol is what the folder holds


def test_a_rerun_over_fewer_prompts_does_not_hide_the_control_drawn_for_all(tmp_path):
    """Run over 3 prompts per task, then over the first one only into the same folder: the second run redraws the
    first prompts' controls at ODA's rate over them; the report over the file (ODA on all 3) keeps, per pair, the
    record drawn at ODA's rate over all 3, so Random covers the prompts ODA covers."""
    model, tokenizer = oda_model(), word_tokenizer()
    policies = [runner.oda(0.0), runner.random_matched(0.0, 42)]
    suite, path = _suite(n_per_task=3), tmp_path / "results.jsonl"
    whole = runner.evaluate(model, tokenizer, suite, policies, path, progress=False)
    runner.evaluate(model, tokenizer, [e for e in suite if e.id.endswith("/0")], policies, path, progress=False)
    file = runner.ResultsFile(path, repair=False)
    redrawn = [key for key, versions in file.versions.items() if len(versions) > 1]
    assert redrawn, "the smaller run must move some task's rate for this test to mean anything"
    assert len(runner.current_records(file.records.values())) < len(whole)   # the newest records alone lose them
    assert sorted(file.current(), key=lambda r: (r["id"], r["policy"])) == sorted(
        whole, key=lambda r: (r["id"], r["policy"]))


def test_one_example_id_is_one_prompt_in_an_output_folder(tmp_path):
    """Another suite's prompts under the same ids (e.g. another length) are refused, whichever policies run; a merge
    of such folders is refused before anything is appended."""
    model, tokenizer = oda_model(), word_tokenizer()
    path = tmp_path / "a" / "results.jsonl"
    runner.evaluate(model, tokenizer, _suite(), [runner.full()], path, progress=False)
    with pytest.raises(ValueError, match="another prompt or output cap.*prompt_sha256"):
        runner.evaluate(model, tokenizer, _suite(length=14), [runner.streaming_llm()], path, progress=False)
    with pytest.raises(ValueError, match="another prompt or output cap.*max_new_tokens"):
        runner.evaluate(model, tokenizer, _suite(max_new_tokens=3), [runner.streaming_llm()], path, progress=False)
    other = tmp_path / "b" / "results.jsonl"
    runner.evaluate(model, tokenizer, _suite(n_per_task=3, length=14), [runner.streaming_llm()], other, progress=False)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="another prompt or output cap"):
        runner.merge_results(path, [other])
    assert path.read_bytes() == before


def test_runs_split_by_task_merge_into_one(tmp_path):
    model, tokenizer = oda_model(), word_tokenizer()
    policies = [runner.full(), runner.oda(0.0)]
    suite = _suite(n_per_task=2)
    whole = runner.evaluate(model, tokenizer, suite, policies, tmp_path / "whole" / "results.jsonl", progress=False)
    for part, task in (("a", "niah_single_1"), ("b", "qa_1")):
        runner.evaluate(model, tokenizer, [e for e in suite if e.task == task], policies,
                        tmp_path / part / "results.jsonl", progress=False)
    merged = tmp_path / "a" / "results.jsonl"
    assert runner.merge_results(merged, [tmp_path / "b" / "results.jsonl"]) == 4
    assert runner.merge_results(merged, [tmp_path / "b" / "results.jsonl"]) == 0  # nothing new the second time
    records = runner.ResultsFile(merged).records
    assert sorted(records) == sorted((r["id"], r["policy"]) for r in whole)
    assert all(records[(r["id"], r["policy"])] == r for r in whole)
    # A rerun over the whole suite into the merged folder generates nothing.
    again = runner.evaluate(model, tokenizer, suite, policies, merged, progress=False)
    assert again == whole
    # Records of other settings never mix in, and a source without a manifest is refused.
    model.set_routing(sinks=3, window=5)
    runner.evaluate(model, tokenizer, suite[:1], policies, tmp_path / "other" / "results.jsonl", progress=False)
    with pytest.raises(ValueError, match="other settings"):
        runner.merge_results(merged, [tmp_path / "other" / "results.jsonl"])
    (tmp_path / "other" / "results.manifest.json").unlink()
    with pytest.raises(ValueError, match="no manifest"):
        runner.merge_results(merged, [tmp_path / "other" / "results.jsonl"])


def test_a_merge_into_an_older_folder_warns_of_what_it_cannot_check(tmp_path, caplog):
    """A destination written before the fingerprints were recorded took a newer source's records with no word, where
    every other reuse of such a folder warns."""
    model, tokenizer = oda_model(), word_tokenizer()
    suite = _suite(n_per_task=2)
    for part, task in (("a", "niah_single_1"), ("b", "qa_1")):
        runner.evaluate(model, tokenizer, [e for e in suite if e.task == task], [runner.full()],
                        tmp_path / part / "results.jsonl", progress=False)
    with caplog.at_level("WARNING", logger="oda_hf"):
        runner.merge_results(tmp_path / "a" / "results.jsonl", [tmp_path / "b" / "results.jsonl"])
    assert "written before" not in caplog.text
    manifest_path = tmp_path / "a" / "results.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["settings"]["base_config_sha256"]
    manifest_path.write_text(json.dumps(manifest))
    (tmp_path / "a" / "results.jsonl").write_text("")
    with caplog.at_level("WARNING", logger="oda_hf"):
        assert runner.merge_results(tmp_path / "a" / "results.jsonl", [tmp_path / "b" / "results.jsonl"]) == 2
    assert (f"{manifest_path} was written before oda_hf recorded base_config_sha256: {tmp_path / 'b' / 'results.jsonl'}"
            "'s records are merged into it without checking those") in caplog.text


def test_merge_keeps_the_matched_random_records_drawn_at_the_current_rate(tmp_path):
    """The split workflow: folder b starts as a copy of a, each redraws the matched control of its own tasks
    over more prompts; the merge must keep, per pair, the record at ODA's rate over the merged records."""
    import shutil

    model, tokenizer = oda_model(), word_tokenizer()
    policies = [runner.oda(0.0), runner.random_matched(0.0, 42)]
    suite = _suite(n_per_task=3)
    a, b = tmp_path / "a" / "results.jsonl", tmp_path / "b" / "results.jsonl"
    runner.evaluate(model, tokenizer, [e for e in suite if e.id.endswith("/0")], policies, a, progress=False)
    b.parent.mkdir()
    for name in ("results.jsonl", "results.manifest.json"):
        shutil.copy(tmp_path / "a" / name, tmp_path / "b" / name)
    for path, task in ((a, "qa_1"), (b, "niah_single_1")):
        runner.evaluate(model, tokenizer, [e for e in suite if e.task == task], policies, path, progress=False)
    fresh = runner.evaluate(model, tokenizer, suite, policies, tmp_path / "fresh.jsonl", progress=False)
    old = runner.ResultsFile(a).records[("niah_single_1/0", "random~oda@0/seed42")]
    assert old["p"] != next(r["p"] for r in fresh if r["id"] == "niah_single_1/0" and r["kind"] == "random")  # stale
    runner.merge_results(a, [b])
    merged = runner.ResultsFile(a).records
    assert [merged[(r["id"], r["policy"])] for r in fresh] == fresh


def test_merge_takes_what_each_source_reports(tmp_path):
    """A source rerun over fewer prompts redraws their matched control at the smaller run's rate; its own report then
    reads the earlier records at the current rate. The merge took only each pair's newest record, so the merged
    report lost the control of the other prompts (2 of 4 here)."""
    from collections import Counter

    model, tokenizer = oda_model(), word_tokenizer()
    policies = [runner.oda(0.0), runner.random_matched(0.0, 42)]
    suite = _suite(n_per_task=4)
    needles = [e for e in suite if e.task == "niah_single_1"]
    a, b = tmp_path / "a" / "results.jsonl", tmp_path / "b" / "results.jsonl"
    runner.evaluate(model, tokenizer, needles, policies, b, progress=False)
    runner.evaluate(model, tokenizer, suites.select_examples(needles, None, 2), policies, b, progress=False)
    runner.evaluate(model, tokenizer, [e for e in suite if e.task == "qa_1"], policies, a, progress=False)
    counts = Counter((r["group"], r["task"]) for r in runner.ResultsFile(b).current())
    assert counts[("random~oda@0", "niah_single_1")] == 4
    runner.merge_results(a, [b])
    merged = Counter((r["group"], r["task"]) for r in runner.ResultsFile(a).current())
    assert merged[("random~oda@0", "niah_single_1")] == merged[("oda@0", "niah_single_1")] == 4


def test_merge_refuses_an_example_scored_against_other_answers(tmp_path):
    """Two folders whose data gave one example id other answers (corrected between runs): merged, the same output
    scored 0 for Full and 100 for ODA. Refused, naming the field; rerunning each folder rescores it first."""
    import dataclasses

    model, tokenizer = oda_model(), word_tokenizer()
    example = _suite(n_per_task=1)[0]
    a, b = tmp_path / "a" / "results.jsonl", tmp_path / "b" / "results.jsonl"
    runner.evaluate(model, tokenizer, [dataclasses.replace(example, answers=["w1000"])], [runner.full()], a,
                    progress=False)
    runner.evaluate(model, tokenizer, [example], [runner.oda(0.0)], b, progress=False)
    with pytest.raises(ValueError, match=r"scores example niah_single_1/0 otherwise than .* \(answers\)"):
        runner.merge_results(a, [b])
    assert len(runner.ResultsFile(a).records) == 1   # nothing appended
    runner.evaluate(model, tokenizer, [example], [runner.full()], a, progress=False)   # rescored, not regenerated
    assert runner.merge_results(a, [b]) == 1


def test_random_controls_draw_per_example(tmp_path):
    """Each prompt of a seed takes its own draws (seeded by seed and example id), the ones `RandomPolicy` with
    `example_seed` makes; a fixed-p Random record replays exactly through `generate()`."""
    model, tokenizer = oda_model(), word_tokenizer()
    suite = _suite(n_per_task=3)
    records = runner.evaluate(model, tokenizer, suite, [runner.random_fixed(0.5, 42)], tmp_path / "r.jsonl",
                              progress=False)
    assert all(r["settings"]["random_draws"] == "per-example" for r in records)
    assert runner.example_seed(42, "qa_1/0") == runner.example_seed(42, "qa_1/0") != runner.example_seed(43, "qa_1/0")
    assert runner.example_seed(42, "qa_1/0") != runner.example_seed(42, "qa_1/1")
    # Pinned: the seed must not depend on the process (Python's str hash does) or the platform.
    assert runner.example_seed(42, "qa_1/0") == int.from_bytes(hashlib.sha256(b"42/qa_1/0").digest()[:8], "big") >> 1
    patterns = {tuple(r["decisions"]) for r in records if r["routed_steps"] >= 4}
    assert len(patterns) > 1, "prompts of one seed must not share one decision pattern"
    for record in records:
        example = next(e for e in suite if e.id == record["id"])
        ids = torch.tensor([runner.encode_prompt(example, tokenizer)])
        model.set_routing(policy=RandomPolicy(0.5, runner.example_seed(42, example.id)))
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       generation_config=runner.greedy_config(model, tokenizer, example.max_new_tokens))
        assert model.routing.decisions[0, :record["routed_steps"]].tolist() == record["decisions"]
    with pytest.raises(ValueError, match="per example"):
        runner.random_fixed(0.5, 42).routing()


def _as_old_draws(path):
    """Rewrite a results file's Random records as an older oda_hf wrote them (no `random_draws` setting)."""
    lines = []
    for record in map(json.loads, path.read_text().splitlines()):
        if record["kind"] == "random":
            del record["settings"]["random_draws"]
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")


def test_random_records_of_shared_draws_are_drawn_again_and_the_rest_kept(tmp_path, monkeypatch):
    model, tokenizer = oda_model(), word_tokenizer()
    suite, policies = _suite(n_per_task=2), [runner.full(), runner.oda(0.0), runner.random_matched(0.0, 42)]
    path = tmp_path / "results.jsonl"
    fresh = runner.evaluate(model, tokenizer, suite, policies, path, progress=False)
    _as_old_draws(path)
    calls = []
    original = runner.generate_record
    monkeypatch.setattr(runner, "generate_record", lambda *a, **k: calls.append(a[3].name) or original(*a, **k))
    again = runner.evaluate(model, tokenizer, suite, policies, path, progress=False)
    assert calls == ["random~oda@0/seed42"] * len(suite)  # Full and ODA records reused
    assert again == fresh
    keyed = {(r["id"], r["policy"]): r for r in fresh}
    assert runner.ResultsFile(path, repair=False).records == keyed  # the new records supersede the old
    # Merging: the example's own draws replace shared ones, never the other way round.
    old = tmp_path / "old" / "results.jsonl"
    runner.evaluate(model, tokenizer, suite, policies, old, progress=False)
    _as_old_draws(old)
    assert runner.merge_results(path, [old]) == 0
    assert runner.merge_results(old, [path]) == len(suite)
    assert runner.ResultsFile(old, repair=False).records == keyed


def _first_run(tmp_path):
    model, tokenizer = oda_model(), word_tokenizer()
    examples, policies = _suite(n_per_task=1), [runner.full(), runner.oda(0.0), runner.random_matched(0.0, 42)]
    path = tmp_path / "results.jsonl"
    records = runner.evaluate(model, tokenizer, examples, policies, path, progress=False)
    return model, tokenizer, examples, policies, path, records


def test_records_and_manifest_carry_the_settings(tmp_path):
    model, tokenizer, examples, _, path, records = _first_run(tmp_path)
    manifest = json.loads((tmp_path / "results.manifest.json").read_text())
    head = runner.head_fingerprint(model.recall_head)
    assert manifest["settings"] == {"model": base_fingerprint(model.base_model),
                                    "base_config_sha256": base_config_fingerprint(model), "dtype": "float32",
                                    "head_sha256": head, "sinks": 2, "window": 4, "chat_template": False,
                                    "generation_sha256": runner.generation_fingerprint(model, tokenizer)}
    assert set(manifest["versions"]) == {"oda_hf", "transformers", "torch"}
    for record in records:
        settings = record["settings"]
        assert {k: settings[k] for k in manifest["settings"]} == manifest["settings"]
        assert settings["policy"] == record["policy"] and settings["max_new_tokens"] == 6
        assert settings["threshold"] == (None if record["kind"] == "full" else 0.0)
        assert settings["seed"] == (42 if record["kind"] == "random" else None)
        assert settings["prompt_sha256"] == runner.prompt_fingerprint(
            runner.encode_prompt(next(e for e in examples if e.id == record["id"]), word_tokenizer()))
    on_disk = {(r["id"], r["policy"]): r["settings"] for r in map(json.loads, path.read_text().splitlines())}
    assert on_disk == {(r["id"], r["policy"]): r["settings"] for r in records}


def test_head_fingerprint_follows_the_weights(tmp_path):
    head = oda_model().recall_head
    head.save_pretrained(tmp_path / "head")
    assert runner.head_fingerprint(RecallHead.from_pretrained(tmp_path / "head")) == runner.head_fingerprint(head)
    with torch.no_grad():
        next(iter(head.parameters())).view(-1)[0] += 1e-6
    assert runner.head_fingerprint(head) != runner.head_fingerprint(RecallHead.from_pretrained(tmp_path / "head"))
    assert runner.head_fingerprint(None) is None


def _change_geometry(model, examples):
    model.set_routing(sinks=3, window=5)


def _change_head(model, examples):
    with torch.no_grad():
        next(iter(model.recall_head.parameters())).view(-1)[0] += 0.5


def _change_cap(model, examples):
    examples[0].max_new_tokens = 4


def _change_prompt(model, examples):
    examples[0].prompt = examples[0].prompt + " w9"


@pytest.mark.parametrize("change, keys, manifest_catches", [
    (_change_geometry, ["sinks: 2 there, 3 now", "window: 4 there, 5 now"], True),
    (_change_head, ["head_sha256"], True),
    (_change_cap, ["max_new_tokens: 6 there, 4 now"], False),
    (_change_prompt, ["prompt_sha256"], False),
])
def test_rerun_with_other_settings_is_refused(tmp_path, change, keys, manifest_catches):
    model, tokenizer, examples, policies, path, _ = _first_run(tmp_path)
    before = path.read_text()
    change(model, examples)
    with pytest.raises(ValueError) as manifest_error:
        runner.evaluate(model, tokenizer, examples, policies, path, progress=False)
    # Without the manifest, every reused record still catches it (its own settings).
    (tmp_path / "results.manifest.json").unlink()
    with pytest.raises(ValueError) as record_error:
        runner.evaluate(model, tokenizer, examples, policies, path, progress=False)
    for error in (manifest_error, record_error):
        message = str(error.value)
        assert all(key in message for key in keys) and "new output folder" in message
    assert ("manifest" in str(manifest_error.value)) == manifest_catches
    assert path.read_text() == before and not (tmp_path / "results.manifest.json").exists()  # nothing written


def test_records_without_settings_are_not_reused(tmp_path):
    model, tokenizer, examples, policies, path, records = _first_run(tmp_path)
    (tmp_path / "results.manifest.json").unlink()
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "settings"}) + "\n" for r in records))
    with pytest.raises(ValueError, match="without its settings"):
        runner.evaluate(model, tokenizer, examples, policies, path, progress=False)
    adopted = runner.evaluate(model, tokenizer, examples, policies, path, progress=False, adopt_unlabeled=True)
    # Reused, not redone; except Random records: older versions drew them with one seed for all prompts.
    assert [r for r in adopted if r["kind"] != "random"] == [
        {k: v for k, v in r.items() if k != "settings"} for r in records if r["kind"] != "random"]
    assert [r for r in adopted if r["kind"] == "random"] == [r for r in records if r["kind"] == "random"]
    assert json.loads((tmp_path / "results.manifest.json").read_text())["settings"]["sinks"] == 2


def test_results_file_repairs_an_interrupted_last_line(tmp_path, caplog):
    path = tmp_path / "r.jsonl"
    a, b = json.dumps({"id": "a", "policy": "full"}), json.dumps({"id": "b", "policy": "full"})
    path.write_text(a + "\n" + b[:7])
    with caplog.at_level("WARNING", logger=runner.__name__):
        results = runner.ResultsFile(path)
    assert path.read_text() == a + "\n" and list(results.records) == [("a", "full")]
    assert "removed an incomplete last line" in caplog.text
    results.add({"id": "b", "policy": "full"})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b"]
    path.write_text(a + "\n" + b)  # complete record, line end not written: the line end is added
    assert len(runner.ResultsFile(path).records) == 2 and path.read_text() == a + "\n" + b + "\n"
    path.write_text(a + "\n" + b[:7])
    assert len(runner.ResultsFile(path, repair=False).records) == 1 and path.read_text() == a + "\n" + b[:7]
    path.write_text(a + "\n" + b[:7] + "\n" + b + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: unreadable record in the middle"):
        runner.ResultsFile(path)


def test_evaluation_input_errors(tmp_path):
    model, tokenizer = oda_model(), word_tokenizer()
    with pytest.raises(ValueError, match="add that ODA policy"):
        runner.evaluate(model, tokenizer, _suite(1), [runner.random_matched(0.0, 42)], tmp_path / "r.jsonl")
    plain = OdaForCausalLM(tiny_model("llama"), oda_config=OdaConfig(sinks=2, window=4, policy="local"))
    with pytest.raises(ValueError, match="recall head"):
        runner.evaluate(plain, tokenizer, _suite(1), [runner.oda(0.0)], tmp_path / "r.jsonl")
    with pytest.raises(ValueError, match="either a fixed probability"):
        runner.PolicySpec("random", p=0.5, seed=1, matched=True, threshold=0.0)
    with pytest.raises(ValueError, match="probability"):
        runner.random_fixed(1.5, 1)
    with pytest.raises(ValueError, match="empty"):
        runner.evaluate(model, tokenizer, [], [runner.full()], tmp_path / "r.jsonl")


def test_trajectory_html_and_png(tmp_path):
    tokens = ["The", " answer", " is", " 42", "."]
    html = trajectory.render_html(tokens, [1, 0, 1, 0], answers=["42"], head_scores=[0.5, -0.2, 0.1, -1.0])
    assert html.count('class="tok prefill"') == 1
    assert html.count('class="tok full') == 2 and html.count('class="tok local') == 2
    assert 'class="tok full answer"' in html  # " 42" came from Full and overlaps the reference
    assert "Full at 2 of 4 routed positions (50.0%)" in html and "q=0.5" in html
    with pytest.raises(ValueError, match="routed decisions"):
        trajectory.render_html(tokens, [1, 0], answers=[])
    tokenizer = word_tokenizer()
    ids = [7, 8, 9, 2]  # w7 w8 w9 <eos>
    pieces = trajectory.token_strings(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) and pieces[1] == " w8"
    # Byte-level BPE splits a Chinese character over byte tokens: the completing token carries it.
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["hello world"], trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_level = PreTrainedTokenizerFast(tokenizer_object=backend)
    byte_ids = byte_level("北京 hello")["input_ids"]
    byte_pieces = trajectory.token_strings(byte_level, byte_ids)
    assert "".join(byte_pieces) == "北京 hello" and "北" in byte_pieces and "" in byte_pieces
    record = {"id": "niah_single_1/0", "task": "niah_single_1", "policy": "oda@0", "output_ids": ids,
              "decisions": [1, 0, 1], "answers": ["w8 w9"]}
    pytest.importorskip("matplotlib")
    items = trajectory.render_record(record, tokenizer, html_path=tmp_path / "t.html", png_path=tmp_path / "t.png")
    assert [(i.text, i.role, i.answer) for i in items] == [("w7", "prefill", False), (" w8", "full", True),
                                                          (" w9", "local", True)]  # <eos> left out
    assert "tok local answer" in (tmp_path / "t.html").read_text() and os.path.getsize(tmp_path / "t.png") > 1000


# -- the command line ---------------------------------------------------------------------------------------------


def _cli_setup(tmp_path, max_new_tokens: int, **suite):
    """A tiny base and head saved under `tmp_path`, a JSONL suite, and the `oda` parser: (model, suite, parser)."""
    model, tokenizer = oda_model(), word_tokenizer()
    model.base_model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    model.recall_head.save_pretrained(tmp_path / "head")
    path = tmp_path / "suite.jsonl"
    _write_jsonl(path, [{"id": e.id, "task": e.task, "prompt": e.prompt, "answers": e.answers,
                         "max_new_tokens": max_new_tokens} for e in _suite(**suite)])
    parser = argparse.ArgumentParser(prog="oda")
    add_cli(parser.add_subparsers(dest="command", required=True))
    return model, path, parser


def test_cli_eval_table_and_trajectories_show_the_same_default_threshold(tmp_path):
    """Without --primary-threshold (and no 0 run), the first threshold given is the main table's and the
    trajectories' (the table once took the lowest and the trajectories the first)."""
    _, suite, parser = _cli_setup(tmp_path, 3, n_per_task=1)
    out = tmp_path / "eval"
    args = parser.parse_args(["eval", "--base", str(tmp_path / "base"), "--head", str(tmp_path / "head"), "--sinks",
                              "2", "--window", "4", "--data", str(suite), "--policies", "oda", "--thresholds", "0.05",
                              "-0.05", "--trajectories", "1", "--out", str(out), "--no-progress", "--no-plots"])
    assert args.func(args) == 0
    report = (out / "report.md").read_text()
    assert "θ=0.05)" in report and "θ=-0.05)" not in report.split("## Quality")[1].split("\n\n")[1]
    assert "oda@0.05" in (out / "trajectories" / "niah_single_1_0.html").read_text()
    # rebuilt from the folder: the same main table (it took the lowest threshold, -0.05, and its numbers)
    args = parser.parse_args(["eval", "--out", str(out), "--report-only", "--no-plots"])
    assert args.func(args) == 0
    assert (out / "report.md").read_text() == report


def test_cli_eval_and_diagnose(tmp_path):
    pytest.importorskip("matplotlib")
    model, suite, parser = _cli_setup(tmp_path, 5, n_per_task=1)
    common = ["--base", str(tmp_path / "base"), "--head", str(tmp_path / "head"), "--sinks", "2", "--window", "4"]
    out = tmp_path / "eval"
    args = parser.parse_args(["eval", *common, "--data", str(suite), "--policies", "full", "local", "oda", "random",
                              "--thresholds", "0", "--seeds", "42", "--trajectories", "1", "--out", str(out),
                              "--no-progress"])
    assert args.func(args) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 and all(r["max_new_tokens"] == 5 for r in records)
    assert {r["policy"] for r in records} == {"full", "streamingllm", "oda@0", "random~oda@0/seed42"}
    saved_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert json.loads((out / "manifest.json").read_text())["settings"]["model"] == base_fingerprint(saved_base)
    rerun = [a if a != "4" else "5" for a in ["eval", *common, "--data", str(suite), "--policies", "full", "--out",
                                             str(out), "--no-progress"]]
    args = parser.parse_args(rerun)  # --window 5 into the same --out
    with pytest.raises(UsageError, match="window: 4 there, 5 now"):  # a user error: one line, exit status 2
        args.func(args)
    for name in ("report.md", "quality_vs_rate.png", "per_task.png", "trajectories/niah_single_1_0.html"):
        assert (out / name).exists()
    args = parser.parse_args(["eval", "--out", str(out), "--report-only", "--no-plots"])
    assert args.func(args) == 0
    # One evaluation split by task over two output folders, merged back into one.
    for part, task in (("a", "niah_single_1"), ("b", "qa_1")):
        args = parser.parse_args(["eval", *common, "--data", str(suite), "--policies", "full", "--tasks", task,
                                  "--out", str(tmp_path / part), "--no-progress", "--no-plots"])
        assert args.func(args) == 0
    args = parser.parse_args(["eval", "--out", str(tmp_path / "a"), "--merge", str(tmp_path / "b"), "--no-plots"])
    assert args.func(args) == 0
    merged = [json.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in merged) == sorted(r["id"] for r in records if r["policy"] == "full")
    assert "qa_1" in (tmp_path / "a" / "report.md").read_text()
    args = parser.parse_args(["eval", "--out", str(tmp_path / "a"), "--merge", str(tmp_path / "missing")])
    with pytest.raises(UsageError, match="--merge .*missing"):
        args.func(args)
    refs = tmp_path / "refs.jsonl"
    _write_jsonl(refs, [{"id": f"r{i}", "input_ids": torch.randint(3, VOCAB, (14,)).tolist()} for i in range(2)])
    diag = tmp_path / "diag"
    args = parser.parse_args(["diagnose", *common, "--data", str(refs), "--positions", "5", "--bootstrap", "20",
                              "--seed", "7", "--threshold", "0.25", "--out", str(diag), "--no-progress"])
    assert args.func(args) == 0
    for name in ("positions.jsonl", "diagnostics.md", "diagnostics.json", "budget_curve.png"):
        assert (diag / name).exists()
    result = json.loads((diag / "diagnostics.json").read_text())
    assert result["positions"] == 2 * 5 and result["seed"] == 7   # --positions per document, the bootstrap's --seed
    assert result["history"] == "selected" and result["threshold"] == 0.25   # the branch committed at --threshold


class _Stop(Exception):
    pass


def test_cli_eval_passes_its_options_to_the_run(tmp_path, monkeypatch):
    """--dtype, --chat-template, every --seeds value, --max-new-tokens of each suite and --max-input-tokens reach the
    run; records without settings are adopted only with --adopt-unlabeled-records."""
    from tiny_models import save_word_tokenizer

    _, suite, parser = _cli_setup(tmp_path, 5, n_per_task=1)
    save_word_tokenizer(tmp_path / "tok", VOCAB)   # with a chat template
    _write_jsonl(tmp_path / "ruler" / "niah_single_1" / "validation.jsonl",
                 [{"index": 0, "input": "w5 w6 w7", "outputs": ["w8"], "length": 3}])   # RULER's cap: 128
    context = " ".join(f"w{i}" for i in range(4, 34))
    _write_jsonl(tmp_path / "longbench" / "hotpotqa.jsonl", [{"input": "w40", "context": context, "answers": ["w9"],
                                                              "all_classes": None, "dataset": "hotpotqa", "_id": "h1"}])
    seen = []

    def spy(model, tokenizer, examples, policies, path, **kwargs):
        seen.append(dict(kwargs, dtype=model.dtype, examples=examples, policies={p.name for p in policies}))
        raise _Stop

    monkeypatch.setattr(runner, "evaluate", spy)
    common = ["eval", "--base", str(tmp_path / "base"), "--head", str(tmp_path / "head"), "--no-progress"]
    runs = [["--data", str(suite), "--tokenizer", str(tmp_path / "tok"), "--chat-template", "--dtype", "bf16",
             "--policies", "oda", "random", "random:0.3", "--thresholds", "0", "--seeds", "1", "2",
             "--max-new-tokens", "2"],
            ["--suite", "ruler", "--data", str(tmp_path / "ruler"), "--policies", "full", "--max-new-tokens", "2"],
            ["--suite", "longbench", "--data", str(tmp_path / "longbench"), "--policies", "full",
             "--max-input-tokens", "10"]]
    for i, run in enumerate(runs):
        args = parser.parse_args(common + run + ["--out", str(tmp_path / f"out{i}")])
        with pytest.raises(_Stop):
            args.func(args)
    jsonl, ruler, longbench = seen
    assert jsonl["dtype"] == torch.bfloat16 and jsonl["chat_template"] is True and jsonl["adopt_unlabeled"] is False
    assert {r.name for r in (runner.random_matched(0.0, 1), runner.random_matched(0.0, 2), runner.random_fixed(0.3, 1),
                             runner.random_fixed(0.3, 2))} <= jsonl["policies"]
    assert all(e.max_new_tokens == 2 for e in jsonl["examples"] + ruler["examples"]) and len(ruler["examples"]) == 1
    assert ruler["dtype"] == torch.float32 and ruler["chat_template"] is False
    (example,) = longbench["examples"]
    truncated = suites.load_longbench(tmp_path / "longbench", tokenizer=word_tokenizer(), max_length=10)[0].prompt
    assert example.prompt == truncated and "w20" not in truncated   # middle-truncated to 10 tokens


def test_cli_eval_budget_policy_holds_per_request(tmp_path):
    """`--policies budget:R`: the head under a Full-call budget at each ODA threshold; no request exceeds R, the
    report names it and shows the highest per-request rate; an ungated head at the same threshold exceeds R."""
    _, suite, parser = _cli_setup(tmp_path, 12, n_per_task=2, length=14)
    out = tmp_path / "eval"
    args = parser.parse_args(["eval", "--base", str(tmp_path / "base"), "--head", str(tmp_path / "head"), "--sinks",
                              "2", "--window", "4", "--data", str(suite), "--policies", "oda", "budget:0.25",
                              "budget:0.5", "--thresholds", "-10", "--out", str(out), "--no-progress", "--no-plots"])
    assert args.func(args) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    groups = report.summarize(records)
    assert set(groups) == {"oda@-10", "budget@p0.25(oda@-10)", "budget@p0.5(oda@-10)"}
    assert groups["oda@-10"].max_request_rate == 1.0  # the head asks at every step at this threshold
    for rate in (0.25, 0.5):
        group = groups[f"budget@p{rate:g}(oda@-10)"]
        assert 0 < group.max_request_rate <= rate and group.full_calls > 0
        for record in records:
            if record["group"] == group.group:  # the budget holds at every prefix of the request, not on average
                decided = record["decisions"][record["window_steps"]:]  # in-window steps come first
                assert all(sum(decided[:n]) <= rate * n + 1e-9 for n in range(1, len(decided) + 1))
    text = (out / "report.md").read_text()
    assert "Budget (rate <= 0.25, head θ=-10)" in text and "Highest request rate" in text
    bad = parser.parse_args.__self__  # the parser itself: budget:R is checked at parse time
    with pytest.raises(SystemExit):
        bad.parse_args(["eval", "--base", "x", "--data", "y", "--out", "z", "--policies", "budget:1.5"])


def test_trajectory_file_stems_of_ids_that_print_alike_differ():
    """`qa/1` and `qa_1` both read as `qa_1`: `oda eval --trajectories` gives the second a hashed name, or it would
    have overwritten the first one's files."""
    from oda_hf.evaluation.trajectory import file_stem

    assert file_stem("qa/1") == file_stem("qa_1") == "qa_1"   # RULER-style ids keep readable names
    assert file_stem("qa_1", hashed=True) not in ("qa_1", file_stem("qa/1", hashed=True))


def test_an_earlier_version_brought_back_must_be_scored_as_the_rest():
    """A stale matched Random record gives way to an earlier version at the current rate, which a rerun over fewer
    prompts did not rescore: scored against old answers beside Full against new ones, it is refused, not reported."""
    matched = runner.random_matched(0.5, 0).name

    def rec(policy, kind, answers, score, **changes):
        record = {"id": "e0", "task": "t", "metric": "string_match_all", "scorer": "string_match_all/v1",
                  "answers": answers, "score": score, "policy": policy, "kind": kind, "threshold": None,
                  "full_calls": 2, "routed_steps": 4, "window_steps": 0, "window_full_calls": 0, "output": "w5",
                  "settings": {"random_draws": runner.RANDOM_DRAWS}}
        return {**record, **changes}

    records = [rec("full", "full", ["w5"], 1.0), rec(runner.oda(0.5).name, "oda", ["w5"], 1.0, threshold=0.5),
               rec(matched, "random", ["w5"], 1.0, threshold=0.5, p=0.25)]   # redrawn at another rate
    versions = {("e0", matched): [rec(matched, "random", ["w9"], 0.0, threshold=0.5, p=0.5), records[2]]}
    with pytest.raises(ValueError, match="example e0 is scored otherwise .answers."):
        runner.current_records(records, versions)
    versions[("e0", matched)][0]["answers"] = ["w5"]   # rescored alike: reported
    assert [r["p"] for r in runner.current_records(records, versions) if r["kind"] == "random"] == [0.5]


def test_an_infinite_confidence_baseline_ranks_in_order():
    """Found by an audit: a certain Local step (second-best probability 0, top-2 log-ratio +inf) made the negated
    baseline -inf, which the rankings' rule (non-finite = Full first, the head's) put first: AUROC 0.5 for 1.0."""
    n = 4
    record = diagnostics.ReferencePositions(
        doc_id="d", history="full", positions=np.arange(1, n + 1), targets=np.zeros(n, dtype=int),
        full_logp=np.array([-1.0, -1.0, 0.0, 0.0]), local_logp=np.array([-2.0, -2.0, 0.0, 0.0]),
        head_scores=np.full(n, np.nan), selected_full=np.zeros(n, dtype=bool), local_top1=np.zeros(n, dtype=int),
        full_top1=np.zeros(n, dtype=int), entropy=np.array([1.0, 0.9, 0.0, 0.0]),
        max_prob=np.array([0.5, 0.6, 1.0, 1.0]), margin=np.array([0.1, 0.2, 1.0, 1.0]),
        top2_logratio=np.array([0.5, 1.0, np.inf, np.inf]))
    pooled = diagnostics.Pooled.of([record])
    assert stats.auroc(pooled.rankings["neg_top2_logratio"], pooled.gains > 0) == 1.0
