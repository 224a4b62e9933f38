"""The transaction's messages: a Stage refuses negative positions, a failure reply carries its error and state."""

from __future__ import annotations

import pytest

from colosync.errors import ManifestError, StaleUpdateError
from colosync.wire.protocol import Ack, Codec, Failed, Stage


@pytest.mark.parametrize("field", ["bucket", "offset", "nbytes", "slot"])
def test_a_stage_with_any_negative_field_is_refused_when_built(field):
    """A Stage names bytes of a bucket in a slot: every one of its four positions must be >= 0."""
    fields = {"update_id": 1, "bucket": 0, "offset": 0, "nbytes": 8, "slot": 0}
    Stage(**fields)  # all in range: accepted
    with pytest.raises(ManifestError, match="negative field"):
        Stage(**{**fields, field: -1})


def test_a_failure_reply_carries_the_engines_state_to_the_raised_error():
    """A stale sender resynchronises from the engine's state that travels with the failure, not from a guess."""
    codec = Codec(Ack | Failed)
    state = Ack(committed_update_id=7, in_flight_update_id=None, highest_update_id=9)
    reply = codec.decode(codec.encode(Failed.from_exception(StaleUpdateError("id 3 is stale"), status=state)))
    exc = reply.to_exception()
    assert isinstance(exc, StaleUpdateError) and "id 3 is stale" in str(exc)
    assert exc.status == state and exc.status.next_update_id() == 10


def test_a_failure_reply_keeps_a_colosync_errors_message_and_names_any_other_errors_type():
    """A ColosyncError crosses as itself, message untouched; anything else becomes an EngineError whose
    message starts with the original type (the sender cannot import the engine's exception classes)."""
    codec = Codec(Ack | Failed)
    mine = codec.decode(codec.encode(Failed.from_exception(StaleUpdateError("id 3 is stale")))).to_exception()
    assert type(mine) is StaleUpdateError and str(mine) == "id 3 is stale"
    other = codec.decode(codec.encode(Failed.from_exception(KeyError("lm_head.weight"))))
    assert (other.error, other.message) == ("EngineError", "KeyError: 'lm_head.weight'")
    assert str(other.to_exception()) == "KeyError: 'lm_head.weight'"
