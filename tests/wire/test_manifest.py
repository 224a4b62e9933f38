"""The manifest validates itself when built and when decoded; malformed input never gets through."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colosync.errors import ManifestError
from colosync.wire.bucket import plan_buckets
from colosync.wire.manifest import (
    ALIGN,
    Layout,
    LoraSpec,
    TensorMeta,
    UpdateManifest,
    decode_manifest,
    encode_manifest,
    manifest_from_json,
    manifest_to_json,
)


def good_manifest() -> UpdateManifest:
    specs = [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (8, 64), torch.bfloat16),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", (64, 8), torch.bfloat16),
        ("scale", (3,), torch.float32),
    ]
    return UpdateManifest(7, "lora", plan_buckets(specs, 1024), LoraSpec(8, 16.0, ("q_proj",)))


def as_dict(m: UpdateManifest) -> dict:
    return msgspec.to_builtins(m)


def test_roundtrip_msgpack_and_json():
    m = good_manifest()
    assert decode_manifest(encode_manifest(m)) == m
    assert manifest_from_json(manifest_to_json(m)) == m
    assert m.total_bytes == 8 * 64 * 2 * 2 + 12


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d["layout"]["tensors"][0].update(shape=[8, -64]), r">= 0 - at `\$.layout.tensors\[0\].shape\[1\]`"),
        (lambda d: d["layout"]["tensors"][0].update(nbytes=5), "needs 1024"),
        (lambda d: d["layout"]["tensors"][0].update(offset=3), "aligned"),
        (lambda d: d["layout"]["tensors"][0].update(bucket=9), "but the update has 3 buckets"),
        (lambda d: d["layout"]["tensors"][1].update(offset=0, bucket=0), "overlap"),
        (lambda d: d["layout"]["tensors"][1].update(name=d["layout"]["tensors"][0]["name"]), "appears twice"),
        (
            lambda d: d["layout"]["tensors"][2].update(
                offset=d["layout"]["bucket_sizes"][d["layout"]["tensors"][2]["bucket"]]
            ),
            "beyond bucket",
        ),
        (lambda d: d["layout"]["tensors"][0].update(dtype="float128"), "unknown dtype"),
        (lambda d: d.update(update_id=0), "positive integer"),
        (lambda d: d.update(lora=None), "needs a LoraSpec"),
        (lambda d: d.update(kind="delta"), "kind"),
        (lambda d: d["lora"].update(rank=0), r">= 1 - at `\$.lora.rank`"),
        (lambda d: d.update(update_id=2**63), "<= 9223372036854775807"),
        (lambda d: d["layout"]["tensors"][0].update(shape=[1] * 17), "length <= 16"),
        (lambda d: d["layout"]["tensors"][0].update(name="x" * 5000), "length <= 4096"),
        (lambda d: d["layout"].update(bucket_sizes=[d["layout"]["bucket_sizes"][0], 65]), "multiple of 64"),
        (
            lambda d: d["layout"].update(bucket_sizes=[d["layout"]["bucket_sizes"][0], -64]),
            r">= 0 - at `\$.layout.bucket_sizes\[1\]`",
        ),
        (lambda d: d["layout"]["tensors"][0].update(shape="8x64"), "Expected `array`"),
    ],
)
def test_decoder_rejects_each_malformation(mutate, needle):
    d = as_dict(good_manifest())
    mutate(d)
    with pytest.raises(ManifestError, match=needle):
        decode_manifest(msgspec.msgpack.encode(d))


def test_constructor_validates_too():
    with pytest.raises(ManifestError, match="appears twice"):
        meta = TensorMeta("w", "float32", (4,), 0, 0, 16)
        Layout((meta, meta), (64,))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_truncated_or_garbage_bytes_raise_manifest_error(data):
    encoded = encode_manifest(good_manifest())
    for candidate in (data, encoded[: len(data) % len(encoded)]):
        with contextlib.suppress(ManifestError):  # the only exception allowed out of the decoder
            decode_manifest(candidate)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(["name", "dtype", "shape", "bucket", "offset", "nbytes"]),
    index=st.integers(0, 2),
    value=json_values,
)
def test_any_wrong_field_value_is_rejected_or_consistent(field, index, value):
    d = as_dict(good_manifest())
    d["layout"]["tensors"][index][field] = value
    try:
        m = decode_manifest(msgspec.msgpack.encode(d))
    except ManifestError:
        return
    # If it decoded, every invariant still holds.
    assert len({t.name for t in m.tensors}) == len(m.tensors)
    for t in m.tensors:
        assert t.offset + t.nbytes <= m.bucket_sizes[t.bucket] and t.offset % 64 == 0


def test_the_manifest_digest_names_layout_kind_and_lora_not_the_update_id():
    from colosync.wire.manifest import manifest_digest

    first = good_manifest()
    digest = manifest_digest(first)
    assert len(digest) == 16
    assert manifest_digest(msgspec.structs.replace(first, update_id=first.update_id + 1)) == digest
    decoded = decode_manifest(msgspec.msgpack.encode(first))  # the engine computes it from what it decoded
    assert manifest_digest(decoded) == digest
    other_lora = msgspec.structs.replace(first, lora=msgspec.structs.replace(first.lora, rank=first.lora.rank * 2))
    assert manifest_digest(other_lora) != digest
    changed = as_dict(first)
    changed["layout"]["tensors"][0]["name"] += "x"
    assert manifest_digest(decode_manifest(msgspec.msgpack.encode(changed))) != digest


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("inf"), float("nan")])
def test_a_lora_alpha_that_is_not_a_positive_finite_number_is_refused(alpha):
    with pytest.raises(ManifestError, match="alpha must be a positive number"):
        LoraSpec(rank=8, alpha=alpha, target_modules=("q_proj",))


def test_a_small_positive_lora_alpha_is_accepted():
    spec = LoraSpec(rank=8, alpha=0.5, target_modules=("q_proj",))
    assert spec.scaling == 0.5 / 8


def test_a_layout_may_hold_an_empty_bucket_but_not_a_negative_or_unaligned_one():
    """Zero-size tensors make a bucket of 0 bytes, which is valid; a negative or unaligned size is not."""
    empty = plan_buckets([("e", (0,), torch.float32), ("f", (0, 3), torch.bfloat16)], 1 << 16)
    assert empty.bucket_sizes == (0,)
    meta = TensorMeta(name="e", dtype="float32", shape=(0,), bucket=0, offset=0, nbytes=0)
    assert Layout((meta,), (0,)).bucket_sizes == (0,)
    for bad in (-ALIGN, ALIGN // 2):
        with pytest.raises(ManifestError, match="must be >= 0 and a multiple"):
            Layout((meta,), (bad,))
