"""transport="auto": the fastest transport that really works, and a logged reason for the others.

The CUDA IPC failure is forced where containers make it happen: the trainer exports a handle
and the engine process cannot open it. These run on CPU-only CI too: there the trainer's
export is simulated and the engine's real ``cuda_ipc`` receiver refuses the handle.
"""

from __future__ import annotations

import logging
import os

import msgspec
import pytest
import torch

from colosync import transports
from colosync.errors import TransportError, TransportUnavailable
from colosync.sync.sender import Sender
from colosync.transports import cuda_ipc
from colosync.transports.cuda_ipc import CudaIpcHandle, CudaIpcSender
from colosync.transports.shm import ShmHandle, ShmReceiver, _unlink

NAMED = [("w", torch.arange(12, dtype=torch.float32).reshape(3, 4)), ("b", torch.ones(5, dtype=torch.bfloat16))]


class _UnopenableExport(CudaIpcSender):
    """A trainer-side export whose handle no engine can open (as when CUDA IPC is blocked)."""

    def __init__(self, slot_bytes: int, slots: int, device: torch.device) -> None:
        self._slot_bytes, self._slots = slot_bytes, slots
        self._views = [torch.zeros(slot_bytes, dtype=torch.uint8) for _ in range(slots)]
        uuid = cuda_ipc.device_uuid(0) if torch.cuda.is_available() else "GPU-00000000-0000-0000-0000-000000000000"
        self._handle = CudaIpcHandle(os.urandom(64), uuid, os.getpid(), slot_bytes, slots)

    def close(self) -> None:
        self._views = []


@pytest.fixture
def forced_ipc(monkeypatch):
    """Make the trainer side believe CUDA IPC works; the engine side decides for real."""
    monkeypatch.setattr(CudaIpcSender, "available", classmethod(lambda cls, device: (True, "forced by the test")))
    monkeypatch.setattr(
        CudaIpcSender,
        "create",
        classmethod(lambda cls, slot_bytes, slots, device: _UnopenableExport(slot_bytes, slots, device)),
    )


def test_cuda_ipc_is_tried_first():
    assert transports.names()[0] == "cuda_ipc" and "shm" in transports.names()


def test_auto_falls_back_to_shm_when_the_engine_cannot_open_cuda_ipc(forced_ipc, store_engine, caplog):
    caplog.set_level(logging.INFO, logger="colosync.transports")
    with Sender(store_engine.connect(), transport="auto", bucket_bytes=4096) as sender:
        report = sender.push(NAMED)
        assert report.transport == "shm"
        assert sender.transport_log[0].startswith("picked 'shm'")
        assert sender.transport_log[1].startswith("passed over 'cuda_ipc'")
    passed = [r for r in caplog.records if "passed over 'cuda_ipc'" in r.getMessage()]
    assert passed and passed[0].levelno == logging.WARNING
    message = passed[0].getMessage()
    assert "the engine could not open it" in message and "TransportError" not in message
    # the reason is the engine's own: no CUDA there, or CUDA refusing the handle
    assert any(why in message for why in ("has no CUDA", "cudaIpcOpenMemHandle failed", "cannot see"))
    assert any("picked 'shm'" in r.getMessage() for r in caplog.records)


def test_forced_cuda_ipc_fails_loudly_instead_of_falling_back(forced_ipc, store_engine):
    with (
        Sender(store_engine.connect(), transport="cuda_ipc", bucket_bytes=4096) as sender,
        pytest.raises(TransportError),
    ):
        sender.push(NAMED)


def test_cpu_tensors_pass_over_cuda_ipc_with_the_reason(store_engine, caplog):
    caplog.set_level(logging.INFO, logger="colosync.transports")
    with Sender(store_engine.connect(), bucket_bytes=4096) as sender:
        assert sender.push(NAMED).transport == "shm"
    assert any("passed over 'cuda_ipc': the tensors are on cpu" in r.getMessage() for r in caplog.records)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(cuda_ipc.DISABLE_ENV, "1")
    ok, why = CudaIpcSender.available(torch.device("cuda"))
    assert not ok and cuda_ipc.DISABLE_ENV in why
    with pytest.raises(TransportUnavailable, match="cannot run here"):
        transports.attach_first("cuda_ipc", torch.device("cuda"), 4096, 1, attach=_never_called)


def _never_called(name: str, handle: bytes) -> None:
    raise AssertionError(f"{name} must not reach the engine")


def test_malformed_handle_is_a_transport_error():
    with pytest.raises(TransportError, match="malformed cuda_ipc handle"):
        cuda_ipc.CudaIpcReceiver.open(b"\x00garbage", torch.device("cpu"))
    with pytest.raises(TransportError, match="64 bytes"):
        CudaIpcHandle(b"short", "GPU-x", 1, 64, 2)


def test_auto_with_no_transport_the_engine_can_open_names_the_probe_command():
    """The engine may not see this /dev/shm (another container): each candidate is passed over, and the
    error says what to run to find out what the machine allows."""

    def engine_elsewhere(name: str, handle: bytes) -> object:
        if name != "shm":
            raise TransportError(f"{name} cannot be opened here")
        _unlink(msgspec.msgpack.decode(handle, type=ShmHandle).name)  # not in the engine's /dev/shm
        return ShmReceiver.open(handle, torch.device("cpu"))  # raises TransportError: cannot open

    with pytest.raises(TransportUnavailable, match=r"^no transport works here: .*'shm': .*cannot open") as info:
        transports.attach_first("auto", torch.device("cpu"), 1 << 16, 1, engine_elsewhere)
    assert str(info.value).endswith("; run `colosync probe` to see what this machine allows")
