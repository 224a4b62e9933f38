"""The sync phase of a colocated step: one push, verified when due, its report kept and passed on.

Every colocated loop ends its step the same way, whoever drives it: the trainer's weights go
into the engine as one transaction, a ``Probe`` of the trainer's own logprobs riding along on
the steps that verify (the engine scores it after installing the update and before serving;
a deviation rolls a LoRA back or fails a full update closed), and the ``SyncReport`` goes to
the loop's metrics. ``Colocated.step`` runs it inside the handoff's ``sync.weights`` step; a
framework that drives its own loop (TRL's ``sync_weights``, ``colosync.integrations.trl``)
calls it directly. Which steps verify, the count, the kept reports and the log line live here
once. The probe is made when ``probe()`` is asked (after the trainer's step, while its model
is awake), which may be well before the push runs. Only pushes that went through count: a
verification stays due until a push carrying a probe succeeds, so a refused push, or a push
made without a probe while one was due, leaves the next push verifying.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from colosync.errors import ConfigError
from colosync.sync.pipeline import SyncReport
from colosync.wire.protocol import Probe

log = logging.getLogger(__name__)

REPORTS_KEPT = 1024


class VerifiedSync:
    """Syncs one after another: ``verify_every=n`` verifies the first and every n-th after the
    last verified one (0: never); ``syncs`` counts the pushes that went through (a refused one
    is neither counted nor kept); the last ``keep`` reports stay in ``reports``; ``on_report``
    sees each."""

    def __init__(
        self,
        verify_every: int = 1,
        keep: int = REPORTS_KEPT,
        on_report: Callable[[SyncReport], None] | None = None,
    ) -> None:
        if verify_every < 0:
            raise ConfigError(f"verify_every must be >= 0 (0: never verify), got {verify_every}")
        self.verify_every = verify_every
        self.on_report = on_report
        self.reports: collections.deque[SyncReport] = collections.deque(maxlen=keep)
        self.syncs = 0
        self._unverified: int | None = None  # pushes since the last verified one (None: none verified yet)

    def due(self) -> bool:
        """Whether the next push verifies: no verified push yet, or ``verify_every - 1`` unverified
        ones since the last (a refused push, or one without a probe, leaves it due)."""
        if self.verify_every == 0:
            return False
        return self._unverified is None or self._unverified >= self.verify_every - 1

    def probe(self, make: Callable[[], Probe] | None) -> Probe | None:
        """The probe for the next push: ``make()`` when it verifies and there is a ``make``, else None."""
        return make() if make is not None and self.due() else None

    def push(self, push: Callable[[Probe | None], SyncReport], probe: Probe | None = None) -> SyncReport:
        """One push (``push(probe)``: the transaction, e.g. ``lambda p: sender.push_peft(model, verify=p)``),
        counted, logged, kept and handed to ``on_report`` once it went through; a refused delivery
        raises from ``push`` and changes nothing here (the next push is due as this one was)."""
        report = push(probe)
        self.syncs += 1
        if probe is not None:
            self._unverified = 0
        elif self._unverified is not None:
            self._unverified += 1
        self.reports.append(report)
        delivery = report.delivery
        deviation = delivery.max_deviation if delivery is not None else None
        log.info(
            "sync %d: update %d, %s, %d bytes in %.1f ms over %s%s",
            self.syncs,
            report.update_id,
            report.kind,
            report.bytes,
            report.seconds.get("total", 0.0) * 1e3,
            report.transport,
            f", verified (max |delta logprob| {deviation:.2g})" if deviation is not None else "",
        )
        if self.on_report is not None:
            self.on_report(report)
        return report

    @property
    def last(self) -> SyncReport | None:
        return self.reports[-1] if self.reports else None


__all__ = ["REPORTS_KEPT", "VerifiedSync"]
