"""An evaluation of model files end to end: the real app, `cardiofl study create` and a site agent that never trained.

The researcher downloads a completed study's theta^g_T and phi_0, names them as files in an evaluate
study's TOML; the command uploads them and creates the study; rome's agent approves, downloads, checks
and evaluates them, and reports exactly what `released_summary` computes of the files: the same figures
as an evaluation of the completed study named by its uid.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.client import cli as client_cli
from cardiofl.client.http import CardioflClient
from shared.tensors.codec import load
from shared.terms import StudyTerms
from site_agent.data import ChallengeSource, open_site_data
from site_agent.data.synthetic import generate_sites
from site_agent.released_evaluation import released_summary
from tests.coordinator.factories import ADMIN
from tests.site_agent.finished_study import ROUNDS, finished_study
from tests.site_agent.test_jobs_service import CPU, agent


def test_a_site_evaluates_the_model_files_a_researcher_uploaded_as_the_completed_study_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "study").mkdir()
    with finished_study(tmp_path / "study") as study:
        coordinator = study.coordinator
        http = httpx.Client(transport=coordinator._transport, base_url=str(coordinator.base_url), headers=ADMIN)
        researcher = CardioflClient(http)
        theta = researcher.download_global_model(study.study_id, ROUNDS)
        phi = researcher.download_initial_local(study.study_id)
        (tmp_path / "models").mkdir()
        (tmp_path / "models" / "theta.safetensors").write_bytes(theta)
        (tmp_path / "models" / "phi0.safetensors").write_bytes(phi)
        toml = tmp_path / "evaluate.toml"
        toml.write_text(
            'name = "files"\nkind = "evaluate"\nsites = ["rome"]\nseed = 11\nround_deadline_s = 600\n'
            '[model]\npreset = "tiny"\nheads = "6:2"\n'
            '[evaluation]\nmodel_file = "models/theta.safetensors"\ninitial_local_file = "models/phi0.safetensors"\n'
        )
        (folder,) = generate_sites(tmp_path / "records", n_sites=1, records_per_site=40, seed=5)
        source = ChallengeSource(path=folder, name="rome")
        data = open_site_data(source, tmp_path / "cache")
        rome, _, _ = agent(coordinator, "rome", tmp_path, data, source)

        @contextmanager
        def in_process(url: str, token: str | None) -> Iterator[CardioflClient]:
            yield researcher

        monkeypatch.setattr(client_cli, "connected", in_process)
        created = CliRunner().invoke(app, ["study", "create", str(toml), "--start", "--json"])
        assert created.exit_code == 0, created.output
        files = json.loads(created.output)
        digests = {
            "model_sha256": hashlib.sha256(theta).hexdigest(),
            "initial_local_sha256": hashlib.sha256(phi).hexdigest(),
        }
        assert files["status"] == "running"
        assert files["config"]["evaluation"] == {"study_uid": None, **digests, "rounds": None, "adapt_local_epochs": 0}
        named = researcher.create_study("named", {**files["config"], "evaluation": {"study_uid": study.study_uid}})
        researcher.study_action(named.id, "start")
        assert [rome.poll_once(), rome.poll_once(), rome.poll_once()] == [True, True, False]

        expected = released_summary(
            StudyTerms.model_validate(files["config"]),
            "rome",
            0,
            global_tensors=load(theta)[0],
            initial_local=load(phi)[0],
            splits=[data.test],
            runtime=CPU,
        )
        of_files, of_study = researcher.evaluations(files["id"]), researcher.evaluations(named.id)
        assert (of_files.evaluated_study_uid, of_files.model_sha256) == (None, digests["model_sha256"])
        assert (of_study.evaluated_study_uid, of_study.model_sha256) == (study.study_uid, digests["model_sha256"])
        assert [r.evaluation for r in of_files.results] == [expected] == [r.evaluation for r in of_study.results]
        assert expected.n_samples == len(data.test)
