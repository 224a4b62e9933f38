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
