"""What a handoff run leaves behind: one record per step and the run's result.

Why this is not part of the executor: the result outlives the run. The demo's report, the
benchmarks' JSON and a training loop's logs read it without running a plan, and its
``to_dict`` is a file format that should change only on purpose, never as a side effect of
changing how steps are run or sampled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from colosync.handoff.model.participants import OpReport
from colosync.handoff.runtime.invariants import Violation


@dataclass
class StepRecord:
    phase: str
    index: int
    step: str
    why: str
    report: OpReport
    held_after: list[str]
    host_before: int
    host_peak: int
    host_after: int
    host_abs_peak: int
    device_before: int
    device_peak: int
    device_after: int
    expected_host_peak: int
    expected_device_peak: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["report"] = msgspec.to_builtins(self.report)
        return d


@dataclass
class ExecutionResult:
    peak_device: str
    baseline_host: int
    baseline_device: int
    records: list[StepRecord] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    @property
    def host_peak(self) -> int:
        """Peak host copies above baseline."""
        return max((r.host_peak for r in self.records), default=0)

    @property
    def host_abs_peak(self) -> int:
        return max((r.host_abs_peak for r in self.records), default=0)

    @property
    def device_peak(self) -> int:
        return max((r.device_peak for r in self.records), default=0)

    def peak_step(self, what: str = "host") -> str:
        key = (lambda r: r.host_peak) if what == "host" else (lambda r: r.device_peak)
        if not self.records:
            return ""
        r = max(self.records, key=key)
        return f"{r.phase}:{r.step}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_device": self.peak_device,
            "baseline_host_bytes": self.baseline_host,
            "baseline_device_bytes": self.baseline_device,
            "host_copies_peak_bytes": self.host_peak,
            "host_copies_peak_step": self.peak_step("host"),
            "host_abs_peak_bytes": self.host_abs_peak,
            "device_peak_bytes": self.device_peak,
            "device_peak_step": self.peak_step("device"),
            "violations": [asdict(v) for v in self.violations],
            "steps": [r.to_dict() for r in self.records],
        }
