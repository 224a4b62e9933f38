"""How far behind its trainer a served version may be before no new request starts on it.

In asynchronous RL the engine generates while the trainer trains and pushes, so every sample's
policy lags the trainer's, usually by one update. A push that fails verification, or a trainer
that runs ahead of its pushes, lets that lag grow without bound, and samples that far off-policy
hurt training more than waiting would. So an engine may refuse to start requests on a version
more than ``max_lag`` updates behind.

The trainer's newest version needs no message of its own: it is the newest update the trainer
began (every ``Begin`` the engine's transaction accepted). ``behind(served)`` counts the updates
begun after the served one, committed or not: one that failed still counts, the trainer moved on.
"""

from __future__ import annotations

import bisect
import threading

from colosync.errors import ConfigError, VersionLagError


class UpdateIds:
    """Update ids, ascending (the newest ``keep``), and how many came after one of them: a version's lag."""

    def __init__(self, keep: int = 4096) -> None:
        self._ids: list[int] = []
        self._keep = keep
        self._lock = threading.Lock()  # a leaf: taken under the transaction's lock and under leases' condition

    def add(self, update_id: int) -> None:
        """Record ``update_id`` if it is newer than every one recorded (ids only grow; a repeat is ignored)."""
        with self._lock:
            if not self._ids or update_id > self._ids[-1]:
                self._ids.append(update_id)
                del self._ids[: -self._keep]

    def after(self, update_id: int) -> int:
        with self._lock:
            return len(self._ids) - bisect.bisect_right(self._ids, update_id)

    @property
    def newest(self) -> int | None:
        with self._lock:
            return self._ids[-1] if self._ids else None


class Staleness:
    """The updates a trainer began, and how many of them a served version may lag (None: any number)."""

    def __init__(self, max_lag: int | None = None) -> None:
        self.max_lag: int | None = None
        self.begun = UpdateIds()
        self.limit(max_lag)

    def limit(self, max_lag: int | None) -> None:
        """From now on, start no request on a version more than ``max_lag`` updates behind (None: no bound)."""
        if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0):
            raise ConfigError(
                f"max_lag counts the updates a served version may lag its trainer: an int >= 0 or None, got {max_lag!r}"
            )
        self.max_lag = max_lag

    def behind(self, served: int) -> int:
        """How many updates the trainer began after ``served``."""
        return self.begun.after(served)

    def too_far(self, served: int) -> bool:
        return self.max_lag is not None and self.behind(served) > self.max_lag

    def refuse(self, served: int, what: str) -> None:
        """Raise ``VersionLagError`` for ``what`` (a generation) while ``served`` lags more than ``max_lag``."""
        if self.too_far(served):
            raise VersionLagError(
                f"the engine starts no {what} on update {served}: the trainer began {self.behind(served)} updates "
                f"after it (the newest {self.begun.newest}), more than max_lag={self.max_lag}; requests start again "
                "once a newer update commits (push one), or raise max_lag"
            )


__all__ = ["Staleness", "UpdateIds"]
