"""Two senders on one engine while a third client generates: one owner, never a mixed version.

Sender A pushes a run of full updates (alternating two versions); sender B, on its own
connection, tries to push meanwhile and is refused with ``EngineBusyError`` naming A; a
generating client runs throughout, and every generation must carry exactly the tokens of
the version its reported update id committed. After A closes, B attaches and commits; an
explicit takeover ends A's ownership and A is told so.
"""

from __future__ import annotations

import os
import threading

import pytest

from colosync.engines.config import Generate
from colosync.errors import EngineBusyError
from colosync.sync.sender import Sender
from tests.faults.updates import NEW_TOKENS, PROMPTS


def test_one_owner_and_every_generation_matches_its_version(fault_engine):
    before = fault_engine.healthy({"base", "new"})
    version_of = {fault_engine.status().committed_update_id: before}
    results: list[tuple[int, list[list[int]]]] = []
    stop = threading.Event()

    def generate() -> None:
        link = fault_engine.engine.connect("generator")
        while not stop.is_set():
            gen = link.call(Generate(PROMPTS, NEW_TOKENS))
            results.append((gen.update_id, gen.tokens))
        link.close()

    generator = threading.Thread(target=generate)
    generator.start()
    a = Sender(fault_engine.engine.connect("sender A"), transport="shm", bucket_bytes=64 << 10)
    b_link = fault_engine.engine.connect("sender B")
    refused = 0
    version = before
    try:
        for _ in range(6):
            version = "new" if version == "base" else "base"
            report = a.push(fault_engine.updates[version])
            version_of[report.update_id] = version
            with pytest.raises(EngineBusyError, match=f"owned by another sender: pid {os.getpid()}"):
                Sender(b_link, transport="shm").push(fault_engine.updates[version])
            refused += 1
    finally:
        stop.set()
        generator.join()
    a.close()  # Detach: B may attach now
    with Sender(b_link, transport="shm") as b:
        report = b.push(fault_engine.updates[before])
        version_of[report.update_id] = before
    b_link.close()
    assert refused == 6 and len(results) > 0
    for update_id, tokens in results:
        assert update_id in version_of, f"a generation reported update {update_id}, which no sender committed"
        assert tokens == fault_engine.tokens[version_of[update_id]], f"update {update_id} served mixed weights"
    fault_engine.healthy({before})


def test_takeover_ends_the_first_owner(fault_engine):
    before = fault_engine.healthy({"base", "new"})
    other = "new" if before == "base" else "base"
    a = Sender(fault_engine.engine.connect("owner"), transport="shm")
    a.push(fault_engine.updates[other])
    with Sender(fault_engine.engine.connect("successor"), transport="shm", takeover=True) as b:
        b.push(fault_engine.updates[before])
    with pytest.raises(EngineBusyError, match=r"no longer owns the engine; another sender took it over") as told:
        a.push(fault_engine.updates[other])
    assert "(successor)" in str(told.value) and "taken over at" in str(told.value), str(told.value)
    assert "close this Sender" in str(told.value)
    a.close()
    fault_engine.healthy({before})
