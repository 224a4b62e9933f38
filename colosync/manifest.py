"""Typed description of one weight update, as it travels between trainer and engine.

An update is described before any byte moves, so the engine can refuse it early and so a
flush in the middle of a stream cannot lose context: the LoRA spec, dtype and layout live
in one validated object, not in keyword arguments. Structs validate themselves at
construction *and* when decoded from the wire (msgspec calls ``__post_init__`` on decode),
so a malformed manifest never reaches the receiver's state machine. Encoding is msgpack or
JSON, never pickle.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec
import torch

from .errors import ManifestError

ALIGN = 64
"""Byte alignment of every tensor inside a bucket (and of every bucket's length)."""

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
    )
    if hasattr(torch, name)
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ManifestError(
            f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ManifestError(f"dtype {dtype} cannot travel; supported: {sorted(_DTYPES)}")
    return name


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


_CACHE_METAS = 1 << 17
_CACHE_LAYOUTS = 64
_VALID_METAS: set["TensorMeta"] = set()
_LAYOUTS: dict[tuple, tuple] = {}  # (tensors, bucket_sizes) -> the canonical pair
_LAYOUT_IDS: dict[int, tuple] = {}  # id(canonical tensors) -> the canonical pair
_TOTALS: dict[int, tuple] = {}  # id(canonical tensors) -> (tensors, total bytes)


class TensorMeta(msgspec.Struct, frozen=True):
    """Where one named tensor lives inside the update's buckets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if self in _VALID_METAS:  # the same layout arrives every update: validate it once
            return
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
        if len(_VALID_METAS) >= _CACHE_METAS:
            _VALID_METAS.clear()
        _VALID_METAS.add(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


class LoraSpec(msgspec.Struct, frozen=True):
    """The PEFT adapter fields an engine needs to build the adapter."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    bias: Literal["none"] = "none"

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


class UpdateManifest(msgspec.Struct, frozen=True):
    """Everything the engine must know about an update before its bytes arrive."""

    update_id: int
    kind: Literal["lora", "full"]
    tensors: tuple[TensorMeta, ...]
    bucket_sizes: tuple[int, ...]
    lora: LoraSpec | None = None

    def __post_init__(self) -> None:
        if self.update_id <= 0:
            raise ManifestError(f"update_id must be a positive integer, got {self.update_id}")
        if (self.kind == "lora") != (self.lora is not None):
            raise ManifestError(
                f"kind={self.kind!r} with lora={'set' if self.lora else 'missing'}: a LoRA update "
                "needs a LoraSpec and a full update must not carry one"
            )
        self._intern_layout()

    def _intern_layout(self) -> None:
        """Check the tensor layout once per distinct layout and share one tuple per layout.

        A sender repeats the same layout every update; after the first check, a manifest's
        ``tensors`` and ``bucket_sizes`` are the very objects of the first one, so receivers
        and engines can key their per-layout caches on ``manifest.tensors`` identity for free.
        """
        known = _LAYOUT_IDS.get(id(self.tensors))
        if known is not None and known[0] is self.tensors and known[1] == self.bucket_sizes:
            canon = known
        else:
            key = (self.tensors, self.bucket_sizes)
            canon = _LAYOUTS.get(key)
            if canon is None:
                _check_layout(self.tensors, self.bucket_sizes)
                if len(_LAYOUTS) >= _CACHE_LAYOUTS:
                    _LAYOUTS.clear()
                    _LAYOUT_IDS.clear()
                    _TOTALS.clear()
                canon = _LAYOUTS[key] = key
                _LAYOUT_IDS[id(key[0])] = key
        if self.tensors is not canon[0]:
            msgspec.structs.force_setattr(self, "tensors", canon[0])
        if self.bucket_sizes is not canon[1]:
            msgspec.structs.force_setattr(self, "bucket_sizes", canon[1])

    @property
    def total_bytes(self) -> int:
        known = _TOTALS.get(id(self.tensors))
        if known is not None and known[0] is self.tensors:
            return known[1]
        total = sum(t.nbytes for t in self.tensors)
        if _LAYOUT_IDS.get(id(self.tensors), (None,))[0] is self.tensors:
            _TOTALS[id(self.tensors)] = (self.tensors, total)
        return total

    def bucket_tensors(self, bucket: int) -> list[TensorMeta]:
        return [t for t in self.tensors if t.bucket == bucket]


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
                f"tensor {t.name!r} is in bucket {t.bucket} but the update has "
                f"{len(bucket_sizes)} buckets"
            )
        if t.offset + t.nbytes > bucket_sizes[t.bucket]:
            raise ManifestError(
                f"tensor {t.name!r} spans bytes [{t.offset}, {t.offset + t.nbytes}) beyond "
                f"bucket {t.bucket}'s {bucket_sizes[t.bucket]} bytes"
            )
        spans.setdefault(t.bucket, []).append((t.offset, t.offset + t.nbytes, t.name))
    for bucket, ranges in spans.items():
        ranges.sort()
        for (_, end, name), (start, _, other) in zip(ranges, ranges[1:]):
            if start < end:
                raise ManifestError(f"tensors {name!r} and {other!r} overlap in bucket {bucket}")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(UpdateManifest)


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
