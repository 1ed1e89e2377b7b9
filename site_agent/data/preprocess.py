"""FedCVD signal preprocessing: drop NaN/all-zero records, resample to 500 Hz, first 5000 samples or edge-pad."""

from __future__ import annotations

from fractions import Fraction
from typing import cast

import numpy as np
from scipy.signal import resample_poly

from site_agent.data.config import PreprocessConfig
from site_agent.data.records import RecordSkipped
from site_agent.data.report import SkipReason

__all__ = ["fix_length", "preprocess_signal", "resample"]


def resample(signal: np.ndarray, fs: float, target_fs: int) -> np.ndarray:
    """Polyphase resampling of (leads, T) from `fs` to `target_fs` along time."""
    ratio = Fraction(target_fs) / Fraction(fs).limit_denominator(1000)
    if ratio == 1:
        return signal
    return cast(np.ndarray, resample_poly(signal, ratio.numerator, ratio.denominator, axis=1))  # scipy is untyped


def fix_length(signal: np.ndarray, length: int) -> tuple[np.ndarray, str]:
    """First `length` samples ('truncated'), or centred edge padding with the odd sample in front ('padded')."""
    n = signal.shape[1]
    if n > length:
        return signal[:, :length], "truncated"
    if n < length:
        missing = length - n
        front = missing - missing // 2
        return np.pad(signal, ((0, 0), (front, missing // 2)), mode="edge"), "padded"
    return signal, "kept"


def preprocess_signal(signal: np.ndarray, fs: float | None, config: PreprocessConfig) -> tuple[np.ndarray, str, bool]:
    """(12, config.signal_len) float32 in the record's units, the length method, and whether it was resampled."""
    if not fs or not np.isfinite(fs) or fs <= 0:
        raise RecordSkipped(SkipReason.BAD_SAMPLING_RATE, str(fs))
    if signal.shape[1] == 0:
        raise RecordSkipped(SkipReason.EMPTY)
    if not np.isfinite(signal).all():
        raise RecordSkipped(SkipReason.NON_FINITE)
    if not signal.any():
        raise RecordSkipped(SkipReason.ALL_ZERO)
    resampled = resample(signal, fs, config.fs)
    fixed, method = fix_length(resampled, config.signal_len)
    return fixed.astype(np.float32), method, resampled is not signal
