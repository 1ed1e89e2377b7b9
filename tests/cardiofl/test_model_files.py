"""`cardiofl study create` with model files: the CLI's own `[evaluation]` keys, replaced by digests, sent first."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.client import cli as client_cli
from cardiofl.client.http import CardioflClient
from cardiofl.client.job_figures import evaluation_table
from cardiofl.client.model_files import read_study_with_models
from shared.terms import TermsError
from tests.cardiofl.job_results import evaluation_results, study

THETA, PHI = b"theta bytes", b"phi_0 bytes"  # the coordinator checks what they hold; the CLI only sends them


def write_study(folder: Path, evaluation: str) -> Path:
    """An evaluate study's TOML in `folder`, with the model files beside it in models/."""
    (folder / "models").mkdir(exist_ok=True)
    (folder / "models" / "theta.safetensors").write_bytes(THETA)
    (folder / "models" / "phi0.safetensors").write_bytes(PHI)
    path = folder / "evaluate.toml"
    path.write_text(
        f'name = "files"\nkind = "evaluate"\nsites = ["rome"]\n[model]\npreset = "tiny"\n[evaluation]\n{evaluation}'
    )
    return path


FILES = 'model_file = "models/theta.safetensors"\ninitial_local_file = "models/phi0.safetensors"\n'


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_file_keys_become_the_digests_of_the_files_relative_to_the_toml(tmp_path: Path) -> None:
    read = read_study_with_models(write_study(tmp_path, FILES + "adapt_local_epochs = 2\n"))
    assert read.name == "files" and read.terms.evaluation is not None
    assert read.terms.evaluation.model_dump() == {
        "study_uid": None,
        "model_sha256": sha(THETA),
        "initial_local_sha256": sha(PHI),
        "rounds": None,
        "adapt_local_epochs": 2,
    }
    assert read.models == {sha(THETA): THETA, sha(PHI): PHI}
    by_uid = read_study_with_models(write_study(tmp_path, 'study_uid = "' + "e" * 32 + '"\n'))
    assert by_uid.models == {} and by_uid.terms.evaluation is not None and by_uid.terms.evaluation.study_uid == "e" * 32


@pytest.mark.parametrize(
    ("evaluation", "problems"),
    [
        (
            FILES + f'model_sha256 = "{"a" * 64}"\n',
            ["evaluation.model_file: name the model by its file or by model_sha256, not both"],
        ),
        ('model_file = "models/none.safetensors"\ninitial_local_file = "models/phi0.safetensors"\n', ["cannot read"]),
        ('model_file = "models/theta.safetensors"\n', ["evaluation: name the evaluated model by study_uid"]),
    ],
    ids=["file and digest", "no such file", "one file"],
)
def test_a_file_key_that_names_no_readable_model_is_refused_before_anything_is_sent(
    tmp_path: Path, evaluation: str, problems: list[str]
) -> None:
    with pytest.raises(TermsError) as refused:
        read_study_with_models(write_study(tmp_path, evaluation))
    assert len(refused.value.problems) == len(problems)
    for line, start in zip(refused.value.problems, problems, strict=True):
        assert line.startswith(start) or start in line


def test_study_create_uploads_each_file_then_creates_the_study_with_their_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[str, str, bytes]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, request.headers["content-type"], request.read()))
        if request.url.path == "/api/v1/models":
            body = request.read()
            return httpx.Response(201, json={"sha256": sha(body), "size": len(body), "tensors": 3})
        return httpx.Response(201, content=study(3).model_dump_json())

    client = CardioflClient(httpx.Client(transport=httpx.MockTransport(answer), base_url="http://coordinator.test"))

    @contextmanager
    def in_process(url: str, token: str | None) -> Iterator[CardioflClient]:
        yield client

    monkeypatch.setattr(client_cli, "connected", in_process)
    result = CliRunner().invoke(app, ["study", "create", str(write_study(tmp_path, FILES)), "--json"])
    assert result.exit_code == 0, result.output
    assert [(path, kind) for path, kind, _ in sent] == [
        ("/api/v1/models", "application/octet-stream"),
        ("/api/v1/models", "application/octet-stream"),
        ("/api/v1/studies", "application/json"),
    ]
    assert [body for _, _, body in sent[:2]] == [THETA, PHI]
    created = json.loads(sent[2][2])
    assert created["name"] == "files"
    assert created["config"]["evaluation"] == {
        "study_uid": None,
        "model_sha256": sha(THETA),
        "initial_local_sha256": sha(PHI),
        "rounds": None,
        "adapt_local_epochs": 0,
    }


def test_study_create_stops_when_the_coordinator_stores_a_file_under_another_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(201, json={"sha256": "0" * 64, "size": 1, "tensors": 1})

    client = CardioflClient(httpx.Client(transport=httpx.MockTransport(answer), base_url="http://coordinator.test"))
    monkeypatch.setattr(CardioflClient, "connect", lambda *_, **__: client)  # `connected` reports its errors
    result = CliRunner().invoke(app, ["study", "create", str(write_study(tmp_path, FILES))])
    assert result.exit_code == 1
    assert f"the coordinator stored the model file of sha256 {sha(THETA)} as {'0' * 64}" in result.output
    assert paths == ["/api/v1/models"]  # no study was created


def test_the_evaluation_table_of_a_model_file_names_no_study() -> None:
    results = evaluation_results().model_copy(update={"evaluated_study_uid": None})
    console = Console(width=200, record=True)
    console.print(evaluation_table(results))
    text = " ".join(console.export_text().split())  # the title wraps at the table's width
    assert f"Evaluation of the uploaded model file (theta^g sha256 {results.model_sha256[:16]}…) at each site" in text
    assert "final model of study" not in text
