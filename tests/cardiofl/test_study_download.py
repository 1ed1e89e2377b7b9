"""`cardiofl study download` over a cut link: resumed from OUT.part, checked against the sha256, then renamed."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from cardiofl.cli import app
from cardiofl.client.resumable_download import partial_paths
from coordinator.config import CoordinatorSettings
from coordinator.main import create_app
from tests.conftest import ADMIN_TOKEN
from tests.coordinator.factories import ADMIN, running_study
from tests.support.cutting_proxy import cutting_proxy
from tests.support.live_server import served

runner = CliRunner()
ALLOWANCE = 4096  # the models listing and the responses' heads, each well under 1 kB


@dataclass(frozen=True)
class Live:
    """A live coordinator with a study whose round-0 theta^g is a few MB."""

    address: tuple[str, int]
    study_id: int
    sha256: str
    size: int

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"


@pytest.fixture()
def live(coordinator_settings: CoordinatorSettings) -> Iterator[Live]:
    with served(create_app(coordinator_settings)) as address:
        with httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=60) as direct:  # a loaded machine
            small = {"preset": "small", "heads": "6:2"}
            study_id, _ = running_study(direct, sites=("lyon",), model=small)  # type: ignore[arg-type]
            (model,) = direct.get(f"/api/v1/studies/{study_id}/models", headers=ADMIN).json()["data"]
        assert model["size"] > 2_000_000  # a cut at half falls deep inside the body
        yield Live(address, study_id, model["sha256"], model["size"])


def _download(live: Live, url: str, out: Path, *extra: str) -> Result:
    args = ["study", "download", str(live.study_id), "--out", str(out), "--url", url, "--token", ADMIN_TOKEN]
    return runner.invoke(app, [*args, *extra])


def _written(out: Path, live: Live) -> bool:
    """Whether `out` holds the model, and no partial file is left beside it."""
    part, meta = partial_paths(out)
    return hashlib.sha256(out.read_bytes()).hexdigest() == live.sha256 and not part.exists() and not meta.exists()


def _cut_run(live: Live, out: Path) -> int:
    """A download cut at half its body that does not try again: the bytes it leaves in OUT.part."""
    with cutting_proxy(live.address, cut_after=live.size // 2) as proxy:
        result = _download(live, proxy.url, out, "--retries", "0")
    assert proxy.cuts == 1
    assert result.exit_code == 1, result.output
    assert "run the command again to resume it" in result.stderr
    part, meta = partial_paths(out)
    held = part.stat().st_size
    assert not out.exists() and 0 < held < live.size
    assert json.loads(meta.read_text())["etag"] == f'"{live.sha256}"'
    return held


def test_a_download_cut_midway_resumes_within_the_command(live: Live, tmp_path: Path) -> None:
    out = tmp_path / "theta.safetensors"
    with cutting_proxy(live.address, cut_after=live.size // 2) as proxy:
        result = _download(live, proxy.url, out)
    assert result.exit_code == 0, result.output
    assert proxy.cuts == 1 and "download cut at" in result.stderr and "resuming in 1 s" in result.stderr
    assert _written(out, live)
    assert proxy.forwarded["down"] < live.size + ALLOWANCE  # each byte of the body sent once
    assert f"round 0 ({live.size:,} bytes, sha256 {live.sha256})" in result.stdout
    assert "━" not in result.output  # no bar when the output is not a terminal


def test_a_rerun_asks_only_for_the_bytes_a_cut_run_did_not_keep(live: Live, tmp_path: Path) -> None:
    out = tmp_path / "theta.safetensors"
    held = _cut_run(live, out)
    with cutting_proxy(live.address, cut_after=None) as proxy:
        result = _download(live, proxy.url, out)
    assert result.exit_code == 0, result.output
    assert f"from {held:,} of {live.size:,} bytes kept" in result.stderr
    assert _written(out, live)
    assert live.size - held <= proxy.forwarded["down"] < live.size - held + ALLOWANCE


def test_a_corrupted_partial_is_caught_and_removed_and_the_next_run_starts_over(live: Live, tmp_path: Path) -> None:
    out = tmp_path / "theta.safetensors"
    held = _cut_run(live, out)
    part, meta = partial_paths(out)
    data = bytearray(part.read_bytes())
    data[held // 2] ^= 0xFF
    part.write_bytes(data)

    result = _download(live, live.url, out)
    assert result.exit_code == 1, result.output
    assert f"not the model's {live.sha256}" in result.stderr and f"{out} not written" in result.stderr
    assert not out.exists() and not part.exists() and not meta.exists()

    with cutting_proxy(live.address, cut_after=None) as proxy:
        result = _download(live, proxy.url, out)
    assert result.exit_code == 0, result.output
    assert _written(out, live)
    assert live.size <= proxy.forwarded["down"] < live.size + ALLOWANCE  # the whole body again


def test_a_partial_of_another_model_is_answered_whole_and_replaced(live: Live, tmp_path: Path) -> None:
    out = tmp_path / "theta.safetensors"
    part, meta = partial_paths(out)
    part.write_bytes(b"\x07" * (live.size // 2))
    meta.write_text(json.dumps({"etag": f'"{"0" * 64}"', "size": live.size}))  # If-Range no longer matches
    with cutting_proxy(live.address, cut_after=None) as proxy:
        result = _download(live, proxy.url, out)
    assert result.exit_code == 0, result.output
    assert "its ETag changed" in result.stderr and "starting over from byte 0" in result.stderr
    assert _written(out, live)
    assert live.size <= proxy.forwarded["down"] < live.size + ALLOWANCE


def test_kept_bytes_past_the_models_end_are_dropped_on_416(live: Live, tmp_path: Path) -> None:
    out = tmp_path / "theta.safetensors"
    part, meta = partial_paths(out)
    part.write_bytes(b"\x07" * (live.size + 10))
    meta.write_text(json.dumps({"etag": f'"{live.sha256}"', "size": live.size + 100}))
    result = _download(live, live.url, out)
    assert result.exit_code == 0, result.output
    assert "no bytes past those kept" in result.stderr
    assert _written(out, live)


def test_a_round_the_study_does_not_have_is_refused_before_any_file_is_written(live: Live, tmp_path: Path) -> None:
    (folder := tmp_path / "models").mkdir()
    result = _download(live, live.url, folder / "theta.safetensors", "--round", "7")
    assert result.exit_code == 1
    assert f"study {live.study_id} has no global model of round 7" in result.stderr
    assert list(folder.iterdir()) == []
