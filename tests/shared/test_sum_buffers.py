import gc

import torch

from shared.algorithms.aggregation import WeightedAverage
from shared.tensors.sum_buffers import SumBuffers


class _Owner:
    """Something whose lifetime bounds a buffer's."""


def test_a_buffer_comes_back_once_its_owner_is_garbage_and_is_handed_out_again() -> None:
    buffers = SumBuffers(keep=2, min_bytes=1024)
    owner = _Owner()
    first = buffers.take(owner, 1000, torch.float32)
    address = first.data_ptr()
    assert buffers.held_bytes() == 0
    del first, owner
    gc.collect()
    assert buffers.held_bytes() == 4000
    keeper = _Owner()
    again = buffers.take(keeper, 1000, torch.float32)
    assert again.data_ptr() == address and buffers.held_bytes() == 0
    other = buffers.take(keeper, 1000, torch.float64)  # another dtype is never mixed up
    assert other.dtype == torch.float64 and other.data_ptr() != address


def test_small_buffers_are_not_kept_and_at_most_keep_are() -> None:
    buffers = SumBuffers(keep=2, min_bytes=1024)
    owners = [_Owner() for _ in range(4)]
    taken = [buffers.take(owner, 1000, torch.float32) for owner in owners]
    small = buffers.take(owners[0], 10, torch.float32)
    del taken, small, owners
    gc.collect()
    assert buffers.held_bytes() == 2 * 4000


def test_averages_reuse_the_buffers_of_earlier_ones_and_results_stay_their_own() -> None:
    update = {"w": torch.arange(300_000, dtype=torch.float32)}
    average = WeightedAverage()
    average.add(update, 1.0)
    first = average.result()
    address = average._sums["w"].data_ptr()
    del average
    gc.collect()
    second = WeightedAverage()
    second.add({"w": torch.zeros(300_000)}, 1.0)
    assert second._sums["w"].data_ptr() == address  # the most recently returned buffer is taken first
    assert torch.equal(first["w"], update["w"])  # the first result was a copy, not the reused buffer
    assert torch.equal(second.result()["w"], torch.zeros(300_000))
