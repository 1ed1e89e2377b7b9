import numpy as np
import pytest

from shared.errors import PrivacyInputError
from shared.privacy.masking import apply_masks, mask_vector, sum_rings
from shared.privacy.prg import Keystream, random_uint64
from shared.privacy.quantize import FixedPoint

SEED_A, SEED_B, SEED_AB = b"A" * 32, b"B" * 32, b"X" * 32


def test_random_uint64_is_deterministic_and_seed_dependent() -> None:
    first = random_uint64(SEED_A, 1000)
    assert first.dtype == np.uint64
    np.testing.assert_array_equal(first, random_uint64(SEED_A, 1000))
    assert (first != random_uint64(SEED_B, 1000)).mean() > 0.99


@pytest.mark.parametrize(
    ("counter", "expected"),
    [  # the oracle: `openssl enc -aes-128-ctr -K 000102..0f -iv <counter>` of 32 zero bytes
        ("101112131415161718191a1b1c1d1e1f", "07feef74e1d5036e900eee118e94929392c2c504d80c820246797d628bf9de08"),
        ("ff" * 16, "3c441f32ce07822364d7a2990e50bb13c6a13b37878f5b826f4f8162a1c8d879"),  # wraps modulo 2^128
    ],
)
def test_the_keystream_is_aes_128_ctr_keyed_by_the_seeds_first_half_from_its_second(
    counter: str, expected: str
) -> None:
    seed = bytes(range(16)) + bytes.fromhex(counter)
    assert random_uint64(seed, 4).tobytes() == bytes.fromhex(expected)
    zero = "66e94bd4ef8a2c3b884cfa59ca342b2e58e2fccefa7e3061367f1d57a4e7455a"  # key and counter all zeros
    assert random_uint64(bytes(32), 4).tobytes() == bytes.fromhex(zero)


def test_keystream_reads_continue_across_chunks() -> None:
    length = (1 << 19) + 123  # longer than one 4 MiB chunk of keystream
    whole = random_uint64(SEED_A, length)
    stream = Keystream(SEED_A)
    np.testing.assert_array_equal(np.concatenate([stream.uint64(1000), stream.uint64(length - 1000)]), whole)


def test_random_uint64_bits_look_uniform() -> None:
    words = random_uint64(SEED_A, 100_000)
    bits = np.unpackbits(words.view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.002  # std of the mean over 6.4M bits is 2e-4
    assert abs(words.astype(np.float64).mean() / 2.0**64 - 0.5) < 0.005


def test_pairwise_masks_cancel_and_self_masks_remain_removable() -> None:
    inputs = [np.arange(10, dtype=np.uint64), np.full(10, 7, dtype=np.uint64)]
    masked_1 = mask_vector(inputs[0], site=1, self_mask_seed=SEED_A, pairwise_seeds={2: SEED_AB})
    masked_2 = mask_vector(inputs[1], site=2, self_mask_seed=SEED_B, pairwise_seeds={1: SEED_AB})
    total = masked_1 + masked_2
    apply_masks(total, [(SEED_A, -1), (SEED_B, -1)])
    np.testing.assert_array_equal(total, inputs[0] + inputs[1])


def test_masked_vector_is_uncorrelated_with_the_input() -> None:
    length = 100_000
    values = np.sin(np.linspace(0, 40, length)) * 5  # a strongly structured input
    ring = FixedPoint().encode(values)
    masked = mask_vector(ring, site=3, self_mask_seed=SEED_A, pairwise_seeds={1: SEED_AB, 7: SEED_B})
    as_signed = masked.view(np.int64).astype(np.float64)
    assert abs(np.corrcoef(values, as_signed)[0, 1]) < 0.01
    assert abs(np.corrcoef(values, masked.astype(np.float64))[0, 1]) < 0.01
    # Without masks the same statistic sees the input plainly.
    assert np.corrcoef(values, ring.view(np.int64).astype(np.float64))[0, 1] > 0.99


def test_masks_applied_window_by_window_equal_whole_keystreams() -> None:
    length = 3 * (1 << 16) + 12_345  # several windows and a partial one
    rng = np.random.default_rng(0)
    vector = rng.integers(0, 2**63, size=length, dtype=np.uint64)
    original = vector.copy()
    masked = mask_vector(vector, site=2, self_mask_seed=SEED_A, pairwise_seeds={1: SEED_B, 3: SEED_AB})
    expected = vector + random_uint64(SEED_A, length) - random_uint64(SEED_B, length) + random_uint64(SEED_AB, length)
    np.testing.assert_array_equal(masked, expected)
    np.testing.assert_array_equal(vector, original)  # masking returns a copy


def test_a_mask_runs_on_from_a_uint32_section_into_a_uint64_section() -> None:
    narrow_length, wide_length = (1 << 16) + 7, 1_001  # an odd number of uint32 words: the stream is mid-word
    rng = np.random.default_rng(1)
    narrow = rng.integers(0, 2**32, size=narrow_length, dtype=np.uint32)
    wide = rng.integers(0, 2**63, size=wide_length, dtype=np.uint64)
    masked = mask_vector((narrow, wide), site=1, self_mask_seed=SEED_A, pairwise_seeds={2: SEED_AB})
    assert isinstance(masked, tuple) and masked[0].dtype == np.uint32 and masked[1].dtype == np.uint64
    for seed in (SEED_A, SEED_AB):  # each keystream: its first 4 * n bytes as uint32, the next bytes as uint64
        stream = Keystream(seed)
        narrow = narrow + stream.fill(np.empty(narrow_length, dtype=np.uint32))
        wide = wide + stream.fill(np.empty(wide_length, dtype=np.uint64))
    np.testing.assert_array_equal(masked[0], narrow)
    np.testing.assert_array_equal(masked[1], wide)


def test_sections_sum_each_in_its_own_ring_and_the_masks_cancel() -> None:
    def vector(value: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full(5, value, dtype=np.uint32), np.full(3, value, dtype=np.uint64)

    top = 2**32 - 1  # wraps in Z_2^32, not in Z_2^64: no carry crosses a section
    masked_1 = mask_vector(vector(top), site=1, self_mask_seed=SEED_A, pairwise_seeds={2: SEED_AB})
    masked_2 = mask_vector(vector(2), site=2, self_mask_seed=SEED_B, pairwise_seeds={1: SEED_AB})
    total = sum_rings([masked_1, masked_2])
    apply_masks(total, [(SEED_A, -1), (SEED_B, -1)])
    np.testing.assert_array_equal(total[0], np.full(5, 1, dtype=np.uint32))
    np.testing.assert_array_equal(total[1], np.full(3, top + 2, dtype=np.uint64))
    with pytest.raises(PrivacyInputError, match="different sections"):
        sum_rings([masked_1, (masked_2[0][:4], masked_2[1])])
    with pytest.raises(PrivacyInputError, match="uint32 or uint64"):
        mask_vector(np.zeros(3, dtype=np.int64), site=1, self_mask_seed=SEED_A, pairwise_seeds={})
