"""Evaluation of ODA: generation quality against Full-call rate, the Random control, fixed-reference
diagnostics and routing-trajectory rendering (paper Section 3 and Appendix B).

* `suites`: examples (generic JSONL, RULER, LongBench v1) with their official metrics (`metrics`);
* `ruler_synth` + `haystacks`: RULER's synthetic tasks generated offline at exact token lengths;
* `runner`: every policy (Full, StreamingLLM, ODA thresholds, matched Random, schedules) generates
  greedily from its own Full prefill; resumable JSONL records;
* `report`: per-task and aggregate scores, pooled and task-averaged Full-call rates, Markdown
  tables in the paper's layout, quality-vs-rate plots;
* `trajectory`: HTML/PNG token renderings coloured by access;
* `diagnostics` + `stats`: per-position gains on fixed references, AUROC/AP, budget curves,
  paired document-bootstrap intervals.
"""

from .diagnostics import (
    ReferencePositions,
    analyze,
    collect_reference_gains,
    load_reference_sequences,
    reference_gains,
    write_diagnostics,
)
from .metrics import METRICS, default_metric, score_example, zh_segmentation
from .report import markdown_report, summarize, write_report
from .runner import (
    PAPER_SEEDS,
    PAPER_THRESHOLDS,
    PolicySpec,
    ResultsFile,
    evaluate,
    full,
    oda,
    paper_policies,
    random_fixed,
    random_matched,
    schedule,
    streaming_llm,
)
from .ruler_synth import generate_suite, write_suite
from .suites import EvalExample, examples_from_organism, load_examples, load_longbench, load_ruler, write_examples
from .trajectory import render_html, render_png, render_record, token_strings

__all__ = [
    "EvalExample", "METRICS", "PAPER_SEEDS", "PAPER_THRESHOLDS", "PolicySpec", "ReferencePositions", "ResultsFile",
    "analyze", "collect_reference_gains", "default_metric", "evaluate", "examples_from_organism", "full", "load_examples", "load_longbench",
    "load_reference_sequences", "load_ruler", "markdown_report", "oda", "paper_policies", "random_fixed",
    "random_matched", "reference_gains", "render_html", "render_png", "render_record", "schedule", "score_example",
    "streaming_llm", "summarize", "token_strings", "write_diagnostics", "write_examples", "write_report",
    "zh_segmentation", "generate_suite", "write_suite",
]
