import numpy as np
import pytest

from site_agent.data.config import PreprocessConfig
from site_agent.data.preprocess import fix_length, preprocess_signal, resample
from site_agent.data.records import RecordSkipped
from site_agent.data.report import SkipReason


def test_longer_records_keep_their_first_samples() -> None:
    signal = np.arange(24.0).reshape(2, 12)
    fixed, method = fix_length(signal, 5)
    assert method == "truncated"
    np.testing.assert_array_equal(fixed, signal[:, :5])


def test_shorter_records_are_edge_padded_centred_with_the_odd_sample_in_front() -> None:
    signal = np.array([[1.0, 2.0, 3.0]])
    fixed, method = fix_length(signal, 6)
    assert method == "padded"
    np.testing.assert_array_equal(fixed, [[1.0, 1.0, 1.0, 2.0, 3.0, 3.0]])
    assert fix_length(signal, 3)[1] == "kept"


@pytest.mark.parametrize("fs", [250, 400, 1000, 257])
def test_resampling_to_500_hz_keeps_duration_and_frequency(fs: int) -> None:
    t = np.arange(int(10 * fs)) / fs
    signal = np.sin(2 * np.pi * 5.0 * t)[None, :]
    out = resample(signal, fs, 500)
    assert out.shape == (1, 5000)
    t500 = np.arange(5000) / 500
    middle = slice(500, 4500)  # away from the filter's edge effects
    np.testing.assert_allclose(out[0, middle], np.sin(2 * np.pi * 5.0 * t500)[middle], atol=0.02)


def test_preprocess_gives_float32_at_the_configured_length() -> None:
    signal = np.random.default_rng(0).normal(size=(12, 2000))  # 8 s at 250 Hz
    out, method, resampled = preprocess_signal(signal, 250.0, PreprocessConfig())
    assert out.shape == (12, 5000) and out.dtype == np.float32
    assert method == "padded" and resampled
    out, method, resampled = preprocess_signal(signal, 100.0, PreprocessConfig(signal_len=1000))
    assert out.shape == (12, 1000) and method == "truncated" and resampled  # 20 s at 100 Hz


@pytest.mark.parametrize(
    ("signal", "fs", "reason"),
    [
        (np.full((12, 100), np.nan), 500.0, SkipReason.NON_FINITE),
        (np.where(np.eye(12, 100) > 0, np.inf, 1.0), 500.0, SkipReason.NON_FINITE),
        (np.zeros((12, 100)), 500.0, SkipReason.ALL_ZERO),
        (np.zeros((12, 0)), 500.0, SkipReason.EMPTY),
        (np.ones((12, 100)), 0.0, SkipReason.BAD_SAMPLING_RATE),
        (np.ones((12, 100)), None, SkipReason.BAD_SAMPLING_RATE),
    ],
)
def test_unusable_signals_are_skipped_with_their_reason(signal: np.ndarray, fs: float | None, reason) -> None:
    with pytest.raises(RecordSkipped) as info:
        preprocess_signal(signal, fs, PreprocessConfig())
    assert info.value.reason is reason
