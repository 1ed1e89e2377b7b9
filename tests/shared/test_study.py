import pytest
import torch

from shared.model.network import build_model, preset
from shared.model.partition import model_partition, model_schema
from shared.study.rules import initial_state, select_participants, shared_schema, study_partition
from shared.terms import StudyTerms, TrainingConfig
from site_agent.local_round import steps_for


@pytest.fixture()
def config() -> StudyTerms:
    return StudyTerms(model={"preset": "tiny", "heads": "6:2"}, sites=["lyon", "oslo", "graz"], seed=11)


def test_fedavg_keeps_the_model_partition(config: StudyTerms) -> None:
    assert study_partition(config) == model_partition(preset("tiny", "6:2"))


def test_shared_schema_is_theta_g_only(config: StudyTerms) -> None:
    schema = shared_schema(config)
    full = model_schema(preset("tiny", "6:2"))
    assert set(schema) == set(model_partition(preset("tiny", "6:2")).shared)
    assert all(schema[name] == full[name] for name in schema)
    assert not any(".local_branch.in_proj" in name or ".local_branch.out_proj" in name for name in schema)


def test_initial_state_is_the_seeded_model_split(config: StudyTerms) -> None:
    shared, local = initial_state(config)
    reference = build_model(preset("tiny", "6:2"), seed=11).state_dict()
    assert shared.keys() == shared_schema(config).keys()
    assert set(local) == set(study_partition(config).local)
    assert all(torch.equal(t, reference[name]) for name, t in {**shared, **local}.items())


def test_all_participation_selects_every_site_with_load_one(config: StudyTerms) -> None:
    assert select_participants(config, 1) == {"lyon": 1.0, "oslo": 1.0, "graz": 1.0}


SITES = [f"s{i}" for i in range(10)]


def policy(name: str, min_sites: int = 1, seed: int = 3, **params: object) -> StudyTerms:
    return StudyTerms(
        model={"preset": "tiny", "heads": "6:2"},
        sites=SITES,
        participation={"name": name, "params": params},
        min_sites=min_sites,
        seed=seed,
    )


def picks(config: StudyTerms, rounds: int, times: dict[str, float] | None = None) -> list[dict[str, float]]:
    return [select_participants(config, r, 1, lambda: times or {}) for r in range(1, rounds + 1)]


def test_random_dropout_keeps_each_site_with_probability_one_minus_p() -> None:
    chosen = picks(policy("random", p=0.3), 2000)
    for site in SITES:
        assert sum(site in pick for pick in chosen) / 2000 == pytest.approx(0.7, abs=0.04)


def test_random_dropout_never_goes_below_min_sites() -> None:
    chosen = picks(policy("random", min_sites=4, p=0.9), 500)
    assert min(len(pick) for pick in chosen) == 4
    assert all(len(pick) >= 4 for pick in chosen)
    assert all(len(pick) == 4 for pick in picks(policy("random", min_sites=4, p=1.0), 50))
    assert all(len(pick) == 10 for pick in picks(policy("random", p=0.0), 50))


def test_fewer_on_odd_drops_a_random_fraction_on_odd_rounds_only() -> None:
    chosen = picks(policy("fewer_on_odd", f=0.3), 1000)
    assert all(len(pick) == 7 for pick in chosen[0::2]) and all(len(pick) == 10 for pick in chosen[1::2])
    for site in SITES:
        assert sum(site in pick for pick in chosen[0::2]) / 500 == pytest.approx(0.7, abs=0.06)
    assert all(len(pick) == 8 for pick in picks(policy("fewer_on_odd", min_sites=8, f=0.7), 20)[0::2])


def test_fast_on_odd_drops_the_slowest_measured_sites() -> None:
    times = {site: float(i) for i, site in enumerate(SITES)}  # s9 is the slowest
    first, second, third = picks(policy("fast_on_odd", f=0.3), 3, times)
    assert set(first) == set(SITES) - {"s7", "s8", "s9"} and len(second) == 10 == len(SITES)
    assert set(third) == set(first)
    # a site never measured is not known to be slow; round 1 of a study has no times at all
    partly = {"s0": 9.0, "s1": 8.0, "s2": 1.0}
    (pick,) = picks(policy("fast_on_odd", f=0.3), 1, partly)
    assert set(SITES) - set(pick) == {"s0", "s1", "s2"}
    (pick,) = picks(policy("fast_on_odd", f=0.3), 1, {"s5": 2.0})
    assert set(SITES) - set(pick) == {"s5"}
    assert picks(policy("fast_on_odd", f=0.3), 1)[0] == dict.fromkeys(SITES, 1.0)
    (kept,) = picks(policy("fast_on_odd", min_sites=9, f=0.5), 1, times)
    assert set(SITES) - set(kept) == {"s9"}


def test_round_times_are_read_only_by_policies_that_use_them() -> None:
    def forbidden() -> dict[str, float]:
        raise AssertionError("read round times")

    assert len(select_participants(policy("fewer_on_odd", f=0.5), 1, 1, forbidden)) == 5


def test_load_factors_preserve_the_total_number_of_local_steps() -> None:
    training = TrainingConfig(batch_size=8, local_epochs=2)
    per_site = steps_for(100, training, 1.0)  # every site has 100 records: 13 batches, 2 epochs
    for config in (policy("random", p=0.5), policy("fewer_on_odd", f=0.7)):
        for pick in picks(config, 200):
            assert all(factor == pytest.approx(len(SITES) / len(pick)) for factor in pick.values())
            total = sum(steps_for(100, training, factor) for factor in pick.values())
            assert len(SITES) * per_site <= total < len(SITES) * per_site + len(pick)  # ceil per site only


def test_picks_are_the_same_after_a_restart_and_change_with_the_attempt() -> None:
    config = policy("random", p=0.5)
    assert picks(config, 30) == picks(config, 30)
    assert any(select_participants(config, r, 1) != select_participants(config, r, 2) for r in range(1, 30))
