"""A model card's building blocks: plain-text sections, paragraphs and tables, and how a figure is written on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.wire.card import ReliabilityBin
from shared.wire.metrics import MetricSummary, figure_text

__all__ = [
    "DASH",
    "METRICS",
    "Block",
    "Bullets",
    "Code",
    "Diagram",
    "Paragraph",
    "Section",
    "Table",
    "figure",
    "number",
]

# The figures a card shows, in its column order: the key of MetricSummary and its name for people.
METRICS = (
    ("micro_f1", "micro-F1"),
    ("map", "mAP"),
    ("macro_auroc", "macro-AUROC"),
    ("balanced_accuracy", "balanced accuracy"),
    ("sensitivity", "sensitivity"),
    ("specificity", "specificity"),
    ("ece", "ECE"),
)
DASH = "–"


@dataclass(frozen=True)
class Paragraph:
    """A paragraph of plain text."""

    text: str


@dataclass(frozen=True)
class Bullets:
    """A list of plain-text items."""

    items: Sequence[str]


@dataclass(frozen=True)
class Table:
    """A table of plain-text cells."""

    header: tuple[str, ...]
    rows: Sequence[tuple[str, ...]]


@dataclass(frozen=True)
class Code:
    """Text shown as it is (the terms' JSON)."""

    text: str
    language: str = "json"


@dataclass(frozen=True)
class Diagram:
    """The reliability diagram: a chart in HTML (its table is beside it)."""

    bins: Sequence[ReliabilityBin]


Block = Paragraph | Bullets | Table | Code | Diagram


@dataclass(frozen=True)
class Section:
    """A titled part of the card."""

    title: str
    blocks: list[Block] = field(default_factory=list)


def number(value: float | None) -> str:
    """A figure to three decimals, or a dash."""
    return DASH if value is None else f"{value:.3f}"


def figure(summary: MetricSummary | None, key: str) -> str:
    """A figure with what bounds it: "0.912±0.003 (95% CI 0.890–0.930)" (± only where pooled from histograms)."""
    if summary is not None and summary.too_few_records:
        return "too few records"
    text = figure_text(summary, key, ci="95% CI ")
    if key == "macro_auroc" and summary is not None and summary.macro_auroc is not None and summary.auroc_classes:
        text += f", {summary.auroc_classes} classes"  # the classes with positives and negatives it averages
    return text
