"""Signal-quality flags of one raw record, its 12 leads in mV at the rate its file gives, before any preprocessing.

A record gets each flag of shared.wire.survey.QUALITY_FLAGS at most once, whichever and however many
of its leads show it. The thresholds are below, each with why; calibrated on the 1,021 real records
of ../shared/data/ecg (ten archives), they flag what is plainly broken there: 6 Ningbo records with
constant leads (flat_lead), PTB-XL and LUDB records stuck at their extreme for tens of milliseconds
(clipped), CODE-15% electrode pops of 15-25 mV (amplitude_outlier), and drifting baselines
(baseline_wander).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = [
    "CLIP_MIN_SAMPLES",
    "CLIP_RUN_SECONDS",
    "FLAT_PTP_MV",
    "OUTLIER_MV",
    "WANDER_CUTOFF_HZ",
    "WANDER_POWER_MV2",
    "quality_flags",
]

FLAT_PTP_MV = 0.02
"""flat_lead: a lead whose finite samples span less than 20 uV peak to peak over the whole record.

The smallest wave of an ECG, a P wave, is about 50 uV, and a QRS complex 0.5 mV or more; 20 uV is four
steps of the coarsest common resolution (4.88 uV a step, CPSC and Georgia). So a lead below it carries
no ECG: an electrode off, a channel zero-filled or constant. An all-zero record has 12 flat leads.
"""

CLIP_RUN_SECONDS = 0.04
"""clipped: a lead that stays at its own maximum or minimum for at least 40 ms in a row (and is not flat).

Saturation of the amplifier or converter, or clipping in software, cuts peaks into plateaus at the
extreme value; a real peak at 1 uV resolution holds its exact extreme for a few milliseconds at most
(the R wave's tip lasts well under 10 ms). 40 ms is four times that and a third of a QRS complex.
"""

CLIP_MIN_SAMPLES = 4
"""clipped, at low rates: the plateau is at least 4 samples long, whatever 40 ms is at the record's rate.

At 100 Hz, 40 ms is 4 samples already; the floor keeps a 50 Hz record from being judged on 2.
"""

OUTLIER_MV = 10.0
"""amplitude_outlier: a finite sample more than 10 mV away from its lead's median.

The largest physiological amplitudes (a QRS in left ventricular hypertrophy) stay under about 5 mV;
10 mV is twice that. Beyond it are electrode pops, saturation spikes and a wrong unit (uV read as mV).
"""

WANDER_CUTOFF_HZ = 0.5
"""baseline_wander: what counts as wander is the part of a lead below 0.5 Hz (its mean removed).

The usual high-pass corner of diagnostic ECG filters (0.5 Hz; AHA's 0.05 Hz preserves ST segments but
lets wander through): breathing (0.15-0.4 Hz) and movement drift lie below, a heart rate above 30 bpm above.
"""

WANDER_POWER_MV2 = 0.25
"""baseline_wander: a lead whose power below WANDER_CUTOFF_HZ is above 0.25 mV^2 (an RMS of 0.5 mV).

That is a sinusoidal drift of 1.4 mV peak to peak, larger than a typical QRS complex (about 1 mV): the
baseline moves more than the beats do. The power is the mean square of the lead's component below
the cutoff, from its discrete Fourier transform (Parseval), over the whole record.
"""


def _finite_extremes(signal: npt.NDArray[np.float64]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(whether each lead has a finite sample, its finite max, its finite min): NaN/Inf ignored."""
    finite = np.isfinite(signal)
    has = np.asarray(finite.any(axis=1))
    high = np.where(finite, signal, -np.inf).max(axis=1)
    low = np.where(finite, signal, np.inf).min(axis=1)
    return has, high, low


def _longest_run(mask: npt.NDArray[np.bool_]) -> int:
    """The longest run of True in a 1-D mask."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((ends - starts).max()) if starts.size else 0


def _clipped(signal: npt.NDArray[np.float64], fs: float, high: np.ndarray, low: np.ndarray, live: np.ndarray) -> bool:
    """Whether a lead that is not flat stays at its maximum or minimum for CLIP_RUN_SECONDS."""
    needed = max(CLIP_MIN_SAMPLES, math.ceil(CLIP_RUN_SECONDS * fs - 1e-9))
    for lead in np.flatnonzero(live):
        for extreme in (high[lead], low[lead]):
            if _longest_run(signal[lead] == extreme) >= needed:
                return True
    return False


def _wander(signal: npt.NDArray[np.float64], fs: float) -> bool:
    """Whether a lead with only finite samples has more than WANDER_POWER_MV2 of power below WANDER_CUTOFF_HZ."""
    n = signal.shape[1]
    leads = signal[np.isfinite(signal).all(axis=1)]
    if n < 2 or not leads.size:
        return False
    spectrum = np.fft.rfft(leads - leads.mean(axis=1, keepdims=True), axis=1)
    frequencies = np.fft.rfftfreq(n, d=1.0 / fs)
    low = (frequencies > 0) & (frequencies <= WANDER_CUTOFF_HZ) & (frequencies < fs / 2)
    power = 2 * (np.abs(spectrum[:, low]) ** 2).sum(axis=1) / n**2  # mean square of the band's component
    return bool((power > WANDER_POWER_MV2).any())


def quality_flags(signal: npt.NDArray[np.float64], fs: float) -> frozenset[str]:
    """The quality flags of a raw (leads, samples) record in mV sampled at `fs` Hz (see the module's thresholds)."""
    flags: set[str] = set()
    if signal.size == 0:
        return frozenset()
    if not np.isfinite(signal).all():
        flags.add("non_finite")
    has, high, low = _finite_extremes(signal)
    flat = has & (high - low < FLAT_PTP_MV)
    if flat.any():
        flags.add("flat_lead")
    if math.isfinite(fs) and fs > 0:
        if _clipped(signal, fs, high, low, has & ~flat):
            flags.add("clipped")
        if _wander(signal, fs):
            flags.add("baseline_wander")
    finite = np.where(np.isfinite(signal), signal, np.nan)
    with np.errstate(invalid="ignore"):
        if has.any():
            median = np.nanmedian(finite[has], axis=1, keepdims=True)
            if (np.abs(finite[has] - median) > OUTLIER_MV).any():
                flags.add("amplitude_outlier")
    return frozenset(flags)
