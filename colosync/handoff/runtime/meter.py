"""Every participant's host and device bytes, sampled as one measurement against a baseline.

Why this is not part of the executor: what a measurement is -- which processes are sampled,
how a shared arena counts once, where device figures come from when this process has no
CUDA, what a remote participant's own samples mean for everyone else -- depends only on the
participants and the host pools, not on the plan or the step being run. Apart, the loop
that runs a step reads as run, measure, check, and a change to how memory is counted cannot
quietly change when it is counted.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.model.ops import Region
from colosync.handoff.model.participants import Footprint, MemoryParticipant
from colosync.handoff.runtime.invariants import Measurement
from colosync.handoff.runtime.sampling import DeviceSampler, HostSampler, trim_host_allocator


def _remote_device(p: MemoryParticipant) -> int:
    sample = getattr(getattr(p, "state", None), "sample", None)
    used = getattr(sample, "device_used", None)
    return int(used) if used is not None else 0


class Meter:
    """Samples ``participants`` (and the processes they run in) together with the host pools
    reserved before the run; ``host_scope="node"`` measures the node's anon+shmem instead."""

    def __init__(self, participants: Sequence[MemoryParticipant], pools: Sequence[HostPool], host_scope: str) -> None:
        self.participants = list(participants)
        self.pools = list(pools)
        self._remote = [p for p in self.participants if p.remote]
        shared = bool(self._remote) or any(getattr(pool, "arena", None) is not None for pool in self.pools)
        # every arena in play, once: the pools' and the ones remote participants map (their
        # self-samples leave an arena to this process's sampler, which counts it once)
        found = [getattr(x, "arena", None) for x in [*self.pools, *self._remote]]
        arenas = list({a.name: a for a in found if a is not None}.values())
        self.host = HostSampler(roots=[p.pid for p in self._remote], shared=shared, scope=host_scope, arenas=arenas)
        self.device = DeviceSampler()
        on_cuda = any(p.footprint().device_type == "cuda" for p in self.participants)
        self.device_measured = self.device.enabled and on_cuda
        self.device_remote = not self.device.enabled and on_cuda
        """No CUDA here (a controller): device figures come from the remote participants' samples."""

    def footprints(self) -> list[Footprint]:
        return [p.footprint() for p in self.participants]

    def held_now(self) -> frozenset[Region]:
        out: frozenset[Region] = frozenset()
        for p in self.participants:
            out |= p.regions()
        return out

    def sizes(self) -> dict[Region, int]:
        sizes: dict[Region, int] = {}
        for p in self.participants:
            sizes.update(p.region_bytes())
        return sizes

    def measure(self, baseline_host: int) -> Measurement:
        """Host and device now, host copies counted above ``baseline_host``."""
        for p in self._remote:
            p.refresh()  # one round trip: what it holds and its footprint now
        if self._remote:
            self.host.refresh()  # a remote engine's workers may have started since
        fps = self.footprints()
        cpu_device = sum(fp.device_bytes for fp in fps if fp.device_type == "cpu")
        if any(fp.device_type == "cpu" for fp in fps):
            trim_host_allocator()  # freed CPU tensors must show up as freed
        h = self.host.sample()
        logical_host = sum(fp.host_bytes for fp in fps)
        if self.device_measured:
            d = self.device.sample()
            device = d.used if d is not None else 0
        elif self.device_remote:
            device = max((_remote_device(p) for p in self._remote), default=0)
        else:
            device = sum(fp.device_bytes for fp in fps)
        return Measurement(
            host_copies=h.value - baseline_host - cpu_device,
            host_abs=h.value,
            device=device,
            logical_host=logical_host,
            held=self.held_now(),
            by_pid=h.by_pid,
        )

    def remote_peaks(
        self, baseline_host: int, participant: MemoryParticipant, before: Measurement, after: Measurement
    ) -> list[Measurement]:
        """The moments a remote operation marked, as measurements of every process: the remote
        process tree as it sampled itself then, every other process as it is now (idle while
        the remote one worked)."""
        out = []
        others = [p for p in self.participants if p is not participant]
        other_fps = [p.footprint() for p in others]
        for peak in getattr(participant, "peaks", []):
            tree = set(peak.host_pids)
            host = sum(v for pid, v in after.by_pid.items() if pid not in tree) + sum(peak.host_pids.values())
            fps = [*other_fps, Footprint(peak.host_bytes, peak.device_bytes, peak.device_type)]
            cpu_device = sum(fp.device_bytes for fp in fps if fp.device_type == "cpu")
            if self.device_measured or self.device_remote:
                device = peak.device_used if peak.device_used is not None else after.device
            else:
                device = sum(fp.device_bytes for fp in fps)
            out.append(
                Measurement(
                    host_copies=host - baseline_host - cpu_device,
                    host_abs=host,
                    device=device,
                    logical_host=sum(fp.host_bytes for fp in fps),
                    held=before.held,
                )
            )
        return out

    def baseline(self, given: int | None) -> tuple[int, int, int]:
        """The host and device baselines of a new run (``given``: the host one, when known), and the
        host copy bytes held from its start (what participants hold, or the pools reserve if more)."""
        gc.collect()  # garbage collected later would otherwise make host copies look smaller
        for p in self._remote:
            p.refresh()
        self.host.refresh()
        fps = self.footprints()
        cpu_device = sum(fp.device_bytes for fp in fps if fp.device_type == "cpu")
        if any(fp.device_type == "cpu" for fp in fps):
            trim_host_allocator()
        h = self.host.sample()
        baseline = given
        reserved = sum(p.capacity_bytes for p in self.pools)
        if baseline is None:
            # Reserved pools (the arena) hold their pages from the start: they are host copies'
            # memory, not baseline. Participants' copies live inside them.
            baseline = h.value - max(sum(fp.host_bytes for fp in fps), reserved) - cpu_device
        dev_base = 0
        if self.device_measured or self.device_remote:
            if self.device_measured:
                d = self.device.sample()
                used = d.used if d is not None else 0
            else:
                used = max((_remote_device(p) for p in self._remote), default=0)
            dev_base = used - sum(fp.device_bytes for fp in fps if fp.device_type == "cuda")
        return baseline, dev_base, max(sum(fp.host_bytes for fp in fps), reserved)
