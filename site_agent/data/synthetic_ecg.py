"""Synthetic 12-lead ECG: heart dipoles projected on the lead vectors, beat timing from the rhythm, in numpy.

Every wave (P, Q, R, S, ST, T, and the extra components of blocks) is a Gaussian in time carried by
a 3-D heart dipole; a lead sees the dipole's projection on its direction (x left, y inferior,
z anterior), so the 12 leads stay consistent (III = II - I, aVR = -(I + II) / 2 ...). The labels are
encoded the way a cardiologist reads them:

* rate and rhythm from the RR intervals: STACH 105-150 bpm, SBRAD 38-56, SVTAC 160-220 without P
  waves, SARRH respiratory RR modulation, AFIB irregular RR with f waves and no P, AFLT sawtooth
  flutter waves with 2:1-4:1 conduction, PAC/PVC premature beats (PVC wide, no P, compensatory pause);
* conduction from intervals and QRS shape: 1AVB PR 220-340 ms, 2AVB dropped beats (Mobitz I/II),
  3AVB dissociated P waves and a slow wide escape rhythm, LBBB/RBBB QRS 120-170 ms with their
  typical vectors (RBBB: terminal rightward-anterior R');
* amplitudes and vectors: LVH tall R/deep S (sometimes strain T), RVH right axis with tall R in V1,
  LAO/LAE broad bifid P, AMI anterior ST elevation and Q waves, ASMI QS in V1-V3, IMI inferior Q waves
  and T inversion; NORM is sinus rhythm at 60-100 bpm with nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shared.labels import class_index

__all__ = ["LEAD_VECTORS", "Artifacts", "synthesize_ecg"]


def _lead_vectors() -> np.ndarray:
    """(12, 3) directions of I, II, III, aVR, aVL, aVF (frontal plane) and V1-V6 (horizontal plane)."""
    lead_i = np.array([1.0, 0.0, 0.0])
    lead_ii = np.array([np.cos(np.pi / 3), np.sin(np.pi / 3), 0.0])
    limb = [lead_i, lead_ii, lead_ii - lead_i, -(lead_i + lead_ii) / 2, lead_i - lead_ii / 2, lead_ii - lead_i / 2]
    angles = np.deg2rad([120.0, 100.0, 75.0, 55.0, 30.0, 0.0])  # from the left towards anterior
    chest = [1.2 * np.array([np.cos(a), 0.1, np.sin(a)]) for a in angles]
    return np.stack(limb + chest)


LEAD_VECTORS = _lead_vectors()

_C = {name: class_index(name) for name in ("NORM", "STACH", "SBRAD", "SARRH", "PAC", "AFIB", "AFLT", "SVTAC", "PVC")}
_C |= {name: class_index(name) for name in ("1AVB", "2AVB", "3AVB", "LBBB", "RBBB", "LAO/LAE", "LVH", "RVH")}
_C |= {name: class_index(name) for name in ("AMI", "IMI", "ASMI")}
_P_LEAD = 0.05  # s from P onset to the P wave's centre; PR runs from P onset to QRS onset


def _unit(x: float, y: float, z: float, magnitude: float = 1.0) -> np.ndarray:
    vector = np.array([x, y, z])
    return magnitude * vector / np.linalg.norm(vector)


@dataclass(frozen=True)
class Artifacts:
    """Recording effects of a site: amplifier gain, white noise, baseline wander, mains hum."""

    gain: float = 1.0
    noise_mv: float = 0.01
    wander_mv: float = 0.05
    powerline_hz: float = 50.0
    powerline_mv: float = 0.0


@dataclass
class _Waves:
    """Gaussian wave events: center (s), width (s), dipole (3,)."""

    centers: list[np.ndarray] = field(default_factory=list)
    sigmas: list[np.ndarray] = field(default_factory=list)
    dipoles: list[np.ndarray] = field(default_factory=list)

    def add(self, centers: np.ndarray, sigma: np.ndarray | float, dipoles: np.ndarray) -> None:
        centers = np.atleast_1d(np.asarray(centers, dtype=np.float64))
        if centers.size == 0:
            return
        self.centers.append(centers)
        self.sigmas.append(np.broadcast_to(np.asarray(sigma, dtype=np.float64), centers.shape))
        self.dipoles.append(np.broadcast_to(np.asarray(dipoles, dtype=np.float64), (centers.size, 3)))

    def render(self, n_samples: int, fs: float) -> np.ndarray:
        """(3, n_samples) dipole over time; each wave is evaluated only within 5 widths of its centre."""
        out = np.zeros((3, n_samples))
        if not self.centers:
            return out
        centers = np.concatenate(self.centers)
        sigmas = np.concatenate(self.sigmas)
        dipoles = np.concatenate(self.dipoles)
        half = int(np.ceil(5 * sigmas.max() * fs))
        index = np.round(centers * fs).astype(np.int64)[:, None] + np.arange(-half, half + 1)  # (E, W)
        inside = (index >= 0) & (index < n_samples)
        shapes = np.exp(-0.5 * ((index / fs - centers[:, None]) / sigmas[:, None]) ** 2)
        for axis in range(3):
            weights = (shapes * dipoles[:, axis : axis + 1])[inside]
            out[axis] = np.bincount(index[inside], weights=weights, minlength=n_samples)
        return out


@dataclass
class _Morphology:
    """A record's heart: dipoles of each wave and the intervals (s)."""

    p: list[tuple[float, np.ndarray]]  # (offset from the P centre, dipole) of each P component
    p_sigma: float
    q: np.ndarray
    r: np.ndarray
    r_late: np.ndarray  # RBBB's R' or LBBB's notch, zero otherwise
    s: np.ndarray
    st: np.ndarray
    t: np.ndarray
    t_sigma: float
    pr: float
    qrsd: float


def _rotation(rng: np.random.Generator, degrees: float) -> np.ndarray:
    """A small random rotation: patient-to-patient variation of the heart's axis."""
    ax, ay, az = np.deg2rad(rng.normal(0.0, degrees, 3))
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    rotation: npt.NDArray[np.float64] = rz @ ry @ rx
    return rotation


def _morphology(labels: set[int], rng: np.random.Generator) -> _Morphology:
    def scale() -> float:
        return float(rng.lognormal(0.0, 0.15))

    m = _Morphology(
        p=[(0.0, _unit(0.5, 0.8, 0.2, 0.15 * scale()))],
        p_sigma=rng.uniform(0.018, 0.024),
        q=_unit(-0.7, 0.2, 0.7, 0.15 * scale()),
        r=_unit(0.7, 0.6, -0.35, 1.3 * scale()),
        r_late=np.zeros(3),
        s=_unit(-0.3, -0.5, -0.8, 0.5 * scale()),
        st=np.zeros(3),
        t=_unit(0.6, 0.7, 0.3, 0.35 * scale()),
        t_sigma=rng.uniform(0.045, 0.06),
        pr=rng.uniform(0.12, 0.20),
        qrsd=rng.uniform(0.08, 0.10),
    )
    if _C["1AVB"] in labels:
        m.pr = rng.uniform(0.22, 0.34)
    if _C["LAO/LAE"] in labels:
        m.p = [(-0.03, _unit(0.2, 0.7, 0.6, 0.09)), (0.035, _unit(0.8, 0.4, -0.7, 0.15 * scale()))]
        m.p_sigma = rng.uniform(0.026, 0.03)
    if _C["LVH"] in labels:
        m.r = m.r * rng.uniform(2.0, 2.8)
        m.s = m.s * rng.uniform(1.8, 2.5)
        if rng.random() < 0.5:  # strain pattern
            m.t = -0.6 * m.t
    if _C["RVH"] in labels:
        m.r = _unit(-0.5, 0.7, 0.6, 1.2 * scale())
        m.s = _unit(0.6, -0.2, -0.6, 0.6 * scale())
    if _C["LBBB"] in labels:
        m.qrsd = rng.uniform(0.13, 0.17)
        m.q = np.zeros(3)  # no septal q
        m.r = _unit(0.75, 0.25, -0.6, 1.5 * scale())
        m.r_late = 0.6 * m.r  # notched, broad R
        m.s = 0.3 * m.s
        m.t = _unit(-0.75, -0.25, 0.6, 0.4)  # discordant T
    elif _C["RBBB"] in labels:
        m.qrsd = rng.uniform(0.12, 0.16)
        m.r_late = _unit(-0.55, 0.05, 0.85, 0.7 * scale())  # terminal rightward-anterior R'
        m.s = _unit(-0.8, 0.0, 0.2, 0.5 * scale())
        m.t = m.t + _unit(0.2, 0.0, -0.4, 0.2)
    if _C["AMI"] in labels:
        m.st = _unit(0.05, -0.05, 1.0, rng.uniform(0.2, 0.4))
        m.q = _unit(0.1, 0.0, -1.0, 0.35)
    if _C["ASMI"] in labels:
        m.q = _unit(0.2, 0.1, -1.0, 0.4)
        m.r = m.r + _unit(0.0, 0.0, -1.0, 0.3)
    if _C["IMI"] in labels:
        m.q = m.q + _unit(0.2, -1.0, 0.1, 0.4)
        m.t = np.array([m.t[0], -abs(m.t[1]) * 0.8, m.t[2]])
    rotate = _rotation(rng, 8.0)
    m.p = [(offset, rotate @ d) for offset, d in m.p]
    for name in ("q", "r", "r_late", "s", "st", "t"):
        setattr(m, name, rotate @ getattr(m, name))
    return m


@dataclass
class _Rhythm:
    """Beat timing: QRS onsets (s), which are PVCs/PACs, P-wave centres not tied to a QRS."""

    onsets: np.ndarray
    kinds: np.ndarray  # 0 normal, 1 PVC, 2 PAC
    conducted_p: np.ndarray  # bool per beat: a P wave precedes this QRS by PR
    free_p: np.ndarray  # centres of P waves not drawn from a QRS (AV blocks)
    atrial: str = "sinus"  # sinus, fibrillation, flutter or none
    flutter_hz: float = 0.0


def _regular_onsets(rng: np.random.Generator, rr: float, duration: float, cv: float) -> np.ndarray:
    count = int(duration / (rr * 0.7)) + 4
    intervals = rr * np.clip(1.0 + cv * rng.standard_normal(count), 0.5, 1.5)
    return -rng.uniform(0.0, rr) + np.concatenate([[0.0], np.cumsum(intervals)])


def _rhythm(labels: set[int], m: _Morphology, duration: float, rng: np.random.Generator) -> _Rhythm:
    if _C["AFIB"] in labels:
        rr = 60.0 / rng.uniform(70, 130)
        count = int(duration / 0.3) + 4
        intervals = np.clip(rr * rng.lognormal(0.0, 0.25, count), 0.3, 2.0)
        onsets = -rng.uniform(0, rr) + np.concatenate([[0.0], np.cumsum(intervals)])
        return _Rhythm(onsets, np.zeros(onsets.size, int), np.zeros(onsets.size, bool), np.array([]), "fibrillation")
    if _C["AFLT"] in labels:
        flutter_hz = rng.uniform(4.2, 5.5)
        onsets = _regular_onsets(rng, int(rng.integers(2, 5)) / flutter_hz, duration, 0.0)
        rhythm = _Rhythm(onsets, np.zeros(onsets.size, int), np.zeros(onsets.size, bool), np.array([]), "flutter")
        rhythm.flutter_hz = flutter_hz
        return rhythm
    if _C["SVTAC"] in labels:
        onsets = _regular_onsets(rng, 60.0 / rng.uniform(160, 220), duration, 0.01)
        return _Rhythm(onsets, np.zeros(onsets.size, int), np.zeros(onsets.size, bool), np.array([]), "none")
    if _C["STACH"] in labels:
        bpm = rng.uniform(105, 150)
    elif _C["SBRAD"] in labels:
        bpm = rng.uniform(38, 56)
    else:
        bpm = rng.uniform(60, 95) if _C["SARRH"] in labels else rng.uniform(60, 100)
    rr = 60.0 / bpm
    if _C["3AVB"] in labels:  # atria at the sinus rate, ventricles escape slowly and independently
        p_centres = _regular_onsets(rng, rr, duration, 0.02)
        onsets = _regular_onsets(rng, 60.0 / rng.uniform(30, 45), duration, 0.01)
        m.qrsd = max(m.qrsd, rng.uniform(0.11, 0.14))
        return _Rhythm(onsets, np.zeros(onsets.size, int), np.zeros(onsets.size, bool), p_centres)
    if _C["2AVB"] in labels:  # every `cycle`-th P wave is not conducted
        p_centres = _regular_onsets(rng, rr, duration, 0.02)
        cycle = int(rng.integers(3, 5))
        phase = np.arange(p_centres.size) % cycle
        conducted = phase != cycle - 1
        mobitz_one = rng.random() < 0.5  # Mobitz I: PR lengthens until a beat drops; II: constant PR
        pr = m.pr + 0.08 * phase if mobitz_one else np.full(p_centres.size, m.pr)
        onsets = p_centres[conducted] - _P_LEAD + pr[conducted]
        return _Rhythm(onsets, np.zeros(onsets.size, int), np.zeros(onsets.size, bool), p_centres)
    onsets = _regular_onsets(rng, rr, duration, 0.02)
    if _C["SARRH"] in labels:
        breathing = rng.uniform(0.2, 0.33)
        depth = rng.uniform(0.12, 0.2)
        breath_phase = rng.uniform(0, 2 * np.pi)
        intervals = rr * (1.0 + depth * np.sin(2 * np.pi * breathing * onsets[:-1] + breath_phase))
        onsets = onsets[0] + np.concatenate([[0.0], np.cumsum(intervals)])
    kinds = np.zeros(onsets.size, int)
    inside = np.flatnonzero((onsets > 0.5) & (onsets < duration - 1.5))[1:-1]
    if _C["PAC"] in labels and inside.size:
        for beat in rng.choice(inside, size=min(inside.size, int(rng.integers(1, 3))), replace=False):
            shift = (onsets[beat] - onsets[beat - 1]) * rng.uniform(0.3, 0.4)
            onsets[beat:] -= shift  # premature, and the sinus node resets
            kinds[beat] = 2
    if _C["PVC"] in labels and inside.size:
        candidates = inside[kinds[inside] == 0]
        for beat in rng.choice(candidates, size=min(candidates.size, int(rng.integers(1, 4))), replace=False):
            onsets[beat] -= (onsets[beat] - onsets[beat - 1]) * rng.uniform(0.35, 0.45)  # compensatory pause
            kinds[beat] = 1
    return _Rhythm(onsets, kinds, kinds != 1, np.array([]))


def _beats(m: _Morphology, rhythm: _Rhythm, rng: np.random.Generator) -> _Waves:
    waves = _Waves()
    onsets, kinds = rhythm.onsets, rhythm.kinds
    rr = np.diff(onsets, prepend=onsets[0] - np.median(np.diff(onsets)))
    normal = onsets[kinds != 1]
    for offset, dipole in m.p:
        sinus_p = onsets[rhythm.conducted_p & (kinds == 0)] - m.pr + _P_LEAD
        waves.add(sinus_p + offset, m.p_sigma, dipole)
        waves.add(rhythm.free_p + offset, m.p_sigma, dipole)
    waves.add(onsets[kinds == 2] - m.pr + _P_LEAD, m.p_sigma, _unit(0.4, -0.6, 0.3, 0.12))  # ectopic atrial P
    d = m.qrsd
    waves.add(normal + 0.15 * d, 0.08 * d, m.q)
    waves.add(normal + 0.45 * d, 0.13 * d, m.r)
    waves.add(normal + 0.78 * d, 0.10 * d, m.s)
    if m.r_late.any():
        waves.add(normal + 0.8 * d, 0.14 * d, m.r_late)
    if m.st.any():
        waves.add(normal + d + 0.07, 0.05, m.st)
    qt = 0.4 * np.sqrt(np.clip(rr, 0.25, 2.0))
    waves.add(normal + qt[kinds != 1] - 0.09, m.t_sigma, m.t)
    pvc = onsets[kinds == 1]
    if pvc.size:
        width = rng.uniform(0.14, 0.18)
        x, y, z = rng.choice([-1.0, 1.0], 3) * rng.uniform(0.3, 1.0, 3)
        direction = _unit(x, y, z, rng.uniform(1.5, 2.2))
        waves.add(pvc + 0.35 * width, 0.2 * width, direction)
        waves.add(pvc + 0.75 * width, 0.15 * width, -0.4 * direction)
        waves.add(pvc + 0.38, 0.07, -0.35 * direction / np.linalg.norm(direction))
    return waves


def _atrial_activity(rhythm: _Rhythm, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(3, N) fibrillation or flutter waves."""
    if rhythm.atrial == "fibrillation":
        waves = sum(
            rng.uniform(0.3, 1.0) * np.sin(2 * np.pi * rng.uniform(4.0, 9.0) * t + rng.uniform(0, 2 * np.pi))
            for _ in range(3)
        )
        return _unit(0.2, 0.5, 0.8, rng.uniform(0.03, 0.08))[:, None] * waves / 2.0
    if rhythm.atrial == "flutter":
        phase = (t * rhythm.flutter_hz + rng.uniform()) % 1.0
        saw = np.where(phase < 0.8, 1.0 - 2.5 * phase, -1.0 + 5.0 * (phase - 0.8))  # slow fall, fast rise
        return _unit(0.1, -0.9, 0.4, rng.uniform(0.1, 0.2))[:, None] * saw
    return np.zeros((3, t.size))


def synthesize_ecg(
    labels: set[int], fs: float, duration_s: float, rng: np.random.Generator, artifacts: Artifacts = Artifacts()
) -> np.ndarray:
    """(12, round(duration_s * fs)) float64 in mV showing the classes in `labels`, in STANDARD_LEADS order."""
    n = int(round(duration_s * fs))
    t = np.arange(n) / fs
    morphology = _morphology(labels, rng)
    rhythm = _rhythm(labels, morphology, duration_s, rng)
    heart = _beats(morphology, rhythm, rng).render(n, fs) + _atrial_activity(rhythm, t, rng)
    signal: npt.NDArray[np.float64] = LEAD_VECTORS @ heart
    frequencies = rng.uniform(0.05, 0.5, (12, 2, 1))
    phases = rng.uniform(0, 2 * np.pi, (12, 2, 1))
    amplitudes = artifacts.wander_mv * rng.uniform(0.3, 1.0, (12, 2, 1))
    signal += (amplitudes * np.sin(2 * np.pi * frequencies * t + phases)).sum(axis=1)
    signal += artifacts.noise_mv * rng.standard_normal(signal.shape)
    if artifacts.powerline_mv:
        signal += artifacts.powerline_mv * np.sin(2 * np.pi * artifacts.powerline_hz * t + rng.uniform(0, 2 * np.pi))
    return artifacts.gain * signal
