"""Buckets: aligned layout under a cap, fused packing, zero-copy views, a fingerprint that notices."""

from __future__ import annotations

import itertools

import pytest
import torch

from colosync.wire.bucket import fingerprint, plan_buckets, tensor_views
from colosync.wire.manifest import ALIGN
from tests.helpers import pack_into

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def specs_of(named):
    return [(n, tuple(t.shape), t.dtype) for n, t in named]


def test_roundtrip_every_dtype_and_shape():
    named = [
        (f"t{i}.{d}", sample(d, s, i))
        for i, (d, s) in enumerate((d, s) for d in DTYPES for s in [(), (1,), (3, 5), (2, 3, 7)])
    ]
    layout = plan_buckets(specs_of(named), 256)
    metas, sizes = layout.tensors, layout.bucket_sizes
    assert all(m.offset % ALIGN == 0 for m in metas)
    buffers = [torch.zeros(s, dtype=torch.uint8) for s in sizes]
    for b, buf in enumerate(buffers):
        in_bucket = [(m, t) for m, (_, t) in zip(metas, named, strict=True) if m.bucket == b]
        pack_into(buf, [m for m, _ in in_bucket], [t for _, t in in_bucket])
    views = {}
    for b, buf in enumerate(buffers):
        views.update(tensor_views(buf, [m for m in metas if m.bucket == b]))
    for name, t in named:
        assert views[name].dtype == t.dtype and views[name].shape == t.shape
        assert (
            torch.equal(views[name].view(torch.uint8), t.view(torch.uint8))
            if t.dim()
            else torch.equal(views[name].reshape(1).view(torch.uint8), t.reshape(1).view(torch.uint8))
        )


def test_views_are_zero_copy():
    layout = plan_buckets([("a", (4,), torch.float32), ("b", (2, 2), torch.float32)], 1024)
    metas, sizes = layout.tensors, layout.bucket_sizes
    buf = torch.zeros(sizes[0], dtype=torch.uint8)
    views = tensor_views(buf, metas)
    views["b"][1, 1] = 5.0
    assert views["b"].data_ptr() == buf.data_ptr() + metas[1].offset
    assert buf[metas[1].offset + 12 : metas[1].offset + 16].view(torch.float32).item() == 5.0


def test_cap_respected_and_oversize_tensor_gets_own_bucket():
    specs = [
        ("small0", (10,), torch.float32),
        ("huge", (1000,), torch.float32),
        ("small1", (10,), torch.float32),
        ("small2", (10,), torch.float32),
    ]
    layout = plan_buckets(specs, 128)
    metas, sizes = layout.tensors, layout.bucket_sizes
    by_name = {m.name: m for m in metas}
    assert by_name["huge"].bucket not in (by_name["small0"].bucket, by_name["small1"].bucket)
    assert sizes[by_name["huge"].bucket] == 4000 // ALIGN * ALIGN + ALIGN
    assert all(size <= 128 for b, size in enumerate(sizes) if b != by_name["huge"].bucket)


def test_bucket_cap_must_hold_an_alignment_unit():
    with pytest.raises(ValueError, match="at least 64"):
        plan_buckets([("a", (1,), torch.float32)], 8)


def test_fingerprint_detects_flips_and_moves():
    buf = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8)
    base = fingerprint(buf)
    flipped = buf.clone()
    flipped[12345] ^= 1
    assert fingerprint(flipped) != base
    moved = buf.clone().view(-1, 8192)
    moved[[0, 1]] = moved[[1, 0]]
    assert fingerprint(moved.flatten()) != base
    assert fingerprint(buf.clone()) == base
    assert fingerprint(torch.empty(0, dtype=torch.uint8)) == 0


def test_fingerprint_adds_up_over_chunks():
    from colosync.wire.bucket import fingerprint_tensor

    buf = torch.randint(0, 256, (3 * 8192 + 704,), dtype=torch.uint8)
    whole = fingerprint(buf)
    for chunk in (64, 512, 8192, 3 * 4096, 20000 // 64 * 64):
        parts = sum(int(fingerprint_tensor(buf[o : o + chunk], o)) for o in range(0, buf.numel(), chunk))
        assert (parts + 2**63) % 2**64 - 2**63 == whole


def test_float_runs_and_segments_stop_at_other_dtypes():
    from colosync.kernels.fused import segments
    from colosync.wire.bucket import float_runs

    specs = [
        ("a", (3, 5), torch.bfloat16),
        ("b", (7,), torch.bfloat16),
        ("i", (4,), torch.int32),
        ("c", (9,), torch.bfloat16),
        ("d", (3,), torch.float32),
    ]
    layout = plan_buckets(specs, 1 << 20)
    metas, sizes = layout.tensors, layout.bucket_sizes
    runs = float_runs(metas)
    assert [r[2] for r in runs] == [torch.bfloat16, torch.bfloat16, torch.float32]  # "i" splits the bf16 run
    segs = segments(metas, sizes[0])
    assert segs[0][0] == 0 and segs[-1][1] == sizes[0]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(segs))  # contiguous cover
    assert all(s[0] % 8 == 0 and s[1] % 8 == 0 for s in segs)
    assert float_runs(plan_buckets([("f8", (4,), torch.float8_e4m3fn)], 1024).tensors) is None


def test_copy_check_copies_fingerprints_and_flags_nonfinite():
    from colosync.kernels.fused import copy_check, segments

    named = [("w", torch.randn(40, 3)), ("n", torch.arange(5, dtype=torch.int64)), ("h", torch.randn(9).half())]
    layout = plan_buckets(specs_of(named), 1 << 20)
    metas, sizes = layout.tensors, layout.bucket_sizes
    buf = torch.zeros(sizes[0], dtype=torch.uint8)
    pack_into(buf, metas, [t for _, t in named])
    segs = segments(metas, sizes[0])
    dst = torch.empty_like(buf)
    fp, bad = copy_check(buf, dst, segs).tolist()
    assert torch.equal(dst, buf) and fp == fingerprint(buf) and bad == 0
    tensor_views(buf, metas)["h"][4] = float("inf")
    assert copy_check(buf, None, segs).tolist()[1] == 1
    tensor_views(buf, metas)["h"][4] = 0
    buf[metas[1].offset : metas[1].offset + 8] = 255  # an int tensor full of ones is no NaN
    assert copy_check(buf, None, segs).tolist()[1] == 0


@pytest.mark.parametrize("size", [8, 72])
def test_changing_any_byte_of_a_small_bucket_changes_its_fingerprint(size):
    """A bucket's fingerprint notices every changed byte, however short the bucket (buckets are whole words)."""
    buf = torch.arange(size, dtype=torch.uint8) * 37 + 11
    before = fingerprint(buf)
    for i in range(size):
        changed = buf.clone()
        changed[i] ^= 0x5A
        assert fingerprint(changed) != before, f"byte {i} of {size} changed, fingerprint did not"
    assert fingerprint(torch.empty(0, dtype=torch.uint8)) == 0
