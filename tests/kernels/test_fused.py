"""A bucket checked chunk by chunk (``fused.clip`` + ``copy_check`` into one ``out``) gets the
fingerprint and the non-finite verdict of the whole bucket: a full update staged in host memory
is checked this way on the device, chunk by chunk as each one passes through its slot."""

from __future__ import annotations

import pytest
import torch

from colosync.kernels.fused import clip, copy_check, segments
from colosync.wire.bucket import fingerprint, plan_buckets

SPECS = [
    ("step", (3,), torch.int64),
    ("w", (37, 5), torch.bfloat16),
    ("mask", (11,), torch.bool),
    ("b", (29,), torch.float32),
    ("h", (13,), torch.float16),
]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def bucket(device: str) -> tuple[torch.Tensor, list]:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layout = plan_buckets(SPECS, 1 << 20)
    size = layout.bucket_sizes[0]
    g = torch.Generator().manual_seed(3)
    src = torch.zeros(size, dtype=torch.uint8)
    for m in layout.tensors:
        view = src[m.offset : m.offset + m.nbytes].view(m.torch_dtype)
        if m.torch_dtype.is_floating_point:
            view.copy_(torch.randn(view.numel(), generator=g).to(m.torch_dtype))
        else:
            view.copy_(torch.randint(0, 2, (view.numel(),), generator=g).to(m.torch_dtype))
    segs = segments(layout.tensors, size)
    assert segs is not None
    return src.to(device), segs


def chunked(src: torch.Tensor, segs: list, chunk: int) -> list[int]:
    out = torch.zeros(2, dtype=torch.int64, device=src.device)
    for offset in range(0, src.numel(), chunk):
        part = src[offset : offset + chunk]
        copy_check(part, None, clip(segs, offset, part.numel()), offset=offset, out=out)
    return [int(out[0]), int(bool(out[1]))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [8, 64, 200, 1 << 20])
def test_a_bucket_checked_chunk_by_chunk_has_the_fingerprint_and_verdict_of_the_whole(device, chunk):
    src, segs = bucket(device)
    assert chunked(src, segs, chunk) == [fingerprint(src.cpu()), 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_non_finite_value_in_any_chunk_flags_the_bucket(device, dtype):
    src, segs = bucket(device)
    start, end = next((s, e) for s, e, lanes, _, d in segs if d == dtype and lanes)
    for at in (start, (start + end) // 2 // dtype.itemsize * dtype.itemsize, end - dtype.itemsize):
        bad = src.clone()
        bad[at : at + dtype.itemsize].view(dtype).fill_(float("inf"))
        for chunk in (8, 64):
            assert chunked(bad, segs, chunk)[1] == 1, (dtype, at, chunk)


def test_clip_keeps_the_segments_inside_a_chunk_relative_to_it():
    segs = [(0, 24, 0, 0, None), (24, 96, 2, 0x7F80, torch.bfloat16), (96, 104, 0, 0, None)]
    assert clip(segs, 16, 64) == [(0, 8, 0, 0, None), (8, 64, 2, 0x7F80, torch.bfloat16)]
    assert clip(segs, 96, 8) == [(0, 8, 0, 0, None)]
    assert clip(None, 0, 8) is None


def test_segments_cover_a_bucket_from_byte_zero_when_it_starts_with_integers():
    """The fused copy/check reads a bucket segment by segment: the segments must cover every byte from 0,
    whatever dtype comes first, and every floating tensor must lie inside a segment checked as its dtype."""
    import itertools

    specs = [
        ("step", (3,), torch.int64),
        ("w", (5, 3), torch.bfloat16),
        ("mask", (11,), torch.bool),
        ("b", (7,), torch.float32),
        ("ids", (2,), torch.int32),
    ]
    layout = plan_buckets(specs, 1 << 20)
    size = layout.bucket_sizes[0]
    segs = segments(layout.tensors, size)
    assert segs is not None
    assert segs[0][0] == 0 and segs[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(segs))
    for m in layout.tensors:
        if not m.torch_dtype.is_floating_point:
            continue
        (seg,) = [s for s in segs if s[0] <= m.offset < s[1]]
        assert seg[1] >= m.offset + m.nbytes and seg[4] == m.torch_dtype and seg[2] == m.torch_dtype.itemsize


def test_copy_check_of_no_bytes_is_fingerprint_zero_and_finite():
    """An empty bucket (only zero-size tensors) is checked like any other: fingerprint 0, nothing non-finite."""
    empty = torch.empty(0, dtype=torch.uint8)
    assert copy_check(empty, None, None).tolist() == [0, 0]
    assert copy_check(empty, torch.empty(0, dtype=torch.uint8), [], offset=8).tolist() == [0, 0]


def test_copy_check_writes_its_verdict_into_the_out_pair_it_is_given():
    """``out=`` (the receiver's per-bucket result row) receives the fingerprint and the non-finite flag."""
    specs = [("w", (4, 4), torch.float32)]
    layout = plan_buckets(specs, 1 << 16)
    size = layout.bucket_sizes[0]
    src = torch.zeros(size, dtype=torch.uint8)
    src[:64].view(torch.float32).copy_(torch.arange(16.0))
    src[4:8].view(torch.float32).fill_(float("nan"))
    out = torch.zeros(2, dtype=torch.int64)
    result = copy_check(src, None, segments(layout.tensors, size), out=out)
    assert out.tolist() == [fingerprint(src), 1]
    assert result.data_ptr() == out.data_ptr()
