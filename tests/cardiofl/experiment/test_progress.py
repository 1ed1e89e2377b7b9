"""A grid's tally (done / running / failed / queued, ETA), and a failed run that stops no other."""

from __future__ import annotations

from pathlib import Path

import pytest

from cardiofl.experiment import grid
from cardiofl.experiment.grid import GridFailed, finished_runs, run_experiment
from cardiofl.experiment.progress import GridTally
from tests.cardiofl.experiment.test_runner import CPU, tiny_experiment


def test_the_eta_is_this_calls_pace_times_the_runs_left() -> None:
    said: list[str] = []
    tally = GridTally(total=10, done=2, say=said.append, started=100.0)
    assert tally.eta(now=150.0) is None and tally.line(now=150.0).endswith("ETA --")  # nothing ended here yet
    tally.slots = 2
    assert tally.queued == 6
    tally.run_finished("a")
    tally.run_finished("b")
    tally.run_failed("c", RuntimeError("out of memory"))
    # 3 runs ended in 60 s: 20 s a run, 5 left (10 - 4 done - 1 failed)
    assert tally.eta(now=160.0) == pytest.approx(100.0)
    assert tally.line(now=160.0) == "4/10 done · 2 running · 1 failed · 3 queued · ETA 0:01:40"
    assert said[0].startswith("run a finished · 3/10 done")
    assert said[2].startswith("run c failed: RuntimeError: out of memory · 4/10 done · 2 running · 1 failed")
    tally.cluster("http://127.0.0.1:8265")
    assert said[-1] == "Ray dashboard: http://127.0.0.1:8265"


def test_a_failed_run_is_named_and_the_others_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_experiment(tmp_path, privacy={"min_records": 3})
    results = tmp_path / "results.jsonl"
    real = grid.run_records

    def second_seed_fails(config, key, *args):  # noqa: ANN001, ANN202
        for number, (record, theta) in enumerate(real(config, key, *args)):
            if key.seed == 1 and number == 1:
                raise RuntimeError("the site's disk is full")
            yield record, theta

    monkeypatch.setattr(grid, "run_records", second_seed_fails)
    said: list[str] = []
    tally = GridTally(total=4, done=0, say=said.append)
    with pytest.raises(GridFailed) as failed:
        run_experiment(config, results, runtime=CPU, tally=tally)
    assert sorted(failed.value.failed) == ["FedDualAtt|6:2|1", "FedDualAtt|8:0|1"]
    assert "2 run(s) failed: FedDualAtt|8:0|1, FedDualAtt|6:2|1" in str(failed.value)
    assert finished_runs(results) == {"FedDualAtt|8:0|0", "FedDualAtt|6:2|0"}  # the grid went on past the first
    assert (tally.done, tally.failed, tally.running, tally.queued) == (2, 2, 0, 0)
    assert any("FedDualAtt|8:0|1 failed: RuntimeError: the site's disk is full" in line for line in said)
    monkeypatch.setattr(grid, "run_records", real)
    ran = run_experiment(config, results, runtime=CPU)  # a rerun tries the failed runs again, and only them
    assert sorted(key.id for key in ran) == ["FedDualAtt|6:2|1", "FedDualAtt|8:0|1"]
    assert finished_runs(results) == {key.id for key in config.runs()}
