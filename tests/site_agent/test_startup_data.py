"""At start the agent opens every data source, logs what loaded, and stops naming the setting of one it cannot use."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import wfdb
from typer.testing import CliRunner

from cardiofl.cli import app
from shared.labels import CLASS_NAMES
from site_agent import loop as loop_module
from site_agent.config import AgentSettings, load_settings, open_data
from site_agent.data import cache as cache_module
from site_agent.data import open_site_data
from site_agent.data.synthetic import generate_sites
from site_agent.errors import ConfigError
from site_agent.store import write_key_file
from tests.site_agent.data.conftest import ECG_DIR, read_truth
from tests.site_agent.data.records import make_record

runner = CliRunner()
Entry = dict[str, object]
KINDS = ("challenge", "ptbxl", "manifest")
UNMAPPED = {"challenge": "Dx: 426783006", "ptbxl": "Labels: STTC", "manifest": "426783006"}  # codes of no class


@pytest.fixture(autouse=True)
def _clean_environ_and_signals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No CARDIOFL_* variable leaks in; the handlers `site run` installs in-process are put back."""
    for name in list(os.environ):
        if name.startswith("CARDIOFL_"):
            monkeypatch.delenv(name)
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def toml_value(value: object) -> str:
    """A TOML value for the few types the configs here use."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def agent_config(tmp_path: Path, data: list[Entry]) -> Path:
    """A complete site config whose only questionable part is `data`."""
    key = tmp_path / "store.key"
    if not key.exists():
        write_key_file(key)
    (tmp_path / "token").write_text("site-token\n")
    values: dict[str, object] = {
        "name": "lyon",
        "coordinator_url": "http://127.0.0.1:9",
        "token_file": str(tmp_path / "token"),
        "store_key_file": str(key),
        "store_dir": str(tmp_path / "store"),
        "cache_dir": str(tmp_path / "cache"),
        "device": "cpu",
        "data": data,
    }
    path = tmp_path / "site.toml"
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
    return path


def valid_source(kind: str, root: Path, *, comment: str | None = None, n: int = 3) -> Entry:
    """A small readable source of `kind`; its records carry AFIB (challenge, manifest) or NORM (ptbxl)."""
    if kind == "challenge":
        for i in range(n):
            make_record(root / "wfdb", f"r{i}", comments=(comment or "Dx: 164889003",), seed=i, n_samples=1000)
        return {"kind": "challenge", "path": str(root / "wfdb")}
    if kind == "ptbxl":
        folder = root / "ptbxl" / "records500" / "00000"
        for i in range(n):
            make_record(folder, f"{i + 1:05d}_hr", comments=(comment or "Labels: NORM",), seed=i, n_samples=1000)
        return {"kind": "ptbxl", "path": str(root / "ptbxl")}
    for i in range(n):
        make_record(root / "archive" / "wfdb", f"r{i}", comments=(), seed=i, n_samples=1000)
    rows = "".join(f"wfdb/r{i},{comment or 'AFIB'}\n" for i in range(n))
    (root / "archive" / "list.csv").write_text("record,labels\n" + rows)
    return {"kind": "manifest", "path": str(root / "archive" / "list.csv")}


def _overwrite(entry: Entry, name: str, content: bytes) -> Entry:
    """Write `content` to a file `name` and point the entry's `path` at it."""
    path = Path(str(entry["path"])).parent / name
    path.write_bytes(content)
    return {**entry, "path": str(path)}


def _break_headers(entry: Entry) -> Entry:
    """Every WFDB header of the source replaced by text wfdb cannot parse."""
    root = Path(str(entry["path"]))
    for header in (root.parent if root.is_file() else root).rglob("*.hea"):
        header.write_text("this is not a WFDB header\n")
    return entry


def _misnamed_path(kind: str, entry: Entry, root: Path) -> Entry:
    """A folder where the manifest CSV belongs, a file where a folder of records belongs."""
    if kind == "manifest":
        return {**entry, "path": str(Path(str(entry["path"])).parent)}
    return _overwrite(entry, "records.zip", b"PK\x03\x04")


def _empty(kind: str, entry: Entry, root: Path) -> Entry:
    """A folder without records, or a manifest with a header row only."""
    if kind == "manifest":
        return _overwrite(entry, "header-only.csv", b"record,labels\n")
    (root / "empty").mkdir()
    return {**entry, "path": str(root / "empty")}


def _two_named(entry: Entry) -> list[Entry]:
    """Two sources under one name."""
    return [{**entry, "name": "ward"}, {**entry, "name": "ward"}]


# (how the source is broken, the setting the error must name, a phrase it must say)
Breaker = Callable[[str, Entry, Path], Entry | list[Entry]]
COMMON: list[tuple[str, Breaker, str, str]] = [
    ("path-missing", lambda kind, e, root: {**e, "path": str(root / "nowhere")}, "data.0.path", "does not exist"),
    ("path-wrong-type", _misnamed_path, "data.0.path", "source is a"),
    ("no-records", _empty, "data.0.path", "lists no records|holds no WFDB records|has no ptbxl_database.csv"),
    ("records-unreadable", lambda kind, e, root: _break_headers(e), "data.0.path", "unreadable 3"),
    (
        "label-map-missing",
        lambda kind, e, root: {**e, "label_map": str(root / "map.json")},
        "data.0.label_map",
        "No such file",
    ),
    (
        "label-map-not-json",
        lambda kind, e, root: {**e, "label_map": str(_write(root / "map.json", '{"164889003": '))},
        "data.0.label_map",
        "not valid JSON",
    ),
    (
        "label-map-csv-columns",
        lambda kind, e, root: {**e, "label_map": str(_write(root / "map.csv", "snomed,name\n1,AFIB\n"))},
        "data.0.label_map",
        "columns 'code' and 'class'",
    ),
    (
        "label-map-not-utf8",
        lambda kind, e, root: {**e, "label_map": str(_write(root / "map.csv", b"code,class\n\xff,AFIB\n"))},
        "data.0.label_map",
        "not UTF-8",
    ),
    ("label-map-unknown-class", lambda kind, e, root: {**e, "label_map": {"x": "NOPE"}}, "data.0.label_map", "NOPE"),
    (
        "split-file-missing",
        lambda kind, e, root: {**e, "split_file": str(root / "split.csv")},
        "data.0.split_file",
        "No such file",
    ),
    (
        "split-file-bad-split",
        lambda kind, e, root: {**e, "split_file": str(_write(root / "split.csv", "record,split\nr0,dev\n"))},
        "data.0.split_file",
        "'train' or 'test'",
    ),
    ("names-clash", lambda kind, e, root: _two_named(e), "data.1.name", "'ward' twice"),
]
MANIFEST: list[tuple[str, Breaker, str, str]] = [
    ("csv-empty-file", lambda kind, e, root: _overwrite(e, "empty.csv", b""), "data.0.path", "is empty"),
    (
        "csv-not-utf8",
        lambda kind, e, root: _overwrite(e, "latin1.csv", "record,labels\nwfdb/r0,AFIB\u00e9\n".encode("latin-1")),
        "data.0.path",
        "not UTF-8",
    ),
    (
        "csv-malformed",
        lambda kind, e, root: _overwrite(e, "huge.csv", b'record,labels\nwfdb/r0,"' + b"x" * 200_000 + b'"\n'),
        "data.0.path",
        "field larger than field limit",
    ),
    ("label-column-absent", lambda kind, e, root: {**e, "label_column": "dx"}, "data.0.label_column", "'dx'"),
    ("record-column-absent", lambda kind, e, root: {**e, "record_column": "file"}, "data.0.record_column", "'file'"),
]
PTBXL: list[tuple[str, Breaker, str, str]] = [
    (
        "database-columns",
        lambda kind, e, root: _with_database(e, b"ecg_id,filename_hr\n1,records500/00000/00001_hr\n"),
        "data.0.path",
        "needs the columns scp_codes",
    ),
    (
        "database-not-utf8",
        lambda kind, e, root: _with_database(e, b"ecg_id,scp_codes,filename_hr\n1,\"{'NORM': 100}\",\xff\n"),
        "data.0.path",
        "not UTF-8",
    ),
    (
        "database-is-a-folder",
        lambda kind, e, root: _with_database(e, None),
        "data.0.path",
        "Is a directory",
    ),
]
CASES = [
    pytest.param(kind, breaker, setting, phrase, id=f"{kind}-{how}")
    for kind in KINDS
    for how, breaker, setting, phrase in COMMON
    + (MANIFEST if kind == "manifest" else [])
    + (PTBXL if kind == "ptbxl" else [])
]
CASES += [
    pytest.param(
        kind,
        lambda kind, e, root: valid_source(kind, root / "unlabelled", comment=UNMAPPED[kind]),
        "data.0.label_column" if kind == "manifest" else "data.0.label_map",
        "no_label 3",
        id=f"{kind}-no-known-label",
    )
    for kind in KINDS
]


def _write(path: Path, content: str | bytes) -> Path:
    """Write a small file and return its path."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _with_database(entry: Entry, content: bytes | None) -> Entry:
    """The PTB-XL source with a ptbxl_database.csv holding `content`, or a folder of that name."""
    database = Path(str(entry["path"])) / "ptbxl_database.csv"
    if content is None:
        database.mkdir()
    else:
        database.write_bytes(content)
    return entry


def never_poll(*_args: object, **_kwargs: object) -> None:
    """Stands in for the poll loop: reaching it means the agent started on a source it cannot use."""
    raise AssertionError("the agent started polling")


@pytest.mark.parametrize(("kind", "breaker", "setting", "phrase"), CASES)
def test_an_unusable_source_stops_the_agent_naming_its_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, breaker: Breaker, setting: str, phrase: str
) -> None:
    open_data(load_settings(agent_config(tmp_path, [valid_source(kind, tmp_path)])))  # unbroken, it is used
    broken = breaker(kind, valid_source(kind, tmp_path / "broken"), tmp_path)
    config = agent_config(tmp_path, broken if isinstance(broken, list) else [broken])
    monkeypatch.setattr(loop_module, "run", never_poll)
    result = runner.invoke(app, ["site", "run", "--config", str(config)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.exception
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: setting '{setting}' (CARDIOFL_SITE_DATA or `data` in the config file), source ")
    assert re.search(phrase, error), error
    assert "Traceback" not in result.output and "Traceback" not in result.stderr


def test_the_variable_is_named_when_the_sources_come_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    folder = tmp_path / "archive"
    folder.mkdir()
    monkeypatch.setenv("CARDIOFL_SITE_DATA", json.dumps([{"kind": "manifest", "path": str(folder)}]))
    with pytest.raises(ConfigError, match=r"^setting 'data.0.path' \(CARDIOFL_SITE_DATA .*is a folder; a manifest"):
        open_data(load_settings(config))


def test_a_file_of_a_source_that_cannot_be_read_names_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(agent_config(tmp_path, [valid_source("challenge", tmp_path)]))

    def refuse(_memo: object, file: Path) -> str:
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(cache_module._DigestMemo, "digest", refuse)
    with pytest.raises(ConfigError, match=r"^setting 'data.0.path' .*cannot read .*/wfdb/r0.hea: Permission denied$"):
        open_data(settings)


def test_a_cache_that_cannot_be_written_names_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(agent_config(tmp_path, [valid_source("challenge", tmp_path)]))

    def disk_full(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_module, "_write", disk_full)
    with pytest.raises(ConfigError, match=r"^setting 'cache_dir': cannot write the cache in .*No space left on device"):
        open_data(settings)
    assert [p.name for p in settings.cache_dir.iterdir() if p.is_dir()] == []


def test_a_manifest_folder_stops_a_real_agent_process_with_one_line(tmp_path: Path) -> None:
    entry = valid_source("manifest", tmp_path)
    config = agent_config(tmp_path, [{**entry, "path": str(Path(str(entry["path"])).parent)}])
    done = subprocess.run(
        [sys.executable, "-m", "cardiofl", "site", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: setting 'data.0.path' (CARDIOFL_SITE_DATA or `data` in the config file), source 'archive': "
        f"{tmp_path / 'archive'} is a folder; a manifest source is a CSV file of records"
    )


def test_a_stop_while_the_cache_is_built_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path, n=6)])
    read: list[str] = []
    rdrecord = wfdb.rdrecord

    def read_then_sigterm(path: str, *args: object, **kwargs: object) -> wfdb.Record:
        read.append(path)
        if len(read) == 3:  # inside the record reader, whose `except Exception` must not swallow the stop
            os.kill(os.getpid(), signal.SIGTERM)
        return rdrecord(path, *args, **kwargs)

    def unhandled(*_args: object) -> None:
        raise AssertionError("SIGTERM reached no handler of the agent")

    signal.signal(signal.SIGTERM, unhandled)  # the agent must install its own before opening the data
    monkeypatch.setattr(wfdb, "rdrecord", read_then_sigterm)
    monkeypatch.setattr(loop_module, "run", never_poll)
    result = runner.invoke(app, ["site", "run", "--config", str(config)])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.exception
    assert len(read) == 3  # the build stopped at once
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []  # no cache, no half-built folder


def summary(caplog: pytest.LogCaptureFixture, index: int) -> list[str]:
    """The start-up summary lines of source `index`, without their prefix."""
    prefix = f"data.{index} "
    return [r.getMessage()[len(prefix) :] for r in caplog.records if r.getMessage().startswith(prefix)]


def test_the_summary_counts_what_a_synthetic_site_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = generate_sites(tmp_path / "raw", 1, 30, seed=11, corrupt_fraction=0.25)[0]
    settings = load_settings(agent_config(tmp_path, [{"kind": "challenge", "path": str(folder), "name": "ward"}]))
    with caplog.at_level(logging.INFO, logger="site_agent"):
        site = open_data(settings)
    truth = read_truth(folder)
    skipped = Counter(row["expected_skip"] for row in truth if row["expected_skip"])
    labels = Counter(name for row in truth if not row["expected_skip"] for name in row["labels"].split(";"))
    kept = len(truth) - sum(skipped.values())
    lines = summary(caplog, 0)
    assert lines[0] == f"ward (challenge, {folder})"
    assert lines[1] == (
        f"found {len(truth)}, loaded {kept} (train {len(site.train)}, test {len(site.test)}), "
        f"skipped {sum(skipped.values())}"
    )
    assert lines[2] == "skipped by reason: " + ", ".join(f"{r} {n}" for r, n in sorted(skipped.items()))
    assert lines[4] == "labels: " + " ".join(f"{name}={labels[name]}" for name in CLASS_NAMES if labels[name])
    assert len(skipped) >= 5 and kept == len(site.train) + len(site.test) > 0
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data ready in ")]
    assert len(ready) == 1 and f"{kept - len(site.test)} train and {len(site.test)} test" in ready[0]
    assert str(site.cache_path) in ready[0]


def test_the_cache_built_at_start_is_the_one_training_maps(tmp_path: Path) -> None:
    settings = load_settings(agent_config(tmp_path, [valid_source("challenge", tmp_path)]))
    site = open_data(settings)
    built = (site.cache_path / "meta.json").stat().st_mtime_ns
    again = open_site_data(settings.data, settings.cache_dir)  # what the worker's data would open
    assert again.cache_path == site.cache_path and (again.cache_path / "meta.json").stat().st_mtime_ns == built
    assert [p for p in settings.cache_dir.iterdir() if p.is_dir()] == [site.cache_path]


def real_manifest_settings(tmp_path: Path, **options: object) -> AgentSettings:
    """Settings with the real manifest as the site's only source."""
    if not (ECG_DIR / "manifest.csv").is_file():
        pytest.skip(f"real ECG manifest not found at {ECG_DIR / 'manifest.csv'}")
    entry = {"kind": "manifest", "path": str(ECG_DIR / "manifest.csv"), **options}
    return load_settings(agent_config(tmp_path, [entry]))


def test_the_summary_on_the_real_manifest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = real_manifest_settings(tmp_path, label_column="dx")
    with caplog.at_level(logging.INFO, logger="site_agent"):
        site = open_data(settings)
    lines = summary(caplog, 0)
    # 136 of the 250 Challenge records carry one of the 20 FedCVD SNOMED codes (data README); the
    # other 771 rows have no `dx` (LUDB, PTB-XL, CODE-15%, SaMi-Trop).
    assert lines[1] == f"found 1021, loaded 136 (train {len(site.train)}, test {len(site.test)}), skipped 885"
    assert lines[2] == "skipped by reason: no_label 885"
    assert lines[4].startswith("labels: STACH=37 SBRAD=44 ")
