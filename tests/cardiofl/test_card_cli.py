"""`cardiofl study card` and `CardioflClient.card`: the coordinator's card, printed or written where asked."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl import card_cli
from cardiofl.cli import app
from cardiofl.client.http import ApiError, CardioflClient
from shared.wire.card import ModelCard
from tests.coordinator.factories import (
    ADMIN,
    eval_stats,
    evaluate_and_upload,
    local_eval,
    running_study,
    train_and_upload,
)

MADE = re.compile(r"made on [0-9-]+ [0-9:]+ UTC")  # when the card was made: the one part that differs


def same_card(text: str, other: str) -> bool:
    """Whether two renderings of a card are the same but for the time each was made."""
    return MADE.sub("made on …", text) == MADE.sub("made on …", other) and len(MADE.findall(text)) == 1


@pytest.fixture()
def finished(coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> tuple[int, CardioflClient]:
    """A completed one-round study, and the researcher's client of it that `cardiofl study card` uses."""
    study_id, headers = running_study(coordinator, rounds=1)
    for seed, site in enumerate(("lyon", "oslo")):
        assert train_and_upload(coordinator, headers[site], 0.1, 10, local_eval=local_eval(seed)).status_code == 201
    for seed, site in enumerate(("lyon", "oslo")):
        assert evaluate_and_upload(coordinator, headers[site], eval_stats=eval_stats(seed).to_dict()).status_code == 201
    coordinator.headers.update(ADMIN)
    client = CardioflClient(coordinator)

    @contextmanager
    def in_process(url: str, token: str | None) -> Iterator[CardioflClient]:
        yield client

    monkeypatch.setattr(card_cli, "connected", in_process)
    return study_id, client


def test_the_client_reads_the_card_as_a_model_or_as_text(finished: tuple[int, CardioflClient]) -> None:
    study_id, client = finished
    card = client.card(study_id)
    assert isinstance(card, ModelCard) and card.final and card.evaluated_round == 1
    pooled = client.round(study_id, 1).pooled
    assert pooled is not None and pooled.eval is not None and card.pooled_eval == pooled.eval
    markdown = client.card(study_id, "md")
    assert markdown.startswith("# Model card: trial") and f"{pooled.eval.micro_f1:.3f}" in markdown
    assert client.card(study_id, "html").startswith("<!doctype html>")
    with pytest.raises(ApiError) as refused:
        client.card(999)
    assert refused.value.status == 404


def test_study_card_writes_the_card_where_asked(finished: tuple[int, CardioflClient], tmp_path: Path) -> None:
    study_id, client = finished
    out = tmp_path / "cards" / "card.md"
    result = CliRunner().invoke(app, ["study", "card", str(study_id), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote the model card of study {study_id} to {out}"
    assert same_card(out.read_text(encoding="utf-8"), client.card(study_id, "md"))
    page = tmp_path / "card.html"
    result = CliRunner().invoke(app, ["study", "card", str(study_id), "--format", "html", "-o", str(page)])
    assert result.exit_code == 0 and same_card(page.read_text(encoding="utf-8"), client.card(study_id, "html"))
    printed = CliRunner().invoke(app, ["study", "card", str(study_id), "--format", "json"])
    assert printed.exit_code == 0
    made = {"generated_at"}
    shown = ModelCard.model_validate_json(printed.output).model_dump(exclude=made)
    assert shown == client.card(study_id).model_dump(exclude=made)
