"""CUDA IPC: one device buffer, exported once per run and opened once by the engine.

For a trainer and an engine on the same GPU. The sender allocates ``slots x slot_bytes`` with
``cudaMalloc`` itself, outside PyTorch's caching allocator: the buffer is never part of an
expandable segment (whose export needs ``pidfd_getfd``, which containers often forbid), it
never grows or moves, and its one handle (``cudaIpcGetMemHandle``, 64 bytes) stays valid for
the whole run -- no handle, reference-counting file or event per update. The handle travels
as bytes inside a typed msgspec struct; nothing is pickled. The engine opens it once
(``cudaIpcOpenMemHandle``) and copies out of it with fused device copies; a sender and an
engine in one process share the buffer directly.

Ordering without a host sync: with the buffer the sender exports one interprocess CUDA event
per slot (``cudaEventInterprocess | cudaEventDisableTiming``, ``cudaIpcGetEventHandle``, once
per run). It records a slot's event after queueing its writes and sends the Stage at once;
the engine's stream waits on the event (``cudaStreamWaitEvent`` on the opened handle) before
it reads the slot. The bucket's fingerprint, computed on the sender's device, goes into a
ring of int64 cells at the end of the buffer rather than into the Stage, and the engine reads
it there on its stream and zeroes it. A slot is still rewritten only once the engine has
acknowledged the copy out of it (``transports.base``); a cell is rewritten only
``FINGERPRINT_CELLS`` buckets later, long after that.

The CUDA runtime is reached through ``ctypes`` on the ``libcudart`` PyTorch has loaded (or
any on the library path), so neither cupy nor cuda-python is needed. Memory is freed (or the
mapping closed) when the last tensor viewing it is gone, never under a live view.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import msgspec
import torch

from colosync.errors import TransportError
from colosync.transports.base import Peers, ReceiverTransport, SenderTransport
from colosync.wire.protocol import Stage

log = logging.getLogger(__name__)

DISABLE_ENV = "COLOSYNC_NO_CUDA_IPC"
EVENTS_ENV = "COLOSYNC_CUDA_IPC_EVENTS"  # "0": no interprocess events, the sender syncs its host per Stage
# Engine side: "host" (default) polls the sender's event with a deadline, so a sender that dies with its
# writes queued costs one refused Stage; "stream" (cudaStreamWaitEvent) saves a few microseconds but a
# never-completing event would stall the engine's stream, and every generation behind it, for good.
WAIT_ENV = "COLOSYNC_CUDA_IPC_WAIT"
WAIT_TIMEOUT_S = 30.0  # "host" wait: how long a sender's writes may take before the Stage is refused
SPIN_S = 0.05  # "host" wait: how long it polls without sleeping
_HANDLE_BYTES = 64
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
FINGERPRINT_CELLS = 256  # int64 pairs after the slots: bucket b's fingerprint goes to cell b % 256
_CELL_BYTES = 16


class CudaIpcHandle(msgspec.Struct, frozen=True):
    handle: bytes  # cudaIpcMemHandle_t
    device_uuid: str  # the GPU that holds the buffer
    pid: int  # the exporting process; a receiver in that process uses the buffer directly
    slot_bytes: int
    slots: int
    events: tuple[bytes, ...] = ()  # cudaIpcEventHandle_t per slot; () from a sender that syncs its host
    fingerprint_cells: int = 0  # int64 pairs after the slots that carry fingerprints (0: in the Stage)

    def __post_init__(self) -> None:
        if len(self.handle) != _HANDLE_BYTES:
            raise TransportError(f"a CUDA IPC handle has {_HANDLE_BYTES} bytes, got {len(self.handle)}")
        if self.slot_bytes <= 0 or self.slots <= 0:
            raise TransportError(f"cuda_ipc needs slot_bytes > 0 and slots > 0, got {self.slot_bytes}, {self.slots}")
        if self.events and (len(self.events) != self.slots or any(len(e) != _HANDLE_BYTES for e in self.events)):
            raise TransportError(
                f"a cuda_ipc handle names one {_HANDLE_BYTES}-byte event handle per slot ({self.slots}), "
                f"got {[len(e) for e in self.events]}"
            )
        if self.fingerprint_cells < 0:
            raise TransportError(f"fingerprint_cells must be >= 0, got {self.fingerprint_cells}")

    @property
    def cells_offset(self) -> int:
        """Where the fingerprint cells start in the buffer: after the slots, 16-byte aligned."""
        return -(-self.slot_bytes * self.slots // _CELL_BYTES) * _CELL_BYTES

    @property
    def nbytes(self) -> int:
        if not self.fingerprint_cells:
            return self.slot_bytes * self.slots
        return self.cells_offset + self.fingerprint_cells * _CELL_BYTES


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


class CudaRuntime:
    """The few CUDA runtime calls this transport needs, through ctypes."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        vp, i, u, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        for name, args in {
            "cudaMalloc": [ctypes.POINTER(vp), sz],
            "cudaFree": [vp],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcMemHandle), vp],
            "cudaIpcOpenMemHandle": [ctypes.POINTER(vp), _IpcMemHandle, u],
            "cudaIpcCloseMemHandle": [vp],
            "cudaGetDevice": [ctypes.POINTER(i)],
            "cudaSetDevice": [i],
            "cudaRuntimeGetVersion": [ctypes.POINTER(i)],
            "cudaDriverGetVersion": [ctypes.POINTER(i)],
        }.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.cudaGetLastError.argtypes, lib.cudaGetLastError.restype = [], ctypes.c_int
        for name in ("cudaGetErrorName", "cudaGetErrorString"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_char_p

    def error(self, code: int) -> str:
        name = self._lib.cudaGetErrorName(code) or b"?"
        text = self._lib.cudaGetErrorString(code) or b""
        return f"{name.decode()} ({code}): {text.decode()}"

    def _check(self, code: int, what: str) -> None:
        if code:
            self._lib.cudaGetLastError()  # clear it, or PyTorch's next launch check reports it as its own
            raise TransportError(f"{what} failed: {self.error(code)}")

    def version(self, which: str = "runtime") -> int:
        out = ctypes.c_int()
        fn = self._lib.cudaRuntimeGetVersion if which == "runtime" else self._lib.cudaDriverGetVersion
        self._check(fn(ctypes.byref(out)), f"cuda{which.title()}GetVersion")
        return out.value

    def _on(self, index: int) -> AbstractContextManager[None]:
        runtime = self

        class _Device:
            def __enter__(self) -> None:
                cur = ctypes.c_int()
                runtime._check(runtime._lib.cudaGetDevice(ctypes.byref(cur)), "cudaGetDevice")
                self.previous = cur.value
                if cur.value != index:
                    runtime._check(runtime._lib.cudaSetDevice(index), f"cudaSetDevice({index})")

            def __exit__(self, *exc: object) -> None:
                if self.previous != index:
                    runtime._lib.cudaSetDevice(self.previous)

        return _Device()

    def malloc(self, nbytes: int, index: int) -> int:
        ptr = ctypes.c_void_p()
        with self._on(index):
            self._check(self._lib.cudaMalloc(ctypes.byref(ptr), nbytes), f"cudaMalloc({nbytes} bytes) on cuda:{index}")
        return _address(ptr, "cudaMalloc")

    def free(self, ptr: int) -> None:
        self._check(self._lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def export(self, ptr: int) -> bytes:
        handle = _IpcMemHandle()
        self._check(self._lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return bytes(handle)  # all 64 bytes (``handle.reserved`` would stop at the first NUL)

    def open(self, handle: bytes, index: int) -> int:
        raw = _IpcMemHandle.from_buffer_copy(handle)
        ptr = ctypes.c_void_p()
        with self._on(index):
            code = self._lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _LAZY_PEER_ACCESS)
        if code:
            self._lib.cudaGetLastError()  # clear it, or PyTorch's next launch check reports it as its own
            raise TransportError(
                f"cudaIpcOpenMemHandle failed: {self.error(code)}. CUDA IPC needs the trainer and the "
                "engine on one host, in one PID/IPC namespace, with the GPU visible to both; "
                "`colosync probe` tests this machine, and transport='auto' falls back to shm"
            )
        return _address(ptr, "cudaIpcOpenMemHandle")

    def close_ipc(self, ptr: int) -> None:
        self._check(self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def _address(ptr: ctypes.c_void_p, call: str) -> int:
    """The device address a successful ``call`` wrote into ``ptr``."""
    if ptr.value is None:
        raise TransportError(f"{call} succeeded but returned a NULL pointer")
    return ptr.value


_runtime: CudaRuntime | None = None
_runtime_error: str | None = None
_runtime_lock = threading.Lock()


def _cudart_candidates() -> list[str]:
    found: list[str] = []
    try:  # the copy PyTorch itself loaded: same per-thread device state as torch
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    for root in sys.path:
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcudart.so*")))
        found += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    by_name = ctypes.util.find_library("cudart")
    found += [p for p in (by_name, "libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0") if p]
    return list(dict.fromkeys(found))


def runtime() -> CudaRuntime:
    """The CUDA runtime through ctypes, loaded once; ``TransportError`` says why if it cannot be."""
    global _runtime, _runtime_error
    with _runtime_lock:
        if _runtime is not None:
            return _runtime
        if _runtime_error is not None:
            raise TransportError(_runtime_error)
        if not torch.cuda.is_available():
            raise TransportError("CUDA is not available in this process")
        torch.cuda.init()
        tried = []
        for path in _cudart_candidates():
            try:
                _runtime = CudaRuntime(ctypes.CDLL(path), path)
                log.debug("cuda_ipc: CUDA runtime %s", path)
                return _runtime
            except (OSError, AttributeError) as exc:
                tried.append(f"{path}: {exc}")
        _runtime_error = "no usable libcudart found (" + "; ".join(tried[-3:]) + ")"
        raise TransportError(_runtime_error)


class DeviceBuffer:
    """Device memory seen as a ``uint8`` tensor; released when the last view of it is gone."""

    def __init__(self, ptr: int, nbytes: int, index: int, release: Callable[[int], None] | None) -> None:
        self.ptr, self.nbytes, self.index = ptr, nbytes, index
        self._release = release
        self.events: list[torch.cuda.Event] = []  # the exporter's slot events (a receiver in-process shares them)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}

    def tensor(self) -> torch.Tensor:
        t = torch.as_tensor(self, device=torch.device("cuda", self.index))
        if t.data_ptr() != self.ptr or t.numel() != self.nbytes:
            raise TransportError("torch copied CUDA memory it was asked to view; cannot share the buffer")
        return t

    def __del__(self) -> None:
        if self._release is None or sys.is_finalizing():
            return
        try:
            self._release(self.ptr)
        except Exception as exc:  # never raise from a finalizer
            log.debug("cuda_ipc: releasing %#x failed: %s", self.ptr, exc)


_exported: dict[bytes, weakref.ReferenceType[DeviceBuffer]] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    bus = getattr(props, "pci_bus_id", None)  # older torch: the PCI location names the GPU too
    if bus is None:
        return f"name:{props.name}"
    return f"pci:{getattr(props, 'pci_domain_id', None)}:{bus}:{getattr(props, 'pci_device_id', None)}"


def index_of(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise TransportError(
        f"the trainer's buffer is on GPU {uuid}, which this process cannot see "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); cuda_ipc needs "
        "trainer and engine on the same GPU -- use shm otherwise"
    )


def allocate(nbytes: int, index: int) -> DeviceBuffer:
    """``cudaMalloc`` memory outside PyTorch's pools, exportable with ``cudaIpcGetMemHandle``."""
    rt = runtime()
    return DeviceBuffer(rt.malloc(nbytes, index), nbytes, index, rt.free)


def open_handle(handle: bytes, index: int, nbytes: int) -> DeviceBuffer:
    rt = runtime()
    return DeviceBuffer(rt.open(handle, index), nbytes, index, rt.close_ipc)


class CudaIpcSender(SenderTransport):
    name = "cuda_ipc"

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, f"the tensors are on {device.type}, not on a CUDA device"
        if os.environ.get(DISABLE_ENV):
            return False, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        try:
            runtime()
        except TransportError as exc:
            return False, str(exc)
        return True, "one cudaMalloc buffer exported once; the engine opens it once and copies out on the GPU"

    @classmethod
    def create(cls, slot_bytes: int, slots: int, device: torch.device, peers: Peers | None = None) -> CudaIpcSender:
        return cls(slot_bytes, slots, device)

    def __init__(self, slot_bytes: int, slots: int, device: torch.device) -> None:
        if slot_bytes <= 0 or slots <= 0:
            raise TransportError(f"cuda_ipc needs slot_bytes > 0 and slots > 0, got {slot_bytes}, {slots}")
        index = _device_index(device)
        self._index = index
        self._slot_bytes, self._slots = slot_bytes, slots
        cells = -(-slot_bytes * slots // _CELL_BYTES) * _CELL_BYTES  # CudaIpcHandle.cells_offset
        memory = allocate(cells + FINGERPRINT_CELLS * _CELL_BYTES, index)
        self._memory: DeviceBuffer | None = memory
        events: list[torch.cuda.Event] = []
        if os.environ.get(EVENTS_ENV, "1") != "0":
            with torch.cuda.device(index):
                events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        event_handles = tuple(bytes(e.ipc_handle()) for e in events)
        memory.events = events
        self._events = events
        self._handle = CudaIpcHandle(
            runtime().export(memory.ptr),
            device_uuid(index),
            os.getpid(),
            slot_bytes,
            slots,
            event_handles,
            FINGERPRINT_CELLS if events else 0,
        )
        for key in [k for k, ref in _exported.items() if ref() is None]:
            del _exported[key]
        _exported[self._handle.handle] = weakref.ref(memory)
        buffer = memory.tensor()
        self._buffer: torch.Tensor | None = buffer
        buffer.zero_()  # padding between tensors stays zero from here on
        self._views = [buffer[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slots)]
        self._cells: torch.Tensor | None = (
            buffer[cells:].view(torch.int64).view(FINGERPRINT_CELLS, 2) if events else None
        )
        log.debug("cuda_ipc: exported %d x %d bytes and %d events on cuda:%d", slots, slot_bytes, slots, index)

    @property
    def nbytes(self) -> int:
        return self._slot_bytes * self._slots

    def handle(self) -> bytes:
        return msgspec.msgpack.encode(self._handle)

    def slot(self, index: int) -> torch.Tensor:
        return self._views[index]

    def written(self, index: int, device: torch.device, fingerprint: torch.Tensor | None = None) -> int:
        if not self._events:
            return 0
        self._events[index].record(torch.cuda.current_stream(self._index))
        return 1  # the slot's event is the seal; the fingerprint is already in the shared cell

    def fingerprint_cell(self, bucket: int) -> torch.Tensor | None:
        cells = self._cells
        return cells[bucket % FINGERPRINT_CELLS] if cells is not None else None

    def close(self) -> None:
        # Drop our views only: the memory is freed once no tensor (an arena view, say) uses it.
        self._views = []
        self._buffer = None
        self._memory = None
        self._cells = None
        self._events = []


class CudaIpcReceiver(ReceiverTransport):
    name = "cuda_ipc"

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> CudaIpcReceiver:
        try:
            decoded = msgspec.msgpack.decode(handle, type=CudaIpcHandle)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise TransportError(f"malformed cuda_ipc handle: {exc}") from None
        return cls(decoded)

    def __init__(self, handle: CudaIpcHandle) -> None:
        if not torch.cuda.is_available():
            raise TransportError("the engine process has no CUDA, so it cannot open a CUDA IPC handle; use shm")
        index = index_of(handle.device_uuid)
        nbytes = handle.nbytes
        memory = None
        if handle.pid == os.getpid():  # same process: CUDA cannot open its own handle, nor needs to
            ref = _exported.get(handle.handle)
            memory = ref() if ref is not None else None
            if memory is None:
                raise TransportError("the cuda_ipc buffer this handle names was already freed in this process")
            events = list(memory.events) if handle.events else []
        else:
            memory = open_handle(handle.handle, index, nbytes)
            events = [_open_event(e, index) for e in handle.events]
        self._handle = handle
        self._index = index
        self._events = events
        self._host_wait = os.environ.get(WAIT_ENV, "host") != "stream"
        buffer = memory.tensor()
        self._views = [buffer[i * handle.slot_bytes : (i + 1) * handle.slot_bytes] for i in range(handle.slots)]
        start = handle.cells_offset
        self._cells: torch.Tensor | None = (
            buffer[start:].view(torch.int64).view(-1, 2) if handle.fingerprint_cells else None
        )

    def slot(self, index: int) -> torch.Tensor:
        return self._views[index]

    def ready(self, stage: Stage) -> None:
        if not self._events or not stage.seal:
            return
        index = stage.slot
        event = self._events[index]
        if not self._host_wait:
            event.wait(torch.cuda.current_stream(self._index))
            return
        start = time.monotonic()
        while not event.query():
            waited = time.monotonic() - start
            # A pack takes 0.1 ms (LoRA) to a few ms (a 4 GiB bucket): poll closely that long, yielding the GIL
            # (sleep(0)) so the socket thread reads on; past SPIN_S, stop spinning a core.
            time.sleep(0 if waited < SPIN_S else 0.0005)
            if waited > WAIT_TIMEOUT_S:
                raise TransportError(
                    f"the sender's writes into cuda_ipc slot {index} did not finish within {WAIT_TIMEOUT_S:.0f} s; "
                    "the sender died or hung mid-update (its GPU work never completed)"
                )

    def sent_fingerprint(self, stage: Stage) -> torch.Tensor | None:
        cells = self._cells
        return cells[stage.bucket % cells.shape[0]] if cells is not None and stage.seal else None

    @property
    def num_slots(self) -> int:
        return self._handle.slots

    def close(self) -> None:
        self._views = []
        self._events = []
        self._cells = None


def _open_event(handle: bytes, index: int) -> torch.cuda.Event:
    """The sender's interprocess event, opened here (``cudaIpcOpenEventHandle``)."""
    try:
        event: torch.cuda.Event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), handle)
    except Exception as exc:  # a refused handle is the transport's failure, so auto can fall back
        raise TransportError(
            f"cudaIpcOpenEventHandle failed: {exc}. CUDA IPC needs the trainer and the engine on one host, "
            "in one PID/IPC namespace; transport='auto' falls back to shm"
        ) from None
    return event
