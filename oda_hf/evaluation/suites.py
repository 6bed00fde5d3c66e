"""Task suites: examples with a prompt, reference answers, a metric and an output cap.

Sources:

* `load_examples` - JSONL files or in-memory dicts of the generic form
  ``{"id", "task", "prompt" (text or a list of token ids), "answers": [...], "max_new_tokens"}``
  (optional ``"metric"``, ``"answer_prefix"``); the metric defaults to the official one of a known
  RULER / LongBench task name. `write_examples` writes any suite in this form.
* `load_ruler` - RULER's generated ``{"index", "input", "outputs", "length"[, "answer_prefix"]}``
  files (``<task>.jsonl``, or ``<task>/validation.jsonl`` as RULER's prepare.py writes them).
* `load_longbench` - LongBench v1 files ``{"input", "context", "answers", "all_classes", "length",
  "dataset", "_id"}`` for the paper's ten tasks, with LongBench's prompt templates, output caps and
  middle truncation of over-long prompts.
* `examples_from_organism` - the model organism's `Example` objects (token-id prompts).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from .metrics import LONGBENCH_METRICS, METRICS, RULER_TASKS, default_metric


@dataclass
class EvalExample:
    """One evaluation prompt.

    Exactly one of `prompt` (text) and `input_ids` is set. `answer_prefix` is appended after the
    prompt (after the chat template when one is applied), as RULER does with its answer prefixes.
    """

    id: str
    task: str
    answers: list[str]
    max_new_tokens: int
    metric: str
    prompt: str | None = None
    input_ids: list[int] | None = None
    answer_prefix: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        where = f"example {self.id!r} (task {self.task!r})"
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError(f"{where}: give exactly one of a text prompt and input_ids.")
        if self.input_ids is not None and (not self.input_ids or not all(isinstance(i, int) for i in self.input_ids)):
            raise ValueError(f"{where}: input_ids must be a non-empty list of integers.")
        if isinstance(self.answers, str):
            self.answers = [self.answers]
        if not self.answers or not all(isinstance(a, str) for a in self.answers):
            raise ValueError(f"{where}: 'answers' must be a non-empty list of strings.")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be a positive integer; got {self.max_new_tokens!r}.")
        if self.metric not in METRICS:
            raise ValueError(f"{where}: unknown metric {self.metric!r}; expected one of {sorted(METRICS)}.")

    def to_dict(self) -> dict:
        return asdict(self)


# -- generic suite -----------------------------------------------------------------------------------


def example_from_dict(record: dict, *, default_max_new_tokens: int | None = None, where: str = "") -> EvalExample:
    """An `EvalExample` from a generic record (see the module docstring)."""
    missing = [key for key in ("id", "task", "prompt", "answers") if key not in record]
    if missing:
        raise ValueError(f"{where or 'record'}: missing field(s) {missing}; a suite record needs "
                         "'id', 'task', 'prompt', 'answers' and 'max_new_tokens'.")
    task = str(record["task"])
    metric = record.get("metric") or default_metric(task)
    if metric is None:
        raise ValueError(f"{where or 'record'}: task {task!r} has no default metric; add a 'metric' field "
                         f"(one of {sorted(METRICS)}).")
    max_new_tokens = record.get("max_new_tokens", default_max_new_tokens)
    if max_new_tokens is None:
        raise ValueError(f"{where or 'record'}: missing 'max_new_tokens'.")
    prompt = record["prompt"]
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
    meta = {k: v for k, v in record.items()
            if k not in ("id", "task", "prompt", "answers", "max_new_tokens", "metric", "answer_prefix")}
    return EvalExample(id=str(record["id"]), task=task, answers=record["answers"], max_new_tokens=max_new_tokens,
                       metric=metric, prompt=text, input_ids=ids, answer_prefix=record.get("answer_prefix", ""),
                       meta=meta)


def load_examples(source: str | os.PathLike | Iterable[dict], *, default_max_new_tokens: int | None = None,
                  tasks: Sequence[str] | None = None, limit: int | None = None) -> list[EvalExample]:
    """Generic suite from a JSONL path, a directory of them (searched recursively) or an iterable of dicts.

    `tasks` keeps only those tasks; `limit` keeps the first `limit` examples of each task.
    Example ids must be unique (they key the resumable results file).
    """
    if isinstance(source, (str, os.PathLike)):
        records = ((record, f"{path}:{line}") for path in _expand(source) for line, record in _read_jsonl(path))
    else:
        records = ((record, f"record {i}") for i, record in enumerate(source))
    examples = [example_from_dict(record, default_max_new_tokens=default_max_new_tokens, where=where)
                for record, where in records]
    return select_examples(examples, tasks, limit)


def write_examples(examples: Iterable[EvalExample], path: str | os.PathLike) -> None:
    """Write a suite as generic JSONL records (what `load_examples` and ``oda eval --suite jsonl`` read)."""
    with open(path, "w", encoding="utf-8") as f:
        for example in examples:
            record = {"id": example.id, "task": example.task,
                      "prompt": example.prompt if example.prompt is not None else example.input_ids,
                      "answers": example.answers, "max_new_tokens": example.max_new_tokens, "metric": example.metric}
            if example.answer_prefix:
                record["answer_prefix"] = example.answer_prefix
            reserved = set(record) | {"answer_prefix"}
            record.update({k: v for k, v in example.meta.items() if k not in reserved})
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def examples_from_organism(examples: Iterable, *, max_new_tokens: int | None = None, slack: int = 8,
                           task_with_length: bool = False) -> list[EvalExample]:
    """Suite from model-organism examples (`oda_hf.organism.Example`; read by attribute only).

    The prompt is the organism's token ids (``prompt_ids()``, with its ``<bos>``), so no tokenizer
    is needed to encode. The output cap is `max_new_tokens` if given, else the example's target
    length (with ``<eos>``) plus `slack`. With `task_with_length`, tasks are named ``task@length``
    so the report has one row per (task, length).
    """
    out = []
    for example in examples:
        task = f"{example.task}@{example.length}" if task_with_length else example.task
        cap = max_new_tokens or len(example.target_ids()) + slack
        out.append(EvalExample(
            id=f"{example.task}/{example.length}/{example.split}/{example.index}", task=task,
            answers=list(example.answers), max_new_tokens=cap, metric=default_metric(example.task),
            input_ids=list(example.prompt_ids()),
            meta={"length": example.length, "split": example.split, "target": example.target}))
    return select_examples(out, None, None)


# -- RULER ---------------------------------------------------------------------------------------------

#: RULER's `tokens_to_generate` per task family (scripts/data/synthetic/constants.py).
RULER_MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
_RULER_SUBSETS = ("validation", "test")


def ruler_max_new_tokens(task: str) -> int:
    family = "niah" if task.startswith("niah") else "qa" if task.startswith("qa") else task
    if family not in RULER_MAX_NEW_TOKENS:
        raise ValueError(f"Unknown RULER task {task!r}; expected one of {RULER_TASKS}.")
    return RULER_MAX_NEW_TOKENS[family]


def ruler_task_from_path(path: str | os.PathLike) -> str:
    """``.../niah_single_1.jsonl`` or ``.../niah_single_1/validation.jsonl`` -> ``niah_single_1``."""
    path = os.path.abspath(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    task = os.path.basename(os.path.dirname(path)) if stem in _RULER_SUBSETS else stem
    if task not in RULER_TASKS:
        raise ValueError(f"Cannot tell the RULER task of {path}: expected <task>.jsonl or <task>/validation.jsonl "
                         f"with a task in {RULER_TASKS}; pass task=... explicitly.")
    return task


def load_ruler(paths: str | os.PathLike | Sequence[str | os.PathLike], *, task: str | None = None,
               max_new_tokens: int | None = None, tasks: Sequence[str] | None = None,
               limit: int | None = None) -> list[EvalExample]:
    """RULER generated files; a directory is searched for ``*.jsonl`` (recursively).

    The prompt is ``input`` and, when the file has one, ``answer_prefix`` is kept separately so a
    chat template can go between them (RULER's newer prepare.py splits it off for that reason).
    `max_new_tokens` overrides RULER's per-task `tokens_to_generate` (the paper uses 512 for all).
    """
    examples = []
    for path in _expand(paths):
        name = task or ruler_task_from_path(path)
        metric = default_metric(name)
        cap = max_new_tokens or ruler_max_new_tokens(name)
        for line, record in _read_jsonl(path):
            for key in ("index", "input", "outputs"):
                if key not in record:
                    raise ValueError(f"{path}:{line}: RULER record without {key!r} (fields: {sorted(record)}).")
            examples.append(EvalExample(
                id=f"{name}/{record['index']}", task=name, answers=list(record["outputs"]), max_new_tokens=cap,
                metric=metric, prompt=record["input"], answer_prefix=record.get("answer_prefix", ""),
                meta={"length": record.get("length"), "source": os.fspath(path)}))
    return select_examples(examples, tasks, limit)


# -- LongBench v1 --------------------------------------------------------------------------------------

#: LongBench's config/dataset2prompt.json, the ten tasks of the paper's table.
LONGBENCH_PROMPTS = {
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, "
              "using a single phrase or sentence if possible. If the question cannot be answered based on the "
              "information in the article, write \"unanswerable\". If the question is a yes/no question, answer "
              "\"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n "
              "Answer the question based on the above article as concisely as you can, using a single phrase or "
              "sentence if possible. If the question cannot be answered based on the information in the article, "
              "write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
              "\"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
                       "question based on the above text, only give me the answer and do not output any other "
                       "words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"
                       "不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
                "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
                "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
                "{input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
                "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
                "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
                "{input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any "
               "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
               "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
               "{input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the "
             "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
             "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n"
                            "下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式"
                            "\n\n答案是：",
}
#: LongBench's config/dataset2maxlen.json for the same tasks (max new tokens).
LONGBENCH_MAX_NEW_TOKENS = {
    "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "2wikimqa": 32, "hotpotqa": 32, "musique": 32,
    "dureader": 128, "qmsum": 512, "vcsum": 512, "passage_retrieval_zh": 32,
}
assert set(LONGBENCH_PROMPTS) == set(LONGBENCH_MAX_NEW_TOKENS) == set(LONGBENCH_METRICS)


def middle_truncate(prompt: str, tokenizer, max_length: int) -> str:
    """LongBench's pred.py truncation: if the tokenized prompt exceeds `max_length` tokens, keep the
    text of the first and the last ``max_length // 2`` tokens (instructions sit at both ends)."""
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return (tokenizer.decode(ids[:half], skip_special_tokens=True)
            + tokenizer.decode(ids[-half:], skip_special_tokens=True))


def longbench_task_from_path(path: str | os.PathLike) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    task = stem[:-2] if stem.endswith("_e") else stem
    if task not in LONGBENCH_PROMPTS:
        raise ValueError(f"Cannot tell the LongBench task of {path}: expected <task>.jsonl with a task in "
                         f"{list(LONGBENCH_PROMPTS)}.")
    return task


def load_longbench(paths: str | os.PathLike | Sequence[str | os.PathLike], *, tokenizer=None,
                   max_length: int | None = None, max_new_tokens: int | None = None,
                   tasks: Sequence[str] | None = None, limit: int | None = None) -> list[EvalExample]:
    """LongBench v1 files (``<task>.jsonl`` as in the dataset's data.zip); a directory is searched.

    The task is the record's ``dataset`` field (else the file name). `max_length` is the input token
    budget (the paper uses 40,960): longer prompts are middle-truncated with `tokenizer` as LongBench
    does. `max_new_tokens` overrides LongBench's per-task output caps.
    """
    if max_length is not None and tokenizer is None:
        raise ValueError("Middle truncation to max_length needs the tokenizer (tokenizer=...).")
    examples = []
    for path in _expand(paths):
        for line, record in _read_jsonl(path):
            task = record.get("dataset") or longbench_task_from_path(path)
            task = task[:-2] if task.endswith("_e") else task
            if task not in LONGBENCH_PROMPTS:
                if tasks is None:
                    raise ValueError(f"{path}:{line}: LongBench task {task!r} is not one of the paper's ten "
                                     f"({list(LONGBENCH_PROMPTS)}).")
                continue
            for key in ("input", "context", "answers"):
                if key not in record:
                    raise ValueError(f"{path}:{line}: LongBench record without {key!r} (fields: {sorted(record)}).")
            prompt = LONGBENCH_PROMPTS[task].format(context=record["context"], input=record["input"])
            if max_length is not None:
                prompt = middle_truncate(prompt, tokenizer, max_length)
            identifier = record.get("_id", line)
            examples.append(EvalExample(
                id=f"{task}/{identifier}", task=task, answers=list(record["answers"]),
                max_new_tokens=max_new_tokens or LONGBENCH_MAX_NEW_TOKENS[task], metric=LONGBENCH_METRICS[task],
                prompt=prompt, meta={"length": record.get("length"), "all_classes": record.get("all_classes"),
                                     "source": os.fspath(path)}))
    return select_examples(examples, tasks, limit)


# -- helpers -------------------------------------------------------------------------------------------


def _read_jsonl(path) -> Iterable[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err}).") from err
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object per line.")
            yield number, record


def suite_sha256(source: str | os.PathLike) -> str:
    """SHA-256 of the suite `load_examples(source)` reads: a JSONL file's bytes, or for a folder every JSONL file
    under it (relative name and bytes, in reading order), so a calibration or evaluation can tell its data."""
    import hashlib

    root = os.fspath(source)
    files = _expand(root)
    if files == [root]:
        from ..known_models import file_sha256
        return file_sha256(root)
    digest = hashlib.sha256()
    for path in files:
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def _expand(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for path in paths:
        path = os.fspath(path)
        if os.path.isdir(path):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                           for name in names if name.endswith(".jsonl"))
            if not found:
                raise FileNotFoundError(f"No .jsonl file under {path}.")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"No such file or directory: {path}")
    return files


def select_examples(examples: list[EvalExample], tasks: Sequence[str] | None, limit: int | None) -> list[EvalExample]:
    if tasks is not None:
        unknown = set(tasks) - {e.task for e in examples}
        if unknown:
            raise ValueError(f"Task(s) {sorted(unknown)} not found in the suite (it has "
                             f"{sorted({e.task for e in examples})}).")
        examples = [e for e in examples if e.task in set(tasks)]
    if limit is not None:
        kept, seen = [], {}
        for example in examples:
            seen[example.task] = seen.get(example.task, 0) + 1
            if seen[example.task] <= limit:
                kept.append(example)
        examples = kept
    ids = [e.id for e in examples]
    if len(set(ids)) != len(ids):
        duplicated = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"Example ids must be unique (they key the results file); duplicated: {duplicated}.")
    return examples
