"""``VerifiedSync``, the sync phase ``Colocated.step`` and TRL's ``sync_weights`` share: which
pushes carry a probe, what is kept and handed on, and a refused push neither counted nor kept."""

from __future__ import annotations

import pytest
import torch

from colosync.colocated.probe import random_probe, scored
from colosync.colocated.sync import VerifiedSync
from colosync.errors import ConfigError, DeliveryError
from colosync.sync.pipeline import SyncReport
from colosync.wire.protocol import Probe

PROBE = Probe([[1, 2]], [[3]], [[-0.5]])


def report(update_id: int) -> SyncReport:
    return SyncReport(update_id, "lora", "shm", 2, 1, 64, {"total": 0.001})


@pytest.mark.parametrize(
    "every, verified", [(1, [1, 1, 1, 1, 1]), (2, [1, 0, 1, 0, 1]), (3, [1, 0, 0, 1, 0]), (0, [0] * 5)]
)
def test_the_first_push_and_every_nth_after_it_carry_the_probe(every, verified):
    seen: list[SyncReport] = []
    sync = VerifiedSync(verify_every=every, keep=3, on_report=seen.append)
    carried = []
    for i in range(5):
        probe = sync.probe(lambda: PROBE)
        carried.append(int(probe is not None))
        sync.push(lambda p, i=i, sent=probe: report(i + 1) if p is sent else pytest.fail("another probe"), probe)
    assert carried == verified
    assert [r.update_id for r in seen] == [1, 2, 3, 4, 5]
    assert [r.update_id for r in sync.reports] == [3, 4, 5] and sync.last is seen[-1] and sync.syncs == 5


def test_no_probe_is_made_when_none_is_due_or_there_is_no_maker():
    sync = VerifiedSync(verify_every=2)
    assert sync.probe(None) is None
    sync.push(lambda p: report(1), PROBE)  # verified: the next push is not due
    assert sync.probe(lambda: pytest.fail("made a probe for a push that does not verify")) is None


def test_a_refused_push_is_not_counted_nor_kept_and_the_next_push_verifies():
    seen: list[SyncReport] = []
    sync = VerifiedSync(verify_every=2, on_report=seen.append)

    def refuse(probe):
        raise DeliveryError("deviation 0.3 > 0.01")

    with pytest.raises(DeliveryError):
        sync.push(refuse, sync.probe(lambda: PROBE))
    assert sync.syncs == 0 and not sync.reports and not seen and sync.last is None
    assert sync.due()  # the refused push verified nothing: the next one carries the probe
    carried = []
    for i in range(4):
        probe = sync.probe(lambda: PROBE)
        carried.append(int(probe is not None))
        sync.push(lambda p, i=i: report(i + 1), probe)
    assert carried == [1, 0, 1, 0] and sync.syncs == 4


def test_a_push_without_a_probe_while_one_is_due_leaves_it_due():
    sync = VerifiedSync(verify_every=3)
    sync.push(lambda p: report(1))  # the first push is due, but nothing rode it
    assert sync.due() and sync.syncs == 1
    carried = []
    for i in range(5):
        probe = sync.probe(lambda: PROBE)
        carried.append(int(probe is not None))
        sync.push(lambda p, i=i: report(i + 2), probe)
    assert carried == [1, 0, 0, 1, 0]  # the first probe, then every 3rd push after it
    sync.push(lambda p: report(7))  # due (the 3rd after the last verified), no probe: still due
    assert sync.due()


def test_negative_cadence_is_refused():
    with pytest.raises(ConfigError, match="verify_every"):
        VerifiedSync(verify_every=-1)


def test_the_probe_is_fixed_by_its_seed_and_scored_by_the_model_as_it_is(tiny_model_dir):
    from colosync.testing import load_model

    a, b = random_probe(50, 2, 3, 4, seed=7), random_probe(50, 2, 3, 4, seed=7)
    assert a == b and a != random_probe(50, 2, 3, 4, seed=8)
    assert all(len(p) == 3 for p in a.prompts) and all(len(c) == 4 and max(c) < 50 for c in a.completions)
    model = load_model(str(tiny_model_dir), torch.device("cpu")).train()
    probe = scored(model, a, tolerance=0.5)
    assert model.training  # the training mode came back
    assert probe.tolerance == 0.5 and probe.prompts == a.prompts
    assert all(x < 0 for row in probe.logprobs for x in row)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert scored(model, a, 0.5).logprobs != probe.logprobs
