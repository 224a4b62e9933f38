"""One pass over a bucket's bytes: copy them, fingerprint them and look for NaN/Inf, at once.

Moving a bucket between two processes on one GPU costs a few passes over its bytes: the
copy, the fingerprint (``bucket.fingerprint``) and the non-finite check. Done as separate
PyTorch ops they read the bytes three times and cost several kernel launches each; on a GPU
with Triton (PyTorch's own dependency there) one kernel does all three in one read, with
the same fingerprint definition. ``copy_check`` falls back to PyTorch ops wherever Triton is
missing, refuses to compile, or fails its self-test on first use (logged once), and on CPU.

A bucket's bytes are split into ``segments``: ranges of one floating dtype, checked lane by
lane on the IEEE exponent bits, and ranges of anything else, only copied and fingerprinted.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, no_type_check

import torch

from colosync.wire.bucket import fingerprint_tensor, float_runs
from colosync.wire.manifest import TensorMeta, align_up

log = logging.getLogger(__name__)

Segment = tuple[int, int, int, int, "torch.dtype | None"]  # start, end, lane bytes (0: none), exponent mask, dtype
_LANES = {
    torch.bfloat16: (2, 0x7F80),
    torch.float16: (2, 0x7C00),
    torch.float32: (4, 0x7F800000),
    torch.float64: (8, 0x7FF0000000000000),
}
_BLOCK = 1024  # int64 words per program step
_WARPS = 4
_WAVES = 4  # programs per multiprocessor (the grid is at most this many times the SM count)


def segments(metas: Sequence[TensorMeta], size: int) -> list[Segment] | None:
    """Cover ``[0, size)`` of a bucket with 8-byte-aligned segments; ``None`` if it holds fp8."""
    runs = float_runs(metas)
    if runs is None:
        return None
    out: list[Segment] = []
    pos = 0
    for start, end, dtype in runs:
        end = min(align_up(end, 8), size)
        if start > pos:
            out.append((pos, start, 0, 0, None))
        lanes, mask = _LANES.get(dtype, (0, 0))
        out.append((start, end, lanes, mask, dtype if lanes else None))
        pos = end
    if pos < size:
        out.append((pos, size, 0, 0, None))
    merged: list[Segment] = []
    for seg in out:
        if merged and seg[2] == 0 and merged[-1][2] == 0:
            merged[-1] = (merged[-1][0], seg[1], 0, 0, None)
        else:
            merged.append(seg)
    return merged


class SelfTestedKernel:
    """A Triton kernel built on first use and checked against PyTorch once per device.

    ``enabled(device)`` is False without CUDA, with ``COLOSYNC_NO_TRITON`` set, and for good
    on a device where building or the self-test failed (logged once, naming ``fallback``).
    """

    def __init__(self, what: str, build: Callable[[], Any], selftest: Callable[[torch.device], None], fallback: str):
        self.what, self.fallback = what, fallback
        self._build, self._selftest = build, selftest
        self.kernel: Any = None  # triton's JITFunction once built (triton ships no types)
        self._state: dict[torch.device, bool] = {}
        self._lock = threading.Lock()

    def enabled(self, device: torch.device) -> bool:
        if device.type != "cuda" or os.environ.get("COLOSYNC_NO_TRITON"):
            return False
        ok = self._state.get(device)
        if ok is not None:
            return ok
        with self._lock:
            if device in self._state:
                return self._state[device]
            try:
                if self.kernel is None:
                    self.kernel = self._build()
                with torch.cuda.device(device):
                    self._selftest(device)
                self._state[device] = True
            except Exception as exc:  # missing, failing to compile, or wrong: the fallback instead
                log.warning(
                    "%s unavailable on %s (%s: %s); %s", self.what, device, type(exc).__name__, exc, self.fallback
                )
                self._state[device] = False
        return self._state[device]


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    @no_type_check  # Triton DSL, not Python: its values are tl tensors, compiled by triton.jit
    def copy_check_kernel(
        src, dst, out, n_words, word0, COPY: tl.constexpr, LANES: tl.constexpr, EMASK: tl.constexpr, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lane = tl.arange(0, BLOCK).to(tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        bad = tl.zeros([BLOCK], dtype=tl.int64)
        n_blocks = tl.cdiv(n_words, BLOCK)
        for b in range(pid, n_blocks, nprog):
            offs = b.to(tl.int64) * BLOCK + lane
            mask = offs < n_words
            w = tl.load(src + offs, mask=mask, other=0)
            if COPY:
                tl.store(dst + offs, w, mask=mask)
            acc += w * ((word0 + offs) // 1024 + 1)
            if LANES == 2:
                for k in tl.static_range(4):
                    bad = bad | (((w >> (16 * k)) & EMASK) == EMASK).to(tl.int64)
            elif LANES == 4:
                for k in tl.static_range(2):
                    bad = bad | (((w >> (32 * k)) & EMASK) == EMASK).to(tl.int64)
            elif LANES == 8:
                bad = bad | ((w & EMASK) == EMASK).to(tl.int64)
        tl.atomic_add(out, tl.sum(acc, axis=0))
        if LANES != 0:
            tl.atomic_add(out + 1, tl.max(bad, axis=0))

    return copy_check_kernel


_sms: dict[torch.device, int] = {}


def _launch(src: torch.Tensor, dst: torch.Tensor | None, out: torch.Tensor, word0: int, lanes: int, emask: int) -> None:
    words = src.view(torch.int64)
    n = words.numel()
    if n == 0:
        return
    sms = _sms.get(src.device)
    if sms is None:
        sms = _sms[src.device] = torch.cuda.get_device_properties(src.device).multi_processor_count
    grid = (max(1, min(triton_cdiv(n, _BLOCK), _WAVES * sms)),)
    _copy_check.kernel[grid](
        words,
        dst.view(torch.int64) if dst is not None else words,
        out,
        n,
        word0,
        COPY=dst is not None,
        LANES=lanes,
        EMASK=emask,
        BLOCK=_BLOCK,
        num_warps=_WARPS,
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _selftest(device: torch.device) -> None:
    g = torch.Generator(device=device).manual_seed(7)
    raw = torch.randint(0, 256, (3 * 8192 + 640,), dtype=torch.uint8, device=device, generator=g)
    for dtype, (lanes, emask) in _LANES.items():
        for poison in (False, True):
            src = raw.view(dtype).clone()
            src.masked_fill_(~torch.isfinite(src), 1.0)
            if poison:
                src[len(src) // 2] = float("nan")
            src = src.view(torch.uint8)
            dst = torch.empty_like(src)
            out = torch.zeros(2, dtype=torch.int64, device=device)
            _launch(src[8192:], dst[8192:], out, 1024, lanes, emask)
            got_fp, got_bad = out.tolist()
            if got_fp != int(fingerprint_tensor(src[8192:], 8192)) or not torch.equal(dst[8192:], src[8192:]):
                raise RuntimeError(f"fused copy/fingerprint disagrees with PyTorch on {dtype}")
            if bool(got_bad) != (not bool(torch.isfinite(src[8192:].view(dtype)).all())):
                raise RuntimeError(f"fused non-finite check disagrees with PyTorch on {dtype}")


_copy_check = SelfTestedKernel("fused copy/check kernel", _build, _selftest, "using PyTorch ops")


def enabled(device: torch.device) -> bool:
    """Whether the fused kernel runs on ``device`` (built and self-tested once per device)."""
    return _copy_check.enabled(device)


def clip(segs: list[Segment] | None, offset: int, nbytes: int) -> list[Segment] | None:
    """The part of a bucket's ``segs`` inside its chunk ``[offset, offset + nbytes)``, relative to
    the chunk, for ``copy_check(chunk, ..., offset=offset)``: a bucket checked chunk by chunk into
    one ``out`` gets the fingerprint and flag of the whole (``offset`` and ``nbytes`` multiples of 8)."""
    if segs is None:
        return None
    end = offset + nbytes
    return [
        (max(start, offset) - offset, min(stop, end) - offset, lanes, emask, dtype)
        for start, stop, lanes, emask, dtype in segs
        if start < end and stop > offset
    ]


def copy_check(
    src: torch.Tensor,
    dst: torch.Tensor | None,
    segs: list[Segment] | None,
    offset: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (if given) and return ``[fingerprint, non-finite flag]`` (int64, lazy).

    ``src`` holds bytes ``[offset, offset + len)`` of a bucket; ``segs`` (from ``segments``,
    relative to ``src``) says which ranges hold which float dtype, or ``None`` to skip the
    non-finite check. ``out``, if given, is an int64 pair (zeroed before a bucket's first chunk)
    that the result is added into: it saves an allocation per call, and the chunks of one bucket
    (``clip``) add up to the bucket's result. The fused kernel needs it on ``src``'s device; the
    PyTorch fallback also adds a host bucket's result into a row on the GPU. Nothing waits for
    the device.
    """
    device = src.device
    if enabled(device):
        if out is None:
            out = torch.zeros(2, dtype=torch.int64, device=device)
        if not segs:
            _launch(src, dst, out, offset // 8, 0, 0)
        else:
            for start, end, lanes, emask, _ in segs:
                _launch(
                    src[start:end],
                    dst[start:end] if dst is not None else None,
                    out,
                    (offset + start) // 8,
                    lanes,
                    emask,
                )
        return out
    if dst is not None:
        dst.copy_(src, non_blocking=True)
    fp = fingerprint_tensor(src, offset) if src.numel() else torch.zeros((), dtype=torch.int64, device=device)
    checked = [src[s:e].view(dtype) for s, e, lanes, _, dtype in (segs or ()) if lanes and e > s and dtype is not None]
    if not checked:
        result = torch.stack([fp, torch.zeros((), dtype=torch.int64, device=device)])
    else:
        # min and max carry any NaN or infinity: ~25x faster than an inf-norm on a CPU (bf16, one thread)
        bounds = torch.stack([b.double() for t in checked for b in torch.aminmax(t)])
        bad = ~torch.isfinite(bounds).all()
        result = torch.stack([fp, bad.to(torch.int64)])
    return out.add_(result.to(out.device)) if out is not None else result  # (a host bucket's row may be on the GPU)


__all__ = ["segments", "clip", "copy_check", "enabled"]
