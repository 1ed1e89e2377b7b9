"""The demo's path through real processes: a coordinator and site agents on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cardiofl.client.http import CardioflClient
from cardiofl.demo import DemoPlan, DemoResult, run_demo
from tests.coordinator.conftest import postgres_schema_url

REAL_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ecg" / "cinc2020_2021"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None  # the demo's default: a SQLite file in its workdir
    else:
        yield from postgres_schema_url()


def assert_finished_cleanly(result: DemoResult, rounds: int, sites: int, held_out: int = 0) -> None:
    """The study trained `sites` sites for `rounds` rounds; `held_out` more evaluated every released model."""
    assert result.study.status == "completed"
    by_kind = [(r.number, r.kind, r.status, len(r.updates)) for r in result.rounds]
    expected = [(t, "train", "completed", sites) for t in range(1, rounds + 1)]
    assert by_kind == [*expected, (rounds + 1, "evaluate", "completed", sites)]
    for r in result.rounds[:rounds]:
        assert r.pooled is not None and r.pooled.eval is not None and r.pooled.local_eval is not None
        assert r.pooled.eval.n_samples and r.pooled.eval.n_samples > 0  # theta^g_t evaluated on every test split
        assert r.pooled.local_eval.n_samples and r.pooled.local_eval.n_samples > 0
        assert sorted(r.participants) == [f"site-{i + 1}" for i in range(sites)]
    validation = [f"site-{i + 1}" for i in range(sites, sites + held_out)]
    assert result.study.config.validation_sites == validation
    if held_out:  # each held-out site evaluated theta^g of every round, the final one included, on all its records
        assert result.external is not None and result.external.final_round == rounds
        evaluated = sorted((r.round, r.site) for r in result.external.results)
        assert evaluated == [(t, site) for t in range(1, rounds + 1) for site in validation]
        assert all(r.evaluation.n_samples > 0 for r in result.external.results)
    for pid in result.pids:  # every process the demo started is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def assert_surveyed(result: DemoResult, sites: int, printed: str) -> None:
    """The demo surveyed every site first and printed the pooled table."""
    assert result.survey is not None and not result.survey.awaiting
    assert [s.site for s in result.survey.sites] == [f"site-{i + 1}" for i in range(sites)]
    assert "data-readiness survey of" in printed and "pooled" in printed


def assert_rounds_explained(result: DemoResult, printed: str) -> None:
    """Round t's line gives the figures of row t (own models, θ^g_t); a note under the tables reads them."""
    lines = [line for line in printed.splitlines() if line.startswith(("round ", "final evaluation:"))]
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2", "final evaluation"]
    for r, line in zip(result.rounds[:2], lines, strict=False):
        assert r.pooled is not None and r.pooled.eval is not None and r.pooled.eval.micro_f1 is not None
        assert f"own models after round {r.number} (mean): micro-F1 " in line
        assert f"global model θ^g_{r.number} (pooled): micro-F1 {r.pooled.eval.micro_f1:.3f} " in line
    assert "each site's θ^g_2 with its own φ_k (mean)" in lines[2]
    assert "the round's global model θ^g_t (pooled)" in " ".join(printed.split())  # the tables' titles
    assert "final eval: nothing trains; on the same test split as every round, it scores each site's θ^g_2" in printed
    assert "global model of round" not in printed.split("external validation")[0]  # the old line, a round behind


def assert_restart_shows_the_study(result: DemoResult, printed: str) -> None:
    """The printed command starts a coordinator again, whose API answers the dashboard's viewer token."""
    (command,) = [line.strip() for line in printed.splitlines() if line.startswith("  CARDIOFL_DATABASE_URL=")]
    setting, *args = shlex.split(command)
    name, value = setting.split("=", 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")} | {name: value}
    child = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    viewer = result.dashboard.split("#token=")[1]
    try:
        with contextlib.closing(CardioflClient.connect(result.url, viewer)) as api:
            deadline = time.monotonic() + 60
            while True:
                try:
                    study = api.study(result.study.id)
                    break
                except Exception:  # noqa: BLE001 - not listening yet
                    assert time.monotonic() < deadline and child.poll() is None, "the restarted coordinator"
                    time.sleep(0.5)
        assert study.status == "completed" and study.completed_rounds == result.study.completed_rounds
    finally:
        child.terminate()
        child.wait(30)


def test_demo_runs_two_agents_for_two_rounds(
    tmp_path: Path, database_url: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    secure = database_url is not None  # on PostgreSQL the demo runs `--secure`: SecAgg+ and distributed DP
    plan = DemoPlan(
        workdir=tmp_path / "demo",
        sites=2,
        rounds=2,
        preset="tiny",
        records_per_site=40,
        batch_size=8,
        database_url=database_url,
        deadline_s=120,
        min_records=5,  # 8 test records a site
        secure=secure,
        validation_sites=0 if secure else 1,  # plain: site-2 never trains, and validates every released model
    )
    plan.workdir.mkdir(parents=True)
    (plan.workdir / "coordinator-1700000000.db").write_bytes(b"an earlier run's database")
    (plan.workdir / "coordinator-1700000000.blobs").mkdir()
    result = run_demo(plan)
    assert_finished_cleanly(result, rounds=2, sites=1 if plan.validation_sites else 2, held_out=plan.validation_sites)
    printed = capsys.readouterr().out
    assert_surveyed(result, 2, printed)
    if plan.validation_sites:
        assert "external validation at site-2 (never trained), global model of round 2 (final):" in printed
    assert result.card == plan.workdir / "card.md" and f"model card: {result.card}" in printed
    assert "macro-AUROC" in printed  # among the figures of every round
    assert_rounds_explained(result, printed)
    card = result.card.read_text(encoding="utf-8")  # the study's model card: the final evaluation of theta^g_2
    final = result.rounds[1].pooled.eval if result.rounds[1].pooled is not None else None
    assert final is not None and final.micro_f1 is not None
    assert card.startswith(f"# Model card: {result.study.name}") and f"{final.micro_f1:.3f}" in card
    if secure:  # every training round released under masks, with its epsilon at the study's delta
        terms = result.study.config
        assert terms.privacy.secure_aggregation is not None and terms.aggregation.name == "equal"
        spent = [r.pooled.privacy for r in result.rounds[:2] if r.pooled is not None and r.pooled.privacy]
        assert [s.rounds for s in spent] == [1, 2] and spent[0].epsilon and spent[1].epsilon
        assert 0 < spent[0].epsilon < spent[1].epsilon and spent[0].mode == "distributed"
    if database_url is None:  # one database per workdir, and no update kept once its round is done
        assert sorted(p.name for p in plan.workdir.glob("coordinator*.db")) == ["coordinator.db"]
        assert [p.name for p in plan.workdir.glob("coordinator*.blobs")] == ["coordinator.blobs"]
        stored = [p for p in (plan.workdir / "coordinator.blobs").rglob("*") if p.is_file()]
        # none under a digest: only spares, for a later upload to be written over or swept within the hour
        # (none at all on a file system under 20 % free, where a released file is unlinked instead)
        assert [p.parent.name for p in stored] == ["spare"] * len(stored)
    assert "/dashboard?study=" in result.dashboard and "#token=" in result.dashboard
    after = printed.split("the coordinator has stopped, and the dashboard with it")[1]
    assert result.url not in after and "/dashboard" not in after  # nothing printed once it stopped points at it
    if database_url is None:
        assert_restart_shows_the_study(result, printed)
    logs = (tmp_path / "demo" / "logs" / "site-1.log").read_text()
    assert "upload accepted" in logs
    assert ("masked final evaluation uploaded" if secure else "final evaluation uploaded") in logs


def test_real_ecg_sites_run_two_rounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not REAL_DATA.is_dir():
        pytest.skip(f"real ECG records not found at {REAL_DATA} (the ../shared/data folder is absent)")
    sites = [
        [REAL_DATA / "georgia_g12ec"],
        [REAL_DATA / "ningbo", REAL_DATA / "chapman_shaoxing"],
        [REAL_DATA / "cpsc2018", REAL_DATA / "ptbxl"],
    ]
    plan = DemoPlan(
        workdir=tmp_path / "real", rounds=2, preset="tiny", data=sites, batch_size=8, deadline_s=300, min_records=1
    )
    result = run_demo(plan)
    assert_finished_cleanly(result, rounds=2, sites=2, held_out=1)  # cpsc2018 and ptbxl held out of training
    first = result.rounds[0]
    n_test = {u.site: u.local_eval.n_samples if u.local_eval else None for u in first.updates}
    assert all(n is not None and n > 0 for n in n_test.values())
    assert first.pooled is not None and first.pooled.eval is not None
    assert first.pooled.eval.n_samples == sum(n for n in n_test.values() if n is not None)
    assert_surveyed(result, 3, capsys.readouterr().out)
    assert result.survey is not None  # the survey counted every real record the loaders read or excluded
    records = {s.site: s.survey.cells()[("train", "records", "records")] for s in result.survey.sites}
    assert all(count is not None and count > 0 for count in records.values())


def test_each_demo_run_starts_its_sites_with_fresh_stores_beside_a_fresh_coordinator(tmp_path: Path) -> None:
    """The last run's store (its approvals, its secure-aggregation ledger) and its record go; the key stays."""
    from cardiofl.demo import _write_site_config

    plan = DemoPlan(workdir=tmp_path)
    site = tmp_path / "sites" / "site-1"
    (site / "store" / "approvals").mkdir(parents=True)
    (site / "store" / "protected-secure-ledger.enc").write_bytes(b"the last run's")
    (site / "store.key").write_text("kept")
    (site / "store.key.approvals-version").write_bytes(b"the last run's")
    config = _write_site_config(plan, "site-1", [tmp_path / "data"], "http://127.0.0.1:1", site / "token")
    assert not (site / "store").exists() and not (site / "store.key.approvals-version").exists()
    assert (site / "store.key").read_text() == "kept" and config.is_file()


def test_a_buffered_demo_completes_without_waiting_for_its_slow_site(tmp_path: Path) -> None:
    plan = DemoPlan(
        workdir=tmp_path / "demo",
        sites=4,
        rounds=6,
        preset="tiny",
        records_per_site=40,
        batch_size=8,
        deadline_s=120,
        min_records=5,
        survey=False,
        validation_sites=0,
        buffer_size=3,  # a version per 3 updates of 4 sites
        slowdown=5.0,  # site-4's agent trains 5 times slower
    )
    result = run_demo(plan)
    assert result.study.status == "completed" and result.study.config.buffered is not None
    trained = [r for r in result.rounds if r.kind == "train"]
    assert [(r.number, r.status, len(r.updates)) for r in trained] == [(t, "completed", 3) for t in range(1, 7)]
    for r in trained:  # every update counted with the version it trained from and how far behind that was
        for u in r.updates:
            assert u.base_round is not None and u.staleness == r.number - 1 - u.base_round
            assert 0 <= u.staleness <= plan.max_staleness
    slow = [u for r in trained for u in r.updates if u.site == "site-4"]
    counts = [sum(u.site == site for r in trained for u in r.updates) for site in ("site-1", "site-2", "site-3")]
    assert len(slow) < max(counts)  # released without it: no buffer waited for site-4
    assert any(u.staleness for u in slow), [(u.base_round, u.staleness) for u in slow]  # it still counts, late
    assert "slowdown = 5.0" in (plan.workdir / "sites" / "site-4" / "site.toml").read_text()
    assert result.rounds[-1].kind == "evaluate" and len(result.rounds[-1].updates) == 4
