"""Name-keyed tensors as safetensors bytes: dump, load, schema checks. Tensors never travel as pickle.

Checking happens in two steps so that a coordinator refuses bad uploads cheaply: the header
(names, shapes, dtypes, byte offsets) is parsed and checked against the schema before any tensor
is decoded; then the decoded values are checked for NaN and Inf.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import threading
import warnings
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from shared.errors import FormatError
from shared.tensors.payload_errors import (
    DTypeMismatch,
    MalformedPayload,
    MissingTensors,
    NonFiniteValues,
    PayloadError,
    PrivateTensorsInPayload,
    ShapeMismatch,
    UnexpectedTensors,
)

__all__ = [
    "DTypeMismatch",
    "Header",
    "MalformedPayload",
    "MissingTensors",
    "NonFiniteValues",
    "PayloadError",
    "PrivateTensorsInPayload",
    "ShapeMismatch",
    "TensorDict",
    "TensorSpec",
    "UnexpectedTensors",
    "content_digest",
    "dump",
    "dump_into",
    "dump_pieces",
    "dump_taking",
    "header_end",
    "load",
    "read_header",
    "schema_of",
    "tensor_view",
    "tensor_views",
    "validate",
]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one named tensor: one row of a shared schema."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        """The spec of an existing tensor."""
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies."""
        return self.numel * self.dtype.itemsize


TensorDict = dict[str, Tensor]
Buffer = bytes | bytearray | memoryview

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


# ---------------------------------------------------------------------------------------------


def dump(tensors: Mapping[str, Tensor], meta: Mapping[str, str] | None = None) -> bytes:
    """Serialize CPU, contiguous copies of `tensors` with string metadata as safetensors bytes.

    Equal inputs always give equal bytes: the header is JSON with sorted keys, and the data are laid
    out larger elements first, then by name, so each tensor is aligned to its element size (for a
    model state this is safetensors' own layout). Each tensor's bytes are copied once, into the result.
    """
    return b"".join(dump_pieces(tensors, meta))


def dump_pieces(tensors: Mapping[str, Tensor], meta: Mapping[str, str] | None = None) -> list[memoryview]:
    """The bytes `dump` gives, as pieces in order (the header, then each tensor's bytes) that copy no tensor.

    A contiguous CPU tensor is viewed, not copied, so a model of a gigabyte is stored a piece at a
    time (coordinator/storage/blob_parts.py) without a second whole copy; valid while the tensors are.
    """
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    prefix, order = _prefix({name: TensorSpec.of(t) for name, t in cpu.items()}, meta)
    data = [cpu[name].reshape(-1).view(torch.uint8).numpy().data for name in order]  # .data: memoryview(array)
    return [memoryview(prefix), *data]


def dump_taking(tensors: MutableMapping[str, Tensor], meta: Mapping[str, str] | None = None) -> memoryview:
    """The bytes `dump` gives, in one buffer, each tensor taken out of `tensors` once it is copied in.

    For a global model just computed: one contiguous body that the database stores a part at a time
    and downloads are served from, without a second whole copy. The body's pages are the system's
    fresh, untouched ones, taken only as each tensor is copied in, and a tensor that nothing else
    holds is freed right after: the model is never in memory twice. `tensors` is left empty.
    """
    specs = {name: TensorSpec.of(t) for name, t in tensors.items()}
    prefix, order = _prefix(specs, meta)
    body = mmap.mmap(-1, _body_size(prefix, order, specs))  # anonymous: no page is resident until written
    for name, view in _fill_views(body, prefix, order, specs).items():
        view.copy_(tensors.pop(name).detach())
    return memoryview(body)


def dump_into(
    specs: Mapping[str, TensorSpec], meta: Mapping[str, str] | None = None
) -> tuple[bytearray, dict[str, Tensor]]:
    """A safetensors body for tensors of `specs`, allocated once, and each tensor as a writable view into it.

    Writing the views fills the body with exactly the bytes `dump` gives for those tensors, without
    building the tensors first and copying them in: for an upload of hundreds of MB that is one
    allocation instead of three.
    """
    prefix, order = _prefix(specs, meta)
    body = bytearray(_body_size(prefix, order, specs))
    return body, _fill_views(body, prefix, order, specs)


def _body_size(prefix: bytes, order: list[str], specs: Mapping[str, TensorSpec]) -> int:
    return len(prefix) + sum(specs[name].numel * _element_size(specs[name].dtype) for name in order)


def _fill_views(
    body: bytearray | mmap.mmap, prefix: bytes, order: list[str], specs: Mapping[str, TensorSpec]
) -> dict[str, Tensor]:
    """Write `prefix` at the start of `body`; each tensor of `specs` as a writable view of its bytes after it."""
    body[: len(prefix)] = prefix
    views: dict[str, Tensor] = {}
    offset = len(prefix)
    for name in order:
        spec = specs[name]
        size = spec.numel * _element_size(spec.dtype)
        raw = (
            torch.frombuffer(body, dtype=torch.uint8, count=size, offset=offset)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        views[name] = raw.view(spec.dtype).reshape(spec.shape)
        offset += size
    return views


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _prefix(specs: Mapping[str, TensorSpec], meta: Mapping[str, str] | None) -> tuple[bytes, list[str]]:
    """The 8-byte length and canonical header of a payload of `specs`, and the order the data follow."""
    unsupported = sorted(name for name, spec in specs.items() if spec.dtype not in DTYPE_NAMES)
    if unsupported:
        raise FormatError(f"cannot serialize the dtype of {', '.join(unsupported)}")
    order = sorted(specs, key=lambda name: (-_element_size(specs[name].dtype), name))
    header: dict[str, object] = {"__metadata__": dict(meta)} if meta else {}
    offset = 0
    for name in order:
        size = specs[name].numel * _element_size(specs[name].dtype)
        header[name] = {
            "dtype": DTYPE_NAMES[specs[name].dtype],
            "shape": list(specs[name].shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    canonical += b" " * (-len(canonical) % 8)  # keep the data section 8-byte aligned
    return struct.pack("<Q", len(canonical)) + canonical, order


@dataclass(frozen=True)
class Header:
    """The parsed safetensors header: each tensor's spec and byte range, and the string metadata."""

    specs: dict[str, TensorSpec]
    offsets: dict[str, tuple[int, int]]  # byte range of each tensor within the data section
    metadata: dict[str, str]
    data_start: int  # where the data section begins in the payload


def header_end(prefix: bytes | bytearray | memoryview, total_size: int | None = None) -> int:
    """Where the header of a payload ends (its data section starts), from the payload's first 8 bytes."""
    view = memoryview(prefix)
    size = len(view) if total_size is None else total_size
    if len(view) < 8 or size < 8:
        raise MalformedPayload(f"payload of {size} bytes is too short for a safetensors header")
    header_len: int
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise MalformedPayload(f"header length {header_len} exceeds the {size}-byte payload (truncated?)")
    return 8 + header_len


def read_header(data: bytes | bytearray | memoryview, total_size: int | None = None) -> Header:
    """Parse and check the header of a safetensors payload without decoding any tensor.

    `data` is the payload, or only its first `header_end` bytes when `total_size` gives the whole
    payload's length (a payload read a range at a time, e.g. from storage).
    """
    view = memoryview(data)
    size = len(view) if total_size is None else total_size
    end = header_end(view, size)
    if end > len(view):
        raise MalformedPayload(f"the {len(view)} bytes given end before the {end}-byte header")
    header_len = end - 8
    try:
        raw = json.loads(bytes(view[8 : 8 + header_len]))
    except (ValueError, RecursionError) as exc:  # not JSON, bad UTF-8, nested too deep, a number too long
        raise MalformedPayload(f"header is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(raw, dict):
        raise MalformedPayload("header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise MalformedPayload("header metadata must map strings to strings")
    specs: dict[str, TensorSpec] = {}
    offsets: dict[str, tuple[int, int]] = {}
    for name, entry in raw.items():
        specs[name], offsets[name] = _parse_entry(name, entry)
    data_len = size - end
    _check_offsets(offsets, specs, data_len)
    return Header(specs, offsets, metadata, data_start=8 + header_len)


def _parse_entry(name: str, entry: object) -> tuple[TensorSpec, tuple[int, int]]:
    if not isinstance(entry, dict):
        raise MalformedPayload(f"header entry for {name!r} is not an object")
    raw_dtype, shape, span = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    dtype = DTYPES_BY_NAME.get(raw_dtype) if isinstance(raw_dtype, str) else None
    if dtype is None:
        raise MalformedPayload(f"tensor {name!r} has unsupported dtype {_shown(raw_dtype)}")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise MalformedPayload(f"tensor {name!r} has an invalid shape {_shown(shape)}")
    if not (isinstance(span, list) and len(span) == 2 and all(type(o) is int and o >= 0 for o in span)):
        raise MalformedPayload(f"tensor {name!r} has invalid data_offsets {_shown(span)}")
    return TensorSpec(tuple(shape), dtype), (span[0], span[1])


def _shown(value: object) -> str:
    """`value` for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_offsets(offsets: dict[str, tuple[int, int]], specs: dict[str, TensorSpec], data_len: int) -> None:
    position = 0
    for name, (begin, end) in sorted(offsets.items(), key=lambda item: item[1]):
        if begin != position or end < begin:
            raise MalformedPayload(f"tensor {name!r} byte range [{begin}, {end}) is not contiguous")
        if end - begin != specs[name].nbytes:
            raise MalformedPayload(
                f"tensor {name!r} holds {end - begin} bytes, its shape and dtype need {specs[name].nbytes}"
            )
        position = end
    if position != data_len:
        raise MalformedPayload(f"data section has {data_len} bytes, the header describes {position} (truncated?)")


def _decode(data: bytes | bytearray, header: Header) -> TensorDict:
    """The tensors of a checked payload: views of a bytearray the caller hands over (no copy), else copies."""
    if isinstance(data, bytearray):  # writable and the caller's to give: each tensor views its own bytes
        return tensor_views(data, header)
    try:
        return safetensors.torch.load(bytes(data))
    except safetensors.SafetensorError as exc:
        raise MalformedPayload(f"cannot decode tensors: {exc}") from None


def tensor_views(data: bytes | bytearray | memoryview, header: Header | None = None) -> TensorDict:
    """Decode without copying: each tensor views its own byte range of `data`; never write to them.

    The tensors keep `data` alive. Reading a stored payload this way costs no pass over its bytes
    beyond the one the caller makes (e.g. accumulating into an average).
    """
    header = header if header is not None else read_header(data)
    return {
        name: tensor_view(data, header.data_start + begin, header.specs[name])
        for name, (begin, _) in header.offsets.items()
    }


_readonly_warning_lock = threading.Lock()
_readonly_warning_silenced = False


def tensor_view(data: bytes | bytearray | memoryview, offset: int, spec: TensorSpec) -> Tensor:
    """The tensor of `spec` over `data` from byte `offset`, without a copy; never write to it."""
    global _readonly_warning_silenced
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    if _readonly_warning_silenced or not memoryview(data).readonly:
        return torch.frombuffer(data, dtype=spec.dtype, count=spec.numel, offset=offset).view(spec.shape)
    # PyTorch warns once per process that a tensor over read-only bytes could be written to;
    # these views are only ever read, so that one warning is silenced.
    with _readonly_warning_lock, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        tensor = torch.frombuffer(data, dtype=spec.dtype, count=spec.numel, offset=offset).view(spec.shape)
        _readonly_warning_silenced = True
    return tensor


def load(data: bytes | bytearray) -> tuple[TensorDict, dict[str, str]]:
    """Decode safetensors bytes into (tensors, metadata); malformed bytes raise MalformedPayload.

    A bytearray is decoded without a copy: the tensors view it, so it must not change afterwards.
    """
    header = read_header(data)
    return _decode(data, header), header.metadata


def content_digest(tensors: Mapping[str, Tensor]) -> str:
    """sha256 of the tensors alone (names, dtypes, shapes, values, by name): alike whatever metadata wraps them."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def schema_of(tensors: Mapping[str, Tensor]) -> dict[str, TensorSpec]:
    """Name -> (shape, dtype) of `tensors`."""
    return {name: TensorSpec.of(t) for name, t in tensors.items()}


def check_header(header: Header, schema: Mapping[str, TensorSpec], private_names: Iterable[str] = ()) -> None:
    """Raise the first PayloadError by which the header's tensors differ from `schema`."""
    names = header.specs.keys()
    unexpected = names - schema.keys()
    private = unexpected & set(private_names)
    if private:
        raise PrivateTensorsInPayload(
            f"payload holds {len(private)} private tensor(s) that must never leave a site: "
            + ", ".join(sorted(private)),
            private,
        )
    if unexpected:
        raise UnexpectedTensors(f"payload holds names outside the schema: {', '.join(sorted(unexpected))}", unexpected)
    missing = schema.keys() - names
    if missing:
        raise MissingTensors(f"payload lacks {len(missing)} tensor(s): {', '.join(sorted(missing))}", missing)
    wrong_shape = [n for n in schema if header.specs[n].shape != schema[n].shape]
    if wrong_shape:
        first = wrong_shape[0]
        raise ShapeMismatch(
            f"tensor {first!r} has shape {list(header.specs[first].shape)}, expected {list(schema[first].shape)}"
            + (f" (and {len(wrong_shape) - 1} more)" if len(wrong_shape) > 1 else ""),
            wrong_shape,
        )
    wrong_dtype = [n for n in schema if header.specs[n].dtype != schema[n].dtype]
    if wrong_dtype:
        first = wrong_dtype[0]
        raise DTypeMismatch(
            f"tensor {first!r} has dtype {header.specs[first].dtype}, expected {schema[first].dtype}"
            + (f" (and {len(wrong_dtype) - 1} more)" if len(wrong_dtype) > 1 else ""),
            wrong_dtype,
        )


def check_finite(tensors: Mapping[str, Tensor]) -> None:
    """Raise NonFiniteValues when a floating tensor holds NaN or Inf."""
    bad = [n for n, t in tensors.items() if t.is_floating_point() and t.numel() and not _finite(t)]
    if bad:
        raise NonFiniteValues(f"NaN or Inf in {len(bad)} tensor(s): {', '.join(sorted(bad))}", bad)


def _finite(tensor: Tensor) -> bool:
    # min and max propagate NaN and are infinite when any value is: one pass, and no temporary as
    # large as the tensor (torch.isfinite(t).all() allocates one, many times slower on a model).
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def validate(
    data: bytes | bytearray, schema: Mapping[str, TensorSpec], *, private_names: Iterable[str] = ()
) -> tuple[TensorDict, dict[str, str]]:
    """Decode `data` if it matches `schema` exactly and is finite; else raise the precise PayloadError."""
    header = read_header(data)
    check_header(header, schema, private_names)
    tensors = _decode(data, header)
    check_finite(tensors)
    return tensors, header.metadata
