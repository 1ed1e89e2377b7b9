import numpy as np
import pytest
import torch

from site_agent.data.loader import RowView, SplitArrays, carve_validation, iterate_batches
from site_agent.data.split import validation_rows

IDS = tuple(f"src/r{i:03d}" for i in range(200))


@pytest.fixture()
def split(tmp_path) -> SplitArrays:
    n, length = 40, 8
    signals = np.memmap(tmp_path / "s.f32", np.float32, "w+", shape=(n, 12, length))
    signals[:] = np.arange(n, dtype=np.float32)[:, None, None]  # row i is filled with i
    signals.flush()
    labels = np.zeros((n, 20), np.float32)
    labels[np.arange(n), np.arange(n) % 20] = 1.0
    readonly = np.memmap(tmp_path / "s.f32", np.float32, "r", shape=(n, 12, length))
    return SplitArrays(readonly, labels, tuple(f"r{i}" for i in range(n)))


def test_validation_rows_are_the_same_for_a_seed_and_differ_between_seeds() -> None:
    first = validation_rows(IDS, seed=7, fraction=0.1)
    assert np.array_equal(first, validation_rows(IDS, seed=7, fraction=0.1))
    assert not np.array_equal(first, validation_rows(IDS, seed=8, fraction=0.1))
    assert list(first) == sorted(set(first.tolist()))  # ascending, no repeats


def test_validation_rows_follow_the_records_not_their_order() -> None:
    chosen = {IDS[row] for row in validation_rows(IDS, seed=3, fraction=0.2)}
    shuffled = tuple(np.random.default_rng(0).permutation(IDS))
    assert {shuffled[row] for row in validation_rows(shuffled, seed=3, fraction=0.2)} == chosen


@pytest.mark.parametrize(
    ("n", "fraction", "size"),
    [(200, 0.1, 20), (200, 0.25, 50), (40, 0.5, 20), (10, 0.01, 1), (2, 0.99, 1), (7, 0.3, 2)],
)
def test_the_validation_size_follows_the_share(n: int, fraction: float, size: int) -> None:
    assert len(validation_rows(IDS[:n], seed=1, fraction=fraction)) == size


@pytest.mark.parametrize(("n", "fraction"), [(1, 0.5), (0, 0.5), (10, 0.0), (10, 1.0)])
def test_an_impossible_carve_is_refused(n: int, fraction: float) -> None:
    with pytest.raises(ValueError):
        validation_rows(IDS[:n], seed=1, fraction=fraction)


def test_the_carve_splits_the_training_records_into_two_disjoint_parts(split: SplitArrays) -> None:
    train, validation = carve_validation(split, seed=11, fraction=0.25)
    assert len(validation) == 10 and len(train) == 30
    assert set(train.record_ids).isdisjoint(validation.record_ids)
    assert set(train.record_ids) | set(validation.record_ids) == set(split.record_ids)
    for part in (train, validation):  # signals, labels and ids stay paired, read from the same memory map
        assert isinstance(part.signals, RowView) and isinstance(part.signals.source, np.memmap)
        rows = [int(record.removeprefix("r")) for record in part.record_ids]
        assert part.signals.shape == (len(rows), 12, 8)
        np.testing.assert_array_equal(np.asarray(part.signals)[:, 0, 0], rows)
        np.testing.assert_array_equal(part.labels, split.labels[rows])


def test_batches_and_slices_of_a_carve_read_its_own_rows(split: SplitArrays) -> None:
    train, _ = carve_validation(split, seed=11, fraction=0.25)
    rows = [int(record.removeprefix("r")) for record in train.record_ids]
    read = [
        int(v)
        for x, _ in iterate_batches(train, 7, shuffle=True, generator=torch.Generator().manual_seed(0))
        for v in x[:, 0, 0]
    ]
    assert sorted(read) == rows
    middle = train.signals[5:9]  # a slice stays a view (FedALA's contiguous slice)
    assert isinstance(middle, RowView)
    np.testing.assert_array_equal(np.asarray(middle)[:, 0, 0], rows[5:9])
    np.testing.assert_array_equal(train.signals[2, 0], np.full(8, rows[2], np.float32))
    again, _ = carve_validation(train, seed=11, fraction=0.5)  # a carve of a carve reads the same file
    assert again.signals.source is split.signals  # type: ignore[union-attr]
    np.testing.assert_array_equal(np.asarray(again.signals)[:, 0, 0], [int(r[1:]) for r in again.record_ids])
