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

Reference answers (``answers``, RULER's ``outputs``) are always a JSON *list* of strings. A single string is
refused with the file and line, not wrapped: scored as a sequence it would be matched character by character,
and which of the two the file meant cannot be told. Files written by ``oda ruler`` are only read when their
folder's ``manifest.json`` lists them with their record count (`check_generated_file`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from ..files import read_jsonl_objects
from ..validation import integer
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
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"{where}: the id must be a non-empty string; got {self.id!r}.")
        if not isinstance(self.task, str) or not self.task:
            raise ValueError(f"{where}: the task must be a non-empty string; got {self.task!r}.")
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError(f"{where}: give exactly one of a text prompt and input_ids.")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"{where}: the prompt must be a string (or token ids as input_ids); got "
                             f"{self.prompt!r} ({type(self.prompt).__name__}).")
        if isinstance(self.input_ids, tuple):
            self.input_ids = list(self.input_ids)
        if self.input_ids is not None and (not isinstance(self.input_ids, list) or not self.input_ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.input_ids)):
            raise ValueError(f"{where}: input_ids must be a non-empty list of token ids (integers >= 0).")
        self.answers = string_list("answers", self.answers, where)
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be a positive integer; got {self.max_new_tokens!r}.")
        if not isinstance(self.metric, str) or self.metric not in METRICS:
            raise ValueError(f"{where}: unknown metric {self.metric!r}; expected one of {sorted(METRICS)}.")
        if not isinstance(self.answer_prefix, str):
            raise ValueError(f"{where}: answer_prefix must be a string; got {self.answer_prefix!r}.")

    def to_dict(self) -> dict:
        return asdict(self)


def string_list(field_name: str, value, where: str) -> list[str]:
    """`value` as a non-empty list of strings. A single string is refused, not wrapped: scored as a sequence it
    would be compared character by character, and wrapping would guess at what the file meant."""
    if isinstance(value, str):
        raise ValueError(f"{where}: {field_name!r} must be a list of strings; got the string {value!r}. Write it as "
                         f"a one-element list: [{json.dumps(value, ensure_ascii=False)}].")
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(a, str) for a in value):
        raise ValueError(f"{where}: {field_name!r} must be a non-empty list of strings; got {value!r}.")
    if not all(a.strip() for a in value):  # "" is a substring of every output: string_match would score it 100
        raise ValueError(f"{where}: {field_name!r} holds an empty answer, which every output would match; got "
                         f"{value!r}. Remove it or write the answer text.")
    return list(value)


def _example(where: str, **fields) -> EvalExample:
    """An `EvalExample` whose errors name the file and line (`where`) of its record."""
    try:
        return EvalExample(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


# -- generic suite -----------------------------------------------------------------------------------


def example_from_dict(record: dict, *, default_max_new_tokens: int | None = None, where: str = "") -> EvalExample:
    """An `EvalExample` from a generic record (see the module docstring)."""
    missing = [key for key in ("id", "task", "prompt", "answers") if key not in record]
    if missing:
        raise ValueError(f"{where or 'record'}: missing field(s) {missing}; a suite record needs "
                         "'id', 'task', 'prompt', 'answers' and 'max_new_tokens'.")
    where = where or "record"
    identifier, task = record["id"], record["task"]
    # An integer id is fine (it is a name); anything else would be stringified into a surprising key.
    if isinstance(identifier, bool) or not isinstance(identifier, (str, int)):
        raise ValueError(f"{where}: 'id' must be a string or an integer; got {identifier!r}.")
    if not isinstance(task, str) or not task:
        raise ValueError(f"{where}: 'task' must be a non-empty string; got {task!r}.")
    metric = record.get("metric")
    if metric is None:  # an absent metric takes the task's default; an empty or wrong one is an error below
        metric = default_metric(task)
        if metric is None:
            raise ValueError(f"{where}: task {task!r} has no default metric; add a 'metric' field "
                             f"(one of {sorted(METRICS)}).")
    max_new_tokens = record.get("max_new_tokens", default_max_new_tokens)
    if max_new_tokens is None:
        raise ValueError(f"{where}: missing 'max_new_tokens'.")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, list):
        text, ids = None, prompt
    else:
        raise ValueError(f"{where}: 'prompt' must be a string or a list of token ids; got {prompt!r} "
                         f"({type(prompt).__name__}).")
    meta = {k: v for k, v in record.items()
            if k not in ("id", "task", "prompt", "answers", "max_new_tokens", "metric", "answer_prefix")}
    return _example(where, id=str(identifier), task=task, answers=record["answers"], max_new_tokens=max_new_tokens,
                    metric=metric, prompt=text, input_ids=ids, answer_prefix=record.get("answer_prefix", ""),
                    meta=meta)


def load_examples(source: str | os.PathLike | Iterable[dict], *, default_max_new_tokens: int | None = None,
                  tasks: Sequence[str] | None = None, limit: int | None = None) -> list[EvalExample]:
    """Generic suite from a JSONL path, a directory of them (searched recursively) or an iterable of dicts.

    `tasks` keeps only those tasks; `limit` keeps `limit` examples of each task, spread over it (`spread_subset`).
    Example ids must be unique (they key the resumable results file).
    """
    if isinstance(source, (str, os.PathLike)):
        def read(path):
            lines = list(_read_jsonl(path))
            check_generated_file(path, lines)
            return [(record, f"{path}:{line}") for line, record in lines]

        records = (item for path in _expand(source) for item in read(path))
    else:
        records = ((record, f"record {i}") for i, record in enumerate(source))
    examples = [example_from_dict(record, default_max_new_tokens=default_max_new_tokens, where=where)
                for record, where in records]
    return select_examples(examples, tasks, limit)


def write_examples(examples: Iterable[EvalExample], path: str | os.PathLike) -> int:
    """Write a suite as generic JSONL records (what `load_examples` and ``oda eval --suite jsonl`` read), atomically;
    returns the number of records."""
    from ..files import atomic_write

    count = 0
    with atomic_write(path) as f:
        for example in examples:
            record = {"id": example.id, "task": example.task,
                      "prompt": example.prompt if example.prompt is not None else example.input_ids,
                      "answers": example.answers, "max_new_tokens": example.max_new_tokens, "metric": example.metric}
            if example.answer_prefix:
                record["answer_prefix"] = example.answer_prefix
            reserved = set(record) | {"answer_prefix"}
            record.update({k: v for k, v in example.meta.items() if k not in reserved})
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


#: Records of `oda ruler` carry ``"generator": "oda-ruler-synth/<version>"``; their folder has a manifest.
GENERATED_PREFIX = "oda-ruler-synth/"
SUITE_MANIFEST = "manifest.json"


def check_generated_file(path: str | os.PathLike, lines: Sequence[tuple[int, dict]]) -> None:
    """A file written by ``oda ruler`` must be listed, with its record count, in its folder's manifest.

    The manifest is written last, so a folder without one (a killed or older writer) or a file with another
    record count (cut short, or from another run) is refused instead of evaluating a partial suite."""
    path = os.fspath(path)
    if not any(str(record.get("generator", "")).startswith(GENERATED_PREFIX) for _, record in lines):
        return
    folder, name = os.path.split(os.path.abspath(path))
    manifest_path = os.path.join(folder, SUITE_MANIFEST)
    fix = "generate the suite again with `oda ruler` into a new --out"
    if not os.path.isfile(manifest_path):
        raise ValueError(f"{path} was written by `oda ruler`, but {manifest_path} is missing (an interrupted or "
                         f"older run): {fix}.")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{manifest_path} is unreadable ({err}): {fix}.") from None
    files = manifest.get("records") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ValueError(f"{manifest_path} does not list its files' record counts (written by an older oda_hf, or "
                         f"not by `oda ruler`): {fix}.")
    if name not in files:
        raise ValueError(f"{path} is not listed in {manifest_path} (a leftover of another run?): {fix}.")
    if files[name] != len(lines):
        raise ValueError(f"{path} holds {len(lines)} records, but {manifest_path} says {files[name]!r} (cut short "
                         f"or changed): {fix}.")


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
        cap = len(example.target_ids()) + slack if max_new_tokens is None else max_new_tokens
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
        cap = ruler_max_new_tokens(name) if max_new_tokens is None else max_new_tokens  # 0 is an error, not a default
        for line, record in _read_jsonl(path):
            where = f"{path}:{line}"
            for key in ("index", "input", "outputs"):
                if key not in record:
                    raise ValueError(f"{where}: RULER record without {key!r} (fields: {sorted(record)}).")
            examples.append(_example(
                where, id=f"{name}/{record['index']}", task=name,
                answers=string_list("outputs", record["outputs"], where), max_new_tokens=cap, metric=metric,
                prompt=record["input"], answer_prefix=record.get("answer_prefix", ""),
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
    if max_length is not None:
        # 1 would keep nothing from either end, and LongBench's `ids[-0:]` would then keep the whole prompt.
        max_length = integer("max_length (--max-input-tokens)", max_length, minimum=2)
        if tokenizer is None:
            raise ValueError("Middle truncation to max_length needs the tokenizer (tokenizer=...).")
    examples = []
    for path in _expand(paths):
        for line, record in _read_jsonl(path):
            task = record.get("dataset") or longbench_task_from_path(path)
            if not isinstance(task, str):
                raise ValueError(f"{path}:{line}: LongBench field 'dataset' must be a task name; got {task!r}.")
            task = task[:-2] if task.endswith("_e") else task
            if task not in LONGBENCH_PROMPTS:
                if tasks is None:
                    raise ValueError(f"{path}:{line}: LongBench task {task!r} is not one of the paper's ten "
                                     f"({list(LONGBENCH_PROMPTS)}).")
                continue
            for key in ("input", "context", "answers"):
                if key not in record:
                    raise ValueError(f"{path}:{line}: LongBench record without {key!r} (fields: {sorted(record)}).")
            where = f"{path}:{line}"
            answers = string_list("answers", record["answers"], where)
            for key in ("input", "context"):
                if not isinstance(record[key], str):
                    raise ValueError(f"{where}: LongBench field {key!r} must be a string; got "
                                     f"{type(record[key]).__name__}.")
            prompt = LONGBENCH_PROMPTS[task].format(context=record["context"], input=record["input"])
            if max_length is not None:
                prompt = middle_truncate(prompt, tokenizer, max_length)
            identifier = record.get("_id", line)
            examples.append(_example(
                where, id=f"{task}/{identifier}", task=task, answers=answers,
                max_new_tokens=LONGBENCH_MAX_NEW_TOKENS[task] if max_new_tokens is None else max_new_tokens,
                metric=LONGBENCH_METRICS[task],
                prompt=prompt, meta={"length": record.get("length"), "all_classes": record.get("all_classes"),
                                     "source": os.fspath(path)}))
    return select_examples(examples, tasks, limit)


# -- helpers -------------------------------------------------------------------------------------------


def _read_jsonl(path) -> Iterable[tuple[int, dict]]:
    found = False
    for number, record in read_jsonl_objects(path):
        found = True
        yield number, record
    if not found:  # an empty file is a mistake (or a cut-short write), never an empty suite to skip
        raise ValueError(f"{path}: no records (the file is empty); give a JSONL file with one record per line.")


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


def spread_subset(items: Sequence, limit: int) -> list:
    """`limit` of `items` spread evenly over them, first and last included (all of them if they are no more). A
    suite's order carries meaning: `oda ruler` puts prompt i's needle at depth i / (n - 1), so the first `limit`
    would hold only the shallow needles (measured on SmolLM2's 2K test prompts: Full 41.8 on the first half, 57.5 on
    the second)."""
    if len(items) <= limit:
        return list(items)
    if limit == 1:
        return [items[(len(items) - 1) // 2]]
    step = (len(items) - 1) / (limit - 1)
    return [items[int(k * step + 0.5)] for k in range(limit)]


def select_examples(examples: list[EvalExample], tasks: Sequence[str] | None, limit: int | None) -> list[EvalExample]:
    if tasks is not None:
        unknown = set(tasks) - {e.task for e in examples}
        if unknown:
            raise ValueError(f"Task(s) {sorted(unknown)} not found in the suite (it has "
                             f"{sorted({e.task for e in examples})}).")
        examples = [e for e in examples if e.task in set(tasks)]
    if limit is not None:
        limit = integer("limit (examples per task)", limit, minimum=1)
        by_task: dict[str, list[EvalExample]] = {}
        for example in examples:
            by_task.setdefault(example.task, []).append(example)
        chosen = {id(example) for task_examples in by_task.values()
                  for example in spread_subset(task_examples, limit)}
        examples = [example for example in examples if id(example) in chosen]
    lengths: dict[str, set] = {}
    for example in examples:   # `oda ruler`'s: a target length (RULER's and LongBench's own vary per prompt)
        if str(example.meta.get("generator", "")).startswith(GENERATED_PREFIX):
            lengths.setdefault(example.task, set()).add(example.meta.get("length"))
    mixed = {task: sorted(found) for task, found in lengths.items() if len(found) > 1}
    if mixed:   # one report row per task averages its examples: across lengths, that is no length's score
        task, found = next(iter(mixed.items()))
        raise ValueError(f"Task {task!r} holds prompts of several lengths ({', '.join(map(str, found))}; "
                         f"{len(mixed)} task(s) so): a report averages a task's prompts into one score. Give one "
                         "length's folder (an `oda ruler` folder has one per length, e.g. DATA/4096) per run.")
    ids = [e.id for e in examples]
    if len(set(ids)) != len(ids):
        duplicated = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"Example ids must be unique (they key the results file); duplicated: {duplicated}.")
    return examples
