"""Typed views of the metrics a researcher reads: a model's summary, a round's pooled figures, epsilon spent.

The coordinator stores them as JSON objects (shared.evaluation.metrics and shared.study.accounting make them);
these models read them back as typed objects for the API, the Python client and `--json` output.
A key the coordinator did not write stays absent on the wire (the JSON is byte for byte what was
stored), and a key a newer coordinator adds passes through as an extra field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, SerializerFunctionWrapHandler, model_serializer
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

__all__ = ["MetricSummary", "PooledMetrics", "PrivacySpent", "figure_text"]


class _Stored(BaseModel):
    """A typed view of a stored JSON object: what was set (or extra) is written back, nothing else."""

    model_config = ConfigDict(extra="allow", frozen=True)

    @model_serializer(mode="wrap")
    def _as_stored(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        written = self.model_fields_set | set(self.model_extra or {})
        return {key: value for key, value in handler(self).items() if key in written}

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The fields in both directions (OpenAPI): what is written is what was read, less what was absent."""
        return handler({key: value for key, value in schema.items() if key != "serialization"})


class MetricSummary(_Stored):
    """One model on test records: loss, micro-F1, mAPs and the clinical figures (None where undefined), and counts.

    A site's contribution that was left out for too few records is only `too_few_records = True`;
    a pooled summary also says how many sites it pooled (`n_sites`) and left out (`n_sites_too_few`).
    """

    loss: float | None = None
    micro_f1: float | None = None
    map: float | None = None  # mean average precision over all classes
    map_present: float | None = None  # ... over the classes with positives in the records
    n_samples: int | None = None
    n_sites: int | None = None
    n_sites_too_few: int | None = None
    too_few_records: bool | None = None
    # clinical figures (docs/researcher/metrics.md): macros over the `auroc_classes` classes with both kinds.
    # `_low`/`_high`: a 95% interval (a site's bootstrap; pooled: DeLong or Wilson); `_bound`: the most a
    # figure pooled from histograms can differ from the exact one over the same records
    auroc_classes: int | None = None
    macro_auroc: float | None = None
    macro_auroc_low: float | None = None
    macro_auroc_high: float | None = None
    macro_auroc_bound: float | None = None
    balanced_accuracy: float | None = None
    balanced_accuracy_low: float | None = None
    balanced_accuracy_high: float | None = None
    sensitivity: float | None = None
    sensitivity_low: float | None = None
    sensitivity_high: float | None = None
    specificity: float | None = None
    specificity_low: float | None = None
    specificity_high: float | None = None
    ece: float | None = None
    ece_low: float | None = None
    ece_high: float | None = None
    ece_bound: float | None = None
    micro_f1_low: float | None = None
    micro_f1_high: float | None = None
    map_low: float | None = None
    map_high: float | None = None


class PrivacySpent(_Stored):
    """Differential privacy after `rounds` released models: epsilon at delta, and the terms it follows from."""

    epsilon: float | None = None
    delta: float | None = None
    relation: str | None = None  # the neighbouring relation epsilon holds under
    sensitivity: float | None = None
    mechanism: str | None = None
    accountant: str | None = None
    rounds: int | None = None
    epsilon_budget: float | None = None
    noise_multiplier: float | None = None
    clip_norm: float | None = None
    mode: str | None = None  # "central" or "distributed" noise


class PooledMetrics(_Stored):
    """A round's pooled figures over its sites.

    `train_loss`: n_k-weighted (None in the final evaluation round); `local_eval`: the personalised
    models after this round's training, averaged per test record; `eval`: the round's theta^g_t with
    `global_label`'s local part, pooled once the sites that received it reported it (round t + 1 or
    the final evaluation); `privacy`: epsilon once theta^g_t is released, under DP.
    """

    train_loss: float | None = None
    eval: MetricSummary | None = None
    local_eval: MetricSummary | None = None
    global_label: str | None = None
    privacy: PrivacySpent | None = None


def figure_text(summary: MetricSummary | None, name: str, *, interval: bool = True, ci: str = "") -> str:
    """A figure as people read it: "0.812±0.004 (0.771–0.853)"; a dash where `summary` has none.

    Three decimals; then `±bound` where the figure was pooled from histograms (`<name>_bound`, the most
    the binning can move it); then, with `interval`, its 95% interval in brackets where it has one
    (`<name>_low`, `<name>_high`), `ci` before the ends ("95% CI " writes "(95% CI 0.771–0.853)").
    The one place a figure is written for people: the CLI's tables and lines, and the dashboard's
    script in its own language (coordinator/static/dashboard.html, `withInterval`).
    """
    value, bound = _value(summary, name), _value(summary, f"{name}_bound")
    low, high = _value(summary, f"{name}_low"), _value(summary, f"{name}_high")
    if value is None:
        return "–"
    text = f"{value:.3f}" + ("" if bound is None else f"±{bound:.3f}")
    return text + (f" ({ci}{low:.3f}–{high:.3f})" if interval and low is not None and high is not None else "")


def _value(summary: MetricSummary | None, key: str) -> float | None:
    """A figure of `summary` by name (a field, or an extra a newer coordinator sent), None where absent."""
    value = getattr(summary, key, None)
    return None if value is None else float(value)
