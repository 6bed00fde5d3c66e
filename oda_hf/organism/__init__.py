"""The ODA model organism: a synthetic long-context language and a tiny Qwen3 trained on it.

Local attention (s = 4 sinks + a w = 64 window) cannot see the needles, which sit at least w
tokens before the question in 256-1024-token contexts; Full attention can.

* `corpus`: seeded RULER-style tasks (`TASKS`), `OrganismCorpus` train/dev/test splits,
  `training_sequence` (answer labels + weighted filler loss), `copy_sequence` (training-only drills);
* `tokenizer`: word-level tokenizer over the closed vocabulary (`save_tokenizer`);
* `metrics`: RULER string match (`string_match_all`, `string_match_part`, `score_by_task`);
* `train_backbone`: ``python -m oda_hf.organism.train_backbone --output DIR`` and
  `evaluate_backbone` (imported lazily: it needs transformers);
* `train_head`, `calibrate` (threshold on dev), `evaluate` (test), `ship` (into `assets/`), `demo`.
"""

from .corpus import (
    TASK_METRIC,
    TASKS,
    VOCAB,
    Example,
    OrganismCorpus,
    TrainingSequence,
    build_example,
    copy_sequence,
    filler_text,
    training_sequence,
)
from .metrics import example_score, score_by_task, string_match_all, string_match_part, task_score

__all__ = [
    "TASKS",
    "TASK_METRIC",
    "VOCAB",
    "Example",
    "OrganismCorpus",
    "TrainingSequence",
    "build_example",
    "copy_sequence",
    "evaluate_backbone",
    "example_score",
    "filler_text",
    "save_tokenizer",
    "score_by_task",
    "string_match_all",
    "string_match_part",
    "task_score",
    "training_sequence",
]


def __getattr__(name):
    if name == "evaluate_backbone":
        from .train_backbone import evaluate_backbone

        return evaluate_backbone
    if name == "save_tokenizer":
        from .tokenizer import save_tokenizer

        return save_tokenizer
    raise AttributeError(name)
