"""Typed description of one weight update, as it travels between trainer and engine.

An update is described before any byte moves, so the engine can refuse it early and so a
flush in the middle of a stream cannot lose context: the LoRA spec, dtype and layout live
in one validated object, not in keyword arguments. Structs validate themselves at
construction *and* when decoded from the wire (msgspec calls ``__post_init__`` on decode),
so a malformed manifest never reaches the receiver's state machine. Encoding is msgpack or
JSON, never pickle.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Annotated, Literal

import msgspec
import torch

from colosync.errors import ManifestError

ALIGN = 64
"""Byte alignment of every tensor inside a bucket (and of every bucket's length)."""

MAX_UPDATE_ID = 2**63 - 1
"""Update ids stay signed 64-bit integers on every wire and in every engine."""
MAX_NAME = 4096
MAX_COUNT = 1 << 22  # tensors or buckets in one update
MAX_DIMS = 16
MAX_BYTES = 1 << 48  # of one tensor or bucket

UpdateId = Annotated[int, msgspec.Meta(ge=0, le=MAX_UPDATE_ID)]
Size = Annotated[int, msgspec.Meta(ge=0, lt=MAX_BYTES)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
    )
    if hasattr(torch, name)
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ManifestError(f"dtype {dtype} cannot travel; supported: {sorted(_DTYPES)}")
    return name


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class TensorMeta(msgspec.Struct, frozen=True):
    """Where one named tensor lives inside the update's buckets."""

    name: Name
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: Annotated[tuple[Size, ...], msgspec.Meta(max_length=MAX_DIMS)]
    bucket: Annotated[int, msgspec.Meta(ge=0, lt=MAX_COUNT)]
    offset: Size
    nbytes: Size

    def __post_init__(self) -> None:
        if not self.name:
            raise ManifestError("tensor name is empty; every tensor needs its parameter name")
        torch_dtype = dtype_from_name(self.dtype)
        if any(d < 0 for d in self.shape):
            raise ManifestError(f"tensor {self.name!r}: negative dimension in shape {list(self.shape)}")
        if self.bucket < 0 or self.offset < 0 or self.nbytes < 0:
            raise ManifestError(
                f"tensor {self.name!r}: bucket, offset and nbytes must be >= 0, got "
                f"bucket={self.bucket} offset={self.offset} nbytes={self.nbytes}"
            )
        expected = math.prod(self.shape) * torch_dtype.itemsize
        if self.nbytes != expected:
            raise ManifestError(
                f"tensor {self.name!r}: nbytes={self.nbytes} but shape {list(self.shape)} of "
                f"{self.dtype} needs {expected}"
            )
        if self.offset % ALIGN:
            raise ManifestError(f"tensor {self.name!r}: offset {self.offset} is not {ALIGN}-byte aligned")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


class LoraSpec(msgspec.Struct, frozen=True):
    """The PEFT adapter fields an engine needs to build the adapter."""

    rank: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    alpha: float
    target_modules: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=256)], ...], msgspec.Meta(max_length=4096)]
    use_rslora: bool = False
    bias: Literal["none"] = "none"
    layers: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=1 << 16)] | None = None
    """If set, the adapter wraps its target modules in these layers only (PEFT's ``layers_to_transform``)."""

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ManifestError(f"LoRA rank must be > 0, got {self.rank}; pass the adapter's r")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ManifestError(f"LoRA alpha must be a positive number, got {self.alpha}")
        if not self.target_modules:
            raise ManifestError("LoRA target_modules is empty; list the module names the adapter wraps")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class Layout(msgspec.Struct, frozen=True, cache_hash=True):
    """Where every tensor of an update lives: its buckets and each tensor's place in them.

    A sender repeats one layout update after update, so a layout is checked once, when it is
    built or decoded, and is its own cache key: frozen, hashed once (``cache_hash``), and
    shared by identity between the manifests that repeat it (the Sender's plan holds one;
    ``Codec`` hands the same object back for a repeated ``Begin``). Receivers and engines key
    their per-layout state on it.
    """

    tensors: Annotated[tuple[TensorMeta, ...], msgspec.Meta(max_length=MAX_COUNT)]
    bucket_sizes: Annotated[tuple[Size, ...], msgspec.Meta(max_length=MAX_COUNT)]

    def __post_init__(self) -> None:
        _check_layout(self.tensors, self.bucket_sizes)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bucket_tensors(self, bucket: int) -> list[TensorMeta]:
        return [t for t in self.tensors if t.bucket == bucket]


AdapterPolicy = Literal["drop", "keep"]
"""What a full update does to the LoRA adapter an engine serves: ``drop`` it (the engine then
serves exactly the pushed weights) or ``keep`` applying it on top of the new weights."""


class UpdateManifest(msgspec.Struct, frozen=True):
    """Everything the engine must know about an update before its bytes arrive.

    ``adapters`` says what a full update does to a served LoRA adapter. ``drop`` (the default)
    is right for the common RL case: the pushed weights are the policy (trained in full, or an
    adapter merged into them), and applying the old adapter again on top would serve another
    model. ``keep`` is for jobs that update the base under an adapter trained on top of it. The
    drop is part of the transaction: an update that does not commit leaves the adapter served.
    A LoRA update replaces the served adapter, so it takes ``drop`` only.
    """

    update_id: UpdateId
    kind: Literal["lora", "full"]
    layout: Layout
    lora: LoraSpec | None = None
    adapters: AdapterPolicy = "drop"

    def __post_init__(self) -> None:
        if not 0 < self.update_id <= MAX_UPDATE_ID:
            raise ManifestError(
                f"update_id must be a positive integer below 2**63, got {self.update_id}; let the Sender "
                "choose ids (it starts above every id the engine has seen)"
            )
        if (self.kind == "lora") != (self.lora is not None):
            raise ManifestError(
                f"kind={self.kind!r} with lora={'set' if self.lora else 'missing'}: a LoRA update "
                "needs a LoraSpec and a full update must not carry one"
            )
        if self.kind == "lora" and self.adapters != "drop":
            raise ManifestError(
                f"a LoRA update with adapters={self.adapters!r}: a LoRA update replaces the served adapter; "
                "adapters='keep' is for full updates (it keeps the adapter applied on top of the new weights)"
            )

    @property
    def drops_adapter(self) -> bool:
        """True for a full update that stops serving the engine's LoRA adapter."""
        return self.kind == "full" and self.adapters == "drop"

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        return self.layout.tensors

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        return self.layout.bucket_sizes

    @property
    def total_bytes(self) -> int:
        return self.layout.total_bytes


def _check_layout(tensors: tuple[TensorMeta, ...], bucket_sizes: tuple[int, ...]) -> None:
    for i, size in enumerate(bucket_sizes):
        if size < 0 or size % ALIGN:
            raise ManifestError(f"bucket {i}: size {size} must be >= 0 and a multiple of {ALIGN}")
    seen: set[str] = set()
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for t in tensors:
        if t.name in seen:
            raise ManifestError(f"tensor {t.name!r} appears twice; names must be unique in one update")
        seen.add(t.name)
        if t.bucket >= len(bucket_sizes):
            raise ManifestError(
                f"tensor {t.name!r} is in bucket {t.bucket} but the update has {len(bucket_sizes)} buckets"
            )
        if t.offset + t.nbytes > bucket_sizes[t.bucket]:
            raise ManifestError(
                f"tensor {t.name!r} spans bytes [{t.offset}, {t.offset + t.nbytes}) beyond "
                f"bucket {t.bucket}'s {bucket_sizes[t.bucket]} bytes"
            )
        spans.setdefault(t.bucket, []).append((t.offset, t.offset + t.nbytes, t.name))
    for bucket, ranges in spans.items():
        ranges.sort()
        for (_, end, name), (start, _, other) in itertools.pairwise(ranges):
            if start < end:
                raise ManifestError(f"tensors {name!r} and {other!r} overlap in bucket {bucket}")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(UpdateManifest)


def manifest_digest(manifest: UpdateManifest) -> bytes:
    """16 bytes naming everything of ``manifest`` but its ``update_id``: layout, kind, LoRA spec and
    adapter policy.

    msgpack encodes one struct value one way, so sender and engine compute it alike.
    """
    encoded = _encoder.encode((manifest.kind, manifest.lora, manifest.adapters, manifest.layout))
    return hashlib.blake2b(encoded, digest_size=16).digest()


def encode_manifest(manifest: UpdateManifest) -> bytes:
    return _encoder.encode(manifest)


def decode_manifest(data: bytes) -> UpdateManifest:
    """Decode msgpack bytes; anything malformed raises ``ManifestError``."""
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        # __post_init__ errors surface wrapped in ValidationError; keep one exception type.
        raise ManifestError(f"malformed manifest: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ManifestError(f"manifest is not valid msgpack: {exc}") from None


def manifest_to_json(manifest: UpdateManifest) -> bytes:
    return msgspec.json.encode(manifest)


def manifest_from_json(data: bytes) -> UpdateManifest:
    try:
        return msgspec.json.decode(data, type=UpdateManifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ManifestError(f"malformed manifest: {exc}") from None
