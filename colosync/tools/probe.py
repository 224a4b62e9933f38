"""``colosync probe``: what this machine allows, tested rather than assumed, with reasons.

Checks CUDA; exports a ``cuda_ipc`` buffer and has a second, spawned process open it, read
it and write it back (the test ``transport="auto"`` relies on, made ahead of time); the
PyTorch allocator's expandable-segments setting and whether ``pidfd_getfd`` is permitted
from another process (why PyTorch's own CUDA IPC fails in many containers); the Yama ptrace
scope; ``/dev/shm``'s size and whether a segment can be registered as pinned memory; whether a
CUDA MPS daemon runs (without one, trainer and engine take turns on the GPU). Then
says which transport ``auto`` would pick and why it would pass over the others.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import multiprocessing as mp
import os
import platform
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from colosync.tools.bench.machine import mps_daemon
from colosync.tools.subcommand import add_subcommand

_SYS_PIDFD_GETFD = 438  # the same number on x86-64 and arm64


class Check(msgspec.Struct):
    name: str
    ok: bool | None  # None: informational
    detail: str


class TransportVerdict(msgspec.Struct):
    name: str
    works: bool
    reason: str


class ProbeReport(msgspec.Struct):
    device: str
    checks: list[Check]
    transports: list[TransportVerdict]
    auto: str | None
    machine: dict[str, Any]


def pidfd_getfd(pid: int, fd: int) -> tuple[bool | None, str]:
    """Try ``pidfd_getfd(pidfd_open(pid), fd)``: may this process take a file of ``pid``?"""
    if not hasattr(os, "pidfd_open"):
        return None, "os.pidfd_open is missing (Python < 3.9 or not Linux)"
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        return False, f"pidfd_open failed: {exc.strerror}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            err = ctypes.get_errno()
            why = {
                errno.EPERM: "EPERM: seccomp or ptrace rules forbid it "
                "(docker: --cap-add SYS_PTRACE, or a seccomp profile allowing pidfd_getfd)",
                errno.ENOSYS: "ENOSYS: the kernel (< 5.6) or a seccomp filter does not provide it",
            }.get(err, os.strerror(err))
            return False, why
        os.close(got)
        return True, "permitted"
    finally:
        os.close(pidfd)


def _expandable_segments() -> Check:
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    on = "expandable_segments:true" in conf.replace(" ", "").lower()
    detail = (
        "expandable segments ON: PyTorch's own CUDA IPC (ForkingPickler, the common sync path) then shares "
        "memory through file descriptors and needs pidfd_getfd; "
        if on
        else "expandable segments off (PyTorch's default); "
    ) + "colosync's cuda_ipc allocates its buffer with cudaMalloc outside the allocator, so this does not affect it"
    return Check(
        "allocator expandable_segments", None, f"{detail} (PYTORCH_CUDA_ALLOC_CONF={conf.strip(',') or 'unset'})"
    )


def _ptrace_scope() -> Check:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        return Check("ptrace scope", None, "no Yama ptrace_scope (not restricted by Yama)")
    meaning = {
        0: "classic: any process of the same user",
        1: "restricted: only descendants (siblings such as trainer and engine need CAP_SYS_PTRACE)",
        2: "admin only: CAP_SYS_PTRACE needed",
        3: "no attach at all",
    }.get(scope, "unknown")
    return Check("ptrace scope", None, f"{scope} ({meaning}); pidfd_getfd follows the same rules")


def _dev_shm() -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return Check("/dev/shm", False, f"not usable: {exc}; shm needs it (docker: --shm-size)")
    size, free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
    ok = free >= 256 << 20
    hint = "" if ok else "; the shm transport needs 2 buckets (128 MiB by default): raise --shm-size"
    return Check("/dev/shm", ok, f"{size / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free{hint}")


def _mps() -> Check:
    folder = mps_daemon()
    if folder is not None:
        return Check(
            "CUDA MPS",
            True,
            f"a control daemon's pipe and pid file are in {folder}: processes of the user who started it share "
            "one context (a killed daemon leaves both: `echo get_server_list | nvidia-cuda-mps-control` tells)",
        )
    return Check(
        "CUDA MPS",
        None,
        "no daemon: a trainer and an engine on one GPU are two contexts that take turns, ~0.3 ms per sync on an "
        "H200; run `nvidia-cuda-mps-control -d` before both start to share one",
    )


def _shm_pinned(device: str) -> Check:
    import torch

    from colosync.transports.shm import ShmReceiver, ShmSender

    try:
        sender = ShmSender(1 << 20, 2, torch.device(device))
    except Exception as exc:
        return Check("shm segment, pinned", False, f"cannot create a segment: {exc}")
    try:
        receiver = ShmReceiver.open(sender.handle(), torch.device(device))
        receiver.close()
        pinned = sender.pinned
    finally:
        sender.close()
    if torch.device(device).type != "cuda":
        return Check(
            "shm segment, pinned",
            None,
            "created and mapped, not pinned: no CUDA here to pin for (copies are plain memcpy)",
        )
    return Check(
        "shm segment, pinned",
        pinned,
        "registered with cudaHostRegister: device<->host copies at DMA speed"
        if pinned
        else "cudaHostRegister failed: copies go through a pageable bounce buffer (several times slower)",
    )


def _ipc_child(handle: bytes, parent: int, fd: int, device: str, conn: Connection) -> None:
    result: dict[str, Any] = {}
    try:
        result["pidfd_getfd"] = list(pidfd_getfd(parent, fd))
        import torch

        from colosync.transports.cuda_ipc import CudaIpcReceiver
        from colosync.wire.bucket import fingerprint

        start = time.perf_counter()
        receiver = CudaIpcReceiver.open(handle, torch.device(device))
        slot = receiver.slot(0)
        result["fingerprint"] = fingerprint(slot)
        slot.fill_(7)
        torch.cuda.synchronize()
        receiver.close()
        result["open_ms"] = (time.perf_counter() - start) * 1e3
        result["ok"] = True
    except Exception as exc:
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
    conn.send_bytes(msgspec.msgpack.encode(result))
    conn.close()


def _cuda_ipc_pair(device: str, timeout_s: float) -> tuple[Check, Check]:
    """Export a buffer here, open/read/write it in a spawned process, check both directions."""
    import torch

    from colosync.transports.cuda_ipc import CudaIpcSender
    from colosync.wire.bucket import fingerprint

    try:
        sender = CudaIpcSender(1 << 20, 1, torch.device(device))
    except Exception as exc:
        reason = f"export failed here: {exc}"
        return Check("CUDA IPC between two processes", False, reason), Check(
            "pidfd_getfd from another process", None, "not tested"
        )
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        slot = sender.slot(0)
        slot.copy_(torch.arange(slot.numel(), device=slot.device, dtype=torch.int64).remainder_(251).to(torch.uint8))
        expected = fingerprint(slot)
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe(duplex=False)
        child = ctx.Process(
            target=_ipc_child, args=(sender.handle(), os.getpid(), devnull, device, child_end), daemon=True
        )
        start = time.perf_counter()
        child.start()
        child_end.close()
        if not parent_end.poll(timeout_s):
            child.terminate()
            return (
                Check(
                    "CUDA IPC between two processes", False, f"the second process did not answer in {timeout_s:.0f}s"
                ),
                Check("pidfd_getfd from another process", None, "not tested"),
            )
        result = msgspec.msgpack.decode(parent_end.recv_bytes())
        child.join(30)
        torch.cuda.synchronize()
        wrote_back = bool((slot == 7).all())
        elapsed = (time.perf_counter() - start) * 1e3
    finally:
        os.close(devnull)
        sender.close()
    ok_pidfd, why_pidfd = result.get("pidfd_getfd", [None, "not tested"])
    pidfd_check = Check(
        "pidfd_getfd from another process",
        ok_pidfd,
        why_pidfd + ("; colosync's cuda_ipc does not need it" if ok_pidfd is False else ""),
    )
    if not result.get("ok"):
        return Check(
            "CUDA IPC between two processes",
            False,
            f"the second process could not use the handle: {result.get('error')}",
        ), pidfd_check
    if result.get("fingerprint") != expected or not wrote_back:
        return Check(
            "CUDA IPC between two processes",
            False,
            "the handle opened but the bytes did not match (read ok: "
            f"{result.get('fingerprint') == expected}, write-back seen: {wrote_back})",
        ), pidfd_check
    return Check(
        "CUDA IPC between two processes",
        True,
        f"exported cudaMalloc memory; a spawned process opened it ({result.get('open_ms', 0):.1f} ms), "
        f"read the exact bytes and wrote back ({elapsed:.0f} ms in all, process start included)",
    ), pidfd_check


def run_probe(device: str | None = None, spawn: bool = True, timeout_s: float = 120.0) -> ProbeReport:
    import torch

    from colosync import transports

    checks: list[Check] = []
    machine: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "platform": platform.platform(),
        "container": os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"),
    }
    cuda = torch.cuda.is_available()
    if device is None:
        device = "cuda" if cuda else "cpu"
    if cuda:
        index = torch.device(device).index or 0 if torch.device(device).type == "cuda" else 0
        props = torch.cuda.get_device_properties(index)
        machine.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}")
        checks.append(
            Check(
                "CUDA",
                True,
                f"{torch.cuda.device_count()} GPU(s); cuda:{index} is {props.name}, "
                f"{props.total_memory / 2**30:.0f} GiB, torch CUDA {torch.version.cuda}",
            )
        )
        try:
            from colosync.transports.cuda_ipc import runtime

            rt = runtime()
            machine.update(cudart=rt.path, cuda_runtime=rt.version("runtime"), cuda_driver=rt.version("driver"))
            checks.append(
                Check(
                    "CUDA runtime (ctypes)",
                    True,
                    f"{rt.path}; runtime {rt.version('runtime')}, driver API {rt.version('driver')}",
                )
            )
        except Exception as exc:
            checks.append(Check("CUDA runtime (ctypes)", False, str(exc)))
    else:
        checks.append(
            Check("CUDA", False, "torch.cuda.is_available() is False: only the shm transport (CPU copies) applies")
        )
    ipc_check = None
    if cuda and torch.device(device).type == "cuda":
        if spawn:
            ipc_check, pidfd_check = _cuda_ipc_pair(device, timeout_s)
            checks += [ipc_check, pidfd_check]
        else:
            checks.append(Check("CUDA IPC between two processes", None, "skipped (--no-spawn)"))
    ok_self, why_self = pidfd_getfd(os.getpid(), 0 if _fd_open(0) else 1)
    checks.append(Check("pidfd_getfd on itself", ok_self, why_self))
    checks += [_expandable_segments(), _ptrace_scope(), _dev_shm(), _shm_pinned(device)]
    if cuda:
        checks.append(_mps())

    verdicts, auto = [], None
    for name, cls, why in transports.candidates("auto", torch.device(device)):
        works, reason = cls is not None, why
        if works and name == "cuda_ipc" and ipc_check is not None and not ipc_check.ok:
            works, reason = False, ipc_check.detail
        verdicts.append(TransportVerdict(name, works, reason))
        if works and auto is None:
            auto = name
    return ProbeReport(device, checks, verdicts, auto, machine)


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _print(report: ProbeReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"colosync probe ({report.device})", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    mark = {True: "[green]ok[/]", False: "[red]no[/]", None: "[dim]info[/]"}
    for c in report.checks:
        table.add_row(c.name, mark[c.ok], c.detail)
    console.print(table)
    transports = Table(title="transports, fastest first", title_justify="left")
    transports.add_column("transport")
    transports.add_column("works")
    transports.add_column("why", overflow="fold")
    for v in report.transports:
        transports.add_row(v.name, mark[v.works], v.reason)
    console.print(transports)
    console.print(f"transport='auto' picks: [bold]{report.auto or 'nothing'}[/]")


def _run(args: argparse.Namespace) -> int:
    report = run_probe(args.device, spawn=not args.no_spawn, timeout_s=args.timeout)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report).decode(), indent=2) + "\n")
    else:
        _print(report)
    return 0 if report.auto else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers,
        "probe",
        doc=__doc__,
        help="test what this machine allows (CUDA IPC, pinned shm, pidfd_getfd, ...) and which transport auto picks",
    )
    parser.add_argument(
        "--device", default=None, help="device the trainer's tensors live on (default: cuda if present, else cpu)"
    )
    parser.add_argument("--no-spawn", action="store_true", help="skip the two-process CUDA IPC test (no child process)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the second process (default 120)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_run)
