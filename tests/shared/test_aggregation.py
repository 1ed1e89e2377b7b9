import pytest
import torch

from shared.algorithms.aggregation import WeightedAverage, weighted_average
from shared.algorithms.weightings import WEIGHTINGS, aggregation_weights
from shared.errors import AggregationError
from shared.tensors.codec import dump, schema_of, tensor_views


def test_samples_weighting_is_proportional_to_n_k() -> None:
    assert aggregation_weights([10, 30, 60], "samples") == pytest.approx([0.1, 0.3, 0.6])


def test_equal_weighting_ignores_n_k() -> None:
    assert aggregation_weights([1, 1000], "equal") == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize(
    ("num_examples", "name", "params", "match"),
    [
        ([], "samples", None, "no updates"),
        ([3, 0], "samples", None, "positive"),
        ([3], "median", None, "unknown aggregation weighting"),
        ([3], "samples", {"alpha": 0.5}, "alpha"),
    ],
)
def test_weights_refuse_bad_input(num_examples: list[int], name: str, params: dict | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aggregation_weights(num_examples, name, params)


def test_weighted_average_matches_hand_computed_values() -> None:
    # Prepare: w = (0.25, 0.75); floats averaged, the int buffer takes the max
    first = {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor(7)}
    second = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(5)}
    # Execute
    actual = weighted_average([(first, 0.25), (second, 0.75)])
    # Assert
    torch.testing.assert_close(actual["w"], torch.tensor([3.0, 7.0]))
    assert actual["n"].dtype == torch.int64 and int(actual["n"]) == 7


def test_weighted_average_divides_by_the_total_weight() -> None:
    actual = weighted_average([({"w": torch.tensor([2.0])}, 1.0), ({"w": torch.tensor([5.0])}, 2.0)])
    torch.testing.assert_close(actual["w"], torch.tensor([4.0]))


def test_integer_buffers_take_the_elementwise_maximum() -> None:
    updates = [({"c": torch.tensor([1, 9, 3])}, 0.9), ({"c": torch.tensor([4, 2, 3])}, 0.1)]
    assert weighted_average(updates)["c"].tolist() == [4, 9, 3]


def test_half_precision_accumulates_in_float32_and_returns_its_dtype() -> None:
    values = [torch.full((4,), 1000.0 + i, dtype=torch.float16) for i in range(3)]
    actual = weighted_average(({"h": v}, 1 / 3) for v in values)
    assert actual["h"].dtype == torch.float16
    torch.testing.assert_close(actual["h"], torch.full((4,), 1001.0, dtype=torch.float16))


def test_average_does_not_modify_its_inputs() -> None:
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    weighted_average([({"w": first}, 0.5), ({"w": second}, 0.5)])
    assert first.tolist() == [1.0, 2.0] and second.tolist() == [3.0, 4.0]


def test_average_of_read_only_views_of_stored_bytes() -> None:
    blobs = [
        dump({"w": torch.tensor([1.0, 3.0]), "n": torch.tensor(2)}),
        dump({"w": torch.tensor([3.0, 5.0]), "n": torch.tensor(1)}),
    ]
    actual = weighted_average((tensor_views(blob), 0.5) for blob in blobs)
    torch.testing.assert_close(actual["w"], torch.tensor([2.0, 4.0]))
    assert int(actual["n"]) == 2


@pytest.mark.parametrize(
    ("second", "match"),
    [
        ({"x": torch.zeros(2)}, "names differ"),
        ({"w": torch.zeros(3)}, "expected"),
        ({"w": torch.zeros(2, dtype=torch.float64)}, "expected"),
    ],
)
def test_mismatched_updates_are_refused(second: dict, match: str) -> None:
    average = WeightedAverage()
    average.add({"w": torch.zeros(2)}, 0.5)
    with pytest.raises(ValueError, match=match):
        average.add(second, 0.5)


def test_empty_or_zero_weight_average_is_refused() -> None:
    with pytest.raises(ValueError, match="no update"):
        WeightedAverage().result()
    average = WeightedAverage()
    average.add({"w": torch.ones(1)}, 0.0)
    with pytest.raises(ValueError, match="sum to zero"):
        average.result()
    with pytest.raises(ValueError, match="finite"):
        average.add({"w": torch.ones(1)}, float("nan"))


def test_weightings_registry_names() -> None:
    assert WEIGHTINGS.keys() == {"samples", "equal", "smoothed", "uncertainty"}


N_K = [10, 30, 60]


def test_smoothed_weighting_spans_samples_to_equal() -> None:
    assert aggregation_weights(N_K, "smoothed", {"alpha": 0.0}) == pytest.approx(aggregation_weights(N_K, "samples"))
    assert aggregation_weights(N_K, "smoothed", {"alpha": 1.0}) == pytest.approx(aggregation_weights(N_K, "equal"))


def test_uncertainty_with_equal_entropies_is_samples() -> None:
    metrics = [{"entropy": 0.4}] * 3
    weights = aggregation_weights(N_K, "uncertainty", {"epsilon": 0.01}, metrics=metrics)
    assert weights == pytest.approx(aggregation_weights(N_K, "samples"))


@pytest.mark.parametrize(
    ("name", "params", "entropies", "expected"),
    [
        ("samples", None, None, [0.1, 0.3, 0.6]),
        ("equal", None, None, [1 / 3, 1 / 3, 1 / 3]),
        # 0.25/3 + 0.75 * (0.1, 0.3, 0.6)
        ("smoothed", {"alpha": 0.25}, None, [0.158333333333, 0.308333333333, 0.533333333333]),
        # n_k / H_k = (20, 120, 60) of 200
        ("uncertainty", {"epsilon": 0.0}, [0.5, 0.25, 1.0], [0.1, 0.6, 0.3]),
        # n_k / (H_k + 0.5) = (10, 40, 40) of 90
        ("uncertainty", {"epsilon": 0.5}, [0.5, 0.25, 1.0], [1 / 9, 4 / 9, 4 / 9]),
    ],
)
def test_weights_of_three_sites_by_hand(
    name: str, params: dict | None, entropies: list[float] | None, expected: list[float]
) -> None:
    metrics = [{"loss": 0.5, "entropy": h} for h in entropies] if entropies else None
    weights = aggregation_weights(N_K, name, params, metrics=metrics)
    assert weights == pytest.approx(expected, abs=1e-9)
    assert sum(weights) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("metrics", "params", "match"),
    [
        ([{"entropy": 0.1}, {"loss": 0.3}, {"entropy": 0.2}], {}, "update 1 reports no usable 'entropy'"),
        ([{"entropy": 0.1}, {"entropy": -1.0}, {"entropy": 0.2}], {}, "update 1"),
        ([{"entropy": 0.1}, {"entropy": True}, {"entropy": 0.2}], {}, "update 1"),
        ([{"entropy": 0.0}] * 3, {"epsilon": 0.0}, "epsilon > 0"),
        ([{"entropy": 0.1}] * 3, {"epsilon": -1.0}, "epsilon"),
        ([{"entropy": 0.1}] * 3, {"mc_passes": 0}, "mc_passes"),
        ([{"entropy": 0.1}] * 3, {"validation_fraction": 0.0}, "validation_fraction"),
        ([{"entropy": 0.1}] * 3, {"validation_fraction": 1.0}, "validation_fraction"),
    ],
)
def test_uncertainty_refuses_unusable_entropies(metrics: list[dict], params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aggregation_weights(N_K, "uncertainty", params, metrics=metrics)


def test_smoothed_refuses_alpha_outside_zero_one() -> None:
    with pytest.raises(ValueError, match="alpha"):
        aggregation_weights(N_K, "smoothed", {"alpha": 1.5})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_mean_computed_a_window_at_a_time_is_the_whole_quotient_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.algorithms import aggregation

    monkeypatch.setattr(aggregation, "QUOTIENT_WINDOW", 7)  # windows that end mid-row and leave a short tail
    generator = torch.Generator().manual_seed(3)
    sums = {"w": torch.randn(5, 9, generator=generator, dtype=torch.float64) * 1e3, "b": torch.tensor(2.5)}
    sums["e"] = torch.empty(0, 4, dtype=torch.float64)
    specs = {name: schema_of({name: sum_.to(dtype)})[name] for name, sum_ in sums.items()}
    average = WeightedAverage()
    average.take_sums(specs, sums, 0.7, 3)
    result = average.result()
    for name, sum_ in sums.items():
        expected = (sum_ / 0.7).to(dtype)
        assert result[name].dtype == dtype and result[name].shape == sum_.shape
        assert torch.equal(result[name].view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8))


def test_sums_handed_over_are_not_copied() -> None:
    sums = {"w": torch.arange(6, dtype=torch.float64)}
    average = WeightedAverage()
    average.take_sums({"w": schema_of({"w": torch.zeros(2, 3)})["w"]}, sums, 2.0, 2)
    sums["w"][0] = 10.0  # the average holds the caller's sums (a model's float64 sums are twice its size)
    assert average.result()["w"].tolist() == [[5.0, 0.5, 1.0], [1.5, 2.0, 2.5]]


def test_an_average_that_took_sums_takes_no_update() -> None:
    average = WeightedAverage()
    average.take_sums({"w": schema_of({"w": torch.zeros(2)})["w"]}, {"w": torch.ones(2, dtype=torch.float64)}, 1.0, 1)
    with pytest.raises(AggregationError, match="took sums takes no update"):
        average.add({"w": torch.ones(2)}, 1.0)
