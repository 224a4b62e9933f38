"""Hostile control messages are refused, never fatal.

The decoder sees garbage, truncations, deep nesting, out-of-range integers, wrong types and
oversize lengths; every one must come back as a typed ``Failed`` reply (mostly
``ManifestError``) from the host, leaving the engine's state untouched. A few are then sent
to the real engine process to show it keeps serving.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colosync.engines.host import EngineHost
from colosync.engines.store import StoreEngine
from colosync.sync.receiver import Receiver
from colosync.wire.protocol import Ack, BatchReply, Failed, Status
from tests.faults.clients import raw_client, read_frame, send, send_raw

DEEP = b"\x82\xa4type\xa6status\xa1x" + b"\x91" * 100_000 + b"\xc0"


@pytest.fixture(scope="module")
def host():
    return EngineHost(Receiver(StoreEngine()))


def reply_of(host, data: bytes):
    return msgspec.msgpack.decode(host.handle_bytes(data), type=Ack | Failed | BatchReply)


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
tags = st.sampled_from(
    [
        "attach",
        "begin",
        "stage",
        "prepare",
        "commit",
        "abort",
        "revert",
        "status",
        "detach",
        "hello",
        "batch",
        "nonsense",
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    tag=tags,
    fields=st.dictionaries(
        st.sampled_from(
            [
                "update_id",
                "manifest",
                "bucket",
                "offset",
                "nbytes",
                "slot",
                "fingerprint",
                "transport",
                "handle",
                "probe",
                "reason",
                "pid",
                "layout",
                "tensors",
                "requests",
            ]
        ),
        values,
        max_size=6,
    ),
)
def test_any_tagged_message_is_answered_not_raised(host, tag, fields):
    reply = reply_of(host, msgspec.msgpack.encode({"type": tag, **fields}))
    assert isinstance(reply, (Ack, Failed, BatchReply))
    assert host.transaction.status().in_flight_update_id is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_are_answered_not_raised(host, data):
    assert isinstance(reply_of(host, data), (Ack, Failed))


@pytest.mark.parametrize(
    "data, needle",
    [
        (DEEP, "RecursionError"),
        (msgspec.msgpack.encode({"type": "abort", "update_id": 2**64 - 1}), "9223372036854775807"),
        (msgspec.msgpack.encode({"type": "prepare", "update_id": -1}), ">= 0"),
        (
            msgspec.msgpack.encode(
                {"type": "stage", "update_id": 1, "bucket": 2**60, "offset": 0, "nbytes": 0, "slot": 0}
            ),
            "bucket",
        ),
        (msgspec.msgpack.encode({"type": "attach", "transport": "shm", "handle": b"x" * 70_000}), "length"),
        (
            msgspec.msgpack.encode({"type": "batch", "requests": [{"type": "prepare", "update_id": 1}] * 70_000}),
            "length",
        ),
        (msgspec.msgpack.encode({"type": "batch", "requests": [{"type": "batch", "requests": []}]}), "batch"),
        (msgspec.msgpack.encode({"type": "batch", "requests": []}), "length"),
        (
            msgspec.msgpack.encode(
                {
                    "type": "begin",
                    "manifest": {"update_id": 2**63, "kind": "full", "layout": {"tensors": [], "bucket_sizes": []}},
                }
            ),
            "update_id",
        ),
    ],
)
def test_each_hostile_message_gets_a_manifest_error(host, data, needle):
    reply = reply_of(host, data)
    assert isinstance(reply, Failed) and reply.error == "ManifestError" and needle in reply.message, reply


def test_the_engine_process_survives_hostile_messages(fault_engine):
    before = fault_engine.healthy({"base", "new"})
    sock = raw_client(fault_engine.engine.address)
    hostile = [
        DEEP,
        msgspec.msgpack.encode({"type": "abort", "update_id": 2**64 - 1}),
        b"\xff" * 100,
        msgspec.msgpack.encode({"type": "generate", "prompts": [[1]] * 3, "max_new_tokens": -5}),
    ]
    for data in hostile:
        send_raw(sock, data)
    send(sock, Status())
    replies = [msgspec.msgpack.decode(read_frame(sock)) for _ in range(len(hostile) + 1)]
    assert [r["type"] for r in replies] == ["failed"] * len(hostile) + ["ack"], replies
    assert all(r["error"] == "ManifestError" for r in replies[:-1]), replies
    sock.close()
    fault_engine.healthy({before})
    assert fault_engine.status().next_update_id() < 2**63  # no id near 2**64 was taken
