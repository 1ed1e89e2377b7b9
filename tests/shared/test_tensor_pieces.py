import pytest
import torch

from shared.algorithms.aggregation import WeightedAverage
from shared.tensors.codec import MalformedPayload, dump, header_end, read_header, tensor_views
from shared.tensors.windows import payload_order, payload_windows, read_window, tensor_pieces, window_views


def _mixed() -> dict[str, torch.Tensor]:
    """Tensors of every kind a model state holds: odd sizes, several dtypes, a scalar, an empty one."""
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(37, 11, generator=generator),
        "b.bias": torch.randn(5, generator=generator).half(),
        "c.num_batches_tracked": torch.tensor(17),
        "d.bf": torch.randn(3, 7, generator=generator).bfloat16(),
        "e.double": torch.randn(13, generator=generator).double(),
        "f.empty": torch.zeros(0, 4),
        "g.mask": torch.tensor([True, False, True]),
    }


def _reader(data: bytes, reads: list[tuple[int, int]]):
    def read(offset: int, size: int) -> bytes:
        reads.append((offset, size))
        return data[offset : offset + size]

    return read


@pytest.mark.parametrize("max_bytes", [1, 8, 12, 100, 1000, 1 << 20])
def test_pieces_cover_every_tensor_exactly_once(max_bytes: int) -> None:
    tensors = _mixed()
    data = dump(tensors)
    header = read_header(data)
    rebuilt = {name: torch.empty(t.numel(), dtype=t.dtype) for name, t in tensors.items()}
    covered = {name: torch.zeros(t.numel(), dtype=torch.int64) for name, t in tensors.items()}
    reads: list[tuple[int, int]] = []
    for name, start, values in tensor_pieces(header, _reader(data, reads), max_bytes):
        assert values.dim() == 1 and values.dtype == tensors[name].dtype
        rebuilt[name][start : start + values.numel()] = values
        covered[name][start : start + values.numel()] += 1
    for name, tensor in tensors.items():
        assert torch.equal(rebuilt[name].view(tensor.shape), tensor), name
        assert bool((covered[name] == 1).all()), name
    # The data section is read once, front to back, in windows no larger than asked (one element at least).
    assert reads[0][0] == header.data_start and sum(size for _, size in reads) == len(data) - header.data_start
    assert all(offset + size == following for (offset, size), (following, _) in zip(reads, reads[1:], strict=False))
    assert max(size for _, size in reads) <= max(max_bytes, 8)


def test_small_tensors_share_a_read() -> None:
    tensors = {f"t{i:02d}": torch.full((4,), float(i)) for i in range(20)}  # 20 tensors of 16 bytes
    data = dump(tensors)
    reads: list[tuple[int, int]] = []
    assert len(list(tensor_pieces(read_header(data), _reader(data, reads), 1 << 20))) == 20
    assert len(reads) == 1


def test_a_short_read_is_a_malformed_payload() -> None:
    data = dump({"w": torch.ones(100)})
    header = read_header(data)
    with pytest.raises(MalformedPayload, match="truncated"):
        list(tensor_pieces(header, lambda offset, size: data[offset : offset + size - 4], 64))


def test_the_header_can_be_read_from_the_first_bytes_alone() -> None:
    data = dump(_mixed(), {"k": "v"})
    end = header_end(data[:8], len(data))
    assert read_header(data[:end], len(data)) == read_header(data)
    with pytest.raises(MalformedPayload, match="truncated"):
        read_header(data[:end], len(data) - 1)  # the offsets describe more bytes than the payload holds
    with pytest.raises(MalformedPayload, match="end before"):
        read_header(data[: end - 1], len(data))


def test_average_of_pieces_equals_average_of_whole_tensors() -> None:
    updates = [
        ({name: t + i if t.dtype != torch.bool else t for name, t in _mixed().items()}, w)
        for i, w in [(0, 0.2), (3, 0.5), (7, 0.3)]
    ]
    whole, pieced = WeightedAverage(), WeightedAverage()
    for tensors, weight in updates:
        whole.add(tensors, weight)
        data = dump(tensors)
        header = read_header(data)
        pieced.add_pieces(header.specs, tensor_pieces(header, _reader(data, []), 24), weight)
    expected, actual = whole.result(), pieced.result()
    assert expected.keys() == actual.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype and torch.equal(actual[name], expected[name]), name


def test_pieces_of_another_schema_are_refused_before_anything_is_added() -> None:
    average = WeightedAverage()
    average.add({"w": torch.ones(3)}, 1.0)
    data = dump({"w": torch.ones(4)})
    header = read_header(data)
    with pytest.raises(ValueError, match="expected"):
        average.add_pieces(header.specs, tensor_pieces(header, _reader(data, [])), 1.0)
    assert average.count == 1 and torch.equal(average.result()["w"], torch.ones(3))


def test_views_and_pieces_agree() -> None:
    data = dump(_mixed())
    views = tensor_views(data)
    for name, start, values in tensor_pieces(read_header(data), _reader(data, []), 10):
        assert torch.equal(views[name].reshape(-1)[start : start + values.numel()], values)


def test_runs_cut_windows_across_tensors_of_one_dtype_and_key() -> None:
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(6)} | {"u.count": torch.tensor(3)}
    header = read_header(dump(tensors))
    windows = payload_windows(header, 64, run_key=lambda name: name != "t3")
    # t0-t2 form a run, t3 a run of its own (another key), t4-t5 another; the int64 one its own.
    firsts = [name for window in windows for name, _, _, _ in window.pieces]
    assert set(firsts) == {"u.count", "t0", "t3", "t4"}
    assert all(window.stop - window.start <= 64 for window in windows)
    assert sum(spec.numel for window in windows for *_, spec in window.pieces) == 61


@pytest.mark.parametrize("max_bytes", [8, 24, 100, 1 << 20])
def test_an_average_of_run_pieces_equals_one_of_whole_tensors(max_bytes: int) -> None:
    updates = [
        ({name: t + i if t.dtype != torch.bool else t for name, t in _mixed().items()}, w)
        for i, w in [(0, 0.2), (3, 0.5), (7, 0.3)]
    ]
    whole, runs = WeightedAverage(), WeightedAverage()
    for tensors, weight in updates:
        whole.add(tensors, weight)
        data = dump(tensors)
        header = read_header(data)
        with runs.adding(header.specs, [weight], payload_order(header)) as accumulate:
            assert runs.lays_out_like(payload_order(header))
            for window in payload_windows(header, max_bytes, run_key=runs.run_key):
                accumulate(window_views(window, [read_window(header, window, _reader(data, []))]))
    expected, actual = whole.result(), runs.result()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype and torch.equal(actual[name], expected[name]), name
