"""A model over a folder or manifest of WFDB records: class probabilities per record, and metrics on labelled ones.

Records go through the training pipeline (site_agent/data: listing, reading, FedCVD preprocessing),
so a record is seen exactly as in training. A record that cannot be used is skipped and counted
by reason, as when a site's data is opened; it never stops the run. `predict` needs no labels;
`evaluate` reads them as training does and skips records with none of the 20 classes.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shared.evaluation.metrics import THRESHOLD, average_precision, mean_average_precision, micro_f1
from shared.labels import CLASS_NAMES
from site_agent.data.config import ManifestSource, PreprocessConfig
from site_agent.data.preprocess import preprocess_signal
from site_agent.data.records import RecordSkipped, read_header, read_signal
from site_agent.data.report import SkipReason, SourceReport
from site_agent.data.scan import scan_source
from site_agent.data.sources import Source, list_records
from site_agent.device import Runtime

__all__ = [
    "ClassMetrics",
    "Evaluation",
    "Predictions",
    "evaluate_predictions",
    "for_prediction",
    "predict_source",
    "write_predictions",
]

Row = tuple[str, np.ndarray, tuple[int, ...] | None]  # record id, (12, L) signal, classes when labelled


@dataclass(frozen=True)
class Predictions:
    """What a model said about the usable records of one source, and what was skipped."""

    record_ids: tuple[str, ...]
    probabilities: np.ndarray  # (N, 20) float32
    labels: np.ndarray | None  # (N, 20) multi-hot truth when the records were read with their labels
    report: SourceReport  # records found, used and skipped by reason

    @property
    def predicted(self) -> np.ndarray:
        """(N, 20) bool: probability >= THRESHOLD (FedCVD's 0.5)."""
        return self.probabilities >= THRESHOLD


def for_prediction(source: Source) -> Source:
    """`source` as prediction reads it: a manifest without its label column still lists its records.

    The manifest reader insists on a label column; prediction reads no labels, so a manifest that
    lacks it is read with its record column in that role.
    """
    if not isinstance(source, ManifestSource):
        return source
    try:
        with source.path.open(newline="", encoding="utf-8-sig") as handle:
            header = next(csv.reader(handle), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return source  # listing the records reports it, naming the setting
    if not header or all(column in header for column in source.label_columns):
        return source
    record_column = source.record_column or ("record" if "record" in header else "path")
    return source.model_copy(update={"label_column": record_column})


def _unlabelled(source: Source, config: PreprocessConfig, report: SourceReport) -> Iterator[Row]:
    """Each readable record of `source`, preprocessed as for training; skipped ones counted in `report`."""
    refs = list_records(source)
    report.candidates = len(refs)
    for ref in refs:
        try:
            if ref.error:
                raise RecordSkipped(SkipReason.UNREADABLE, ref.error)
            header = read_header(ref.path)
            signal, method, resampled = preprocess_signal(read_signal(ref.path, header), header.fs, config)
        except RecordSkipped as skipped:
            report.skip(skipped.reason, ref.record_id)
            continue
        report.keep((), is_test=True, method=method, resampled=resampled, fs=header.fs)
        yield ref.record_id, signal, None


def _labelled(source: Source, config: PreprocessConfig, report: SourceReport) -> Iterator[Row]:
    """Each usable labelled record, exactly as training loads it (records with no known class skipped)."""
    for record in scan_source(source, config, report):
        yield record.record_id, record.signal, record.classes


@torch.no_grad()
def _probabilities(model: nn.Module, signals: list[np.ndarray], runtime: Runtime) -> np.ndarray:
    """(B, 20) sigmoid probabilities of a batch, computed as the site's evaluation computes them."""
    x = torch.from_numpy(np.stack(signals)).to(runtime.device, non_blocking=True)
    with runtime.autocast():
        logits = model(x).float()
    return torch.sigmoid(logits).cpu().numpy()


def predict_source(
    model: nn.Module,
    source: Source,
    runtime: Runtime,
    *,
    labelled: bool = False,
    batch_size: int = 32,
    progress: bool | None = None,
) -> Predictions:
    """Run `model` (eval mode) over every usable record of `source`; `labelled` also reads each record's classes.

    `progress`: a bar on stderr (None: when stderr is a terminal).
    """
    from tqdm import tqdm

    config = PreprocessConfig()  # as the site's data is opened for training (site_agent/config.py open_data)
    report = SourceReport(name=source.display_name, kind=source.kind, path=str(source.path))
    rows = (_labelled if labelled else _unlabelled)(source, config, report)
    total = len(list_records(source))
    model.eval()
    ids: list[str] = []
    classes: list[tuple[int, ...]] = []
    batches: list[np.ndarray] = []
    pending: list[np.ndarray] = []
    shown = progress if progress is not None else sys.stderr.isatty()
    with tqdm(total=total, desc="records", unit="record", disable=not shown, leave=False) as bar:
        for record_id, signal, record_classes in rows:
            ids.append(record_id)
            classes.append(record_classes or ())
            pending.append(signal)
            if len(pending) == batch_size:
                batches.append(_probabilities(model, pending, runtime))
                pending = []
            bar.update(report.loaded + report.n_skipped - bar.n)
        if pending:
            batches.append(_probabilities(model, pending, runtime))
        bar.update(total - bar.n)
    probabilities = np.concatenate(batches) if batches else np.zeros((0, len(CLASS_NAMES)), np.float32)
    truth = None
    if labelled:
        truth = np.zeros((len(ids), len(CLASS_NAMES)), np.int64)
        for row, indices in enumerate(classes):
            truth[row, list(indices)] = 1
    return Predictions(tuple(ids), probabilities.astype(np.float32), truth, report)


def _names(row: np.ndarray) -> str:
    return ";".join(name for name, on in zip(CLASS_NAMES, row, strict=True) if on)


def write_predictions(path: Path, predictions: Predictions) -> None:
    """A CSV: `record`, per class `prob_<CLASS>` (6 decimals) and `pred_<CLASS>` (0/1), `predicted`, `true`.

    `predicted` and `true` list class names separated by ';'; `true` only when the records were labelled.
    """
    columns = ["record", *(f"prob_{name}" for name in CLASS_NAMES), *(f"pred_{name}" for name in CLASS_NAMES)]
    columns.append("predicted")
    if predictions.labels is not None:
        columns.append("true")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for row, record_id in enumerate(predictions.record_ids):
            predicted = predictions.predicted[row]
            line = [record_id, *(f"{p:.6f}" for p in predictions.probabilities[row]), *(int(v) for v in predicted)]
            line.append(_names(predicted))
            if predictions.labels is not None:
                line.append(_names(predictions.labels[row]))
            writer.writerow(line)


@dataclass(frozen=True)
class ClassMetrics:
    """One class's row of an evaluation."""

    name: str
    positives: int  # records with the class
    predicted: int  # records predicted to have it
    f1: float  # at THRESHOLD; 0 when undefined
    ap: float  # average precision; 0 without positives


@dataclass(frozen=True)
class Evaluation:
    """FedCVD's metrics over labelled predictions (shared/evaluation/metrics.py, exact)."""

    n_records: int
    micro_f1: float
    map: float  # mean AP over all 20 classes, absent classes scoring 0 (FedCVD)
    map_present: float  # mean AP over the classes with positives (NaN without any)
    classes: tuple[ClassMetrics, ...]

    def to_dict(self) -> dict[str, object]:
        """JSON-able form."""
        return {
            "n_records": self.n_records,
            "threshold": THRESHOLD,
            "micro_f1": self.micro_f1,
            "map": self.map,
            "map_present": None if np.isnan(self.map_present) else self.map_present,
            "classes": [vars(c) for c in self.classes],
        }


def evaluate_predictions(predictions: Predictions) -> Evaluation:
    """Micro-F1, mAP and per-class F1 and AP of labelled predictions."""
    truth, scores = predictions.labels, predictions.probabilities
    if truth is None:
        raise ValueError("the predictions were made without labels")
    ap = average_precision(truth, scores)
    map_all, map_present = mean_average_precision(truth, scores)
    rows = tuple(
        ClassMetrics(
            name,
            int(truth[:, index].sum()),
            int(predictions.predicted[:, index].sum()),
            micro_f1(truth[:, [index]], scores[:, [index]]),  # micro-F1 of one class is its F1
            float(ap[index]),
        )
        for index, name in enumerate(CLASS_NAMES)
    )
    return Evaluation(len(truth), micro_f1(truth, scores), map_all, map_present, rows)
