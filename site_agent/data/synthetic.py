"""Synthetic hospital sites in the PhysioNet Challenge layout (.hea + .mat, `#Dx:` SNOMED-CT), non-IID on purpose.

Each site differs the way real hospitals do: label priors (some classes absent), amplifier gain,
noise, baseline wander, mains hum, sampling rate (250/1000 Hz sites make the loader resample), lead
name spelling, and how many records are shorter (padding) or longer (truncation) than 10 s. Signals
come from `synthetic_ecg`; labels are learnable from them. `corrupt_fraction` replaces some records
by broken ones, one kind after another, to exercise the loader's skipping; `truth.csv` in each site
folder lists every record with its classes and the skip reason the loader should give (empty if none).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.io

from shared.labels import CLASS_NAMES, CLASSES, N_CLASSES, class_index
from site_agent.data.records import STANDARD_LEADS
from site_agent.data.report import SkipReason
from site_agent.data.synthetic_ecg import Artifacts, synthesize_ecg

__all__ = [
    "CORRUPTIONS",
    "SiteProfile",
    "default_site_profiles",
    "generate_sites",
    "sample_labels",
    "write_record",
]

ADC_GAIN = 1000.0  # digital units per mV: 1 uV resolution in int16, as the Challenge files
SINUS_RHYTHM = "426783006"  # SNOMED sinus rhythm: real headers carry it, FedCVD maps it to nothing
TRUTH_FILE = "truth.csv"

# Base prevalence of each class as the primary finding (NORM-heavy, like PTB-XL).
BASE_PRIOR = np.array(
    [30, 6, 6, 4, 3, 6, 3, 2, 4, 4, 2, 1.5, 5, 5, 3, 5, 2, 3, 4, 4],
    dtype=np.float64,
)
_RHYTHMS = {class_index(n) for n in ("STACH", "SBRAD", "SARRH", "AFIB", "AFLT", "SVTAC")}
_NO_P_WAVES = {class_index(n) for n in ("AFIB", "AFLT", "SVTAC")}
_ATRIAL = {class_index(n) for n in ("PAC", "1AVB", "2AVB", "3AVB", "LAO/LAE")}
_EXCLUSIVE_GROUPS = [
    {class_index(n) for n in ("1AVB", "2AVB", "3AVB")},
    {class_index(n) for n in ("LBBB", "RBBB")},
    {class_index(n) for n in ("LVH", "RVH")},
    {class_index(n) for n in ("AMI", "ASMI")},
    _RHYTHMS,
]
_AV_BLOCKS = {class_index(n) for n in ("2AVB", "3AVB")}
_MI = {class_index(n) for n in ("AMI", "IMI", "ASMI")}

# Broken records: (kind, skip reason the loader must report).
CORRUPTIONS: tuple[tuple[str, SkipReason], ...] = (
    ("truncated_signal", SkipReason.UNREADABLE),
    ("garbage_header", SkipReason.UNREADABLE),
    ("missing_signal_file", SkipReason.UNREADABLE),
    ("nan_samples", SkipReason.NON_FINITE),
    ("all_zero", SkipReason.ALL_ZERO),
    ("missing_lead", SkipReason.MISSING_LEAD),
    ("no_label", SkipReason.NO_LABEL),
)


@dataclass(frozen=True)
class SiteProfile:
    """How one synthetic hospital records and whom it sees."""

    prior: tuple[float, ...] = tuple(BASE_PRIOR)  # relative frequency of each class as primary label
    multi_label_rate: float = 0.25  # chance of a second finding (and a third at a third of it)
    fs: int = 500
    artifacts: Artifacts = field(default_factory=Artifacts)
    short_fraction: float = 0.05  # records of 6-9.5 s (padded by the loader)
    long_fraction: float = 0.05  # records of 11-20 s (truncated)
    upper_case_leads: bool = False  # AVR/AVL/AVF instead of aVR/aVL/aVF
    sinus_code_rate: float = 0.5  # sinus records that also carry the unmapped sinus-rhythm code


def default_site_profiles(
    n_sites: int, seed: int, heterogeneity: float = 1.0, exclusive_classes: int = 0
) -> list[SiteProfile]:
    """K distinct sites: site 1 records at 250 Hz and site 2 at 1000 Hz, the others at 500 Hz.

    `heterogeneity` scales the spread of label priors and recording effects (0 gives every site the
    same priors and artifacts; rates and lead spelling still differ); above 0, every site except the
    first also lacks two classes entirely. `exclusive_classes` N > 0: the last N classes are primary
    labels of the last site alone, each as common there as its most common class.
    """
    if not 0 <= exclusive_classes < N_CLASSES:
        raise ValueError(f"exclusive_classes must be in [0, {N_CLASSES}), got {exclusive_classes}")
    held = np.arange(N_CLASSES - exclusive_classes, N_CLASSES)
    rng = np.random.default_rng([seed, 7919])
    profiles = []
    for site in range(n_sites):
        prior = BASE_PRIOR * np.exp(heterogeneity * rng.normal(0.0, 0.8, N_CLASSES))
        if heterogeneity > 0 and site > 0:
            prior[rng.choice(np.arange(1, N_CLASSES), size=2, replace=False)] = 0.0
        if len(held):
            prior[held] = prior.max() if site == n_sites - 1 else 0.0
        spread = min(heterogeneity, 1.0)
        artifacts = Artifacts(
            gain=float(np.exp(spread * rng.uniform(-0.25, 0.25))),
            noise_mv=float(0.01 + spread * rng.uniform(0.0, 0.03)),
            wander_mv=float(0.05 + spread * rng.uniform(0.0, 0.2)),
            powerline_hz=60.0 if site % 2 else 50.0,
            powerline_mv=float(spread * rng.uniform(0.0, 0.03)),
        )
        profiles.append(
            SiteProfile(
                prior=tuple(float(p) for p in prior),
                fs={1: 250, 2: 1000}.get(site, 500),
                artifacts=artifacts,
                short_fraction=float(0.05 + spread * rng.uniform(0.0, 0.15)),
                long_fraction=float(0.05 * spread),
                upper_case_leads=site % 3 == 2,
            )
        )
    return profiles


def _compatible(labels: set[int], candidate: int) -> bool:
    if candidate in labels or candidate == class_index("NORM"):
        return False
    combined = labels | {candidate}
    if any(len(combined & group) > 1 for group in _EXCLUSIVE_GROUPS):
        return False
    if combined & _NO_P_WAVES and combined & _ATRIAL:
        return False
    if combined & _AV_BLOCKS and combined & (_RHYTHMS | {class_index("PAC"), class_index("PVC")}):
        return False
    return not (class_index("LBBB") in combined and combined & _MI)


def sample_labels(prior: np.ndarray, multi_label_rate: float, rng: np.random.Generator) -> set[int]:
    """A plausible label set: a primary class from `prior`, maybe one or two compatible extra findings."""
    weights = np.asarray(prior, dtype=np.float64)
    primary = int(rng.choice(N_CLASSES, p=weights / weights.sum()))
    labels = {primary}
    if primary == class_index("NORM"):
        return labels
    for chance in (multi_label_rate, multi_label_rate / 3):
        if rng.random() >= chance:
            break
        allowed = np.array([w if _compatible(labels, c) else 0.0 for c, w in enumerate(weights)])
        if allowed.sum() == 0:
            break
        labels.add(int(rng.choice(N_CLASSES, p=allowed / allowed.sum())))
    return labels


def _duration(profile: SiteProfile, rng: np.random.Generator) -> float:
    draw = rng.random()
    if draw < profile.short_fraction:
        return float(rng.uniform(6.0, 9.5))
    if draw < profile.short_fraction + profile.long_fraction:
        return float(rng.uniform(11.0, 20.0))
    return 10.0


def write_record(
    folder: Path, name: str, digital: np.ndarray, fs: int, lead_names: Sequence[str], comments: list[str]
) -> None:
    """One Challenge-layout record: MATLAB v4 `val` (leads x samples, int16) and its WFDB header.

    The header is the text `wfdb.Record.wrheader` writes for these fields (format 16 at byte offset
    24, gain 1000/mV, initial value and checksum per lead), written directly because wfdb's writer
    costs ~15 ms a record; tests read every generated record back with `wfdb.rdrecord`.
    """
    scipy.io.savemat(folder / f"{name}.mat", {"val": digital}, format="4")
    checksums = (digital.astype(np.int64).sum(axis=1) + 32768) % 65536 - 32768
    lines = [f"{name} {digital.shape[0]} {fs} {digital.shape[1]}"]
    lines += [
        f"{name}.mat 16+24 {ADC_GAIN:g}/mV 16 0 {int(first)} {int(checksum)} 0 {lead}"
        for first, checksum, lead in zip(digital[:, 0], checksums, lead_names, strict=True)
    ]
    lines += [f"#{comment}" for comment in comments]
    (folder / f"{name}.hea").write_text("\n".join(lines) + "\n")


def _corrupt(kind: str, digital: np.ndarray) -> tuple[np.ndarray, str | None]:
    """Adjust a record before writing (or say which file to break after); returns (digital, post-write action)."""
    if kind == "nan_samples":
        digital = digital.copy()
        digital[3, 100:400] = -32768  # WFDB's "no sample" value for format 16 reads back as NaN
    elif kind == "all_zero":
        digital = np.zeros_like(digital)
    elif kind == "missing_lead":
        digital = digital[:-1]
    return digital, kind if kind in ("truncated_signal", "garbage_header", "missing_signal_file") else None


def _break_files(action: str, folder: Path, name: str) -> None:
    mat = folder / f"{name}.mat"
    if action == "truncated_signal":
        mat.write_bytes(mat.read_bytes()[: mat.stat().st_size // 3])
    elif action == "garbage_header":
        (folder / f"{name}.hea").write_bytes(b"\x00\xffnot a header\n" * 3)
    elif action == "missing_signal_file":
        mat.unlink()


def _generate_site(
    folder: Path, site: int, profile: SiteProfile, n_records: int, rng: np.random.Generator, n_corrupt: int
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    leads = [lead.upper() if profile.upper_case_leads else lead for lead in STANDARD_LEADS]
    prior = np.asarray(profile.prior, dtype=np.float64)
    corrupt_at = set(rng.choice(n_records, size=min(n_corrupt, n_records), replace=False).tolist())
    truth_rows = []
    corrupt_seen = 0
    for index in range(n_records):
        name = f"s{site:02d}_{index:05d}"
        labels = sample_labels(prior, profile.multi_label_rate, rng)
        signal = synthesize_ecg(labels, profile.fs, _duration(profile, rng), rng, profile.artifacts)
        digital = np.clip(np.round(signal * ADC_GAIN), -32767, 32767).astype(np.int16)
        codes = [CLASSES[c].codes["snomed"][0] for c in sorted(labels)]
        if not labels & _NO_P_WAVES and rng.random() < profile.sinus_code_rate:
            codes.append(SINUS_RHYTHM)
        kind, reason, action = "", "", None
        if index in corrupt_at:
            kind, skip = CORRUPTIONS[corrupt_seen % len(CORRUPTIONS)]
            corrupt_seen += 1
            reason = skip.value
            digital, action = _corrupt(kind, digital)
            if kind == "no_label":
                codes = [SINUS_RHYTHM]
        age = int(np.clip(rng.normal(66 if labels & _MI else 55, 15), 18, 95))
        comments = [f"Age: {age}", f"Sex: {rng.choice(['Male', 'Female'])}", f"Dx: {','.join(codes)}", "Rx: Unknown"]
        write_record(folder, name, digital, profile.fs, leads[: digital.shape[0]], comments)
        if action:
            _break_files(action, folder, name)
        classes = ";".join(CLASS_NAMES[c] for c in sorted(labels)) if kind != "no_label" else ""
        truth_rows.append({"record": name, "labels": classes, "corruption": kind, "expected_skip": reason})
    with (folder / TRUTH_FILE).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["record", "labels", "corruption", "expected_skip"])
        writer.writeheader()
        writer.writerows(truth_rows)


def generate_sites(
    out_dir: Path,
    n_sites: int,
    records_per_site: int,
    seed: int,
    *,
    profiles: Sequence[SiteProfile] | None = None,
    heterogeneity: float = 1.0,
    corrupt_fraction: float = 0.0,
    exclusive_classes: int = 0,
) -> list[Path]:
    """Write `n_sites` folders `site_00`, `site_01`, ... of Challenge-layout records; return their paths.

    The same arguments always give the same files. `profiles` overrides `default_site_profiles`, which
    `heterogeneity` and `exclusive_classes` shape.
    """
    if n_sites < 1 or records_per_site < 1:
        raise ValueError("need at least one site and one record per site")
    if not 0.0 <= corrupt_fraction <= 1.0:
        raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}")
    chosen = (
        list(profiles)
        if profiles is not None
        else default_site_profiles(n_sites, seed, heterogeneity, exclusive_classes)
    )
    if len(chosen) != n_sites:
        raise ValueError(f"got {len(chosen)} profiles for {n_sites} sites")
    folders = []
    for site, profile in enumerate(chosen):
        folder = Path(out_dir) / f"site_{site:02d}"
        rng = np.random.default_rng([seed, site])
        n_corrupt = int(round(corrupt_fraction * records_per_site))
        _generate_site(folder, site, profile, records_per_site, rng, n_corrupt)
        folders.append(folder)
    return folders
