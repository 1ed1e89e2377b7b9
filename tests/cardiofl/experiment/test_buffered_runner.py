"""The runner's buffered studies: the simulated clock's buffers, the releases, and FedAvg as their special case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cardiofl.experiment.buffered import Buffer, buffer_schedule
from cardiofl.experiment.config import ExperimentConfig, load_experiment
from cardiofl.experiment.grid import run_experiment
from cardiofl.experiment.report import build_report
from cardiofl.experiment.results import read_results
from cardiofl.experiment.runner import load_sites, simulate_study
from cardiofl.experiment.site_rounds import site_round
from shared.algorithms.buffered import staleness_factor
from shared.study.rules import initial_state
from shared.terms import BufferedSpec, StudyTerms
from site_agent.device import resolve_runtime

CPU = resolve_runtime("cpu")
SITES = ["a", "b", "c", "d"]


def test_a_slow_site_joins_later_buffers_with_its_staleness() -> None:
    seconds = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 5.0}
    buffers = buffer_schedule(SITES, seconds, BufferedSpec(buffer_size=3, max_staleness=5), 7)
    fast = [Buffer({"a": n, "b": n, "c": n}, float(n)) for n in range(1, 6)]
    assert buffers[:5] == fast  # a, b, c fill each buffer; d, tasked in round 1, arrives at 5 s
    assert buffers[5] == Buffer({"a": 6, "b": 6, "d": 1}, 6.0)  # d joins buffer 6, 5 versions behind
    assert buffers[6] == Buffer({"a": 7, "c": 6, "b": 7}, 7.0)  # c waited on no buffer: its 6th update fills 7


def test_an_update_beyond_max_staleness_is_refused_and_the_site_trains_again() -> None:
    seconds = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 5.0}
    buffers = buffer_schedule(SITES, seconds, BufferedSpec(buffer_size=3, max_staleness=4), 11)
    assert [b.refused for b in buffers[:5]] == [()] * 5
    assert buffers[5].refused == ("d",) and "d" not in buffers[5].members  # 5 behind at 5 s: refused
    # tasked again in round 6, it comes 5 behind again at 10 s: a site this slow never counts at this bound
    assert [index for index, b in enumerate(buffers) if b.refused] == [5, 10]
    assert all("d" not in b.members for b in buffers)


def test_ties_go_by_site_name_and_every_buffer_holds_a_site_once() -> None:
    buffers = buffer_schedule(SITES, {}, BufferedSpec(buffer_size=2), 4)
    # a and b, given version 1 at 1 s, arrive at 2 s one version behind: c and d filled buffer 2 meanwhile
    assert [b.members for b in buffers] == [{"a": 1, "b": 1}, {"c": 1, "d": 1}, {"a": 2, "b": 2}, {"c": 3, "d": 3}]


def experiment(tmp_path: Path, **changes: object) -> ExperimentConfig:
    values: dict[str, object] = {
        "name": "buffered",
        "preset": "tiny",
        "heads": ["6:2"],
        "rounds": 3,
        "synthetic": {"sites": 3, "records_per_site": 30, "seed": 5},
        "training": {"optimizer": "sgd", "lr": 0.05, "batch_size": 8, "max_steps": 2},
        "privacy": {"min_records": 3},
        "device": "cpu",
        "cache_dir": str(tmp_path / "cache"),
        **changes,
    }
    return ExperimentConfig.model_validate(values)


def study_of(config: ExperimentConfig, buffered: dict[str, object] | None) -> StudyTerms:
    base = config.study(config.runs()[0]).model_dump(mode="json")
    return StudyTerms.model_validate({**base, "buffered": buffered})


def test_a_full_buffer_of_fresh_updates_at_server_lr_1_is_fedavg_to_the_bit(tmp_path: Path) -> None:
    config = experiment(tmp_path)
    data = load_sites(config)
    synchronous = list(simulate_study(study_of(config, None), data, CPU))
    buffered = list(simulate_study(study_of(config, {"buffer_size": 3}), data, CPU))
    assert len(buffered) == len(synchronous) == 4
    for sync, buff in zip(synchronous, buffered, strict=True):
        assert sync.global_model.keys() == buff.global_model.keys()
        assert all(torch.equal(sync.global_model[n], buff.global_model[n]) for n in sync.global_model)
        assert sync.weights == pytest.approx(buff.weights)
    assert buffered[1].buffer is not None and buffered[1].buffer.bases == {"site-1": 1, "site-2": 1, "site-3": 1}
    assert buffered[-1].kind == "evaluate" and buffered[-1].record(20)["sites"].keys() == {"site-1", "site-2", "site-3"}


def test_a_stale_update_moves_theta_by_its_own_change_times_its_staleness_weight(tmp_path: Path) -> None:
    config = experiment(tmp_path)
    data = load_sites(config)
    spec = {"buffer_size": 2, "server_lr": 0.7}
    study = study_of(config, spec)
    seconds = {"site-1": 1.0, "site-2": 1.0, "site-3": 2.5}
    outcomes = list(simulate_study(study, data, CPU, site_seconds=seconds, evaluate_final=False))
    buffers = [o.buffer for o in outcomes]
    assert [b.bases if b else None for b in buffers] == [
        {"site-1": 0, "site-2": 0},
        {"site-1": 1, "site-2": 1},
        {"site-1": 2, "site-3": 0},  # site-3, tasked in round 1 and arriving at 2.5 s, two versions behind
    ]
    # theta^g_3 by hand, in float64, from the site's own round: its change against theta^g_0, weighted by
    # w_k s(2) with w_k its share of n within the buffer, and site-1's fresh change against theta^g_2
    theta_0, phi_0 = initial_state(study)
    theta_2 = outcomes[1].global_model
    third = outcomes[2].results
    stale = site_round(study, "site-3", 1, study.sites, theta_0, phi_0, phi_0, data["site-3"], CPU)
    assert all(torch.equal(stale.shared[n], third["site-3"].shared[n]) for n in stale.shared)
    counts = [third[s].meta.num_examples for s in ("site-1", "site-3")]
    assert study.aggregation.name == "samples"
    w1, w3 = counts[0] / sum(counts), counts[1] / sum(counts)
    u1, u3 = w1 * staleness_factor("inverse_sqrt", 0), w3 * staleness_factor("inverse_sqrt", 2)
    assert outcomes[2].weights == pytest.approx({"site-1": u1, "site-3": u3})
    for name, value in outcomes[2].global_model.items():
        if not value.is_floating_point():
            continue
        change = u1 * (third["site-1"].shared[name].double() - theta_2[name].double()) + u3 * (
            third["site-3"].shared[name].double() - theta_0[name].double()
        )
        expected = (theta_2[name].double() + 0.7 * change).to(value.dtype)
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)


def test_a_replayed_schedule_gives_the_clock_s_releases(tmp_path: Path) -> None:
    config = experiment(tmp_path, rounds=2)
    data = load_sites(config)
    study = study_of(config, {"buffer_size": 2})
    seconds = {"site-1": 3.0}
    clocked = list(simulate_study(study, data, CPU, site_seconds=seconds, evaluate_final=False))
    schedule = [Buffer(o.buffer.bases and {s: b + 1 for s, b in o.buffer.bases.items()}) for o in clocked if o.buffer]
    replayed = list(simulate_study(study, data, CPU, schedule=schedule, evaluate_final=False))
    for one, two in zip(clocked, replayed, strict=True):
        assert all(torch.equal(one.global_model[n], two.global_model[n]) for n in one.global_model)
    assert [o.clock for o in replayed] == [None, None]


def test_site_seconds_name_training_sites() -> None:
    with pytest.raises(ValueError, match="site_seconds"):
        ExperimentConfig.model_validate(
            {"name": "x", "synthetic": {"sites": 2}, "site_seconds": {"site-9": 2.0}, "preset": "tiny"}
        )


def test_a_buffered_study_s_sites_are_not_sent_to_ray(tmp_path: Path) -> None:
    config = experiment(tmp_path)
    study = study_of(config, {"buffer_size": 2})

    class Elsewhere:
        pass

    with pytest.raises(ValueError, match="in turn"):
        next(simulate_study(study, {}, CPU, sites=Elsewhere()))  # type: ignore[arg-type]


def test_a_synchronous_round_lasts_as_its_slowest_site_or_its_deadline_which_drops_it(tmp_path: Path) -> None:
    config = experiment(tmp_path, rounds=2)
    data = load_sites(config)
    seconds = {"site-3": 4.0}
    waiting = list(simulate_study(study_of(config, None), data, CPU, site_seconds=seconds, evaluate_final=False))
    assert [o.clock for o in waiting] == [4.0, 8.0] and all(len(o.results) == 3 for o in waiting)
    base = config.study(config.runs()[0]).model_dump(mode="json")
    hurried = StudyTerms.model_validate({**base, "round_deadline_s": 2.0})
    dropped = list(simulate_study(hurried, data, CPU, site_seconds=seconds, evaluate_final=False))
    assert [o.clock for o in dropped] == [2.0, 4.0]  # the rounds close at the deadline without site-3
    assert [sorted(o.results) for o in dropped] == [["site-1", "site-2"]] * 2
    records = [o.record(20) for o in dropped]
    assert [r["clock"] for r in records] == [2.0, 4.0] and "site-3" not in records[0]["sites"]


def test_site_readings_read_each_release_on_every_training_site_s_test_split(tmp_path: Path) -> None:
    config = experiment(tmp_path, rounds=1)
    data = load_sites(config)
    (outcome,) = simulate_study(study_of(config, None), data, CPU, site_readings=True, evaluate_final=False)
    assert sorted(outcome.by_site) == ["site-1", "site-2", "site-3"]
    for site, summary in outcome.by_site.items():
        assert summary.n_samples == len(data[site].test)
    assert outcome.record(20)["global_by_site"]["site-1"]["n_samples"] == len(data["site-1"].test)


def test_exclusive_classes_are_the_last_site_s_alone(tmp_path: Path) -> None:
    config = experiment(tmp_path, synthetic={"sites": 3, "records_per_site": 60, "seed": 5, "exclusive_classes": 3})
    data = load_sites(config)
    for site, held in data.items():
        labels = torch.cat([torch.as_tensor(split.labels) for split in (held.train, held.test)])
        present = labels[:, -3:].sum().item()
        assert (present > 0) == (site == "site-3"), (site, present)


def test_the_report_sets_the_slowest_site_against_simulated_time(tmp_path: Path) -> None:
    config = experiment(
        tmp_path,
        rounds=2,
        site_readings=True,
        site_seconds={"site-3": 3.0},
        methods=[
            {"label": "Sync, waits"},
            {"label": "Sync, deadline", "round_deadline_s": 2.0, "rounds": 3},
            {"label": "Buffered", "buffered": {"buffer_size": 2}, "rounds": 3},
        ],
    )
    results = tmp_path / "results.jsonl"
    run_experiment(config, results, runtime=CPU)
    report = build_report(results)
    assert "timeline" in report.figures
    table = report.markdown.split("## Against simulated time (slowest site: site-3, 3 s a round)")[1]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    assert rows["Sync, waits"][1:3] == ["2", "6.0"]  # two rounds of 3 s: the slow site sets the pace
    assert rows["Sync, deadline"][1:3] == ["3", "6.0"]  # three rounds closed at 2 s without it
    assert rows["Buffered"][1:3] == ["3", "3.0"]  # site-1 and site-2 fill a buffer a second
    assert {run.method for run in read_results(results)} == {"Sync, waits", "Sync, deadline", "Buffered"}
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    buffered = [r for r in lines if r.get("method") == "Buffered" and r.get("kind") == "train"]
    assert [r["clock"] for r in buffered] == [1.0, 2.0, 3.0]
    assert [sorted(r["sites"]) for r in buffered] == [["site-1", "site-2"]] * 3
    assert all("buffer" not in r for r in lines if r.get("method") != "Buffered")
    last = buffered[-1]
    reading = last["global_by_site"]["site-3"]
    assert rows["Buffered"][3] == f"{100 * reading['micro_f1']:.1f} ± 0.0"  # one seed: its own reading


def test_the_shipped_cpu_heterogeneous_experiment_compares_four_ways_to_wait_or_not() -> None:
    config = load_experiment("cpu-heterogeneous")
    assert config.site_seconds == {"site-4": 5.0} and config.site_readings and config.synthetic is not None
    assert config.synthetic.exclusive_classes == 3 and config.seeds == [0, 1, 2]
    studies = {key.method: config.study(key) for key in config.runs()}
    assert studies["Sync, waits"].buffered is None and studies["Sync, waits"].round_deadline_s > 5
    assert studies["Sync, deadline"].round_deadline_s == 2.0  # the slow site never meets it
    assert studies["Centre dropout"].participation.name == "fast_on_odd"
    buffered = studies["Buffered"].buffered
    assert buffered is not None and buffered.buffer_size == 3 and buffered.max_staleness == 8


def test_validation_sites_read_every_nth_release_and_the_last(tmp_path: Path) -> None:
    config = experiment(
        tmp_path,
        synthetic={"sites": 4, "records_per_site": 30, "seed": 5},
        validation_sites=["site-4"],
        validation_every=2,
        methods=[{"label": "FedBuff", "buffered": {"buffer_size": 2}}],
    )
    study = config.study(config.runs()[0])
    assert study.sites == ["site-1", "site-2", "site-3"] and study.buffered is not None
    outcomes = list(simulate_study(study, load_sites(config), CPU, site_seconds={"site-3": 2.5}))
    assert [sorted(o.external) for o in outcomes if o.kind == "train"] == [[], ["site-4"], ["site-4"]]
    assert all("site-4" not in o.results for o in outcomes)  # it never trains
