import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import site_agent.data.cache as cache_module
from site_agent.data import ChallengeSource, open_site_data

from .records import make_record

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def source(tmp_path) -> ChallengeSource:
    for i in range(6):
        make_record(tmp_path / "src", f"r{i}", seed=i, n_samples=1000)
    return ChallengeSource(path=tmp_path / "src", test_fraction=0.0)


def cache_folders(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir() if p.is_dir())


def test_second_open_reuses_the_cache_without_scanning(source, tmp_path, monkeypatch) -> None:
    first = open_site_data(source, tmp_path / "cache", signal_len=1000)
    monkeypatch.setattr(cache_module, "scan_source", lambda *a: pytest.fail("the cache was rebuilt"))
    again = open_site_data(source, tmp_path / "cache", signal_len=1000)
    assert again.cache_path == first.cache_path
    np.testing.assert_array_equal(again.train.signals, first.train.signals)
    assert isinstance(again.train.signals, np.memmap)
    assert str(again.report) == str(first.report)


def test_cached_arrays_equal_the_wfdb_samples(source, tmp_path) -> None:
    site = open_site_data(source, tmp_path / "cache", signal_len=1000)
    digital = make_record(tmp_path / "other", "r3", seed=3, n_samples=1000)  # same samples as src/r3
    row = site.train.record_ids.index("src/r3")
    np.testing.assert_allclose(site.train.signals[row], digital / 1000.0, rtol=1e-6)


def test_changed_file_content_rebuilds(source, tmp_path) -> None:
    hour_ago = (os.stat(source.path).st_mtime_ns - 3600 * 10**9,) * 2
    for file in source.path.iterdir():
        os.utime(file, ns=hour_ago)  # old files: their digests are remembered by size, mtime and inode
    first = open_site_data(source, tmp_path / "cache", signal_len=1000)
    assert len(json.loads((tmp_path / "cache" / cache_module.DIGEST_MEMO).read_text())) == 12
    assert open_site_data(source, tmp_path / "cache", signal_len=1000).cache_path == first.cache_path
    header = source.path / "r0.hea"
    header.write_text(header.read_text().replace("164889003", "164884008"))  # AFIB -> PVC, same size
    second = open_site_data(source, tmp_path / "cache", signal_len=1000)
    assert second.cache_path != first.cache_path
    row = second.train.record_ids.index("src/r0")
    assert np.flatnonzero(second.train.labels[row]).tolist() == [8]


def test_added_record_and_changed_settings_rebuild(source, tmp_path) -> None:
    first = open_site_data(source, tmp_path / "cache", signal_len=1000)
    shorter = open_site_data(source, tmp_path / "cache", signal_len=800)
    assert shorter.cache_path != first.cache_path and shorter.train.signals.shape == (6, 12, 800)
    make_record(source.path, "r9", seed=9, n_samples=1000)
    more = open_site_data(source, tmp_path / "cache", signal_len=1000)
    assert more.cache_path != first.cache_path and len(more.train) == 7
    # The new version replaced the old cache of the same settings; other settings keep theirs.
    assert cache_folders(tmp_path / "cache") == sorted([more.cache_path, shorter.cache_path])
    assert first.train.signals.shape == (6, 12, 1000) and float(np.abs(first.train.signals).sum()) > 0  # still mapped


def test_cache_inside_the_source_folder_is_not_part_of_its_content(source) -> None:
    first = open_site_data(source, source.path / ".." / "src" / "cache", signal_len=1000)
    again = open_site_data(source, source.path / "cache", signal_len=1000)
    assert again.cache_path.resolve() == first.cache_path.resolve()


def test_debris_of_a_crashed_build_is_removed(source, tmp_path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    key = cache_module.cache_key([source], cache_module.PreprocessConfig(signal_len=1000), cache_dir)
    debris = cache_dir / f".{key}.dead.building"
    debris.mkdir()
    (debris / "train_signals.f32").write_bytes(b"half")
    site = open_site_data(source, cache_dir, signal_len=1000)
    assert not debris.exists() and len(site.train) == 6


def test_a_failed_build_leaves_no_cache(source, tmp_path, monkeypatch) -> None:
    def explode(*args):
        raise RuntimeError("disk full")
        yield

    monkeypatch.setattr(cache_module, "scan_source", explode)
    with pytest.raises(RuntimeError, match="disk full"):
        open_site_data(source, tmp_path / "cache", signal_len=1000)
    assert cache_folders(tmp_path / "cache") == []


def test_two_processes_building_at_once_share_one_complete_cache(source, tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        from site_agent.data import ChallengeSource, open_site_data
        site = open_site_data(ChallengeSource(path=Path({str(source.path)!r}), test_fraction=0.0),
                              Path({str(tmp_path / "cache")!r}), signal_len=1000)
        total = float(site.train.signals.sum())
        print(json.dumps({{"path": str(site.cache_path), "n": len(site.train), "sum": total}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for _ in range(2)
    ]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err.decode()
        results.append(json.loads(out))
    assert results[0] == results[1] and results[0]["n"] == 6
    assert [p.name for p in cache_folders(tmp_path / "cache")] == [Path(results[0]["path"]).name]
    assert not list((tmp_path / "cache").glob(".*.building"))
