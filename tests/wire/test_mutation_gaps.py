"""Wire-format promises that the mutation run (benchmarks/mutation/) found no test holding.

Each test names the promise; the mutants it kills are listed in benchmarks/mutation/README.md.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from colosync.errors import StaleUpdateError
from colosync.wire.bucket import fingerprint, plan_buckets
from colosync.wire.fused import segments
from colosync.wire.protocol import Ack, Codec, Failed


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


def test_segments_cover_a_bucket_from_byte_zero_when_it_starts_with_integers():
    """The fused copy/check reads a bucket segment by segment: the segments must cover every byte from 0,
    whatever dtype comes first, and every floating tensor must lie inside a segment checked as its dtype."""
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


def test_a_failure_reply_carries_the_engines_state_to_the_raised_error():
    """A stale sender resynchronises from the engine's state that travels with the failure, not from a guess."""
    codec = Codec(Ack | Failed)
    state = Ack(committed_update_id=7, in_flight_update_id=None, highest_update_id=9)
    reply = codec.decode(codec.encode(Failed.from_exception(StaleUpdateError("id 3 is stale"), status=state)))
    exc = reply.to_exception()
    assert isinstance(exc, StaleUpdateError) and "id 3 is stale" in str(exc)
    assert exc.status == state and exc.status.next_update_id() == 10


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("inf"), float("nan")])
def test_a_lora_alpha_that_is_not_a_positive_finite_number_is_refused(alpha):
    from colosync.errors import ManifestError
    from colosync.wire.manifest import LoraSpec

    with pytest.raises(ManifestError, match="alpha must be a positive number"):
        LoraSpec(rank=8, alpha=alpha, target_modules=("q_proj",))


def test_a_small_positive_lora_alpha_is_accepted():
    from colosync.wire.manifest import LoraSpec

    spec = LoraSpec(rank=8, alpha=0.5, target_modules=("q_proj",))
    assert spec.scaling == 0.5 / 8


@pytest.mark.parametrize("field", ["bucket", "offset", "nbytes", "slot"])
def test_a_stage_with_any_negative_field_is_refused_when_built(field):
    """A Stage names bytes of a bucket in a slot: every one of its four positions must be >= 0."""
    from colosync.errors import ManifestError
    from colosync.wire.protocol import Stage

    fields = {"update_id": 1, "bucket": 0, "offset": 0, "nbytes": 8, "slot": 0}
    Stage(**fields)  # all in range: accepted
    with pytest.raises(ManifestError, match="negative field"):
        Stage(**{**fields, field: -1})


def test_copy_check_of_no_bytes_is_fingerprint_zero_and_finite():
    """An empty bucket (only zero-size tensors) is checked like any other: fingerprint 0, nothing non-finite."""
    from colosync.wire.fused import copy_check

    empty = torch.empty(0, dtype=torch.uint8)
    assert copy_check(empty, None, None).tolist() == [0, 0]
    assert copy_check(empty, torch.empty(0, dtype=torch.uint8), [], offset=8).tolist() == [0, 0]


def test_copy_check_writes_its_verdict_into_the_out_pair_it_is_given():
    """``out=`` (the receiver's per-bucket result row) receives the fingerprint and the non-finite flag."""
    from colosync.wire.fused import copy_check

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


def test_a_layout_may_hold_an_empty_bucket_but_not_a_negative_or_unaligned_one():
    """Zero-size tensors make a bucket of 0 bytes, which is valid; a negative or unaligned size is not."""
    from colosync.errors import ManifestError
    from colosync.wire.manifest import ALIGN, Layout, TensorMeta

    empty = plan_buckets([("e", (0,), torch.float32), ("f", (0, 3), torch.bfloat16)], 1 << 16)
    assert empty.bucket_sizes == (0,)
    meta = TensorMeta(name="e", dtype="float32", shape=(0,), bucket=0, offset=0, nbytes=0)
    assert Layout((meta,), (0,)).bucket_sizes == (0,)
    for bad in (-ALIGN, ALIGN // 2):
        with pytest.raises(ManifestError, match="must be >= 0 and a multiple"):
            Layout((meta,), (bad,))


def test_a_failure_reply_keeps_a_colosync_errors_message_and_names_any_other_errors_type():
    """A ColosyncError crosses as itself, message untouched; anything else becomes an EngineError whose
    message starts with the original type (the sender cannot import the engine's exception classes)."""
    codec = Codec(Ack | Failed)
    mine = codec.decode(codec.encode(Failed.from_exception(StaleUpdateError("id 3 is stale")))).to_exception()
    assert type(mine) is StaleUpdateError and str(mine) == "id 3 is stale"
    other = codec.decode(codec.encode(Failed.from_exception(KeyError("lm_head.weight"))))
    assert (other.error, other.message) == ("EngineError", "KeyError: 'lm_head.weight'")
    assert str(other.to_exception()) == "KeyError: 'lm_head.weight'"
