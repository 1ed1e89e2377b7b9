"""Experiment tracking on the researcher's side: a study's terms, each round's metrics and epsilon, and theta^g_T.

Nothing here is part of a study's terms, so sites never see it and never approve it again for it.
`track_study` follows a study through the coordinator's API (CardioflClient.watch_rounds) and
hands the trackers, per round number t as the step:
- the terms, flattened to "training.lr"-style parameters, once;
- `train_loss` and each site's personalised model's `site/<name>/<metric>` when round t settles
  (the final evaluation round T + 1 carries the sites' final personalised models); the metrics are
  `TRACKED_FIGURES`, each where the summary has it: FedCVD's, the clinical ones (macro_auroc,
  balanced_accuracy, sensitivity, specificity, ece) and their interval ends (`_low`, `_high`) and bounds (`_bound`);
- `epsilon` under DP, as the coordinator accounts it;
- `global/<metric>`, the pooled Global model theta^g_t with phi_0, once the sites that received it
  have reported it (with round t + 1, or the final evaluation);
- the last released theta^g as a safetensors artifact when the study ends.
`RunTracking` logs a run of the in-process runner (`cardiofl experiment run --mlflow/--tensorboard`)
the same way, one tracker run per grid point, from the runner's round records.

`MlflowTracker` writes one run to any MLflow tracking URI (MLflow's own default is
sqlite:///mlflow.db), `TensorBoardTracker` an event file under a log directory; each is an optional
extra (`pip install 'cardiofl[mlflow]'`, `'cardiofl[tensorboard]'`) imported only when used.
MLflow's usage telemetry is switched off (MLFLOW_DISABLE_TELEMETRY) unless the user set it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from cardiofl.client.http import CardioflClient
from shared.evaluation.figure_names import CLINICAL_METRICS, SUMMARY_METRICS
from shared.study.accounting import privacy_report
from shared.terms import StudyTerms
from shared.wire.api import RoundPublic
from shared.wire.metrics import MetricSummary, PooledMetrics

__all__ = [
    "TRACKED_FIGURES",
    "MlflowTracker",
    "RunTracking",
    "TensorBoardTracker",
    "Tracker",
    "flat_params",
    "open_trackers",
    "record_metrics",
    "round_metrics",
    "study_params",
    "track_study",
]


# what is logged of a summary, each where it has it: FedCVD's figures, the clinical ones, and the ends of
# their 95% intervals and the bounds of those pooled from histograms (docs/researcher/metrics.md)
_ENDS = ("_low", "_high", "_bound")
TRACKED_FIGURES = tuple(
    name
    for figure in (*SUMMARY_METRICS, *CLINICAL_METRICS)
    for name in (figure, *(f"{figure}{end}" for end in _ENDS))
    if name in MetricSummary.model_fields
)


class Tracker(Protocol):
    """Where a study's record goes."""

    def params(self, values: Mapping[str, str]) -> None:
        """The study's parameters, once."""

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Scalars at round `step`."""

    def artifact(self, path: Path) -> None:
        """A file kept with the run."""

    def close(self) -> None:
        """The run is over."""


def flat_params(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested terms as "a.b.c" -> value text (lists and empty tables as JSON)."""
    out: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return out


def _summary(prefix: str, summary: MetricSummary | Mapping[str, Any] | None) -> dict[str, float]:
    if not summary:
        return {}
    values = summary.model_dump() if isinstance(summary, MetricSummary) else summary
    return {f"{prefix}{key}": float(values[key]) for key in TRACKED_FIGURES if values.get(key) is not None}


def _finite(values: Mapping[str, float]) -> dict[str, float]:
    return {key: value for key, value in values.items() if math.isfinite(value)}


def round_metrics(round_: RoundPublic) -> dict[str, float]:
    """A settled round's own scalars: its training loss, each site's personalised model, its epsilon."""
    pooled = round_.pooled or PooledMetrics()
    out: dict[str, float] = {}
    if pooled.train_loss is not None:
        out["train_loss"] = pooled.train_loss
    for update in round_.updates:
        out.update(_summary(f"site/{update.site}/", update.local_eval))
    if pooled.privacy is not None and pooled.privacy.epsilon is not None:
        out["epsilon"] = pooled.privacy.epsilon
    return _finite(out)


def record_metrics(record: Mapping[str, Any], study: StudyTerms) -> dict[str, float]:
    """The same scalars as `round_metrics`, from a runner's round record (cardiofl.experiment.runner)."""
    out: dict[str, float] = {}
    if record.get("train_loss") is not None:
        out["train_loss"] = float(record["train_loss"])
    for site, values in record["sites"].items():
        out.update(_summary(f"site/{site}/", values.get("local")))
    spent = privacy_report(study, record["round"]) if record["kind"] == "train" else None
    if spent is not None and spent["epsilon"] is not None:
        out["epsilon"] = float(spent["epsilon"])
    return _finite(out)


def study_params(study: StudyTerms, **extra: str) -> dict[str, str]:
    """What a tracker keeps of a study: `extra` (its id and name, or the run's key) and its flattened terms."""
    return {**extra, **flat_params(study.model_dump(mode="json"))}


def track_study(client: CardioflClient, study_id: int, trackers: Sequence[Tracker], *, wait: float = 30.0) -> int:
    """Log the study to every tracker as its rounds settle, until it ends; the number of rounds logged."""
    study = client.study(study_id)
    params = study_params(study.config, **{"study.id": str(study.id), "study.name": study.name})
    for tracker in trackers:
        tracker.params(params)
    logged = 0
    for round_ in client.watch_rounds(study_id, wait=wait):
        logged += 1
        _send(trackers, round_.number, round_metrics(round_))
        if round_.status == "completed" and round_.number > 1:  # its sites reported theta^g_{t-1}: all of them
            earlier = client.round(study_id, round_.number - 1)
            reading = earlier.pooled.eval if earlier.pooled else None
            if earlier.status == "completed" and earlier.kind == "train" and reading:
                _send(trackers, earlier.number, _summary("global/", reading))
    released = [m.round for m in client.global_models(study_id) if m.round > 0]
    last = max(released, default=None)
    model = client.download_global_model(study_id, last) if last is not None else None
    _finish(trackers, model, f"study{study_id}-theta-g-round{last}.safetensors")
    return logged


class RunTracking:
    """One runner run sent to its trackers as its rounds end (cardiofl.experiment.runner).

    The same scalars at the same steps as `track_study` logs for a study of the same terms:
    `previous_global` of round t + 1 (or of the final evaluation) is theta^g_t's Global reading.
    """

    def __init__(self, trackers: Sequence[Tracker], study: StudyTerms, params: Mapping[str, str]) -> None:
        self.trackers, self.study = list(trackers), study
        for tracker in self.trackers:
            tracker.params(study_params(study, **params))

    def round(self, record: Mapping[str, Any]) -> None:
        """One round record: its own scalars, and the Global reading of the model the round before released."""
        _send(self.trackers, record["round"], record_metrics(record, self.study))
        if record["round"] > 1 and record.get("previous_global"):
            _send(self.trackers, record["round"] - 1, _summary("global/", record["previous_global"]))

    def finish(self, global_model: bytes | None, name: str) -> None:
        """The run is over: keep theta^g_T (safetensors bytes) as the artifact `name`, and close every tracker."""
        _finish(self.trackers, global_model, name)


def _finish(trackers: Sequence[Tracker], artifact: bytes | None, name: str) -> None:
    """Hand each tracker the artifact (when there is one), then close it."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        if artifact is not None:
            path.write_bytes(artifact)
        for tracker in trackers:
            if artifact is not None:
                tracker.artifact(path)
            tracker.close()


def open_trackers(mlflow: str | None, experiment: str, run_name: str, tensorboard: Path | None) -> list[Tracker]:
    """A run in MLflow experiment `experiment` at tracking URI `mlflow`, and/or an event file under `tensorboard`."""
    trackers: list[Tracker] = []
    if mlflow is not None:
        trackers.append(MlflowTracker(mlflow, experiment, run_name))
    if tensorboard is not None:
        trackers.append(TensorBoardTracker(tensorboard))
    return trackers


def _send(trackers: Sequence[Tracker], step: int, values: Mapping[str, float]) -> None:
    if values:
        for tracker in trackers:
            tracker.metrics(step, values)


class MlflowTracker:
    """One MLflow run (in experiment `experiment`, created if new) at `tracking_uri`."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # a hospital's workstation does not phone home
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def params(self, values: Mapping[str, str]) -> None:
        """Each parameter (MLflow keeps values up to 6000 characters)."""
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(key, value[:6000]) for key, value in values.items()])

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Each scalar at step `step`."""
        from mlflow.entities import Metric

        metrics = [Metric(key, value, 0, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def artifact(self, path: Path) -> None:
        """The file, in the run's artifacts."""
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        """Mark the run finished."""
        self.client.set_terminated(self.run_id)


class TensorBoardTracker:
    """A TensorBoard event file under `log_dir` (scalars by tag, the parameters as text)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.log_dir = log_dir

    def params(self, values: Mapping[str, str]) -> None:
        """The parameters as one Markdown table of text."""
        rows = "\n".join(f"| {key} | {value} |" for key, value in sorted(values.items()))
        self.writer.add_text("params", f"| parameter | value |\n| --- | --- |\n{rows}", 0)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Each scalar under its tag at step `step`."""
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def artifact(self, path: Path) -> None:
        """TensorBoard keeps no files: the artifact's name is noted as text."""
        self.writer.add_text("artifacts", path.name, 0)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
