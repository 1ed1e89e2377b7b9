import numpy as np
import pytest
import torch

from shared.privacy.errors import ValueOutOfRange
from shared.privacy.quantize import COUNTS, FixedPoint
from shared.study.vectors import TensorLayout, flatten, unflatten


def _ring_sum(vectors: list[np.ndarray]) -> np.ndarray:
    total = np.zeros_like(vectors[0])
    for vector in vectors:
        np.add(total, vector, out=total)
    return total


def test_encode_decode_error_is_at_most_half_a_step() -> None:
    encoding = FixedPoint(fraction_bits=10)
    values = np.random.default_rng(0).uniform(-1000, 1000, size=10_000)
    error = np.abs(encoding.decode(encoding.encode(values)) - values)
    assert error.max() <= 2.0**-11
    assert error.max() > 2.0**-11 * 0.9  # the bound is tight, so rounding really is to nearest


def test_sum_of_max_sites_extreme_values_decodes_without_wrapping() -> None:
    encoding = FixedPoint(fraction_bits=24, max_sites=64)
    rng = np.random.default_rng(1)
    inputs = [rng.choice([-1.0, 1.0], size=1000) * encoding.max_abs for _ in range(64)]
    for vector in inputs:
        vector[:10] = encoding.max_abs  # these coordinates' sums reach the top of the range
    decoded = encoding.decode(_ring_sum([encoding.encode(v) for v in inputs]))
    np.testing.assert_allclose(decoded, np.sum(inputs, axis=0), rtol=0, atol=encoding.error_bound(64))
    assert decoded[0] == 64 * encoding.max_abs == 2.0 ** (62 - 24)


def test_sum_error_stays_within_the_stated_bound() -> None:
    encoding = FixedPoint()
    rng = np.random.default_rng(2)
    inputs = [rng.normal(scale=3.0, size=50_000) for _ in range(20)]
    decoded = encoding.decode(_ring_sum([encoding.encode(v) for v in inputs]))
    assert np.abs(decoded - np.sum(inputs, axis=0)).max() <= encoding.error_bound(20) == 20 * 2.0**-25


@pytest.mark.parametrize("bad", [np.nan, np.inf, 2.0**28 * 1.01])
def test_encode_refuses_values_that_could_wrap(bad: float) -> None:
    with pytest.raises(ValueOutOfRange):
        FixedPoint().encode(np.array([0.0, bad]))


def test_counts_sum_exactly_and_refuse_non_integers() -> None:
    counts = [np.array([0, 5, 2**40]), np.array([3, 0, 2**40])]
    assert COUNTS.decode_counts(_ring_sum([COUNTS.encode_counts(c) for c in counts])).tolist() == [3, 5, 2**41]
    with pytest.raises(ValueOutOfRange):
        COUNTS.encode_counts(np.array([0.5]))
    with pytest.raises(ValueError):
        FixedPoint().encode_counts(np.array([1]))


def test_flatten_orders_by_name_and_unflatten_restores_dtypes() -> None:
    tensors = {
        "b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a.bias": torch.tensor([1.5, -2.0], dtype=torch.float64),
        "c.scale": torch.tensor(7.0, dtype=torch.bfloat16),
    }
    vector, layout = flatten(tensors)
    assert layout == TensorLayout.of(tensors) and layout.names == ("a.bias", "b.weight", "c.scale")
    assert vector.tolist() == [1.5, -2.0, 0, 1, 2, 3, 4, 5, 7.0]
    restored = unflatten(vector, layout)
    assert restored.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert restored[name].dtype == tensor.dtype
        torch.testing.assert_close(restored[name], tensor)
    vector[0] = 99.0
    assert restored["a.bias"][0] == 1.5  # restored tensors own their memory


def test_unflatten_rejects_a_vector_of_the_wrong_length() -> None:
    _, layout = flatten({"w": torch.zeros(3)})
    with pytest.raises(ValueError):
        unflatten(np.zeros(4), layout)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_encode_into_equals_encoding_the_scaled_values_across_windows(dtype: type) -> None:
    rng = np.random.default_rng(3)
    values = (rng.normal(scale=50.0, size=3 * (1 << 16) + 77)).astype(dtype)  # several windows and a partial one
    encoding, weight = FixedPoint(fraction_bits=24), 0.3141592653589793
    out = np.empty(values.size, dtype=np.uint64)
    encoding.encode_into(values, out, weight)
    reference = encoding.encode(values.astype(np.float64) * weight)  # the scaled values in float64, then encoded
    np.testing.assert_array_equal(out, reference)


def test_encode_into_refuses_a_bad_value_in_any_window() -> None:
    values = np.zeros(2 * (1 << 16) + 5)
    values[-1] = np.nan
    with pytest.raises(ValueOutOfRange):
        FixedPoint().encode_into(values, np.empty(values.size, dtype=np.uint64))
    values[-1] = 0.6 * FixedPoint().max_abs  # in range as it is, out of range once weighted by 2
    FixedPoint().encode_into(values, np.empty(values.size, dtype=np.uint64), 1.0)
    with pytest.raises(ValueOutOfRange):
        FixedPoint().encode_into(values, np.empty(values.size, dtype=np.uint64), 2.0)


NARROW = FixedPoint(fraction_bits=24, ring_bits=32)


@pytest.mark.parametrize("factors", ["scalar", "per_value"])
def test_a_32_bit_sum_of_extreme_changes_with_weights_summing_to_one_does_not_wrap(factors: str) -> None:
    sites, length = 16, 3 * (1 << 16) + 9
    rng = np.random.default_rng(5)
    weights = rng.dirichlet(np.ones(sites))  # w_k >= 0, summing to 1: a study's normalised weights
    bases = rng.normal(size=length)  # theta^g: the changes, not the values, are bounded
    inputs = [bases + rng.choice([-1.0, 1.0], size=length) * NARROW.max_abs for _ in range(sites)]
    for vector in inputs:
        vector[:10] = bases[:10] + NARROW.max_abs  # these coordinates' sums reach the top of the range
    per_site = [w if factors == "scalar" else np.full(length, w) for w in weights]
    codes = [
        NARROW.encode_into(x, np.empty(length, dtype=np.uint32), f, base=bases)
        for x, f in zip(inputs, per_site, strict=True)
    ]
    assert all(c.dtype == np.uint32 for c in codes)
    decoded = NARROW.decode(_ring_sum(codes))
    expected = sum(w * (x - bases) for w, x in zip(weights, inputs, strict=True))
    np.testing.assert_allclose(decoded, expected, rtol=0, atol=NARROW.error_bound(sites))
    assert NARROW.max_abs == 64.0 and abs(decoded[0] - 64.0) <= NARROW.error_bound(sites)


@pytest.mark.parametrize(
    ("value", "factor", "message"),
    [
        (64.5, 0.01, "exceed 64"),  # checked before the weight: a small weight does not make it fit
        (-64.5, 1.0, "exceed 64"),
        (np.nan, 0.5, "not finite"),
        (1.0, 1.5, r"lie in \[0, 1\]"),  # a factor above 1 would break the bound on the sum
        (1.0, -0.1, r"lie in \[0, 1\]"),
    ],
)
def test_a_32_bit_encoding_refuses_changes_beyond_its_range_and_factors_outside_0_1(
    value: float, factor: float, message: str
) -> None:
    values = np.zeros((1 << 16) + 3)
    values[-1] = value
    with pytest.raises(ValueOutOfRange, match=message):
        NARROW.encode_into(values, np.empty(values.size, dtype=np.uint32), factor)
    with pytest.raises(ValueError, match="fit a 32-bit ring"):
        FixedPoint(fraction_bits=29, ring_bits=32)
