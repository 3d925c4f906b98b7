"""Benchmark evaluation: every method on the same seeded items, with baselines and reports.

    from tokenfuse.eval import EvalSettings, run_eval
    results = run_eval(cfg, EvalSettings(tasks=["arc_easy"], methods=["single", "gac", "vote"], limit=50))

See ``runner`` (the flow and the forms), ``methods`` (the rows, vote and MBR), ``answers`` (``mux``
and ``sc``, from sampled answers), ``records``
(resumable per-item JSONL), ``report`` (table, intervals, figure) and ``docs/evaluation.md``.
"""

from tokenfuse.eval.methods import ALL_METHODS, majority_vote, mbr_select
from tokenfuse.eval.runner import DEFAULT_TASKS, EvalSettings, run_eval
from tokenfuse.eval.stats import bootstrap_ci

__all__ = ["ALL_METHODS", "DEFAULT_TASKS", "EvalSettings", "bootstrap_ci", "majority_vote", "mbr_select", "run_eval"]
