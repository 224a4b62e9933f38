"""Pack a bucket's tensors and fingerprint the bucket in one kernel launch, one read of each byte.

A LoRA bucket is hundreds of small tensors. ``torch._foreach_copy_`` packs them in about ten
launches, and the fingerprint (``bucket.fingerprint_tensor``) is a second pass over the bucket,
so the trainer reads every byte twice before the engine may start. The gather kernel reads
each source once, stores it at its place in the bucket and adds it to the bucket's
fingerprint on the way (padding is zero, so it adds nothing: the sum is the whole bucket's).

The sources are named by rows in a device table -- (address, first word in the bucket,
words), at most ``CHUNK`` words each, so the work spreads over the GPU whatever the tensor
sizes -- rather than by kernel arguments. A CUDA graph of the launch therefore stays valid
when the trainer's tensors move: ``GatherTable.bind`` rewrites the rows (stream-ordered, so a
launch still reading the old rows is unaffected) and the same graph replays.

Sources qualify when they are contiguous, 16-byte aligned and a whole number of 8-byte words,
on the bucket's device; ``bind`` says False otherwise and the caller packs the two-pass way.
Without Triton, or where its self-test fails, ``enabled`` is False for good (logged once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, no_type_check

import torch

from colosync.kernels.fused import SelfTestedKernel
from colosync.wire.bucket import fingerprint_tensor
from colosync.wire.manifest import TensorMeta

CHUNK = 1 << 14
"""Words (8 bytes) per table row: 128 KiB. On an H200 (``benchmarks/kernels/record.json``) 16K-word rows
packed seed-lora's bucket in 0.091 ms (0.103 with 64K, 0.19 with 256K: too few programs) and a 4 GiB bucket of
llama8b-full in 2.05 ms, against 1.97 ms for a plain device copy of it."""
_BLOCK = 2048  # words per program step
_WARPS = 4
_PTR = torch.Tensor.data_ptr
_CONTIGUOUS = torch.Tensor.is_contiguous


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    @no_type_check  # Triton DSL, compiled by triton.jit
    def gather_kernel(table, dst, out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        addr = tl.load(table + 3 * row)
        first = tl.load(table + 3 * row + 1)
        n = tl.load(table + 3 * row + 2)
        src = addr.to(tl.pointer_type(tl.int64))
        lane = tl.arange(0, BLOCK).to(tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, n, BLOCK):
            offs = start + lane
            mask = offs < n
            w = tl.load(src + offs, mask=mask, other=0)
            tl.store(dst + first + offs, w, mask=mask)
            acc += w * ((first + offs) // 1024 + 1)
        tl.atomic_add(out, tl.sum(acc, axis=0))

    return gather_kernel


def launch(table: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> None:
    """Run the rows of ``table`` into ``dst`` (the bucket, uint8) and add their fingerprint to ``out[0]``."""
    rows = table.shape[0]
    if rows:
        _gather.kernel[(rows,)](table, dst.view(torch.int64), out, BLOCK=_BLOCK, num_warps=_WARPS)


class GatherTable:
    """The gather rows of one bucket (``metas``) on one device, for the sources last bound."""

    def __init__(self, metas: Sequence[TensorMeta], device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # sources report cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.whole = all(m.nbytes % 8 == 0 for m in metas)
        index: list[int] = []
        static: list[tuple[int, int, int]] = []  # per row: source byte offset, first word, words
        for j, m in enumerate(metas):
            words = m.nbytes // 8
            for start in range(0, words, CHUNK):
                index.append(j)
                static.append((start * 8, m.offset // 8 + start, min(CHUNK, words - start)))
        self._index = torch.tensor(index, dtype=torch.long)
        self._static = torch.tensor(static, dtype=torch.int64).reshape(-1, 3)
        self.table = torch.empty(len(index), 3, dtype=torch.int64, device=device)
        self.ptrs: tuple[int, ...] | None = None  # the sources the rows name now
        self.layout_number = 0  # and the layout number they had then

    def bind(self, srcs: Sequence[torch.Tensor], layout: int = 0) -> bool:
        """Point the rows at ``srcs`` (rewritten only if they moved); False if they do not qualify.

        ``layout``: a number for the sources' shapes, strides, dtypes and devices (``LayoutVersion``; 0 if
        unknown). Sources at the rows' addresses with the rows' number qualified when the rows were
        written, so nothing else about them is read."""
        ptrs = tuple(map(_PTR, srcs))
        if layout and ptrs == self.ptrs and layout == self.layout_number:
            return True
        if not all(map(_CONTIGUOUS, srcs)):
            return False
        if ptrs == self.ptrs:
            self.layout_number = layout
            return True
        device = self.device
        if not self.whole or any(p % 16 for p in ptrs) or any(s.device != device for s in srcs):
            return False
        rows = self._static.clone()
        if len(rows):
            rows[:, 0] += torch.tensor(ptrs, dtype=torch.int64)[self._index]
        self.table.copy_(rows)  # on the current stream: after any launch still reading the old rows
        self.ptrs, self.layout_number = ptrs, layout
        return True


def _selftest(device: torch.device) -> None:
    """The kernel against ``fingerprint_tensor`` and a plain copy, on odd sizes and chunk edges."""
    g = torch.Generator(device=device).manual_seed(11)
    sizes = [5, 1024, CHUNK + 3, 0, 2 * CHUNK]  # words
    srcs = [torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, device=device, generator=g) for n in sizes]
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // 8) * 8 + 8  # 64-byte aligned, with a word of padding at least
    metas = [
        TensorMeta(f"t{i}", "int64", (n,), 0, off * 8, n * 8)
        for i, (n, off) in enumerate(zip(sizes, offsets, strict=True))
    ]
    dst = torch.full((pos * 8,), 0xAB, dtype=torch.uint8, device=device)
    for n, off in zip(sizes, offsets, strict=True):  # padding is zero in a packed bucket
        dst.view(torch.int64)[off + n : off + -(-n // 8) * 8 + 8] = 0
    table = GatherTable(metas, device)
    if not table.bind(srcs):
        raise RuntimeError("the self-test's sources do not qualify")
    out = torch.zeros(2, dtype=torch.int64, device=device)
    launch(table.table, dst, out)
    words = dst.view(torch.int64)
    for n, off, src in zip(sizes, offsets, srcs, strict=True):
        if not torch.equal(words[off : off + n], src):
            raise RuntimeError("the gather kernel put a tensor's words in the wrong place")
    if int(out[0]) != int(fingerprint_tensor(dst)):
        raise RuntimeError("the gather kernel's fingerprint disagrees with fingerprint_tensor")


_gather = SelfTestedKernel("gather kernel", _build, _selftest, "packing in two passes")


def enabled(device: torch.device) -> bool:
    """Whether the gather kernel runs on ``device`` (built and self-tested once per device)."""
    return _gather.enabled(device)


__all__ = ["CHUNK", "GatherTable", "enabled", "launch"]
