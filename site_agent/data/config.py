"""Settings of a site's ECG sources (one pydantic model per layout) and of FedCVD preprocessing.

A source's layout is its `kind`: the `cardiofl.sources` entry points of every installed
distribution (shared/plugins.py), each naming its config class; cardiofl's own four (PTB-XL,
Challenge, manifest, SPH) are registered by its pyproject.toml, a plug-in's by its own, and
`parse_source` reads every kind through them. A plug-in's class is a RecordSource: it lists its
records and reads each one's signal; cardiofl's pipeline does the rest (labels, split,
preprocessing, skips counted by reason, the cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, SerializeAsAny, TypeAdapter, model_validator

from shared.plugins import Registry

if TYPE_CHECKING:
    import numpy as np

    from site_agent.data.record_ref import RecordRef

__all__ = [
    "SOURCES",
    "ChallengeSource",
    "DataSourceConfig",
    "ManifestSource",
    "PreprocessConfig",
    "PtbxlSource",
    "RecordSource",
    "SourceConfig",
    "SphSource",
    "parse_source",
]


class SourceConfig(BaseModel):
    """Fields every source kind has: where it is, how its codes map to classes, how it splits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path
    name: str | None = None  # shown in reports; defaults to the folder or file name
    # A site's own code map: {"code": "CLASS" | ["CLASS", ...]} inline, or a JSON/CSV file (shared.labels).
    label_map: Path | dict[str, str | list[str]] | None = None
    seed: int = 0  # the train/test split is a seeded hash of each record id
    test_fraction: float = Field(0.2, ge=0.0, le=1.0)
    split_file: Path | None = None  # CSV with columns record,split (train|test); overrides seed/test_fraction
    # FedCVD's shipped split of this source: its `appendix/ECG/clientK` folder (train.csv, test.csv keyed by
    # ECG_ID, FedCVD's numbering of the records it keeps, checked against each record's labels, age and sex).
    fedcvd_split: Path | None = None
    # FedCVD's record set: keep only records with 0 < age < 120 and a known sex (skipped as bad_demographics).
    require_demographics: bool = False
    if TYPE_CHECKING:
        # Every kind's class declares its own `kind: Literal[...]` field; declared here for the type checker only,
        # so that the base model gets no such field.
        kind: str

    @model_validator(mode="after")
    def _one_split(self) -> SourceConfig:
        if self.split_file is not None and self.fedcvd_split is not None:
            raise ValueError("give split_file or fedcvd_split, not both")
        if self.fedcvd_split is not None and not self.require_demographics:
            raise ValueError(
                "fedcvd_split numbers the records FedCVD keeps, after its age/sex filter: set require_demographics"
            )
        return self

    @property
    def display_name(self) -> str:
        """Name used in reports."""
        return self.name or self.path.name


class PtbxlSource(SourceConfig):
    """PTB-XL: `ptbxl_database.csv` (`scp_codes`, `filename_hr`/`filename_lr`) + records500/records100.

    Without the CSV, every `*_hr` (or `*_lr`) record under `path` is read and its labels come from a
    `# Labels:` header comment of PTB-XL statement names.
    """

    kind: Literal["ptbxl"] = "ptbxl"
    resolution: Literal["hr", "lr"] = "hr"  # hr: records500 (FedCVD), lr: records100


class ChallengeSource(SourceConfig):
    """PhysioNet/CinC Challenge 2020/2021 layout: `.hea` + `.mat`/`.dat` at any folder depth, `#Dx:` SNOMED-CT codes.

    The synthetic site generator writes this layout too.
    """

    kind: Literal["challenge"] = "challenge"


class ManifestSource(SourceConfig):
    """A CSV listing records, so any archive can be mapped without code.

    Columns: the record path (`record`, else `path`, or the one `record_column` names: a WFDB path
    relative to the CSV, extension optional), the labels (`labels`, or the column(s) `label_column`
    names: codes or class names separated by ';', ',', '|' or '+'; several columns are joined), and
    optionally `split` (train|test), `age` and `sex`. Class names are accepted under every
    `label_scheme`; the scheme says which codes are (auto: PTB-XL SCP and SNOMED-CT).
    """

    kind: Literal["manifest"] = "manifest"
    label_scheme: Literal["auto", "name", "ptbxl", "snomed", "aha"] = "auto"
    # The column(s) holding each record's codes or class names, e.g. "dx" (SNOMED-CT) or ["dx", "labels"].
    label_column: str | Annotated[tuple[str, ...], Field(min_length=1)] = "labels"
    record_column: str | None = None  # None: `record`, or `path` when there is no `record` column

    @property
    def label_columns(self) -> tuple[str, ...]:
        """The label column(s) as a tuple."""
        return (self.label_column,) if isinstance(self.label_column, str) else self.label_column


class SphSource(SourceConfig):
    """SPH (Shandong Provincial Hospital, figshare) as shipped: `metadata.csv` and `records/<ECG_ID>.h5`.

    metadata.csv has the columns ECG_ID, AHA_Code, Patient_ID, Age, Sex, N, Date. AHA_Code lists AHA
    statements separated by ';', a statement joined to its modifiers by '+' (`22;50+346`); FedCVD splits
    on both. Each record file holds the dataset `ecg`, shape (12, N): leads I, II, III, aVR, aVL, aVF,
    V1-V6 in mV, sampled at 500 Hz.
    """

    kind: Literal["sph"] = "sph"


class RecordSource(SourceConfig):
    """A plug-in's source layout: it lists its records and reads each signal, cardiofl's pipeline does the rest.

    A subclass sets `kind` to a Literal of its entry point's name and implements `records` and
    `read_signal`; `label_scheme` is the code system of its records' codes (the default label map's:
    "snomed", "ptbxl", "aha" or "name"), and `files` the files whose content defines it (every file
    under `path`, by default), which the cache key hashes with the plug-in's identity. A record it
    cannot read raises OSError or ValueError from `read_signal` and is skipped as unreadable.
    """

    label_scheme: ClassVar[str] = "snomed"

    def records(self) -> Iterable[RecordRef]:
        """Every record of the source, in a stable order, with its codes (and split, age, sex where known)."""
        raise NotImplementedError

    def read_signal(self, ref: RecordRef) -> tuple[np.ndarray, float]:
        """(signal, sampling rate in Hz): the 12 standard leads in order (I ... V6) x samples, in mV."""
        raise NotImplementedError

    def files(self) -> list[Path]:
        """The files whose content defines the source, sorted."""
        if self.path.is_file():
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file())


SOURCES: Registry[type] = Registry("cardiofl.sources", type, "data source")
BUILTIN_SOURCES = (PtbxlSource, ChallengeSource, ManifestSource, SphSource)


def source_classes() -> Mapping[str, type[SourceConfig]]:
    """The config class of each registered source by kind; a plug-in's is a RecordSource whose `kind` is its name."""
    classes: dict[str, type[SourceConfig]] = {}
    for kind in SOURCES:
        found = SOURCES[kind]
        if not issubclass(found, SourceConfig) or (
            found not in BUILTIN_SOURCES and not issubclass(found, RecordSource)
        ):
            raise TypeError(
                f"data source {kind!r} of {SOURCES.distribution(kind).metadata['Name']!r} is not a RecordSource"
            )
        if found.model_fields.get("kind") is None or found.model_fields["kind"].default != kind:
            raise TypeError(f"data source {kind!r}: its class's `kind` must default to {kind!r}")
        classes[kind] = found
    return classes


@lru_cache(maxsize=8)
def _adapter(classes: tuple[type[SourceConfig], ...]) -> TypeAdapter[SourceConfig]:
    # A Union of the classes registered at run time: a valid type form for pydantic, none a type checker can see.
    return TypeAdapter(Annotated[Union[classes], Field(discriminator="kind")])  # type: ignore[arg-type]  # noqa: UP007


def parse_source(data: object) -> SourceConfig:
    """Validate a source given as a dict (JSON/TOML/env) into its kind's config model."""
    if isinstance(data, SourceConfig):
        return data
    return _adapter(tuple(source_classes().values())).validate_python(data)


DataSourceConfig = Annotated[SerializeAsAny[SourceConfig], PlainValidator(parse_source)]


class PreprocessConfig(BaseModel):
    """FedCVD preprocessing: resample to `fs`, keep the first `signal_len` samples or edge-pad centred."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fs: int = Field(500, gt=0)
    signal_len: int = Field(5000, gt=0)
    # FedCVD also drops records without 0 < age < 120 or with unknown sex: here for every source (each source
    # can also ask for it alone); off unless asked for.
    require_demographics: bool = False
