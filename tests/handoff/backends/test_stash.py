"""The stash: offload and restore keep every tensor object, view and alias; counts add up."""

from __future__ import annotations

import pytest
import torch

from colosync.errors import StashError
from colosync.handoff.backends.stash import StashStats, TensorStash
from tests.helpers import MiB, cpu_host_pool


def test_stash_keeps_objects_views_and_aliasing():
    base = torch.randn(1024, 256)
    view = base[:, 3:7]  # non-contiguous view of the same storage
    other = torch.arange(5000, dtype=torch.int64)
    before = (base.clone(), view.clone(), other.clone())
    ids = (id(base), id(view), id(other))
    st = TensorStash("t", "cpu", cpu_host_pool(chunk_bytes=MiB))
    stats = st.offload([base, view, other, base], backup=True)
    assert stats.tensors == 3 and stats.bytes_to_host >= base.numel() * 4 + other.numel() * 8
    assert base.numel() == 0 and other.numel() == 0  # placeholders: using them fails loudly
    assert stats.device_freed == base.numel() * 0 + 1024 * 256 * 4 + 5000 * 8
    assert st.offload([base], backup=True).noop  # idempotent
    st.restore()
    assert st.restore().noop
    assert (id(base), id(view), id(other)) == ids
    assert torch.equal(base, before[0]) and torch.equal(view, before[1]) and torch.equal(other, before[2])
    view.fill_(7.0)  # aliasing survived: writing the view changes the base
    assert torch.all(base[:, 3:7] == 7.0)
    assert base.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()  # one flat buffer


def test_second_cycle_is_one_large_copy():
    ts = [torch.randn(64, 1024) for _ in range(32)]  # 32 x 256 KiB
    st = TensorStash("t", "cpu", cpu_host_pool(chunk_bytes=16 * MiB))
    first = st.offload(ts, backup=True)
    assert first.copies == 32
    st.restore()
    second = st.offload(ts, backup=True)
    assert second.copies == 1  # laid out back to back: coalesced
    st.restore()


def test_stash_reports_memory_it_could_not_free():
    t = torch.randn(1 << 20)
    extra = t.view(-1)[:10]  # a view the stash is not told about
    st = TensorStash("t", "cpu", cpu_host_pool(chunk_bytes=MiB))
    stats = st.offload([t], backup=True)
    assert stats.device_retained == 4 * MiB and stats.device_freed == 0
    st.restore()
    del extra


def test_backup_needs_a_pool():
    with pytest.raises(StashError, match="HostPool"):
        TensorStash("t", "cpu").offload([torch.ones(3)], backup=True)


def test_stats_of_two_stashes_add_up():
    a = StashStats(participant="t.grads", op="offload", tensors=2, copies=0, device_freed=10, seconds=0.5)
    b = StashStats(
        participant="t.state",
        op="offload",
        tensors=3,
        copies=1,
        bytes_to_host=7,
        host_allocated=8,
        device_freed=20,
        seconds=0.25,
        note="x",
    )
    both = StashStats(noop=True) + a + b
    assert not both.noop and both.participant == "t.grads" and both.note == "x"
    assert (both.tensors, both.copies, both.device_freed, both.bytes_to_host, both.host_allocated) == (5, 1, 30, 7, 8)
    assert both.seconds == 0.75
    assert (StashStats(noop=True) + StashStats(noop=True)).noop
