"""The names of a summary's figures, importable without numpy (the command line's tables print them)."""

from __future__ import annotations

__all__ = ["CLINICAL_METRICS", "SUMMARY_METRICS"]

SUMMARY_METRICS = ("loss", "micro_f1", "map", "map_present")  # the scalars of every summary, besides counts
# the clinical figures of a summary; each may come with `<name>_low` and `<name>_high`, its 95% interval
CLINICAL_METRICS = ("macro_auroc", "balanced_accuracy", "sensitivity", "specificity", "ece")
