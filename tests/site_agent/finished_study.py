"""A finished tiny study for the tests of a study's model at work: an in-process coordinator, two real agents.

The coordinator app runs behind a TestClient; two site agents train a 2-round FedDualAtt study on
synthetic sites and take part in the final evaluation. Helpers build the expected models straight
from the coordinator's blobs and a site's store, and load an exported file in a Python that has
torch but not cardiofl.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch
from fastapi.testclient import TestClient

from coordinator.main import create_app
from shared.model.network import DualAttentionResNet1D, build_model
from shared.model.partition import model_partition
from shared.tensors.codec import TensorDict, load
from shared.terms import ModelSpec
from site_agent.approvals import study_key as store_key
from site_agent.client import CoordinatorClient
from site_agent.data import ChallengeSource, open_site_data
from site_agent.data.synthetic import generate_sites
from site_agent.device import resolve_runtime
from site_agent.store import SiteStore, generate_key
from site_agent.worker import SiteWorker
from tests.conftest import coordinator_settings_for, create_tables
from tests.coordinator.factories import ADMIN, create_study, enrol

SITES = ("lyon", "oslo")
MODEL = ModelSpec(preset="tiny", heads="6:2")
ROUNDS = 2
SEED = 11


@dataclass(frozen=True)
class FinishedStudy:
    """A completed study and what one site (lyon) holds of it."""

    coordinator: TestClient
    study_id: int
    study_uid: str
    site: str
    headers: dict[str, str]  # the site's token
    key: bytes  # its store key
    store_dir: Path
    records: Path  # its synthetic Challenge-layout folder
    config_file: Path  # its site.toml

    @property
    def store(self) -> SiteStore:
        """The site's store."""
        return SiteStore(self.store_dir, self.key, self.site)

    def http(self, headers: dict[str, str] | None = None) -> httpx.Client:
        """An HTTP client of the in-process coordinator with the site's token (or `headers`)."""
        return httpx.Client(
            transport=self.coordinator._transport,
            base_url=str(self.coordinator.base_url),
            headers=headers if headers is not None else self.headers,
        )

    @contextmanager
    def client(self, headers: dict[str, str] | None = None) -> Iterator[CoordinatorClient]:
        """The agent's client of the in-process coordinator with the site's token (or `headers`)."""
        with self.http(headers) as http:
            yield CoordinatorClient(http)

    def blob(self, path: str) -> TensorDict:
        """Tensors of a model blob, downloaded as the admin."""
        response = self.coordinator.get(f"/api/v1/studies/{self.study_id}/models/{path}", headers=ADMIN)
        assert response.status_code == 200, response.text
        return load(response.content)[0]

    def model(self, round_: int, local: TensorDict) -> DualAttentionResNet1D:
        """theta^g of `round_` with `local` as phi, in eval mode: the expected model, built directly."""
        partition = model_partition(MODEL.config())
        shared = self.blob(str(round_))
        model = build_model(MODEL.config())
        model.load_state_dict({**{n: shared[n] for n in partition.shared}, **local}, strict=True)
        return model.eval()

    def personal_model(self) -> DualAttentionResNet1D:
        """theta^g_T with the site's latest phi_k."""
        committed = self.store.load_local(store_key(self.study_id, self.study_uid))
        assert committed is not None
        return self.model(ROUNDS, committed[1])


def _site_toml(path: Path, site: str, headers: dict[str, str], key: bytes, root: Path, records: Path) -> None:
    token = headers["Authorization"].removeprefix("Bearer ")
    path.write_text(
        f'name = "{site}"\n'
        'coordinator_url = "http://testserver"\n'
        f'token = "{token}"\n'
        f'store_key = "{base64.urlsafe_b64encode(key).decode()}"\n'
        f'store_dir = "{root / site}"\n'
        f'cache_dir = "{root / "cache" / site}"\n'
        'device = "cpu"\n'
        "progress_bar = false\n"
        "[[data]]\n"
        'kind = "challenge"\n'
        f'path = "{records}"\n'
    )


@contextmanager
def finished_study(root: Path) -> Iterator[FinishedStudy]:
    """Run the study to its end (rounds 1..T and the final evaluation) and hand over lyon's side of it."""
    url = f"sqlite:///{root / 'coordinator.db'}"
    create_tables(url)
    folders = generate_sites(root / "raw", n_sites=len(SITES), records_per_site=40, seed=3)
    with TestClient(create_app(coordinator_settings_for(url))) as coordinator:
        workers, stores = {}, {}
        for name, folder in zip(SITES, folders, strict=True):
            headers = enrol(coordinator, name)
            key = generate_key()
            data = open_site_data(ChallengeSource(path=folder, name=name), root / "cache" / name)
            http = httpx.Client(transport=coordinator._transport, base_url=str(coordinator.base_url), headers=headers)
            workers[name] = SiteWorker(
                site=name,
                client=CoordinatorClient(http, poll_wait_s=0.0),
                # its approvals' version where the agent of _site_toml keeps it (beside the store: the key is inline)
                store=SiteStore(root / name, key, name, version_file=root / f"{name}.approvals-version"),
                data=lambda data=data: data,
                runtime=resolve_runtime("cpu"),
                progress_bar=False,
                auto_approve=True,
            )
            stores[name] = (headers, key)
        study_id = create_study(
            coordinator,
            list(SITES),
            rounds=ROUNDS,
            training={"lr": 0.05, "batch_size": 8, "max_steps": 2},
            seed=SEED,
            model=MODEL.model_dump(),
        )
        assert coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
        for _ in range(ROUNDS + 1):  # the training rounds, then the final evaluation
            for worker in workers.values():
                assert worker.poll_once()
        study = coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
        assert study["status"] == "completed", study
        site = SITES[0]
        headers, key = stores[site]
        config_file = root / "site.toml"
        _site_toml(config_file, site, headers, key, root, folders[0])
        yield FinishedStudy(
            coordinator, study_id, study["uid"], site, headers, key, root / site, folders[0], config_file
        )


LOADER = """
import importlib.util, json, sys
sys.path.append(sys.argv[1])  # torch's folder, and nothing of the project
import torch
project = [name for name in ("cardiofl", "shared", "site_agent", "coordinator") if importlib.util.find_spec(name)]
assert not project, project
torch.manual_seed(0)
signals = torch.randn(3, 12, 5000)
program = torch.export.load(sys.argv[2])
print(json.dumps(program.module()(signals).tolist()))
"""


def run_export_without_cardiofl(path: Path, cwd: Path) -> np.ndarray:
    """The outputs of an exported file on torch.manual_seed(0)'s randn(3, 12, 5000), computed by a bare Python."""
    torch_dir = str(Path(torch.__file__).resolve().parents[1])
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", LOADER, torch_dir, str(path)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return np.array(json.loads(result.stdout.strip().splitlines()[-1]))


def seeded_signals() -> torch.Tensor:
    """The input `run_export_without_cardiofl` feeds, made the same way here."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(3, 12, 5000, generator=generator)
