"""What every recorded benchmark carries: the machine it ran on and the exact command.

A figure without its machine (GPU, driver, CUDA, torch, host memory) and the command line
that reproduces it cannot be compared with anything, so ``colosync bench``,
``colosync handoff-bench`` and ``benchmarks/handoff/gpu_handoff.py`` all write ``run_header``.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def command_line(argv: Sequence[str] | None = None, prog: Sequence[str] = ("colosync",)) -> str:
    """The shell command that reproduces this run: ``prog`` and ``argv`` (default: this
    process's arguments), quoted as a shell would need them."""
    return shlex.join([*prog, *(sys.argv[1:] if argv is None else argv)])


def gpu_driver(index: int = 0) -> str:
    """The NVIDIA driver version (``nvidia-smi``, else the CUDA driver API's), or ``unknown``."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(index)],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from colosync.transports.cuda_ipc import runtime

        return f"CUDA driver API {runtime().version('driver')}"
    except Exception:  # the driver version is informational
        return "unknown"


MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"


def mps_daemon() -> str | None:
    """The pipe directory of a CUDA MPS control daemon (``CUDA_MPS_PIPE_DIRECTORY``, else
    ``/tmp/nvidia-mps``) when its control pipe and its pid file are there, else None. A daemon
    told to ``quit`` removes its pid file and leaves the pipes (seen on an H200, driver 580,
    ``benchmarks/gpu/bench-mps.sh``); one killed outright leaves both, so this says "likely running".

    Without MPS, a trainer and an engine on one GPU are two CUDA contexts that the GPU
    time-slices, and every hand-off between them cost ~0.3 ms on an H200
    (``benchmarks/two-contexts/two_contexts.py``): more than the GPU work of a LoRA sync.
    """
    folder = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    running = all(os.path.exists(os.path.join(folder, f)) for f in ("control", "nvidia-cuda-mps-control.pid"))
    return folder if running else None


def machine_info(device: Any = None) -> dict[str, Any]:
    """Host, Python, torch and CUDA; and for a CUDA ``device`` (default: the current one when
    CUDA is available) its name, memory and the driver."""
    import torch

    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
    }
    try:
        import psutil

        info["host_memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    if device is None:
        if not torch.cuda.is_available():
            return info
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return info
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    info.update(
        gpu=props.name, gpu_memory_bytes=props.total_memory, driver=gpu_driver(index), mps=mps_daemon() is not None
    )
    return info


def run_header(
    argv: Sequence[str] | None = None, *, prog: Sequence[str] = ("colosync",), device: Any = None
) -> dict[str, Any]:
    """``{"command", "date", "commit", "machine"}``: the exact command (``command_line``), the UTC
    date, the code that ran (``source_commit``) and ``machine_info(device)``."""
    return {
        "command": command_line(argv, prog),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "machine": machine_info(device),
    }


def source_commit() -> str:
    """The git commit of the colosync tree that is running, ``+dirty`` if its package differs from it;
    ``colosync <version>`` where it runs from an installed copy rather than a git checkout."""
    from colosync import __version__

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package folder

    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)
        return run.stdout.strip() if run.returncode == 0 else ""

    try:
        commit = git("rev-parse", "--short", "HEAD")
        if not commit:
            return f"colosync {__version__}"
        return commit + ("+dirty" if git("status", "--porcelain", "--", ".") else "")
    except (OSError, subprocess.SubprocessError):
        return f"colosync {__version__}"
