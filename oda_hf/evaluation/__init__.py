"""Evaluation of ODA: generation quality against Full-call rate, the Random control, fixed-reference
diagnostics and routing-trajectory rendering (paper Section 3 and Appendix B).

* `suites`: examples (generic JSONL, RULER, LongBench v1) with their official metrics (`metrics`);
* `runner`: every policy (Full, StreamingLLM, ODA thresholds, matched Random, schedules) generates
  greedily from its own Full prefill; resumable JSONL records;
* `report`: per-task and aggregate scores, pooled and task-averaged Full-call rates, Markdown
  tables in the paper's layout, quality-vs-rate plots;
* `trajectory`: HTML/PNG token renderings coloured by access;
* `diagnostics` + `stats`: per-position gains on fixed references, AUROC/AP, budget curves,
  paired document-bootstrap intervals.

Public names load on first use (see `oda_hf._lazy`).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "ReferencePositions": ".diagnostics",
    "analyze": ".diagnostics",
    "collect_reference_gains": ".diagnostics",
    "load_reference_sequences": ".diagnostics",
    "reference_gains": ".diagnostics",
    "write_diagnostics": ".diagnostics",
    "METRICS": ".metrics",
    "default_metric": ".metrics",
    "score_example": ".metrics",
    "zh_segmentation": ".metrics",
    "markdown_report": ".report",
    "summarize": ".report",
    "write_report": ".report",
    "PAPER_SEEDS": ".runner",
    "PAPER_THRESHOLDS": ".runner",
    "PolicySpec": ".runner",
    "ResultsFile": ".runner",
    "evaluate": ".runner",
    "full": ".runner",
    "oda": ".runner",
    "paper_policies": ".runner",
    "random_fixed": ".runner",
    "random_matched": ".runner",
    "schedule": ".runner",
    "streaming_llm": ".runner",
    "EvalExample": ".suites",
    "examples_from_organism": ".suites",
    "load_examples": ".suites",
    "load_longbench": ".suites",
    "load_ruler": ".suites",
    "write_examples": ".suites",
    "render_html": ".trajectory",
    "render_png": ".trajectory",
    "render_record": ".trajectory",
    "token_strings": ".trajectory",
    "SharedPrefill": ".runner",
    "head_fingerprint": ".runner",
    "run_settings": ".runner",
    "generate_suite": ".ruler_synth",
    "write_suite": ".ruler_synth",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
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
    from .suites import EvalExample, examples_from_organism, load_examples, load_longbench, load_ruler, write_examples
    from .trajectory import render_html, render_png, render_record, token_strings
    from .runner import SharedPrefill, head_fingerprint, run_settings
    from .ruler_synth import generate_suite, write_suite

__all__ = sorted(_EXPORTS)
