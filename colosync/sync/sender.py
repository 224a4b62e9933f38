"""Trainer-side driver: named tensors -> buckets -> transport slots -> one transaction.

The Sender owns one transport per engine link, attached on first use (``transports.attach_first``)
and reused for every update. It plans buckets from shapes alone, once per layout (``sync.plan``),
packs each bucket with one fused copy (straight into the transport slot when the slot lives on
the tensors' device; a bucket that is one tensor is sent from the tensor's own bytes), keeps a
``Stage`` in flight per slot so packing overlaps the engine's copy-out, and finishes with
prepare and commit (``sync.pipeline``). Control messages are pipelined: the engine's replies
are read only when a slot must be reused and at the end, and fingerprints are computed on the
device and read back without a separate sync. Any failure aborts the update on the engine and
re-raises; the engine keeps serving its last committed version.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec
import torch

from colosync import transports
from colosync.errors import (
    ColosyncError,
    ConfigError,
    StaleUpdateError,
    TransportError,
    TransportUnavailable,
    UnknownLayoutError,
    UpdateRejected,
)
from colosync.sync.link import Link, ReportsEngines
from colosync.sync.pipeline import BucketStreamer, PhaseTimer, SlotPipeline, SyncReport
from colosync.sync.plan import LayoutChanged, Plan, Plans, StreamSource
from colosync.transports.base import Peers
from colosync.wire.bucket import TensorSpec, typed_views
from colosync.wire.manifest import AdapterPolicy, Layout, LoraSpec, align_up
from colosync.wire.protocol import Abort, Ack, Attach, Begin, BeginAgain, Commit, Detach, Prepare, Probe, Status

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20
Specs = Sequence[tuple[str, Sequence[int], torch.dtype]]  # TensorSpecs, or plain (name, shape, dtype)


def peft_lora_spec(peft_model: torch.nn.Module, adapter: str = "default") -> LoraSpec:
    """The ``LoraSpec`` of a PEFT model's adapter (rank, alpha, targets, rslora, layers).

    The manifest names target modules by leaf (``q_proj``). PEFT keeps ``"all-linear"``, a
    regex string or a list of full module paths as given, so for those the targets are the
    leaves of the modules the adapter really wraps, and ``layers`` the layer indices they sit
    in when that is not every layer.
    """
    configs: Any = getattr(peft_model, "peft_config", None)  # PEFT's {adapter name: LoraConfig}, duck-typed
    if not configs:
        raise ConfigError(
            f"push_peft needs a PEFT model, and this {type(peft_model).__name__} carries no adapter (no "
            "peft_config): wrap it with peft.get_peft_model(model, LoraConfig(...)), or push full weights with "
            "sender.push(model.named_parameters())"
        )
    if adapter not in configs:
        raise ConfigError(
            f"this PEFT model has no adapter {adapter!r}; it has {sorted(configs)}: pass adapter=<one of them>"
        )
    cfg = configs[adapter]
    targets = cfg.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    layers = getattr(cfg, "layers_to_transform", None)
    layers = (layers,) if isinstance(layers, int) else tuple(sorted(layers)) if layers else None
    if not all(target.isidentifier() for target in targets):
        targets, layers = _wrapped_targets(peft_model, adapter, layers)
    return LoraSpec(
        rank=int(cfg.r),
        alpha=float(cfg.lora_alpha),
        target_modules=targets,
        use_rslora=bool(getattr(cfg, "use_rslora", False)),
        layers=layers,
    )


_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def _wrapped_targets(
    peft_model: torch.nn.Module, adapter: str, layers: tuple[int, ...] | None
) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """The leaf names of the modules carrying ``adapter``, and their layers if not all of them."""
    wrapped = [name for name, module in peft_model.named_modules() if adapter in getattr(module, "lora_A", {})]
    if not wrapped:
        raise ConfigError(f"PEFT adapter {adapter!r} wraps no module; check its target_modules")
    leaves = tuple(sorted({name.rsplit(".", 1)[-1] for name in wrapped}))
    found = {int(m.group(1)) for m in (_LAYER_INDEX.search(f".{name}.") for name in wrapped) if m}
    config: Any = getattr(peft_model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    every = set(range(int(getattr(config, "num_hidden_layers", 0) or 0)))
    if layers is None and found and found != every:
        layers = tuple(sorted(found))
    return leaves, layers


def peft_lora_tensors(peft_model: torch.nn.Module, adapter: str = "default") -> list[tuple[str, torch.Tensor]]:
    """The adapter's weights under PEFT's saved names (no adapter name in them)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter)
    return list(state.items())


class Sender:
    """Pushes updates through one transport to one engine, or to every engine of an ``EngineSet`` as one.

    >>> sender = Sender(link, transport="shm")
    >>> report = sender.push_peft(peft_model)           # LoRA
    >>> report = sender.push(model.named_parameters())  # full weights

    ``transport="auto"`` (the default) attaches the first transport in preference order
    (``colosync.transports.names()``) that works end to end -- the engine really opening its handle
    is the test -- and logs why it passed over the others (``transport_log``). Attaching makes this
    Sender the engine's one owner until ``close`` detaches; ``takeover=True`` ends another owner's
    ownership instead of being refused with ``EngineBusyError``."""

    def __init__(
        self,
        link: Link,
        transport: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        slots: int = 2,
        device: torch.device | str | None = None,
        takeover: bool = False,
    ) -> None:
        if slots < 1:
            raise ConfigError(f"slots must be >= 1, got {slots}; pass slots=2 (the default) to overlap copies")
        self.link = link
        self.transport_name = transport
        self.bucket_bytes = bucket_bytes
        self.slots = slots
        self.device = torch.device(device) if device is not None else None
        self.takeover = takeover
        self.transport_log: list[str] = []  # why each transport was picked or passed over
        self._transport: transports.SenderTransport | None = None
        self._streamer: BucketStreamer | None = None  # packs into self._transport's slots
        self._next_id: int | None = None
        self._plans = Plans()
        # (layout, kind, lora, adapters) of the engine's last begun and committed update: a BeginAgain repeats it
        self._begun: tuple[Layout, str, LoraSpec | None, AdapterPolicy] | None = None
        self._arena: Plan | None = None  # the one plan this Sender may push, if it hosts an arena
        self._peers: Peers | None = None  # the receivers the transport was made for (a set of engines)

    # -- public -----------------------------------------------------------------------------
    @property
    def transport(self) -> transports.SenderTransport | None:
        return self._transport

    def push_peft(
        self, peft_model: torch.nn.Module, adapter: str = "default", verify: Probe | None = None
    ) -> SyncReport:
        return self.push(
            peft_lora_tensors(peft_model, adapter), lora=peft_lora_spec(peft_model, adapter), verify=verify
        )

    def push(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        lora: LoraSpec | None = None,
        update_id: int | None = None,
        verify: Probe | None = None,
        adapters: AdapterPolicy = "drop",
    ) -> SyncReport:
        """Send ``named`` as one transaction: a LoRA update if ``lora`` is given, else full weights.

        ``verify``: completions with this trainer's logprobs under the update (``Probe.from_model``);
        the engine scores them after installing it and before serving anything else, and a
        deviation over the probe's tolerance raises ``DeliveryError`` (a LoRA update rolled back, a
        full one failed closed). ``report.delivery`` carries the measured deviation,
        ``report.seconds["verify"]`` what it cost the engine.

        ``adapters`` (full updates): ``"drop"`` (the default) stops serving the engine's LoRA
        adapter, so the engine serves exactly these weights -- right for full training and for
        weights with the adapter merged in; ``"keep"`` applies it on top of them.
        """
        _check_adapters(adapters, lora)
        start = time.perf_counter()
        items = named if isinstance(named, list) else list(named)
        names, tensors = [n for n, _ in items], [t for _, t in items]
        last = self._plans.named(names) if update_id is None and self._arena is None else None
        if last is not None and self._begun is not None and self._begun[0] is last.layout:
            # The layout the engine committed last, by names alone: shapes are checked bucket by bucket.
            try:
                return self._resync_once(
                    lambda: self._push(last, tensors, None, lora, None, start, verify, adapters, check=True)
                )
            except (LayoutChanged, UpdateRejected) as exc:  # aborted; the engine may have refused the old layout
                if self._plans.find(names, tensors, self.bucket_bytes) is last:
                    raise
                log.info("the tensors' shapes or dtypes changed since the last push (%s); planning again", exc)
        plan = self._plans.find(names, tensors, self.bucket_bytes)
        return self._resync_once(
            lambda: self._push(plan, tensors, None, lora, update_id, start, verify, adapters), update_id
        )

    def push_stream(
        self,
        specs: Specs,
        tensors: Iterator[tuple[str, torch.Tensor]],
        lora: LoraSpec | None = None,
        update_id: int | None = None,
        verify: Probe | None = None,
        adapters: AdapterPolicy = "drop",
    ) -> SyncReport:
        """Like ``push`` for sources that materialize tensors lazily (memory bounded by a bucket).

        ``specs`` lists every tensor's name, shape and dtype up front; ``tensors`` must yield
        them in the same order. (A stream is read once, so a stale id is not retried here.)
        """
        _check_adapters(adapters, lora)
        start = time.perf_counter()
        plan = self._plans.get([(n, tuple(shape), dtype) for n, shape, dtype in specs], self.bucket_bytes)
        return self._push(plan, None, StreamSource(tensors), lora, update_id, start, verify, adapters)

    def drop_adapter(self, verify: Probe | None = None) -> SyncReport:
        """Stop serving the engine's LoRA adapter: the engine serves its base weights again.

        One transaction like any push (an empty full update with ``adapters="drop"``), so it gets
        an update id, can be verified against the base model (``verify``, a probe of the model
        without the adapter), and rolls back to the adapter if verification fails. A Sender that
        hosts an arena pushes only the arena's tensors: drop through a second Sender.
        """
        return self.push([], verify=verify, adapters="drop")

    def arena(self, specs: Specs, device: torch.device | str) -> list[torch.Tensor]:
        """Tensors for ``specs`` that live inside the transport's shared buffer (``cuda_ipc``).

        Keep the trainer's weights in them (allocate the adapter there, or copy into them once)
        and ``push`` them: a sync then packs nothing, the engine copies straight out of them.
        Do not write them while a push is running. The buffer holds exactly one update, so its
        memory is that update's size, and this Sender then pushes only those tensors (use a
        second Sender for other updates).
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        specs = [TensorSpec(n, torch.Size(shape), dtype) for n, shape, dtype in specs]  # Size: as push() sees them
        total = sum(align_up(math.prod(shape) * dtype.itemsize) for _, shape, dtype in specs)
        self.close()
        self.bucket_bytes = max(align_up(total), 8192)  # one bucket, the whole update
        self.slots = 1
        transport = self._attach(device, None).transport
        self._plans.clear()  # plans made under another bucket size would not fit the arena
        self._arena = self._plans.get(specs, self.bucket_bytes)
        return _arena_views(transport, self._arena, device)

    def close(self) -> None:
        if self._transport is not None:
            _detach(self.link)  # the engine drops its mapping and lets another sender attach
            if self._streamer is not None:
                self._streamer.drain()  # no copy may land in the slots once they are unmapped
            self._transport.close()
            self._transport = self._streamer = None  # the streamer takes its staging buffer along
        self._arena = None
        self._plans.drop_views()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _resync_once(self, push: Callable[[], SyncReport], requested: int | None = None) -> SyncReport:
        """Run ``push``; if the engine says our next id is stale (it saw higher ids), resynchronise and retry once."""
        try:
            return push()
        except UnknownLayoutError as exc:  # the engine lost what BeginAgain referred to: the full Begin, once
            log.warning("%s; sending the full manifest", exc)
        except StaleUpdateError as exc:
            if requested is not None:
                raise
            status: Ack | None = getattr(exc, "status", None)  # what the engine said with the refusal
            self._next_id = status.next_update_id() if status is not None else None
            log.warning("update id was stale (%s); resynchronised to %s, retrying once", exc, self._next_id)
        return push()

    def _push(
        self,
        plan: Plan,
        tensors: list[torch.Tensor] | None,
        source: StreamSource | None,
        lora: LoraSpec | None,
        update_id: int | None,
        start: float,
        verify: Probe | None,
        adapters: AdapterPolicy,
        check: bool = False,
    ) -> SyncReport:
        """One update of ``plan``; ``check``: the tensors' shapes and dtypes are yet to be checked (``Plan.check``)."""
        if self._arena is not None and plan is not self._arena:
            raise TransportError(
                f"this Sender's buffer is an arena for {len(self._arena.metas)} tensors; pushing other tensors "
                "through it would overwrite them: push the arena's tensors, or use a second Sender"
            )
        device = self.device if self.device is not None else _device_of(tensors, source, self.transport_name)
        streamer = self._attach(device, plan)
        transport = streamer.transport
        uid = self._claim_update_id(update_id)
        manifest = plan.manifest(uid, lora, adapters)
        timer = PhaseTimer()
        begun, self._begun = self._begun, None  # set again only once this update commits
        try:
            # A link with submit_batch takes the tail of the update as one Batch and, for the manifest
            # the engine began last on this link, a BeginAgain (~40 bytes) instead of the manifest.
            batch = getattr(self.link, "submit_batch", None)
            begin: Begin | BeginAgain = Begin(manifest)
            if batch is not None and begun == (plan.layout, manifest.kind, lora, adapters):
                begin = BeginAgain(uid, plan.digest(manifest))
            pipe = SlotPipeline(transport.num_slots, self.link.submit, begin, transport.publish, timer, batch)
            streamer.stream(plan, uid, pipe, tensors, source, check)
            if source is not None:
                source.finish()
            ack = pipe.finish(Prepare(uid), Commit(uid, probe=verify))
        except BaseException as exc:
            _abort(self.link, self._streamer, uid, exc)
            if not transport.survives_abort:  # e.g. a group whose collectives may be out of step: a fresh one next
                self.close()
            raise
        self._begun = (plan.layout, manifest.kind, lora, adapters)
        report = _report(uid, manifest.kind, transport.name, plan, timer, start, ack, verify is not None)
        return _with_engines(report, self.link)

    def _attach(self, device: torch.device, plan: Plan | None) -> BucketStreamer:
        """The attached transport (through its streamer), attaching one on first use or when a set's members changed."""
        peers = _peers_of(self.link)
        if self._streamer is not None and peers == self._peers:
            return self._streamer
        if self._arena is not None:
            raise TransportError("this Sender's link now has other engines; its arena lives in the old transport")
        self.close()
        self._begun = None  # a new member has no Begin to repeat
        link, takeover = self.link, self.takeover
        attached = transports.attach_first(
            self.transport_name,
            device,
            *_first_geometry(plan, self.bucket_bytes, self.slots),
            lambda name, handle: link.submit(Attach(transport=name, handle=handle, takeover=takeover)).wait(),
            peers,
        )
        self.transport_log, self._peers, self._transport = attached.log, peers, attached.transport
        self._plans.drop_views()  # views of some earlier transport's slots
        # (after a close, another sender may have pushed: never reuse an id the engine has seen)
        self._next_id = max(self._next_id or 0, attached.reply.next_update_id())
        self._streamer = BucketStreamer(attached.transport, self._plans, self.bucket_bytes)
        return self._streamer

    def _claim_update_id(self, requested: int | None) -> int:
        if self._next_id is None:
            self._next_id = self.link.submit(Status()).wait().next_update_id()
        uid = self._next_id if requested is None else requested
        self._next_id = max(self._next_id, uid + 1)
        return uid


def _peers_of(link: Link) -> Peers | None:
    """The receiving processes behind ``link`` when it is a set of engines (``control.engine_set``)."""
    peers: Peers | None = getattr(link, "peers", None)
    return peers


def _first_geometry(plan: Plan | None, bucket_bytes: int, slots: int) -> tuple[int, int]:
    """Buckets and slots no bigger than the first update needs (a slot has at least 64 KiB)."""
    if plan is not None and plan.sizes:
        return min(bucket_bytes, align_up(max(*plan.sizes, 1), 1 << 16)), max(1, min(slots, len(plan.sizes)))
    return bucket_bytes, slots


def _arena_views(transport: transports.SenderTransport, plan: Plan, device: torch.device) -> list[torch.Tensor]:
    """``plan``'s tensors as views of the transport's one slot, which becomes the plan's arena."""
    slot = transport.slot(0)
    if slot.device != device:
        raise TransportUnavailable(
            f"the {transport.name} transport keeps its buffer in {slot.device} memory, so it "
            f"cannot host an arena for tensors on {device}; use transport='cuda_ipc'"
        )
    views = typed_views(slot[: plan.sizes[0]], plan.metas) if plan.sizes else []
    plan.arena = views
    return list(views)


def _detach(link: Link) -> None:
    try:
        link.submit(Detach(reason="Sender.close")).wait()
    except Exception as exc:  # a gone engine has nothing to detach
        log.debug("detach not acknowledged: %s", exc)


def _abort(link: Link, streamer: BucketStreamer | None, uid: int, exc: BaseException) -> None:
    """Tell the engine to drop update ``uid``, which failed here with ``exc``; note on ``exc`` if it had committed."""
    if streamer is not None:
        with contextlib.suppress(Exception):  # the original error matters more
            streamer.drain()  # this update's copies may not land in the slots over the next one's
    try:
        ack = link.submit(Abort(uid, reason=f"sender failed: {type(exc).__name__}: {exc}")).wait()
    except Exception as abort_exc:  # the original error matters more
        log.debug("abort of update %d not acknowledged: %s", uid, abort_exc)
        return
    if ack.committed_update_id >= uid:  # the Commit was already on its way and landed
        exc.add_note(f"colosync: the engine did commit update {uid} before this error reached the sender")


def _device_of(tensors: list[torch.Tensor] | None, source: StreamSource | None, transport_name: str) -> torch.device:
    """Where an update's tensors live; for an update with none, anywhere the requested transport can run."""
    if tensors:
        return tensors[0].device
    first = source.peek() if source is not None else None
    if first is not None:
        return first[1].device
    if transport_name != "auto" and torch.cuda.is_available():
        cpu_ok, _ = transports.sender_class(transport_name).available(torch.device("cpu"))
        if not cpu_ok:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _report(
    uid: int, kind: str, transport: str, plan: Plan, timer: PhaseTimer, start: float, ack: Ack, verified: bool
) -> SyncReport:
    seconds = dict(timer.seconds, total=time.perf_counter() - start)
    if ack.delivery is not None and verified:
        seconds["verify"] = ack.delivery.seconds
    if ack.waited_s:
        seconds["commit_wait"] = ack.waited_s  # part of "commit": no room for one more version until then
    report = SyncReport(uid, kind, transport, len(plan.metas), len(plan.sizes), plan.total, seconds, ack.delivery)
    log.info(
        "pushed update %d: %d tensors, %d bytes in %.2f ms via %s",
        uid,
        report.tensors,
        report.bytes,
        seconds["total"] * 1e3,
        transport,
    )
    return report


def _with_engines(report: SyncReport, link: Link) -> SyncReport:
    """``report`` with what each engine of a set now serves, where the link is a set."""
    if isinstance(link, ReportsEngines):
        return msgspec.structs.replace(report, engines=link.outcomes())
    return report


def _check_adapters(adapters: str, lora: LoraSpec | None) -> None:
    if adapters not in ("drop", "keep"):
        raise ConfigError(f"adapters must be 'drop' or 'keep', got {adapters!r}")
    if lora is not None and adapters != "drop":
        raise ConfigError(
            "adapters='keep' is for full updates: a LoRA push replaces the served adapter; leave adapters out"
        )


__all__ = ["Sender", "SyncReport", "peft_lora_spec", "peft_lora_tensors", "DEFAULT_BUCKET_BYTES", "ColosyncError"]
