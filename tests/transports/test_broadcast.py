"""``broadcast`` specifics beyond what the engine-set tests cover: a group still forming when its process exits.

A group forms on a thread of its own, inside torch's process-group constructor, which nothing can
stop. Had that thread been a daemon, a constructor returning while the interpreter shuts down
would abort the whole process (a test runner included) with "terminate called without an active
exception". The process's exit instead waits for it, at most its join timeout.
"""

from __future__ import annotations

import subprocess
import sys
import time

# A group of two that nobody else joins, and a finalizer that keeps the interpreter shutting down
# past the group's 1 s timeout, so the constructor returns during the shutdown.
_EXIT_WHILE_FORMING = """
import time, sys, torch
from colosync.transports.base import Peers
from colosync.transports.broadcast import BroadcastSender

class SlowShutdown:
    def __del__(self, sleep=time.sleep):
        sleep(2.0)

sender = BroadcastSender.create(1024, 2, torch.device("cpu"), Peers(receivers=1, join_timeout_s=1.0))
sys.slow_shutdown = SlowShutdown()
print("exiting", flush=True)
"""


def test_a_process_that_exits_while_its_group_is_forming_exits_cleanly():
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_FORMING], capture_output=True, text=True, timeout=60, check=False
    )
    assert child.returncode == 0, f"exit status {child.returncode}:\n{child.stderr[-2000:]}"
    assert "terminate called" not in child.stderr
    assert "exiting" in child.stdout
    assert time.monotonic() - started < 30  # waited for the join timeout, not for ever


_CLOSED_BEFORE_ANYONE_CAME = """
import torch
from colosync.transports.base import Peers
from colosync.transports.broadcast import BroadcastSender

sender = BroadcastSender.create(1024, 2, torch.device("cpu"), Peers(receivers=2, join_timeout_s=60.0))
sender.close()  # no engine opened its handle (an Attach that failed, say): nobody will come
"""


def test_a_group_closed_before_every_rank_opened_its_handle_does_not_hold_the_exit():
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", _CLOSED_BEFORE_ANYONE_CAME], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert time.monotonic() - started < 30  # not the group's 60 s timeout


# ``close`` lands just after every rank opened the handle and just before the thread enters torch's
# constructor: the moment a sender that finished an update with no bytes (or an aborted one) closes.
_CLOSED_AS_THE_GROUP_FORMS = """
import torch
from colosync.transports import broadcast
from colosync.transports.base import Peers

opened = broadcast._Group._every_rank_opened

def then_close(self, *store):
    left = opened(self, *store)
    self.close()
    return left

broadcast._Group._every_rank_opened = then_close
sender = broadcast.BroadcastSender.create(1024, 2, torch.device("cpu"), Peers(receivers=1, join_timeout_s=30.0))
receiver = broadcast.BroadcastReceiver.open(sender.handle(), torch.device("cpu"))
print("exiting", flush=True)
"""


def test_a_group_closed_as_it_forms_exits_cleanly():
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", _CLOSED_AS_THE_GROUP_FORMS], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, f"exit status {child.returncode}:\n{child.stderr[-2000:]}"
    assert "exiting" in child.stdout
    assert time.monotonic() - started < 20  # both ranks formed the group and left it, no join timeout
