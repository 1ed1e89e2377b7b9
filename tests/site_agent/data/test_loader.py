import numpy as np
import pytest
import torch

from site_agent.data import SplitArrays, iterate_batches


@pytest.fixture()
def split(tmp_path) -> SplitArrays:
    n, length = 23, 50
    signals = np.memmap(tmp_path / "s.f32", np.float32, "w+", shape=(n, 12, length))
    signals[:] = np.arange(n, dtype=np.float32)[:, None, None]  # row i is filled with i
    signals.flush()
    labels = np.zeros((n, 20), np.float32)
    labels[np.arange(n), np.arange(n) % 20] = 1.0
    readonly = np.memmap(tmp_path / "s.f32", np.float32, "r", shape=(n, 12, length))
    return SplitArrays(readonly, labels, tuple(f"r{i}" for i in range(n)))


def rows_of(batches) -> list[int]:
    rows = []
    for signals, labels in batches:
        ids = signals[:, 0, 0].long()
        assert torch.equal(labels.argmax(dim=1), ids % 20)  # signals and labels stay paired
        rows += ids.tolist()
    return rows


def test_in_order_batches_cover_every_row_once(split) -> None:
    batches = list(iterate_batches(split, 5, shuffle=False))
    assert [len(x) for x, _ in batches] == [5, 5, 5, 5, 3]
    x, y = batches[0]
    assert x.dtype == torch.float32 and x.shape == (5, 12, 50) and y.shape == (5, 20) and y.dtype == torch.float32
    assert rows_of(batches) == list(range(23))


def test_shuffled_batches_are_a_seeded_permutation(split) -> None:
    first = rows_of(iterate_batches(split, 4, shuffle=True, generator=torch.Generator().manual_seed(1)))
    again = rows_of(iterate_batches(split, 4, shuffle=True, generator=torch.Generator().manual_seed(1)))
    other = rows_of(iterate_batches(split, 4, shuffle=True, generator=torch.Generator().manual_seed(2)))
    assert sorted(first) == list(range(23)) and first == again and first != other


def test_drop_last_and_limit_samples(split) -> None:
    assert [len(x) for x, _ in iterate_batches(split, 5, shuffle=True, drop_last=True)] == [5, 5, 5, 5]
    limited = list(iterate_batches(split, 4, shuffle=False, limit_samples=10))
    assert [len(x) for x, _ in limited] == [4, 4, 2] and rows_of(limited) == list(range(10))
    assert list(iterate_batches(split, 4, shuffle=False, limit_samples=0)) == []


def test_empty_split_yields_nothing_and_bad_batch_size_is_refused(split) -> None:
    empty = SplitArrays(np.zeros((0, 12, 50), np.float32), np.zeros((0, 20), np.float32), ())
    assert len(empty) == 0 and list(iterate_batches(empty, 8, shuffle=True)) == []
    with pytest.raises(ValueError, match="batch_size"):
        next(iterate_batches(split, 0, shuffle=False))


def test_label_counts(split) -> None:
    counts = split.label_counts()
    assert counts.dtype == np.int64 and counts.sum() == 23 and counts[0] == 2
