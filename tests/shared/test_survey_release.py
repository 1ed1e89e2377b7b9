"""What of a survey leaves a site: no small count nor one worked out by subtraction, seeded noise, its epsilon."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from shared.privacy.discrete import DiscreteGaussian
from shared.study.accounting import DpAccounting, epsilon_after
from shared.study.survey import survey_accounting, survey_epsilon, survey_privacy_report, survey_sigma
from shared.wire.metrics import PrivacySpent
from shared.wire.survey import GROUPS, SURVEY_L2_SENSITIVITY, UNKNOWN, SiteSurvey, all_cells, tables_of
from shared.wire.survey_release import add_noise, hidden_binary, hidden_partition, release, release_problem, suppress
from tests.shared.survey_counts import random_cells, random_survey, survey_with

KEY = b"\x11" * 32


def test_a_partition_hides_its_small_cells_and_enough_others() -> None:
    recording = [False] * 4
    assert hidden_partition([0, 25, 50, 0], 20, hide_zero=recording) == [False] * 4  # zeros show
    assert hidden_partition([3, 30, 50, 0], 20, hide_zero=recording) == [True, True, False, False]
    assert hidden_partition([3, 30, 25, 0], 20, hide_zero=recording) == [True, False, True, False]  # the smallest
    assert hidden_partition([12, 9, 50, 0], 20, hide_zero=recording) == [True, True, False, False]  # 21 >= 20
    assert hidden_partition([5, 5, 0, 0], 20, hide_zero=recording) == [True, True, False, False]  # all of 10 records
    patient = [True, True, False]  # F, M, unknown
    assert hidden_partition([0, 50, 0], 20, hide_zero=patient) == [True, True, False]  # "no woman" is not shown
    assert hidden_partition([30, 50, 0], 20, hide_zero=patient) == [False, False, False]
    assert hidden_partition([30, 50, 4], 20, hide_zero=patient) == [True, False, True]


def test_a_binary_count_hides_when_it_or_its_complement_is_small() -> None:
    assert not hidden_binary(30, 100, 20, hide_zero=True)
    assert hidden_binary(5, 100, 20, hide_zero=True) and hidden_binary(95, 100, 20, hide_zero=True)
    assert hidden_binary(0, 100, 20, hide_zero=True) and hidden_binary(100, 100, 20, hide_zero=True)  # none, all
    assert not hidden_binary(0, 100, 20, hide_zero=False) and not hidden_binary(100, 100, 20, hide_zero=False)
    assert hidden_binary(30, 45, 20, hide_zero=False)  # 15 without it


def test_the_zero_rule_by_table() -> None:
    survey = survey_with(
        {"train": 100, "test": 8, "excluded": 40},
        train__labels__NORM=100,  # every record: its complement is 0
        train__labels__STACH=40,
        train__quality__clipped=0,
        train__sex__M=60,  # F 40, unknown 0
        excluded__reason__no_label=40,
    )
    released = suppress(survey, 20).cells()
    assert released[("train", "labels", "NORM")] is None and released[("train", "labels", "AFIB")] is None
    assert released[("train", "labels", "STACH")] == 40
    assert released[("train", "quality", "clipped")] == 0 and released[("train", "sampling_rate", "250 Hz")] == 0
    assert [released[("train", "sex", key)] for key in ("F", "M", UNKNOWN)] == [40, 60, 0]
    assert released[("excluded", "reason", "no_label")] == 40 and released[("excluded", "reason", "empty")] == 0
    test_cells = [value for (group, _, _), value in released.items() if group == "test"]
    assert set(test_cells) == {None}  # 8 records: the whole group is hidden


@pytest.mark.parametrize("seed", range(40))
def test_no_small_count_survives_nor_can_be_worked_out(seed: int) -> None:
    exact = random_cells(seed)
    n = int(np.random.default_rng(seed).integers(1, 40))
    released = suppress(SiteSurvey.from_cells(exact), n).cells()
    for group in GROUPS:
        records = exact[(group, "records", "records")]
        if 0 < records < n:
            assert all(value is None for (g, _, _), value in released.items() if g == group)
            continue
        assert released[(group, "records", "records")] == records
        for table in tables_of(group):
            cells = [(group, table.name, key) for key in table.keys]
            for cell in cells:
                value = released[cell]
                zero_shows = not table.patient or cell[2] == UNKNOWN or records == 0
                if value is None:
                    continue
                assert value == exact[cell] and (value >= n or (value == 0 and zero_shows))
                if not table.partition:  # nor is what it leaves of the records small
                    assert records - value >= n or (records - value == 0 and zero_shows)
            hidden = [exact[cell] for cell in cells if released[cell] is None]
            if table.partition and hidden:  # the hidden cells' sum is known: records less the shown ones
                assert len(hidden) >= 2 and sum(hidden) >= n
                assert records - sum(released[cell] or 0 for cell in cells) == sum(hidden)


def test_suppression_is_done_once_and_keeps_the_noise_it_saw() -> None:
    survey = random_survey(3)
    released = suppress(survey, 10)
    assert released.min_records == 10 and released.noise_sigma is None
    with pytest.raises(ValueError, match="suppressed already"):
        suppress(released, 10)
    with pytest.raises(ValueError, match="min_records is at least 1"):
        suppress(survey, 0)
    noisy = release(survey, min_records=10, noise_sigma=2.0, key=KEY)
    assert (noisy.min_records, noisy.noise_sigma) == (10, 2.0)
    assert SiteSurvey.model_validate_json(noisy.model_dump_json()) == noisy


def test_noise_is_the_samplers_draws_in_cell_order_and_reproducible_from_the_key() -> None:
    survey = random_survey(5, largest=5000)
    noisy = add_noise(survey, 3.5, key=KEY)
    draws = DiscreteGaussian(KEY).sample(len(all_cells()), Fraction(3.5) ** 2)
    exact = list(survey.cells().values())
    expected = [max(int(value or 0) + int(draw), 0) for value, draw in zip(exact, draws, strict=True)]
    assert list(noisy.cells().values()) == expected
    assert add_noise(survey, 3.5, key=KEY) == noisy
    assert add_noise(survey, 3.5, key=b"\x12" * 32) != noisy
    assert noisy.noise_sigma == 3.5 and noisy.min_records is None
    with pytest.raises(ValueError, match="exact survey"):
        add_noise(noisy, 3.5)
    with pytest.raises(ValueError, match="positive"):
        add_noise(survey, 0.0)


def test_suppression_after_noise_reads_the_noisy_counts_only() -> None:
    survey = random_survey(9)
    noisy = add_noise(survey, 4.0, key=KEY)
    assert release(survey, min_records=15, noise_sigma=4.0, key=KEY) == suppress(noisy, 15)
    for seed in range(20):  # whatever the noise did, nothing small shows (the model's validator checks it too)
        released = release(random_survey(seed), min_records=15, noise_sigma=6.0, key=bytes([seed]) * 32)
        assert all(value is None or value == 0 or value >= 15 for value in released.cells().values())


def test_the_coordinator_can_tell_a_survey_released_as_the_terms_say() -> None:
    survey = random_survey(2)
    released = release(survey, min_records=20, noise_sigma=5.0, key=KEY)
    assert release_problem(released, min_records=20, noise_sigma=5.0) is None
    assert "not suppressed" in str(release_problem(survey, min_records=20, noise_sigma=None))
    assert "terms say 30" in str(release_problem(released, min_records=30, noise_sigma=5.0))
    assert "noise sigma is 5.0" in str(release_problem(released, min_records=20, noise_sigma=None))


def _rdp_epsilon(sigma: float, delta: float, sensitivity_squared: float) -> float:
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    orders = np.asarray(rdp.DEFAULT_RDP_ORDERS, dtype=np.float64)
    return float(rdp.compute_epsilon(orders, orders * sensitivity_squared / (2 * sigma**2), delta)[0])


@pytest.mark.parametrize("sigma", [2.0, 10.0, 25.0])
def test_epsilon_is_the_accountants_for_one_release_of_sensitivity_sqrt_32(sigma: float) -> None:
    delta = 1e-6
    assert survey_epsilon(sigma, delta) == pytest.approx(_rdp_epsilon(sigma, delta, 32.0), rel=1e-12)
    accounting = survey_accounting(sigma, delta)
    assert isinstance(accounting, DpAccounting) and accounting.tau == 0.0
    assert epsilon_after(accounting, 1) == survey_epsilon(sigma, delta)
    assert accounting.sensitivity == SURVEY_L2_SENSITIVITY == math.sqrt(32)
    assert survey_epsilon(2 * sigma, delta) < survey_epsilon(sigma, delta)


def test_sigma_for_an_epsilon_is_the_smallest_that_fits() -> None:
    sigma = survey_sigma(1.0, 1e-6)
    assert survey_epsilon(sigma, 1e-6) <= 1.0 < survey_epsilon(sigma * 0.999, 1e-6)
    with pytest.raises(ValueError, match="positive"):
        survey_sigma(0.0, 1e-6)


def test_the_privacy_report_reads_as_a_studys() -> None:
    spent = PrivacySpent.model_validate(survey_privacy_report(25.0, 1e-6))
    assert spent.epsilon == survey_epsilon(25.0, 1e-6) and spent.rounds == 1
    assert spent.relation == "add/remove-one record" and spent.sensitivity == math.sqrt(32)
    assert spent.mechanism == "discrete Gaussian" and spent.accountant == "rdp"
