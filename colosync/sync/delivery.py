"""Proof of delivery: does the engine compute, for the update it just installed, what the trainer computes?

Bytes that arrived intact are not yet proof (an engine can install them and keep serving
stale prepacked weights, or install them into the wrong modules). So a ``Probe`` travels
with the ``Commit``: completions with the trainer's own logprobs. The engine scores them
right after installing the update, before it serves anything else, and the largest
deviation decides: within tolerance the update stands; beyond it a LoRA update is rolled
back and a full update fails closed. This module holds the comparison and the wording, so
every engine reports a failed delivery the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from colosync.errors import DeliveryError
from colosync.wire.protocol import Ack, Probe


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
    if not after.serving and after.adapter:  # a full update kept an adapter applied on top of itself
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


__all__ = ["Deviation", "delivery_error"]
