"""The optional torch_memory_saver trainer backend: it says why it cannot run here."""

from __future__ import annotations

import pytest

from colosync.handoff import UnsupportedOperation


def test_tms_backend_explains_why_it_is_unavailable():
    from colosync.handoff.backends.tms_trainer import TmsTrainerMemory, tms_available

    ok, why = tms_available()
    if ok:
        pytest.skip("torch_memory_saver is usable here")
    assert "torch_memory_saver" in why
    with pytest.raises(UnsupportedOperation, match="torch_memory_saver"):
        TmsTrainerMemory()
