"""The coordinator's server process: how much of a request body it reads ahead of the app."""

import pytest
from uvicorn.protocols.http import flow_control, h11_impl, httptools_impl

from coordinator.serving.process import RECEIVE_BUFFER_BYTES, widen_receive_buffer


@pytest.fixture
def protocols(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The two HTTP protocols of uvicorn, their receive limits restored after the test."""
    for protocol in (h11_impl, httptools_impl):
        monkeypatch.setattr(protocol, "HIGH_WATER_LIMIT", protocol.HIGH_WATER_LIMIT)
    return h11_impl, httptools_impl


def test_both_protocols_read_megabytes_of_a_body_ahead_not_uvicorns_64_kib(protocols: tuple) -> None:
    assert flow_control.HIGH_WATER_LIMIT == 64 * 1024  # uvicorn's own, which a model upload outruns
    widen_receive_buffer(RECEIVE_BUFFER_BYTES)
    assert [protocol.HIGH_WATER_LIMIT for protocol in protocols] == [RECEIVE_BUFFER_BYTES] * 2
    assert RECEIVE_BUFFER_BYTES >= 1 << 20


def test_a_uvicorn_that_no_longer_reads_the_limit_is_said_not_ignored(
    protocols: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(httptools_impl, "HIGH_WATER_LIMIT")
    with pytest.raises(RuntimeError, match="httptools_impl no longer reads HIGH_WATER_LIMIT"):
        widen_receive_buffer(RECEIVE_BUFFER_BYTES)
