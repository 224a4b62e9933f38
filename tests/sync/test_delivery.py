"""``verified_commit``: the one commit -> probe -> revert sequence that the engine host and the vLLM
link both run (their own tests drive it through real engines: tests/engines/test_full_over_adapter.py,
test_trust.py, test_vllm.py). Here each branch is driven by a recorded ``apply`` and a scorer."""

from __future__ import annotations

import pytest

from colosync.errors import DeliveryError, EngineError
from colosync.sync.delivery import delivery_error, verified_commit
from colosync.wire.protocol import Ack, Commit, Delivery, Probe, Revert

PROBE = Probe([[1, 2]], [[3, 4]], [[-1.0, -2.0]], tolerance=1e-3)


class Engine:
    """Commits ``uid``; a Revert goes back to ``uid - 1`` (LoRA) or fails closed (``revertible=False``)."""

    def __init__(self, revertible: bool = True, revert_error: Exception | None = None) -> None:
        self.sent: list = []
        self.revertible, self.revert_error = revertible, revert_error

    def apply(self, request):
        self.sent.append(request)
        if isinstance(request, Commit):
            return Ack(request.update_id, delivery=Delivery(2, 2))
        if self.revert_error is not None:
            raise self.revert_error
        if self.revertible:
            return Ack(request.update_id - 1, adapter=request.update_id - 1)
        return Ack(request.update_id, serving=False)


def test_without_a_probe_it_is_one_commit():
    engine = Engine()
    ack = verified_commit(engine.apply, Commit(5), lambda probe: pytest.fail("nothing to score"))
    assert engine.sent == [Commit(5)] and ack.delivery == Delivery(2, 2)


def test_a_probe_within_tolerance_reports_its_deviation_and_never_reaches_the_engine():
    engine = Engine()
    ack = verified_commit(engine.apply, Commit(5, probe=PROBE), lambda probe: ([[-1.0, -2.0005]], {5}))
    assert engine.sent == [Commit(5)]
    assert ack.delivery.changed == 2 and ack.delivery.max_deviation == pytest.approx(5e-4)
    assert ack.delivery.seconds >= 0


@pytest.mark.parametrize(
    "score, why",
    [
        (lambda probe: ([[-1.0, -2.5]], {5}), r"0\.5 at prompt 0 token 1, over the probe's tolerance 0\.001"),
        (lambda probe: ([[-1.0, -2.0]], {4}), r"scored by updates \[4\], not 5"),
        (lambda probe: (_ for _ in ()).throw(EngineError("gone")), r"scoring the probe failed \(EngineError: gone\)"),
    ],
    ids=["deviation", "another version", "scoring raised"],
)
def test_a_failed_probe_reverts_and_says_what_the_engine_serves(score, why):
    engine = Engine()
    with pytest.raises(DeliveryError, match=why + r".*rolled back to update 4"):
        verified_commit(engine.apply, Commit(5, probe=PROBE), score)
    assert [type(r) for r in engine.sent] == [Commit, Revert] and engine.sent[1].update_id == 5
    engine = Engine(revertible=False)
    with pytest.raises(DeliveryError, match="fails closed"):
        verified_commit(engine.apply, Commit(5, probe=PROBE), score)


def test_a_revert_that_fails_says_to_restart():
    engine = Engine(revert_error=EngineError("workers gone"))
    with pytest.raises(DeliveryError, match=r"reverting it failed too \(EngineError: workers gone\).*restart"):
        verified_commit(engine.apply, Commit(5, probe=PROBE), lambda probe: ([[0.0, 0.0]], {5}))


def test_the_kept_adapter_is_named_only_for_the_full_update_that_failed_closed_over_it():
    kept = delivery_error(7, "off", Ack(7, serving=False, adapter=3))
    assert "still applies the LoRA adapter of update 3" in str(kept) and "adapters='drop'" in str(kept)
    # an engine already failed closed under adapter 3 rolls back a LoRA push 8: not a kept adapter's doing
    rolled_back = delivery_error(8, "off", Ack(7, serving=False, adapter=3))
    assert "adapters=" not in str(rolled_back) and "same model and conversion" in str(rolled_back)
    assert "adapters=" not in str(delivery_error(7, "off", Ack(7, serving=False)))
