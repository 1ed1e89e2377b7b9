import ctypes
import struct

import pytest
import torch

from shared.model.network import build_model, preset
from shared.model.partition import model_partition
from shared.tensors.codec import (
    DTypeMismatch,
    MalformedPayload,
    MissingTensors,
    NonFiniteValues,
    PrivateTensorsInPayload,
    ShapeMismatch,
    TensorSpec,
    UnexpectedTensors,
    dump,
    dump_into,
    load,
    read_header,
    schema_of,
    tensor_views,
    validate,
)


@pytest.fixture()
def shared_and_local() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    config = preset("tiny", "6:2")
    return model_partition(config).split(build_model(config, seed=3).state_dict())


def test_round_trip_is_bit_exact_with_metadata(shared_and_local) -> None:
    shared, _ = shared_and_local
    data = dump(shared, {"study": "s1", "round": "3"})
    tensors, meta = load(data)
    assert meta == {"study": "s1", "round": "3"}
    assert tensors.keys() == shared.keys()
    for name, tensor in shared.items():
        assert tensors[name].dtype == tensor.dtype
        assert torch.equal(tensors[name], tensor)
    assert dump(tensors, meta) == data  # deterministic bytes


def test_round_trip_keeps_int64_buffers_and_bfloat16() -> None:
    tensors = {"a": torch.tensor([2**40, -1]), "b": torch.randn(3, dtype=torch.bfloat16)}
    loaded, _ = load(dump(tensors))
    assert torch.equal(loaded["a"], tensors["a"]) and torch.equal(loaded["b"], tensors["b"])


def test_validate_accepts_exact_schema(shared_and_local) -> None:
    shared, local = shared_and_local
    tensors, _ = validate(dump(shared), schema_of(shared), private_names=local)
    assert tensors.keys() == shared.keys()


def test_validate_names_private_tensors(shared_and_local) -> None:
    shared, local = shared_and_local
    leaked = {**shared, **local}
    with pytest.raises(PrivateTensorsInPayload) as info:
        validate(dump(leaked), schema_of(shared), private_names=local)
    assert info.value.code == "private_tensors_in_payload"
    assert info.value.names == sorted(local)
    assert "blocks.0.local_branch.in_proj.weight" in str(info.value)


def test_validate_unexpected_names(shared_and_local) -> None:
    shared, local = shared_and_local
    with pytest.raises(UnexpectedTensors) as info:
        validate(dump({**shared, "surprise": torch.zeros(2)}), schema_of(shared), private_names=local)
    assert type(info.value) is UnexpectedTensors and info.value.names == ["surprise"]


def test_validate_missing_names(shared_and_local) -> None:
    shared, _ = shared_and_local
    partial = dict(shared)
    partial.pop("head.bias")
    with pytest.raises(MissingTensors) as info:
        validate(dump(partial), schema_of(shared))
    assert info.value.names == ["head.bias"] and info.value.code == "missing_tensors"


def test_validate_shape_mismatch(shared_and_local) -> None:
    shared, _ = shared_and_local
    bad = {**shared, "head.bias": torch.zeros(21)}
    with pytest.raises(ShapeMismatch, match=r"'head.bias' has shape \[21\], expected \[20\]"):
        validate(dump(bad), schema_of(shared))


def test_validate_dtype_mismatch(shared_and_local) -> None:
    shared, _ = shared_and_local
    bad = {**shared, "head.bias": shared["head.bias"].double()}
    with pytest.raises(DTypeMismatch, match="torch.float64"):
        validate(dump(bad), schema_of(shared))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_validate_non_finite(shared_and_local, value: float) -> None:
    shared, _ = shared_and_local
    bad = dict(shared)
    bad["head.weight"] = bad["head.weight"].clone()
    bad["head.weight"][0, 0] = value
    with pytest.raises(NonFiniteValues) as info:
        validate(dump(bad), schema_of(shared))
    assert info.value.names == ["head.weight"]


def test_validate_truncated_bytes(shared_and_local) -> None:
    shared, _ = shared_and_local
    data = dump(shared)
    for cut in (0, 5, 8, 40, len(data) - 1):
        with pytest.raises(MalformedPayload):
            validate(data[:cut], schema_of(shared))


def test_validate_malformed_header() -> None:
    garbage_json = struct.pack("<Q", 5) + b"{nope"
    with pytest.raises(MalformedPayload, match="JSON"):
        read_header(garbage_json)
    not_object = struct.pack("<Q", 2) + b"[]"
    with pytest.raises(MalformedPayload, match="object"):
        read_header(not_object)
    huge = struct.pack("<Q", 2**40) + b"{}"
    with pytest.raises(MalformedPayload, match="truncated"):
        read_header(huge)


def test_validate_overlapping_offsets_are_refused() -> None:
    import json

    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + b"\0" * 12
    with pytest.raises(MalformedPayload, match="contiguous"):
        read_header(data)


def test_pickle_bytes_are_malformed() -> None:
    import pickle

    with pytest.raises(MalformedPayload):
        load(pickle.dumps({"a": [1.0, 2.0]}))


def test_dump_is_deterministic_across_processes() -> None:
    import subprocess
    import sys

    code = (
        "import sys, hashlib, torch; from shared.tensors.codec import dump; "
        "d = dump({'w': torch.arange(6.0), 'b': torch.ones(2)}, {f'k{i}': str(i) for i in range(8)}); "
        "sys.stdout.write(hashlib.sha256(d).hexdigest())"
    )
    digests = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(3)
    }
    assert len(digests) == 1


def test_tensor_views_share_the_payload_bytes(shared_and_local) -> None:
    shared, _ = shared_and_local
    data = dump(shared)
    views = tensor_views(data)
    assert views.keys() == shared.keys()
    assert all(
        torch.equal(views[name], tensor) and views[name].dtype == tensor.dtype for name, tensor in shared.items()
    )
    writable = bytearray(data)
    name = "head.bias"
    begin, _ = read_header(writable).offsets[name]
    view = tensor_views(writable)[name]
    writable[read_header(writable).data_start + begin : read_header(writable).data_start + begin + 4] = struct.pack(
        "<f", 7.5
    )
    assert float(view[0]) == 7.5  # no copy: the view sees the buffer change


def test_a_bytearray_payload_is_decoded_without_a_copy_and_bytes_with_one() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
    payload = dump(tensors)
    owned = bytearray(payload)
    viewed, _ = load(owned)
    start = ctypes.addressof(ctypes.c_char.from_buffer(owned))
    for name, tensor in viewed.items():
        assert torch.equal(tensor, tensors[name])
        assert start <= tensor.data_ptr() < start + len(owned)  # it lies in the buffer handed over
    viewed["a"][0, 0] = 42.0  # writable, and its own bytes only
    assert torch.equal(viewed["b"], tensors["b"])
    copied, _ = load(payload)
    assert torch.equal(copied["a"], tensors["a"])


def test_dump_into_views_filled_give_the_bytes_of_dump() -> None:
    tensors = {
        "b.weight": torch.randn(3, 5),
        "a.count": torch.tensor(7, dtype=torch.int64),
        "c.half": torch.randn(4, dtype=torch.float16),
        "d.empty": torch.empty(0, 2),
        "e.words": torch.arange(11, dtype=torch.int64),
    }
    meta = {"cardiofl.update": '{"num_examples": 3}'}
    body, views = dump_into({name: TensorSpec.of(t) for name, t in tensors.items()}, meta)
    for name, tensor in tensors.items():
        assert views[name].shape == tensor.shape and views[name].dtype == tensor.dtype
        views[name].copy_(tensor)
    assert bytes(body) == dump(tensors, meta)


def test_dump_taking_writes_dumps_bytes_into_one_body_and_lets_each_tensor_go() -> None:
    import gc
    import weakref

    from shared.tensors.codec import dump_taking

    tensors = {"w": torch.arange(300, dtype=torch.float32).reshape(30, 10), "b": torch.ones(7, dtype=torch.int64)}
    expected = dump(tensors, {"round": "1"})
    taken = dict(tensors)
    alive = {name: weakref.ref(tensor) for name, tensor in tensors.items()}
    del tensors
    body = dump_taking(taken, {"round": "1"})
    gc.collect()
    assert bytes(body) == expected and taken == {}
    assert all(ref() is None for ref in alive.values())  # nothing else held them: freed once copied in
