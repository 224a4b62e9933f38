"""``HostStaging``: where a full update lands in host memory -- pinning, a host pool's chunks, ownership."""

from __future__ import annotations

import torch

from colosync.handoff.backends.arena import HostArena
from colosync.sync.staging import HostStaging
from colosync.wire.bucket import plan_buckets
from colosync.wire.manifest import Layout, TensorMeta, UpdateManifest


def test_a_host_staging_area_pins_when_asked_and_by_default_exactly_when_cuda_is_present():
    assert HostStaging(keep=True, pin=True).pin is True
    assert HostStaging(keep=True, pin=False).pin is False
    assert HostStaging(keep=False).pin is torch.cuda.is_available()


def test_a_host_staging_area_that_lent_nothing_yet_owns_no_tensor():
    """An engine may ask before the first update whether its weights alias the area: they cannot."""
    area = HostStaging(keep=True, pin=False)
    weight = torch.randn(4)
    assert area.owns(weight) is False
    assert area.disown_if_aliased([weight]) is False


def test_a_host_staging_area_with_a_pool_is_a_lease_of_the_pools_chunks_given_back_when_the_update_ends():
    """``HostStaging(pool=...)``: a full update's staging takes the arena's pages (one contiguous lease,
    named for the sync, the buckets back to back inside it), and the lease goes back at ``done`` even when
    the area is kept."""
    with HostArena.create(1 << 18, chunk_bytes=1 << 16, pin="none") as arena:
        pool = arena.pool()
        area = HostStaging(keep=True, pin=False, pool=pool)
        specs = [("a", (3000,), torch.float32), ("b", (100,), torch.float32), ("c", (30000,), torch.float32)]
        manifest = UpdateManifest(1, "full", plan_buckets(specs, 1 << 14))
        staging = area.lend(manifest)
        assert set(pool.leases()) == {"engine.sync_staging"}
        flat = area._lease.flat  # (the lease the area holds: one run of chunks)
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel()
        assert hi - lo >= sum(manifest.bucket_sizes) and max(manifest.bucket_sizes) > arena.chunk_bytes
        for bucket in staging.buckets:
            assert lo <= bucket.data_ptr() and bucket.data_ptr() + bucket.numel() <= hi
        for t, (name, shape, dtype) in zip(staging.tensors, specs, strict=True):
            assert (tuple(t.shape), t.dtype) == (shape, dtype), name
        area.done()
        assert pool.leases() == {} and arena.leased_bytes == 0


def test_host_staging_packs_buckets_back_to_back_in_one_run_of_arena_chunks():
    """The buckets lie page-aligned, in order and without overlap, in one contiguous lease of as few
    chunks as hold them (a bucket may span chunks); an update without buckets leases nothing."""

    def manifest(*sizes: int) -> UpdateManifest:
        metas = tuple(
            TensorMeta(name=f"t{b}", dtype="uint8", shape=(size,), bucket=b, offset=0, nbytes=size)
            for b, size in enumerate(sizes)
        )
        return UpdateManifest(1, "full", Layout(metas, sizes))

    chunk = 1 << 14
    with HostArena.create(8 * chunk, chunk_bytes=chunk, pin="none") as arena:
        pool = arena.pool()
        area = HostStaging(keep=False, pin=False, pool=pool)
        cases = [((4096, chunk - 4096), 1), ((12288, 12288, 12288), 3), ((64, 4096, 64), 1), ((40000,), 3), ((), 0)]
        for sizes, chunks in cases:
            staging = area.lend(manifest(*sizes))
            assert arena.leased_bytes == chunks * chunk, sizes
            flats = staging.buckets
            assert [f.numel() for f in flats] == list(sizes)
            if sizes:
                base = area._lease.flat.data_ptr()  # (the lease the area holds)
                starts = [f.data_ptr() - base for f in flats]
                assert all(s % 4096 == 0 for s in starts) and starts == sorted(starts), sizes
                assert all(a + n <= b for a, n, b in zip(starts, sizes, starts[1:], strict=False)), sizes
            area.done()
            assert arena.leased_bytes == 0


def test_host_staging_owns_exactly_the_bytes_of_its_buckets():
    """``owns``: a tensor inside a bucket is the area's; one that starts just past a bucket's end is not."""
    with HostArena.create(1 << 15, chunk_bytes=1 << 14, pin="none") as arena:
        area = HostStaging(keep=True, pin=False, pool=arena.pool())
        staging = area.lend(UpdateManifest(1, "full", plan_buckets([("w", (64,), torch.float32)], 1 << 14)))
        (flat,) = staging.buckets
        chunk = area._lease.flat
        start = flat.data_ptr() - chunk.data_ptr()
        assert area.owns(staging.tensors[0]) and area.owns(chunk[start + flat.numel() - 1 :])
        assert not area.owns(chunk[start + flat.numel() :]) and not area.owns(torch.empty(4))
        area.release()
