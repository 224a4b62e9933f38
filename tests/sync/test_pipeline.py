"""The sender's pipeline: ``PhaseTimer`` (``SlotPipeline`` is tested in tests/sync/test_sender.py)."""

from __future__ import annotations

import time

from colosync.sync.pipeline import PhaseTimer


def test_a_reports_phase_seconds_add_up_over_every_bucket():
    """``SyncReport.seconds[phase]`` is the time spent in that phase over the whole update, not its last bucket."""
    timer = PhaseTimer()
    timer.add("pack", time.perf_counter() - 1.0)  # one bucket spent a second packing
    timer.add("pack", time.perf_counter() - 2.0)  # the next, two
    assert timer.seconds["pack"] >= 3.0
