"""Learned heads end to end: the service equals the runner bit for bit, and no gate or local head leaves a site."""

from __future__ import annotations

from pathlib import Path

import torch
from fastapi.testclient import TestClient

from cardiofl.experiment.runner import load_sites
from shared.algorithms.learned_heads import gate_names
from shared.model.partition import LOCAL_BRANCH_PATTERN
from shared.study.rules import algorithm_model, shared_schema
from shared.tensors.codec import load
from shared.terms import StudyTerms
from shared.wire.protocol import UpdateMeta
from tests.cardiofl.experiment.test_head_splits_service import service_equals_runner
from tests.cardiofl.experiment.test_runner import tiny_experiment


def test_learned_heads_in_the_service_equal_the_runner(coordinator: TestClient, tmp_path: Path) -> None:
    experiment = tiny_experiment(tmp_path, seeds=[7], heads=["6:2"], rounds=3, privacy={"min_records": 3})
    data = load_sites(experiment)
    (key,) = experiment.runs()
    raw = experiment.study(key).model_dump(mode="json")
    # gates: 1/2 through round 1, one validation step in round 2 (to logit +-1), hard from round 3; the
    # cross-fitted probe on its 4 default folds, 2 epochs each (its default 20 took 30 s to the same checks)
    raw["algorithm"] = {"name": "learned_heads", "params": {"freeze_after": 2, "probe_epochs": 2}}
    study = StudyTerms.model_validate(raw)

    _, _, _, sent = service_equals_runner(coordinator, tmp_path, study, data)

    # on the wire: the shared schema only, no gate, no local head; the usages in the meta, soft then hard
    config = algorithm_model(study.model, study.algorithm)
    for bodies in sent.values():
        trained = [load(body) for body in bodies if load(body)[0]]
        assert len(trained) == study.rounds
        usages = []
        for tensors, metadata in trained:
            assert tensors.keys() == shared_schema(study).keys()
            assert not any(LOCAL_BRANCH_PATTERN.match(n) or n in gate_names(config) for n in tensors)
            usage = torch.tensor(UpdateMeta.from_metadata(metadata).head_usage)
            assert usage.shape == (config.n_blocks, config.n_heads) and bool(((usage >= 0) & (usage <= 1)).all())
            usages.append(usage)
        assert bool((usages[0] == 0.5).all())  # no step before theta^g_0's heads and phi_k's have trained
        stepped = torch.sigmoid(torch.tensor([-1.0, 1.0]))
        assert bool(((usages[1] - stepped[0]).abs() < 1e-6).logical_or((usages[1] - stepped[1]).abs() < 1e-6).all())
        assert bool(((usages[2] == 0) | (usages[2] == 1)).all())  # frozen after two trained rounds
        assert torch.equal(usages[2], (usages[1] > 0.5).float())


def test_cross_fitted_gates_with_kept_evidence_in_the_service_equal_the_runner(
    coordinator: TestClient, tmp_path: Path
) -> None:
    """The kept falls round-trip through the site's store (two comparisons, rounds 2 and 3) and never travel."""
    experiment = tiny_experiment(tmp_path, seeds=[7], heads=["6:2"], rounds=3, privacy={"min_records": 3})
    data = load_sites(experiment)
    (key,) = experiment.runs()
    raw = experiment.study(key).model_dump(mode="json")
    params = {"freeze_after": 3, "probe_folds": 2, "probe_epochs": 1, "evidence": "mean", "evidence_skip": 0}
    raw["algorithm"] = {"name": "learned_heads", "params": params}
    study = StudyTerms.model_validate(raw)

    _, _, _, sent = service_equals_runner(coordinator, tmp_path, study, data)

    for bodies in sent.values():
        trained = [load(body) for body in bodies if load(body)[0]]
        assert len(trained) == study.rounds
        for tensors, metadata in trained:
            assert tensors.keys() == shared_schema(study).keys()
            assert not any(name.startswith("learned_heads.") for name in [*tensors, *metadata])
