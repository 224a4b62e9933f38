"""Where one sync's time goes: sender and engine CPU profiles, GPU kernel times, messaging cost.

    python3 benchmarks/profile_sync.py --workload seed-lora --transport cuda_ipc [--bucket-mb 256]

1. the round trip of one control message to a ``sink`` engine process (the floor of any RPC);
2. pushes from this process into an engine process, both under cProfile (top functions);
3. the same pushes with the engine in this process (``LocalLink``): no socket, no GPU context
   switch between two processes -- the difference is what two processes cost;
4. GPU kernel times of one in-process push (torch.profiler).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time
from multiprocessing.connection import Connection

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from colosync.errors import EngineError


def _serve(conn: Connection, device: str, profile_path: str) -> None:
    from colosync.engines.process import EngineConfig, EngineHost

    host = EngineHost(EngineConfig(engine="sink", device=device, timeout_s=600))
    prof = cProfile.Profile()
    conn.send_bytes(b"ready")
    while True:
        data = conn.recv_bytes()
        if data == b"stop":
            break
        if data == b"profile-on":
            prof.enable()
            conn.send_bytes(b"ok")
            continue
        conn.send_bytes(host.handle_bytes(data))
    prof.disable()
    prof.dump_stats(profile_path)
    conn.send_bytes(b"bye")


def _expect(conn: Connection, want: bytes) -> None:
    got = conn.recv_bytes()
    if got != want:
        raise EngineError(f"the profiled sink engine answered {got[:60]!r}, expected {want!r}")


def _top(stats_source, n: int = 22, key: str = "tottime") -> str:
    out = io.StringIO()
    stats = (
        pstats.Stats(stats_source, stream=out)
        if isinstance(stats_source, str)
        else pstats.Stats(stats_source, stream=out)
    )
    stats.strip_dirs().sort_stats(key).print_stats(n)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
    return "\n".join(lines[start - 1 : start + n + 1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="seed-lora")
    ap.add_argument("--transport", default="cuda_ipc")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--gpu-trace", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()

    import torch

    from colosync.engines.process import codecs
    from colosync.engines.sink import SinkEngine
    from colosync.sync.link import LocalLink, PipeLink
    from colosync.sync.receiver import Receiver
    from colosync.sync.sender import Sender
    from colosync.tools.bench.sync import load_sync_workload, make_tensors
    from colosync.wire.protocol import Status

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    wl, specs, lora = load_sync_workload(args.workload)
    named = make_tensors(specs, device)
    bucket = args.bucket_mb << 20
    print(f"== {wl.name}: {wl.tensors} tensors, {wl.bytes / 1e6:.1f} MB, {args.transport}, bucket {args.bucket_mb} MiB")

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    prof_path = "/tmp/colosync-engine.prof"
    proc = ctx.Process(target=_serve, args=(child, str(device), prof_path), daemon=True)
    proc.start()
    _expect(parent, b"ready")
    link = PipeLink(parent, *codecs(SinkEngine.requests, SinkEngine.replies))

    rtt = []
    for _ in range(200):
        t = time.perf_counter()
        link.call(Status())
        rtt.append(time.perf_counter() - t)
    print(f"control round trip (Status): median {statistics.median(rtt) * 1e6:.0f} us, min {min(rtt) * 1e6:.0f} us")

    sender = Sender(link, transport=args.transport, bucket_bytes=bucket)
    for _ in range(5):
        sender.push(named, lora=lora)
    parent.send_bytes(b"profile-on")  # no request is pending on the link: talk to the loop directly
    _expect(parent, b"ok")
    prof = cProfile.Profile()
    times, reports = [], []
    for _ in range(args.updates):
        t = time.perf_counter()
        prof.enable()
        reports.append(sender.push(named, lora=lora))
        prof.disable()
        times.append(time.perf_counter() - t)
    times_plain = []
    for _ in range(args.updates):
        t = time.perf_counter()
        sender.push(named, lora=lora)
        times_plain.append(time.perf_counter() - t)
    sender.close()
    parent.send_bytes(b"stop")
    while parent.recv_bytes() != b"bye":
        pass
    proc.join(30)
    print(
        f"two processes: median {statistics.median(times_plain) * 1e3:.3f} ms "
        f"(profiled {statistics.median(times) * 1e3:.3f} ms)"
    )
    phases = {k: statistics.median(r.seconds[k] for r in reports) * 1e3 for k in reports[0].seconds}
    print("sender phases (profiled), ms:", {k: round(v, 3) for k, v in phases.items()})
    print("\n-- sender, by tottime --\n" + _top(prof))
    print("\n-- sender, by cumtime --\n" + _top(prof, 30, "cumtime"))
    print("\n-- engine, by tottime --\n" + _top(prof_path))
    print("\n-- engine, by cumtime --\n" + _top(prof_path, 30, "cumtime"))

    # the same, in one process
    receiver = Receiver(SinkEngine(device), device)
    local = Sender(LocalLink(receiver), transport=args.transport, bucket_bytes=bucket)
    for _ in range(5):
        local.push(named, lora=lora)
    torch.cuda.synchronize()
    loc = []
    for _ in range(args.updates):
        t = time.perf_counter()
        local.push(named, lora=lora)
        loc.append(time.perf_counter() - t)
    print(f"\none process (LocalLink): median {statistics.median(loc) * 1e3:.3f} ms, min {min(loc) * 1e3:.3f} ms")
    if args.gpu_trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                local.push(named, lora=lora)
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    local.close()
    receiver.close()


if __name__ == "__main__":
    main()
