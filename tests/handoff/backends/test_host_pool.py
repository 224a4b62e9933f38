"""The host pool: chunks reused across leases, copies split at chunk edges, ``max_bytes``."""

from __future__ import annotations

import pytest
import torch

from colosync.errors import ConfigError, HostPoolExhausted, StashError
from colosync.handoff.backends.host_pool import HostPool
from tests.helpers import MiB, cpu_host_pool


def test_pool_reuses_chunks_and_splits_copies_at_chunk_edges():
    p = cpu_host_pool(chunk_bytes=1 * MiB)
    src = torch.arange(3 * MiB // 4, dtype=torch.int32).view(torch.uint8)
    lease = p.lease("a", src.numel())
    assert p.capacity_bytes == 3 * MiB and p.leases() == {"a": 3 * MiB}
    lease.write(0, src)
    back = torch.empty_like(src)
    lease.read(0, back)
    assert torch.equal(back, src)
    part = torch.empty(1000, dtype=torch.uint8)
    lease.read(MiB - 500, part)  # straddles a chunk boundary
    assert torch.equal(part, src[MiB - 500 : MiB + 500])
    lease.release()
    lease.release()  # idempotent
    again = p.lease("b", 2 * MiB)
    assert p.capacity_bytes == 3 * MiB  # no growth: chunks were reused
    again.release()
    assert p.trim() == 3 * MiB and p.capacity_bytes == 0
    with pytest.raises(StashError, match="already released"):
        lease.write(0, src)


def test_pool_max_bytes_names_the_fix():
    p = cpu_host_pool(chunk_bytes=MiB, max_bytes=2 * MiB)
    held = p.lease("engine.mirror", 2 * MiB)
    with pytest.raises(HostPoolExhausted, match="peak_device='gpu'") as info:
        p.lease("trainer.state", MiB)
    assert "engine.mirror" in str(info.value)
    held.release()
    p.lease("trainer.state", MiB).release()
    p.close()


def test_pool_chunk_size_must_be_whole_pages():
    with pytest.raises(ConfigError, match="multiple of 4096.*HostPool\\(chunk_bytes=1 << 30\\)"):
        HostPool(chunk_bytes=1000, pin="none")


def test_auto_chunks_follow_the_first_copy_so_rounding_stays_small():
    from colosync.handoff.backends.host_pool import MIN_AUTO_CHUNK, GiB, chunk_bytes_for

    small = HostPool(pin="none")
    lease = small.lease("trainer.state", 48 << 20)  # a test-sized state: not one 1 GiB chunk
    assert small.chunk_bytes == chunk_bytes_for(48 << 20) and small.capacity_bytes <= (48 << 20) * 1.04
    lease.release()
    small.close()
    assert chunk_bytes_for(40 << 30) == GiB and chunk_bytes_for(1 << 20) == MIN_AUTO_CHUNK
    big = HostPool(pin="none")
    big.reserve(64 << 20)  # the reservation sizes the chunks, and later leases keep them
    assert big.chunk_bytes == 2 << 20 and big.lease("x", 1 << 20).capacity == 2 << 20
