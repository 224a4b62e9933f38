"""``Versions``: which LoRA versions a vLLM engine committing beside running requests holds, and when each retires.

The bookkeeping alone, with the retirement recorded instead of sent to vLLM's workers (the real
engine runs it in ``test_vllm_inflight``): a version retires exactly when it is superseded and
its last request has ended, never while a request still runs on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from colosync.engines.vllm.versions import Slots, Versions
from colosync.engines.vllm.worker import VERSIONED_ID_BASE, versioned_update_id
from colosync.errors import ConfigError, EngineError, VersionLagError
from colosync.sync.staleness import Staleness


def committed(versions: Versions, uid: int) -> None:
    """What the link does for a LoRA commit that verifies: room, the workers' commit, publish."""
    versions.make_room()
    versions.staged(uid)
    versions.publish()


def test_a_superseded_version_retires_when_its_last_request_ends():
    retired: list[int] = []
    versions = Versions(3, retired.append)
    committed(versions, 1)
    with versions.lease() as first, versions.lease() as second:
        assert first.update_id == second.update_id == 1
        assert first.lora_request.lora_int_id == VERSIONED_ID_BASE + 1
        committed(versions, 2)
        with versions.lease() as third:
            assert third.update_id == 2  # new requests get the new version at once
        assert retired == [] and versions.installed() == [1, 2]
    assert retired == [1] and versions.installed() == [2]  # its last request ended
    committed(versions, 3)
    assert retired == [1, 2]  # nothing ran on 2 any more: retired at the commit
    assert (versions.lag(1), versions.lag(2), versions.lag(3)) == (2, 1, 0)  # a sample's staleness
    assert versioned_update_id(VERSIONED_ID_BASE + 3) == 3 and versioned_update_id(7) is None


def test_a_version_being_verified_is_served_to_nobody_and_a_revert_forgets_it():
    retired: list[int] = []
    versions = Versions(2, retired.append)
    committed(versions, 1)
    versions.make_room()
    versions.staged(2)
    assert versions.probe_version() == 2
    with versions.lease() as lease:
        assert lease.update_id == 1
    versions.reverted(1)
    versions.publish()  # nothing pending: nothing changes
    assert versions.current == 1 and versions.installed() == [1] and retired == []


def test_beyond_the_limit_a_commit_waits_for_a_retirement_and_times_out_naming_the_requests():
    retired: list[int] = []
    versions = Versions(2, retired.append, room_timeout_s=0.3)
    committed(versions, 1)
    held = versions.lease()
    held.__enter__()
    committed(versions, 2)  # 1 and 2 installed: full
    with pytest.raises(EngineError, match=r"\{1: 1\}.*versions_in_flight"):
        versions.make_room()
    versions.room_timeout_s = 10.0
    threading.Timer(0.3, lambda: held.__exit__(None, None, None)).start()
    waited = versions.make_room()
    assert 0.2 < waited < 5 and retired == [1]


def test_a_full_update_waits_for_every_request_and_lets_none_start_until_applied():
    retired: list[int] = []
    versions = Versions(2, retired.append)
    committed(versions, 1)
    held = versions.lease()
    held.__enter__()
    committed(versions, 2)
    events: list[str] = []

    def full_update():
        with versions.exclusive():
            events.append("applied")
            time.sleep(0.2)
            versions.reset(0, 3)  # the full update (update 3) dropped the adapter

    def late_request():
        with versions.lease() as lease:
            events.append(f"request on {lease.update_id}")

    full = threading.Thread(target=full_update)
    full.start()
    time.sleep(0.2)
    late = threading.Thread(target=late_request)
    late.start()
    time.sleep(0.1)
    assert events == []  # the full update waits for the request on 1; the late request waits for the update
    held.__exit__(None, None, None)
    full.join(5)
    late.join(5)
    assert events[0] == "applied" and retired == [1]
    assert events[1] == "request on 0"  # after the update (which dropped the adapter), never during it


def test_a_version_that_failed_to_retire_keeps_its_slot_and_is_retried_before_the_next_commit():
    attempts: list[int] = []

    def retire(uid: int) -> None:
        attempts.append(uid)
        if len(attempts) == 1:
            raise RuntimeError("the workers did not answer")

    versions = Versions(2, retire, room_timeout_s=0.2)
    committed(versions, 1)
    committed(versions, 2)  # 1 retires at once, and that fails: it still holds a slot
    assert versions.installed() == [1, 2]
    committed(versions, 3)  # tried again first, then there is room
    assert attempts == [1, 1, 2] and versions.installed() == [3]


def test_a_full_update_that_cannot_drain_says_which_requests_hold_it_and_blocks_nothing_after():
    versions = Versions(2, lambda uid: None, room_timeout_s=0.2)
    committed(versions, 1)
    held = contextlib.ExitStack()
    assert versions.try_lease(held) is not None
    with pytest.raises(EngineError, match=r"\{1: 1\}"), versions.exclusive():
        pass
    assert versions.try_lease(contextlib.ExitStack()) is not None  # new requests start again
    held.close()
    versions.reset(0, 7)  # a full update committed as 7, the adapter dropped
    assert versions.lag(1) == 1 and versions.lag(7) == 0


def test_fewer_than_two_versions_is_refused():
    with pytest.raises(ConfigError, match="at least 2"):
        Versions(1, lambda uid: None)


def test_adapters_sharing_the_slots_wait_for_each_other_and_a_reserved_slot_counts():
    """Named adapters' commits run at once: the slot one made room for is taken until it installs or fails."""
    slots = Slots()
    slots.total = 3
    retired: list[int] = []
    a, b, c = (Versions(2, retired.append, room_timeout_s=0.3, slots=slots, name=n) for n in "abc")
    committed(a, 1)
    a.make_room()  # a's next version is on its way
    b.make_room()  # b's first: the last free slot, reserved
    with pytest.raises(EngineError, match=r"no free LoRA slot for adapter 'c'.*all 3 .*a: versions \[1\]"):
        c.make_room()
    a.unreserve()  # a's commit failed: its slot is free again
    b.staged(1)
    b.publish()
    with a.lease():
        committed(a, 2)  # a's version 1 runs on: a holds 1 and 2, b holds 1, no slot is free
        started = time.monotonic()
        with pytest.raises(EngineError, match="no free LoRA slot for adapter 'c'"):
            c.make_room()
        assert time.monotonic() - started >= 0.25  # it waited for a retirement before it gave up
    c.make_room()  # a's version 1 retired with its last request: room for c
    assert retired == [1] and (a.installed(), b.installed()) == ([2], [1])


def test_no_request_starts_on_a_version_more_than_max_lag_behind_the_trainer():
    """The trainer began updates 2 and 3 (2 failed): version 1 lags by 2, over max_lag=1, until 3 commits."""
    staleness = Staleness(max_lag=1)
    versions = Versions(2, lambda uid: None, room_timeout_s=0.3, staleness=staleness)
    staleness.begun.add(1)
    committed(versions, 1)
    staleness.begun.add(2)  # a push on its way (it will fail): one behind is allowed
    with versions.lease() as lease:
        assert lease.update_id == 1
    staleness.begun.add(3)
    assert staleness.behind(1) == 2
    with contextlib.ExitStack() as held:
        assert versions.try_lease(held) is None  # the driving thread starts none and steps on
    lagging = r"update 1: the trainer began 2 updates after it \(the newest 3\).*max_lag=1"
    with pytest.raises(VersionLagError, match=lagging), versions.lease():
        pass
    with pytest.raises(VersionLagError, match="max_lag=1"):
        asyncio.run(_lease_async(versions))
    assert versions.in_flight() == {}  # the refused ones hold nothing
    with versions.lease(bounded=False) as scoring:
        assert scoring.update_id == 1  # a scoring request is not held up by the bound

    versions.room_timeout_s = 10.0
    got: list[int] = []
    waiting = threading.Thread(target=lambda: got.append(_leased(versions)))
    waiting.start()
    time.sleep(0.2)
    assert got == []  # it waits for a newer commit
    committed(versions, 3)
    waiting.join(5)
    assert got == [3]


def test_without_max_lag_a_lagging_version_serves_and_a_bad_bound_is_refused():
    staleness = Staleness()
    versions = Versions(2, lambda uid: None, staleness=staleness)
    committed(versions, 1)
    for uid in range(2, 10):
        staleness.begun.add(uid)
    assert _leased(versions) == 1 and staleness.behind(1) == 8
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="max_lag"):
            Staleness(bad)


def _leased(versions: Versions) -> int:
    with versions.lease() as lease:
        return lease.update_id


async def _lease_async(versions: Versions) -> int:
    async with versions.lease_async() as lease:
        return lease.update_id
