"""The handoff's vocabulary: the memory regions two colocated participants hold, and the
operations that move them.

Plans, the simulator, the executor and the backends all speak in these terms, so that what a
plan *expects* an operation to do (allocate the engine's host mirror, free the trainer's
device state, ...) can be compared with what a participant *reports* it did and with what
the machine *measured*. The semantics of every operation live here, once, as a function of
the regions currently held (``effect``); that function is also what makes operations
idempotent by definition: an operation whose precondition does not hold does nothing.
"""

from __future__ import annotations

from enum import StrEnum

from colosync.errors import PlanError


class Place(StrEnum):
    HOST = "host"
    DEVICE = "device"


class Region(StrEnum):
    """One kind of memory a participant can hold, on the host or on the device."""

    ENGINE_WEIGHTS = "engine.weights"
    """The engine's weights on the device."""
    ENGINE_KV = "engine.kv"
    """The engine's KV cache and CUDA graphs: pure device memory, dropped, never backed up."""
    ENGINE_MIRROR = "engine.mirror"
    """The host copy of the engine's weights made by ``offload_weights(backup=True)``."""
    TRAINER_STATE = "trainer.state"
    """The trainer's backed-up device state: parameters, optimizer state, buffers."""
    TRAINER_GRADS = "trainer.grad_buffer"
    """The trainer's gradient buffer: overwritten by the next step, so not backed up."""
    TRAINER_CACHE = "trainer.cache"
    """Device memory the trainer's allocator holds beyond live tensors (caches, activations)."""
    TRAINER_BACKUP = "trainer.backup"
    """The host copy of the trainer's state made by ``sleep()``."""
    TRAINER_LOAD = "trainer.load_staging"
    """Host memory a checkpoint load stages through, only during ``load()``."""
    SYNC_TRANSPORT = "sync.transport"
    """The weight sync's transport slots on the host (shared memory), only during the sync."""
    SYNC_STAGING = "sync.staging"
    """Device memory the engine's receiver lands the update in (plus device transport slots)."""
    SYNC_HOST_STAGING = "sync.host_staging"
    """Host memory a bounded full update lands in until commit (a lease of the shared arena
    when there is one: the host copies are gone while the sync runs), only during the sync."""
    SYNC_PREPARED = "sync.prepared"
    """Device copies the engine prepares before it commits (a LoRA adapter beside the served
    one; a full update's prepared weights)."""

    @property
    def place(self) -> Place:
        return Place.HOST if self in _HOST_REGIONS else Place.DEVICE

    @property
    def actor(self) -> str:
        return self.value.split(".", 1)[0]


_HOST_REGIONS = frozenset(
    {Region.ENGINE_MIRROR, Region.TRAINER_BACKUP, Region.TRAINER_LOAD, Region.SYNC_TRANSPORT, Region.SYNC_HOST_STAGING}
)
SYNC_REGIONS = frozenset({Region.SYNC_TRANSPORT, Region.SYNC_STAGING, Region.SYNC_PREPARED, Region.SYNC_HOST_STAGING})
"""What a weight sync holds while it runs, and frees by its end (commit frees the staging)."""
HOST_COPIES = frozenset({Region.ENGINE_MIRROR, Region.TRAINER_BACKUP})
"""The two large host copies that ``peak_device='gpu'`` keeps from coexisting."""
ARENA_REGIONS = HOST_COPIES | {Region.SYNC_HOST_STAGING}
"""What lives in the shared host arena: the two copies and, between them, a full update's staging."""


class Op(StrEnum):
    """An operation of one participant, named ``actor.method``."""

    TRAINER_LOAD = "trainer.load"
    TRAINER_WAKE_UP = "trainer.wake_up"
    TRAINER_SLEEP = "trainer.sleep"
    TRAINER_OFFLOAD_GRAD_BUFFER = "trainer.offload_grad_buffer"
    TRAINER_CLEAR_MEMORY = "trainer.clear_memory"
    ENGINE_OFFLOAD_KV = "engine.offload_kv"
    ENGINE_OFFLOAD_WEIGHTS = "engine.offload_weights"
    ENGINE_ONLOAD_WEIGHTS = "engine.onload_weights"
    ENGINE_ONLOAD_KV = "engine.onload_kv"
    SYNC_WEIGHTS = "sync.weights"
    """Push the trainer's weights into the engine (a colosync ``Sender`` transaction)."""

    @property
    def actor(self) -> str:
        return self.value.split(".", 1)[0]

    @property
    def method(self) -> str:
        return self.value.split(".", 1)[1]


R = Region


def effect(op: Op, held: frozenset[Region], backup: bool = True) -> tuple[frozenset[Region], frozenset[Region]]:
    """What ``op`` does when ``held`` is currently held: ``(allocates, frees)``.

    Allocations happen before frees inside one operation (a copy needs its destination
    before the source can go), so an operation's peak is ``held | allocates``. An operation
    whose precondition does not hold returns two empty sets: it is a no-op.
    """
    alloc: set[Region] = set()
    free: set[Region] = set()
    if op is Op.ENGINE_OFFLOAD_KV:
        free = {R.ENGINE_KV} & held
    elif op is Op.ENGINE_OFFLOAD_WEIGHTS:
        if R.ENGINE_WEIGHTS in held:
            alloc = {R.ENGINE_MIRROR} if backup else set()
            free = {R.ENGINE_WEIGHTS}
    elif op is Op.ENGINE_ONLOAD_WEIGHTS:
        if R.ENGINE_WEIGHTS not in held:
            alloc = {R.ENGINE_WEIGHTS}
            free = {R.ENGINE_MIRROR} & held
    elif op is Op.ENGINE_ONLOAD_KV:
        if R.ENGINE_KV not in held:
            alloc = {R.ENGINE_KV}
    elif op is Op.TRAINER_LOAD:
        if not held & {R.TRAINER_STATE, R.TRAINER_BACKUP}:
            alloc = {R.TRAINER_LOAD, R.TRAINER_STATE, R.TRAINER_GRADS, R.TRAINER_CACHE}
            free = {R.TRAINER_LOAD}
    elif op is Op.TRAINER_WAKE_UP:
        if R.TRAINER_BACKUP in held and R.TRAINER_STATE not in held:
            alloc = {R.TRAINER_STATE, R.TRAINER_GRADS, R.TRAINER_CACHE}
            free = {R.TRAINER_BACKUP}
    elif op is Op.TRAINER_SLEEP:
        if R.TRAINER_STATE in held:
            alloc = {R.TRAINER_BACKUP}
            free = {R.TRAINER_STATE, R.TRAINER_GRADS, R.TRAINER_CACHE} & held
    elif op is Op.TRAINER_OFFLOAD_GRAD_BUFFER:
        free = {R.TRAINER_GRADS} & held
    elif op is Op.TRAINER_CLEAR_MEMORY:
        free = {R.TRAINER_CACHE} & held
    elif op is Op.SYNC_WEIGHTS:
        # The sender reads the trainer's weights on the device, the receiver installs into the
        # engine's: both must be resident. Its memory is transient: allocated and freed within.
        if {R.TRAINER_STATE, R.ENGINE_WEIGHTS} <= held:
            alloc = free = set(SYNC_REGIONS)
    else:
        raise PlanError(
            f"unknown operation {op!r}; pass one of the Op members {[o.value for o in Op]} (Op(name) converts a name)"
        )
    return frozenset(alloc), frozenset(free)


LENT = frozenset({Region.ENGINE_KV, Region.TRAINER_STATE, Region.TRAINER_GRADS})
"""With a loan (``HandoffConfig(lend_kv=True)``) these share one block, allocated once and never
freed: the engine's KV cache, and the trainer's state and gradient buffer woken up inside it."""


def device_bytes(held: frozenset[Region] | set[Region], sizes: dict[Region, int], *, lent: bool = False) -> int:
    """Device bytes of the regions ``held``, at ``sizes``; with a loan, the shared block counts
    always and once (the KV cache's size), whoever uses it."""
    if not lent:
        return sum(sizes.get(r, 0) for r in held if r.place is Place.DEVICE)
    return sizes.get(Region.ENGINE_KV, 0) + sum(
        sizes.get(r, 0) for r in held if r.place is Place.DEVICE and r not in LENT
    )


def apply(op: Op, held: frozenset[Region], backup: bool = True) -> frozenset[Region]:
    alloc, free = effect(op, held, backup)
    return (held | alloc) - free
