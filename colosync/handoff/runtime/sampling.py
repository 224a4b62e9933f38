"""Measure host and device memory while a handoff runs.

Host: what a cgroup charges a job is its anonymous plus shared memory ("anon+shmem", the
figure radixark/miles #2781 reports), so the sampler reads ``RssAnon`` and ``RssShmem`` of this process
and its children from ``/proc/<pid>/status`` (cheap enough to poll every few milliseconds),
with total RSS and the system-wide used/shared figures alongside. ``psutil`` finds the
children and the system figures; without it the same numbers come from ``/proc``.

Across processes (a trainer and an engine process that both map one shared host arena) a
shared page shows in the ``RssShmem`` of every process that maps it, so summing per process
would count the arena twice. With ``shared=True`` the sampler reads each process's
proportional set size instead (``Pss_Anon`` + ``Pss_Shmem`` from ``/proc/<pid>/smaps_rollup``):
a page mapped by n processes counts 1/n in each, so the sum over the processes counts it
once. That walk costs about 10 ms per GB mapped (measured: 14 ms for 1 GB, 28 ms for 4 GB)
and holds the process's ``mmap_lock`` while it runs, so with a large shared arena (32-80 GB
in a colocated job) every sample would cost a process most of a second. Given the arenas
(``arenas=``, at least ``pss_limit_bytes`` of them), the sampler reads ``status`` instead and
counts each arena once itself: an arena is resident from its creation and fully mapped in
every process that maps it (the creator fills it; pinning, or an explicit populate,
maps it in the others), so each process's ``RssShmem`` less the arena mappings its
``/proc/<pid>/maps`` lists (a few hundred lines, no page walk) is what it holds besides, and
the arenas' bytes are added once, to this process (``count_arenas``; a remote participant
sampling itself leaves them to the controller that samples everyone). Other shared mappings
(the ``shm`` transport's slots, a few buckets) then count once per process that maps them:
an overcount of at most that much, never an undercount.
``scope="node"`` reads the node instead (``AnonPages`` + ``Shmem`` of ``/proc/meminfo``):
what a node-wide budget sees, but also every other job's memory on the node.

Device: ``cudaMemGetInfo`` (``torch.cuda.mem_get_info``) sees every process on the GPU, which
is what matters when the engine runs in other processes; torch's own reserved/peak counters
are kept alongside for this process. ``PeakWatcher`` polls both on a thread to catch peaks
inside an operation.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

try:  # psutil is a dependency, but a bare GPU host may lack it: fall back to /proc
    import psutil
except ImportError:  # pragma: no cover - exercised only where psutil is missing
    psutil = None  # type: ignore[assignment]  # None marks it missing; callers check before use

if TYPE_CHECKING:
    import ctypes

PSS_LIMIT_BYTES = 1 << 30
"""Shared arenas this large are counted without a page walk (see the module docstring)."""

_libc: ctypes.CDLL | Literal[False] | None = None  # None: not loaded yet; False: no glibc here


def trim_host_allocator() -> bool:
    """Ask glibc to return freed heap memory to the OS (``malloc_trim(0)``).

    Tensors below glibc's mmap threshold (up to 32 MiB) live on the heap, and freeing them
    does not lower the process's RSS until the heap is trimmed; without this, CPU tensors
    that a participant really freed would still look resident. Returns False where there is
    no glibc."""
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    _libc.malloc_trim(0)
    return True


@dataclass(frozen=True)
class HostSample:
    anon: int
    shmem: int
    rss: int
    system_used: int
    system_shared: int
    by_pid: dict[int, int] = field(default_factory=dict)
    """anon + shmem of each sampled process (empty for ``scope="node"``)."""

    @property
    def value(self) -> int:
        """anon + shmem of the process tree: what the sampler compares against limits."""
        return self.anon + self.shmem


@dataclass(frozen=True)
class DeviceSample:
    used: int
    """Bytes in use on the device by every process (total - free)."""
    total: int
    reserved: int
    """Bytes torch's caching allocator holds in this process."""


def _kb_fields(path: str, keys: tuple[bytes, ...]) -> dict[str, int] | None:
    """The ``Key:  N kB`` lines of a /proc file named by ``keys``, in bytes (None: unreadable)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    out = {}
    for line in data.split(b"\n"):
        if line.startswith(keys):
            key, value = line.split(b":", 1)
            out[key.decode()] = int(value.split()[0]) * 1024
    return out


def _status_fields(pid: int | str) -> dict[str, int] | None:
    return _kb_fields(f"/proc/{pid}/status", (b"VmRSS:", b"RssAnon:", b"RssShmem:", b"RssFile:"))


def _pss_fields(pid: int | str) -> dict[str, int] | None:
    out = _kb_fields(f"/proc/{pid}/smaps_rollup", (b"Rss:", b"Pss_Anon:", b"Pss_Shmem:"))
    return out if out is not None and "Pss_Anon" in out else None


def _mapped_bytes(pid: int | str, names: tuple[str, ...]) -> int:
    """Bytes of ``pid``'s mappings whose path names one of ``names`` (``/proc/<pid>/maps``)."""
    total = 0
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    keys = tuple(n.encode() for n in names)
    for line in data.split(b"\n"):
        if any(k in line for k in keys):
            start, end = line.split(b" ", 1)[0].split(b"-")
            total += int(end, 16) - int(start, 16)
    return total


def _node_anon_shmem() -> tuple[int, int]:
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0
    return fields.get("AnonPages", 0), fields.get("Shmem", 0)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (engine workers, vLLM's engine core)."""
    if psutil is not None:
        try:
            return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return [pid]
    return [pid] + _children_proc(pid)


def _children_proc(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            out.append(kid)
            out.extend(_children_proc(kid))
    return out


def _meminfo() -> tuple[int, int]:
    if psutil is not None:
        vm = psutil.virtual_memory()
        return int(vm.total - vm.available), int(getattr(vm, "shared", 0))
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0
    return fields.get("MemTotal", 0) - fields.get("MemAvailable", 0), fields.get("Shmem", 0)


class HostSampler:
    """Samples the host memory of this process, ``roots`` and (optionally) their children.

    ``shared``: count pages shared between the sampled processes once (proportional set
    size, see the module docstring). ``arenas``: the shared host arenas in play (objects with
    ``name`` and ``mapped_bytes``); at ``pss_limit_bytes`` or more of them, shared pages are
    counted without a page walk (module docstring), the arenas once, to this process when
    ``count_arenas``. ``scope="node"``: the node's anon+shmem instead.
    """

    def __init__(
        self,
        *,
        children: bool = True,
        system: bool = True,
        roots: Iterable[int] = (),
        shared: bool = False,
        scope: str = "processes",
        arenas: Iterable[Any] = (),
        count_arenas: bool = True,
        pss_limit_bytes: int = PSS_LIMIT_BYTES,
    ) -> None:
        if scope not in ("processes", "node"):
            raise ValueError(f"scope must be 'processes' or 'node', got {scope!r}")
        self.children = children
        self.system = system
        self.shared = shared
        self.scope = scope
        self.arenas = list(arenas)
        self.count_arenas = count_arenas
        self.fast_shared = shared and sum(a.mapped_bytes for a in self.arenas) >= pss_limit_bytes
        """Shared pages counted from ``status`` and ``maps`` (no page walk): see the module docstring."""
        self.roots: list[int] = [os.getpid(), *(r for r in roots if r != os.getpid())]
        self._pids: list[int] = list(self.roots)
        self.refresh()

    def add_root(self, pid: int) -> None:
        """Sample ``pid`` (another participant's process) and its children too."""
        if pid not in self.roots:
            self.roots.append(pid)
            self.refresh()

    def refresh(self) -> None:
        """Re-discover child processes (engine workers may start late)."""
        pids: list[int] = []
        for root in self.roots:
            for pid in process_tree(root) if self.children else [root]:
                if pid not in pids:
                    pids.append(pid)
        self._pids = pids

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    def sample(self) -> HostSample:
        used, shared = _meminfo() if self.system else (0, 0)
        if self.scope == "node":
            anon, shmem = _node_anon_shmem()
            return HostSample(anon=anon, shmem=shmem, rss=anon + shmem, system_used=used, system_shared=shared)
        anon = shmem = rss = 0
        by_pid: dict[int, int] = {}
        names = tuple(a.name for a in self.arenas)
        for pid in self._pids:
            fields = _pss_fields(pid) if self.shared and not self.fast_shared else None
            if fields is not None:
                a, sh, r = fields["Pss_Anon"], fields.get("Pss_Shmem", 0), fields.get("Rss", 0)
            else:
                fields = _status_fields(pid)
                if fields is None:
                    if psutil is None:
                        continue
                    try:  # not Linux: RSS only
                        r = psutil.Process(pid).memory_info().rss
                    except psutil.Error:
                        continue
                    a, sh = r, 0
                else:
                    a, sh = fields.get("RssAnon", fields.get("VmRSS", 0)), fields.get("RssShmem", 0)
                    r = fields.get("VmRSS", 0)
                    if self.fast_shared:  # the arenas' mappings out: they are added once below
                        sh = max(0, sh - _mapped_bytes(pid, names))
            anon += a
            shmem += sh
            rss += r
            by_pid[pid] = a + sh
        if self.fast_shared and self.count_arenas:
            once = sum(a.mapped_bytes for a in self.arenas)
            shmem += once
            by_pid[os.getpid()] = by_pid.get(os.getpid(), 0) + once
        return HostSample(anon=anon, shmem=shmem, rss=rss, system_used=used, system_shared=shared, by_pid=by_pid)


class DeviceSampler:
    """Samples one CUDA device; on a machine without CUDA every sample is None."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.enabled = torch.cuda.is_available()
        if self.enabled:
            dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            if dev.type != "cuda":
                self.enabled = False
            self.device = dev
        else:
            self.device = torch.device("cpu")

    def sample(self) -> DeviceSample | None:
        if not self.enabled:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceSample(used=total - free, total=total, reserved=torch.cuda.memory_reserved(self.device))


class PeakWatcher:
    """Polls host and device on a background thread; ``take()`` returns and resets the maxima."""

    def __init__(self, host: HostSampler, device: DeviceSampler, interval_s: float = 0.005) -> None:
        self.host = host
        self.device = device
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._host_max = 0
        self._dev_max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="colosync-peak-watcher", daemon=True)

    def __enter__(self) -> PeakWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        if self.device.enabled:
            torch.cuda.set_device(self.device.device)
        while not self._stop.wait(self.interval_s):
            h = self.host.sample().value
            d = self.device.sample()
            with self._lock:
                self._host_max = max(self._host_max, h)
                if d is not None:
                    self._dev_max = max(self._dev_max, d.used)

    def take(self) -> tuple[int, int]:
        with self._lock:
            out = (self._host_max, self._dev_max)
            self._host_max = self._dev_max = 0
        return out
