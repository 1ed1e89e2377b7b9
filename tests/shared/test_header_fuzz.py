"""Hostile safetensors headers: whatever the bytes, the parser answers with a PayloadError, never another error."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.tensors.codec import MalformedPayload, PayloadError, TensorSpec, dump, load, read_header, validate

SETTINGS = settings(
    max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
SCHEMA = {"w": TensorSpec((2, 3), torch.float32)}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": json_values | st.sampled_from(["F32", "F16", "I64", "BOOL", "f32", "U8"]),
        "shape": json_values | st.lists(st.integers(min_value=-3, max_value=2**40), max_size=3),
        "data_offsets": json_values | st.lists(st.integers(min_value=-10, max_value=2**40), max_size=3),
    },
)


def payload(header: object, data: bytes = b"") -> bytes:
    """A payload whose header is `header` as JSON, padded as safetensors pads it."""
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data


def parses_or_refuses(data: bytes) -> None:
    """Every entry point the coordinator and the agent use either succeeds or raises a PayloadError."""
    for parse in (read_header, load, lambda body: validate(body, SCHEMA)):
        try:
            parse(data)
        except PayloadError:
            pass


@SETTINGS
@given(st.binary(max_size=256))
def test_arbitrary_bytes(data: bytes) -> None:
    parses_or_refuses(data)


@SETTINGS
@given(json_values, st.binary(max_size=64))
def test_arbitrary_json_as_the_header(header: object, data: bytes) -> None:
    parses_or_refuses(payload(header, data))


@SETTINGS
@given(st.dictionaries(st.text(max_size=6), entries, max_size=3), st.binary(max_size=64))
def test_arbitrary_tensor_entries(header: dict, data: bytes) -> None:
    parses_or_refuses(payload(header, data))


@SETTINGS
@given(st.binary(min_size=1, max_size=8), st.integers(min_value=0, max_value=200))
def test_a_valid_payload_with_bytes_changed(noise: bytes, position: int) -> None:
    body = bytearray(dump({"w": torch.ones(2, 3)}, {"k": "v"}))
    position %= len(body)
    body[position : position + len(noise)] = noise
    parses_or_refuses(bytes(body))


@pytest.mark.parametrize(
    "header",
    [
        "[" * 100_000 + "]" * 100_000,  # deeper than the JSON parser recurses: RecursionError
        '{"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}',  # unhashable dtype: TypeError
        '{"w": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}',  # a bool is no dimension
        '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}',
        '{"n": ' + "9" * 5000 + "}",  # longer than Python converts to int: ValueError
    ],
)
def test_headers_that_broke_the_parser_are_malformed(header: str) -> None:
    encoded = header.encode() + b" " * (-len(header) % 8)
    data = struct.pack("<Q", len(encoded)) + encoded + b"\0" * 4
    with pytest.raises(MalformedPayload):
        read_header(data)
    parses_or_refuses(data)
