"""One site's part of one round, with no HTTP: load theta^g and phi_k, run the algorithm, evaluate, split.

The site agent calls this with what it downloaded; the in-process experiment runner calls it with
tensors in memory. Both therefore train exactly the same way, down to the random stream, which
is derived from (study seed, round, site) alone. The study's algorithm (site_agent/algorithms)
does the training; this module checks names against the study's exchange (shared/study/rules.py),
evaluates, adds what the aggregation weighting needs, and splits what to upload from what to keep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from shared.algorithms.exchange import Exchange
from shared.algorithms.head_splits import zero_unused_heads
from shared.algorithms.learned_heads import head_usage
from shared.algorithms.registry import parsed_params
from shared.evaluation.metrics import site_contribution
from shared.evaluation.summaries import site_summary
from shared.model.partition import Partition
from shared.study.dp import dp_fraction_bits, honest_quorum, release_update
from shared.study.round_terms import load_factor
from shared.study.rules import algorithm_exchange, algorithm_model
from shared.tensors.codec import TensorDict
from shared.terms import AggregationSpec, AlgorithmSpec, ModelSpec, PrivacyConfig, StudyTerms, TrainingConfig
from shared.wire.protocol import EvalSummary, UpdateMeta, UpdateMetrics
from site_agent.algorithms import CLIENT_ALGORITHMS
from site_agent.algorithms.base import RoundContext, make_optimizer, stable_seed, steps_for
from site_agent.algorithms.uncertainty import report_for_weighting
from site_agent.data import SiteData, SplitArrays, iterate_batches
from site_agent.device import Runtime
from site_agent.training import Progress

__all__ = [
    "LocalRoundResult",
    "LocalRoundSpec",
    "TestPredictions",
    "evaluate",
    "make_optimizer",
    "round_context",
    "round_seed",
    "run_local_evaluation",
    "run_local_round",
    "seeded_rng",
    "steps_for",
]


@dataclass(frozen=True)
class LocalRoundSpec:
    """Everything that decides how a site trains in one round: the study's terms, and the round's place in them.

    Made by `of`, from the terms and the round's participants alone: the agent (once its task agreed
    with the terms its operator approved, site_agent/task_check.py), the in-process runner and the
    site's model commands (site_agent/study_model.py) all build their rounds so.
    """

    terms: StudyTerms
    site: str
    round: int
    load_factor: float = 1.0  # |all sites| / |selected sites|: local steps are scaled by it
    quorum: int = 1  # the honest sites among the round's fewest released (shared/study/dp.py honest_quorum): DP noise

    @classmethod
    def of(
        cls, terms: StudyTerms, site: str, round_number: int, participants: Sequence[str] | None = None
    ) -> LocalRoundSpec:
        """`site`'s round `round_number` of a study with `terms`, among `participants` (by default every site)."""
        chosen = list(participants) if participants is not None else terms.sites
        return cls(terms, site, round_number, load_factor(terms, chosen), honest_quorum(terms, len(chosen)))

    @property
    def model(self) -> ModelSpec:
        """The study's model."""
        return self.terms.model

    @property
    def site_model(self) -> ModelSpec:
        """The model this site trains: the study's, at the site's own head split (model.site_heads)."""
        return self.terms.model.for_site(self.site)

    @property
    def training(self) -> TrainingConfig:
        """How the site trains."""
        return self.terms.training

    @property
    def algorithm(self) -> AlgorithmSpec:
        """The study's client algorithm."""
        return self.terms.algorithm

    @property
    def aggregation(self) -> AggregationSpec:
        """The study's weighting: what the site reports for it."""
        return self.terms.aggregation

    @property
    def privacy(self) -> PrivacyConfig:
        """What may leave the site besides tensors, and how."""
        return self.terms.privacy

    @property
    def seed(self) -> int:
        """The study's seed."""
        return self.terms.seed


@dataclass(frozen=True)
class LocalRoundResult:
    """What a round produced: tensors to upload, private tensors to keep, and the update's meta."""

    shared: TensorDict  # exactly the study's upload schema
    local: TensorDict  # phi_k and the algorithm's private state after training; never leaves the site
    meta: UpdateMeta
    grid: dict[str, np.ndarray] = field(default_factory=dict)  # DP: the released change in grid steps (secure sums it)


def round_seed(study_seed: int, round_: int, site: str) -> int:
    """A 63-bit seed for one site's round, stable across processes and machines."""
    return stable_seed("cardiofl", study_seed, round_, site)


@dataclass(frozen=True)
class TestPredictions:
    """A model's scores on the site's test split: only what is computed from them leaves the site."""

    truth: np.ndarray  # (N, C) labels in {0, 1}
    scores: np.ndarray  # (N, C) probabilities
    loss_sum: float  # sum over records of the mean BCE over classes

    def summary(self, privacy: PrivacyConfig, seed: int) -> EvalSummary:
        """The site's scalar report, exact from the scores (mAP as scikit-learn computes it).

        With at least `privacy.min_records` records it holds the clinical figures too, each with its
        bootstrap interval drawn from `seed`; below, only FedCVD's scalars.
        """
        enough = len(self.truth) >= privacy.min_records
        summary = site_summary(self.truth, self.scores, self.loss_sum, seed=seed if enough else None)
        return EvalSummary.model_validate(summary)

    def contribution(self, privacy: PrivacyConfig) -> dict[str, object]:
        """Counts and histograms for the pooled statistics, or the marker when below `privacy.min_records`."""
        return site_contribution(self.truth, self.scores, self.loss_sum, min_records=privacy.min_records)


@torch.no_grad()
def evaluate(model: nn.Module, split: SplitArrays, runtime: Runtime, *, batch_size: int = 64) -> TestPredictions:
    """`model`'s scores on `split`, kept in memory on the site."""
    model.eval()
    truth, scores, loss_sum = [], [], 0.0
    for x, y in iterate_batches(split, batch_size, shuffle=False):
        with runtime.autocast():
            logits = model(x.to(runtime.device, non_blocking=True)).float()
        y = y.to(runtime.device)
        per_sample = nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none").mean(dim=1)
        truth.append(y.cpu().numpy())
        scores.append(torch.sigmoid(logits).cpu().numpy())
        loss_sum += float(per_sample.sum())
    if not truth:
        raise ValueError("evaluating on an empty split")
    return TestPredictions(np.concatenate(truth), np.concatenate(scores), loss_sum)


def _split_received(exchange: Exchange, global_tensors: Mapping[str, Tensor]) -> tuple[TensorDict, TensorDict]:
    """theta^g_{t-1} as (shared model tensors, server state); the names must be the global schema's."""
    expected = exchange.global_schema().keys()
    if global_tensors.keys() != expected:
        missing, extra = expected - global_tensors.keys(), global_tensors.keys() - expected
        raise ValueError(f"global model does not match the study: missing {sorted(missing)}, extra {sorted(extra)}")
    model = {name: global_tensors[name] for name in exchange.partition.shared}
    return model, {name: global_tensors[name] for name in exchange.server_state}


def _split_kept(exchange: Exchange, local_tensors: Mapping[str, Tensor]) -> tuple[TensorDict, TensorDict]:
    """The site's kept tensors as (phi_k, the algorithm's state); phi_k must be whole."""
    missing = set(exchange.partition.local) - local_tensors.keys()
    unknown = local_tensors.keys() - exchange.local_names()
    if missing or unknown:
        raise ValueError(f"kept tensors do not match the study: missing {sorted(missing)}, unknown {sorted(unknown)}")
    own = {name: local_tensors[name] for name in exchange.partition.local}
    return own, {name: t for name, t in local_tensors.items() if name in exchange.site_state}


def round_context(
    spec: LocalRoundSpec,
    exchange: Exchange,
    global_tensors: Mapping[str, Tensor],
    local_tensors: Mapping[str, Tensor],
    data: SiteData,
    runtime: Runtime,
    progress: Callable[[int, str], Progress] | None = None,
    stop: threading.Event | None = None,
    label: str | None = None,
) -> RoundContext:
    """An algorithm's view of the site's round: the tensors split and checked by `exchange`, the round's seed."""
    received, server_state = _split_received(exchange, global_tensors)
    own, state = _split_kept(exchange, local_tensors)
    return RoundContext(
        config=algorithm_model(spec.site_model, spec.algorithm),
        model_seed=spec.seed,
        training=spec.training,
        params=parsed_params(spec.algorithm),
        exchange=exchange,
        load_factor=spec.load_factor,
        seed=round_seed(spec.seed, spec.round, spec.site),
        received=received,
        server_state=server_state,
        own=own,
        state=state,
        data=data,
        runtime=runtime,
        label=label or f"{spec.site} round {spec.round}",
        progress=progress,
        stop=stop,
    )


def _global_evaluation(ctx: RoundContext, initial_local: Mapping[str, Tensor]) -> TestPredictions | None:
    """Scores of the global evaluation model (theta^g, phi_0, the site's BatchNorm where local) on the test split."""
    if len(ctx.data.test) == 0:
        return None
    state = ctx.exchange.global_evaluation_state(ctx.received, ctx.own, initial_local)
    return evaluate(ctx.build(state), ctx.data.test, ctx.runtime)


@contextmanager
def seeded_rng(seed: int, runtime: Runtime) -> Iterator[None]:
    """Seed every random stream of torch with `seed` inside, and restore them after (CPU, and the round's GPU)."""
    devices = [runtime.device.index or 0] if runtime.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def run_local_round(
    spec: LocalRoundSpec,
    partition: Partition,
    *,
    global_tensors: Mapping[str, Tensor],
    local_tensors: Mapping[str, Tensor],
    initial_local: Mapping[str, Tensor],
    data: SiteData,
    runtime: Runtime,
    progress: Callable[[int, str], Progress] | None = None,
    stop: threading.Event | None = None,
) -> LocalRoundResult:
    """Run the study's algorithm from theta^g_{t-1} and the kept tensors; return (shared, local, meta).

    `partition` is the study's (shared/study/rules.py `study_partition`); it must be the spec's.

    `eval_stats` is the site's contribution to the pooled statistics of the global evaluation model
    theta^g_{t-1} with phi_0 (docs/researcher/model.md) on its test split, or the marker of too few records;
    `local_eval` the exact scalar metrics of the site's personalised model after training (Ditto's
    v_k, ...). The update also carries what the study's aggregation weighting needs (e.g. H_k).
    """
    if len(data.train) == 0:
        raise ValueError(f"site {spec.site} has no training records")
    # the records trained on (and counted as n_k): the training split, less any validation carve
    data, weighting_report = report_for_weighting(spec.aggregation, data, study_seed=spec.seed, site=spec.site)
    exchange = algorithm_exchange(spec.site_model, spec.algorithm)
    if partition != exchange.partition:
        raise ValueError(f"the partition given is not the one of algorithm {spec.algorithm.name!r} on this model")
    algorithm = CLIENT_ALGORITHMS[spec.algorithm.name]
    ctx = round_context(spec, exchange, global_tensors, local_tensors, data, runtime, progress, stop)
    with seeded_rng(ctx.seed, runtime):
        global_predictions = _global_evaluation(ctx, initial_local)
        outcome = algorithm.run(ctx)
        personal = outcome.personal if outcome.personal is not None else outcome.model
        local_predictions = evaluate(personal, data.test, runtime) if len(data.test) else None
        extra = weighting_report(outcome.model, runtime)

    state = {name: t.detach().to("cpu") for name, t in outcome.model.state_dict().items()}
    shared, local = exchange.partition.split(state)
    if spec.model.site_heads:  # the heads this site keeps local leave as zeros (shared/algorithms/head_splits.py)
        shared = zero_unused_heads(shared, spec.site_model.config())
    shared.update(outcome.uploads)
    local.update(outcome.state)
    if shared.keys() != exchange.upload_schema().keys() or not local.keys() <= exchange.local_names():
        raise RuntimeError(f"algorithm {spec.algorithm.name!r} produced tensors outside its declared exchange")
    grid: dict[str, np.ndarray] = {}
    if spec.privacy.dp is not None:  # what leaves: theta^g_{t-1} + the clipped change on the grid (+ a noise share)
        secure = spec.privacy.secure_aggregation is not None
        bits = dp_fraction_bits(spec.terms)
        release = release_update(
            shared, ctx.received, spec.privacy.dp, fraction_bits=bits, secure=secure, quorum=spec.quorum
        )
        shared, grid = release.tensors, release.grid
    result = outcome.training
    metrics = UpdateMetrics(
        loss=result.loss,
        eval_stats=global_predictions.contribution(spec.privacy) if global_predictions is not None else None,
        local_eval=local_predictions.summary(spec.privacy, ctx.seed) if local_predictions is not None else None,
        train_steps=result.steps,
        samples_per_second=result.samples_per_second,
        **extra,
    )
    usage = head_usage(local, ctx.config) if ctx.config.learned_heads else None  # 1 - g: leaves, the gates stay
    meta = UpdateMeta(num_examples=len(data.train), metrics=metrics, train_seconds=result.seconds, head_usage=usage)
    return LocalRoundResult(shared, local, meta, grid)


def run_local_evaluation(
    spec: LocalRoundSpec,
    *,
    global_tensors: Mapping[str, Tensor],
    local_tensors: Mapping[str, Tensor],
    initial_local: Mapping[str, Tensor],
    data: SiteData,
    runtime: Runtime,
) -> LocalRoundResult:
    """The final evaluation round: reports of theta^g_T with phi_0 and of the site's own model.

    The site's own model is the algorithm's (`personal_model`: theta^g_T with phi_k, Ditto's v_k,
    FedALA's and FedAH's adaptively aggregated models ...). Nothing is uploaded but statistics, and
    the kept tensors stay as they are.
    """
    if len(data.test) == 0:
        raise ValueError(f"site {spec.site} has no test records to evaluate on")
    data, _ = report_for_weighting(spec.aggregation, data, study_seed=spec.seed, site=spec.site)  # as trained
    exchange = algorithm_exchange(spec.site_model, spec.algorithm)
    ctx = round_context(spec, exchange, global_tensors, local_tensors, data, runtime)
    with seeded_rng(ctx.seed, runtime):
        global_predictions = _global_evaluation(ctx, initial_local)
        local_predictions = evaluate(CLIENT_ALGORITHMS[spec.algorithm.name].personal_model(ctx), data.test, runtime)
    assert global_predictions is not None
    metrics = UpdateMetrics(
        loss=global_predictions.loss_sum / len(global_predictions.truth),
        eval_stats=global_predictions.contribution(spec.privacy),
        local_eval=local_predictions.summary(spec.privacy, ctx.seed),
    )
    meta = UpdateMeta(num_examples=len(data.train), metrics=metrics, train_seconds=0.0)
    return LocalRoundResult({}, dict(local_tensors), meta)
