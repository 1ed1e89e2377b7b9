"""A site's round is chosen once from the task: its kind's workflow, wrapped for secure aggregation when secure."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shared.wire.protocol import RoundKind, TaskSpec
from site_agent.site_rounds import Evaluation, PlainTraining, SecureAggregated, site_round_for


@pytest.mark.parametrize(
    ("kind", "secure", "workflow", "inner"),
    [
        (RoundKind.TRAIN, None, PlainTraining, None),
        (RoundKind.EVALUATE, None, Evaluation, None),
        (RoundKind.TRAIN, object(), SecureAggregated, PlainTraining),
        (RoundKind.EVALUATE, object(), SecureAggregated, Evaluation),
    ],
)
def test_the_workflow_follows_the_kind_and_the_secure_round(
    kind: RoundKind, secure: object, workflow: type, inner: type | None
) -> None:
    chosen = site_round_for(SimpleNamespace(kind=kind, secure=secure))  # type: ignore[arg-type]
    assert type(chosen) is workflow and chosen.kind is kind and chosen.secure is (secure is not None)
    if inner is not None:
        assert type(chosen.inner) is inner  # type: ignore[attr-defined]


def test_the_task_kind_is_the_enum_both_sides_share_and_its_wire_form_is_unchanged() -> None:
    assert TaskSpec.model_fields["kind"].default is RoundKind.TRAIN
    assert RoundKind("evaluate") is RoundKind.EVALUATE and f"{RoundKind.TRAIN}" == "train"
    from coordinator.models import RoundKind as StoredKind

    assert StoredKind is RoundKind
