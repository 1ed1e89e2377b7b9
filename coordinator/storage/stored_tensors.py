"""A stored safetensors blob read as tensors: its header, and each tensor read on its own when asked for."""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from coordinator.storage.blobs import BlobReader
from shared.tensors.codec import Header, TensorSpec, header_end, read_header, tensor_view
from shared.tensors.windowed import WindowedTensors

__all__ = ["StoredTensors", "blob_header"]


def blob_header(blob: BlobReader) -> Header:
    """The parsed safetensors header of an open blob, read without the data that follows it."""
    return read_header(blob.read(0, header_end(blob.read(0, 8), blob.size)), blob.size)


class StoredTensors(WindowedTensors):
    """An open blob's tensors by name, each copied out of the blob when looked up, or a window of one.

    Valid while the blob is open; a tensor looked up stays valid after (it owns its bytes).
    """

    def __init__(self, blob: BlobReader) -> None:
        self._blob, self._header = blob, blob_header(blob)

    def __getitem__(self, name: str) -> Tensor:
        spec = self._header.specs[name]
        return self.window(name, 0, spec.numel).view(spec.shape)

    def window(self, name: str, start: int, stop: int) -> Tensor:
        """Flat elements [start, stop) of tensor `name` (fewer at its end), copied out of the blob."""
        spec = self._header.specs[name]
        start, stop = min(max(start, 0), spec.numel), min(max(stop, start), spec.numel)
        begin, _ = self._header.offsets[name]
        itemsize = spec.dtype.itemsize
        data = bytearray(self._blob.read(self._header.data_start + begin + start * itemsize, (stop - start) * itemsize))
        return tensor_view(data, 0, TensorSpec((stop - start,), spec.dtype))

    def __iter__(self) -> Iterator[str]:
        return iter(self._header.specs)

    def __len__(self) -> int:
        return len(self._header.specs)
