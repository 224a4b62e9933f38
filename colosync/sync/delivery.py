"""Proof of delivery: does the engine compute, for the update it just installed, what the trainer computes?

Bytes that arrived intact are not yet proof (an engine can install them and keep serving
stale prepacked weights, or install them into the wrong modules). So a ``Probe`` travels
with the ``Commit``: completions with the trainer's own logprobs. The engine scores them
right after installing the update, before it serves anything else, and the largest
deviation decides: within tolerance the update stands; beyond it a LoRA update is rolled
back and a full update fails closed. This module holds that sequence (``verified_commit``),
the comparison and the wording, so every engine -- a host in front of a Receiver, the vLLM
link in front of its workers -- verifies, reverts and reports a failed delivery the same way.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import msgspec

from colosync.errors import ColosyncError, DeliveryError
from colosync.wire.protocol import Ack, Commit, Delivery, Probe, Revert

log = logging.getLogger(__name__)


class Deviation:
    """The largest |engine − trainer| logprob difference of a probe, and where it is."""

    def __init__(self, probe: Probe, engine: Sequence[Sequence[float]]) -> None:
        self.value, self.prompt, self.token = 0.0, -1, -1
        if len(engine) != len(probe.logprobs):
            self.value = math.inf
            return
        for i, (mine, theirs) in enumerate(zip(engine, probe.logprobs, strict=True)):
            if len(mine) != len(theirs):
                self.value, self.prompt = math.inf, i
                return
            for j, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                d = abs(a - b)
                if not d <= self.value:  # NaN counts as the worst
                    self.value, self.prompt, self.token = (d if math.isfinite(d) else math.inf), i, j

    def within(self, tolerance: float) -> bool:
        return self.value <= tolerance

    def __str__(self) -> str:
        where = f" at prompt {self.prompt} token {self.token}" if self.token >= 0 else ""
        return f"max |engine - trainer logprob| {self.value:.3g}{where}"


def delivery_error(update_id: int, why: str, after: Ack) -> DeliveryError:
    """The error for an update that committed but did not verify, saying what the engine did about it."""
    if after.serving and after.committed_update_id != update_id:
        outcome = f"the engine rolled back to update {after.committed_update_id} and serves it"
    elif not after.serving:
        outcome = (
            "the engine refuses to serve (it fails closed: a full update cannot be rolled back) until a full "
            f"update commits: push a good one (update {after.committed_update_id} is committed, not served)"
        )
    else:
        outcome = f"the engine still serves update {update_id}"
    if not after.serving and after.adapter and after.committed_update_id == update_id:  # a full update kept one
        fix = (
            f"The engine still applies the LoRA adapter of update {after.adapter} on top of these full weights "
            "(they were pushed with adapters='keep'), the likely cause if the weights already contain it "
            "(merge_and_unload): push them with adapters='drop' (the default), which serves exactly the weights "
            "pushed"
        )
    else:
        fix = (
            "Check that trainer and engine load the same model and conversion, or raise Probe.tolerance if the "
            "engine's numerics (dtype, kernels) legitimately differ"
        )
    return DeliveryError(f"update {update_id} committed but failed verification: {why}; {outcome}. {fix}")


Scorer = Callable[[Probe], tuple[Sequence[Sequence[float]], set[int]]]
"""``probe -> (the engine's logprob of every completion token, the updates that computed them)``."""


def verified_commit(apply: Callable[[Commit | Revert], Ack], commit: Commit, score: Scorer) -> Ack:
    """Commit ``commit`` through ``apply`` and, if it carries a probe, prove it: the one sequence every engine runs.

    ``apply`` takes a transaction request to the engine's Receiver(s) and returns their ``Ack``
    (a host calls its Receiver, the vLLM link pauses, calls every worker, labels and resumes).
    The Receiver checks the structural count itself and reverts a shortfall before it replies;
    this adds the probe: scored by ``score`` right after the commit, before anything else is
    served, by the update just committed and no other, within the probe's tolerance. Otherwise
    the update is reverted (a LoRA rolls back, a full update fails closed) and the
    ``DeliveryError`` says what the engine serves now. The probe never reaches the Receiver.
    """
    uid, probe = commit.update_id, commit.probe
    ack = apply(Commit(uid))
    if probe is None:
        return ack
    started = time.perf_counter()
    deviation: Deviation | None = None
    try:
        logprobs, versions = score(probe)
        if versions != {uid}:
            why: str | None = f"the probe was scored by updates {sorted(versions)}, not {uid}"
        else:
            deviation = Deviation(probe, logprobs)
            why = (
                None
                if deviation.within(probe.tolerance)
                else f"{deviation}, over the probe's tolerance {probe.tolerance:g}"
            )
    except Exception as exc:  # an unscored update is an unverified one: revert it like a mismatch
        log.exception("update %d: scoring the probe failed", uid)
        why = f"scoring the probe failed ({type(exc).__name__}: {exc})"
    if why is not None:
        log.error("update %d failed verification: %s; reverting it", uid, why)
        try:
            after = apply(Revert(uid, why))
        except ColosyncError as exc:
            raise DeliveryError(
                f"update {uid} committed but failed verification: {why}; reverting it failed too "
                f"({type(exc).__name__}: {exc}): restart the engine, then push a good update"
            ) from exc
        raise delivery_error(uid, why, after)
    checked = ack.delivery or Delivery(changed=0, expected=0)
    seconds = time.perf_counter() - started
    value = deviation.value if deviation is not None else None
    return msgspec.structs.replace(ack, delivery=msgspec.structs.replace(checked, max_deviation=value, seconds=seconds))


__all__ = ["Deviation", "Scorer", "delivery_error", "verified_commit"]
