"""Write benchmarks/README.md (one table: every subject's current figure) and its plots from the records.

    python benchmarks/index.py                     # README.md here, each plot beside its record
    python benchmarks/index.py --out DIR --no-plots

Each subject folder holds its current record (JSON with the command, machine, date and commit that
made it); this script reads nothing else, so the same records always give the same README. A new
result replaces its folder's record (history lives in git), then this script runs again;
tests/test_benchmarks_index.py fails while the committed README is stale.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

Record = dict[str, Any]


def load(folder: str, name: str = "record.json") -> Record:
    return json.loads((HERE / folder / name).read_text())


def meta(record: Record) -> dict[str, Any]:
    """command, date, commit and machine of a record, wherever its tool put them."""
    header = record.get("header", {})
    found = {key: record.get(key, header.get(key)) for key in ("command", "date", "commit", "machine")}
    if found["machine"] is None:  # colosync bench writes the host and GPU at the top level
        found["machine"] = {k: record[k] for k in ("host", "gpu", "driver", "cuda", "torch") if k in record} or None
    return found


def machine(record: Record) -> str:
    m = meta(record)["machine"]
    gpu = record.get("gpu")
    if isinstance(m, dict):
        gpu = gpu or m.get("gpu")
        if not gpu:
            return f"{m.get('cpu_count', '?')}-core CPU"
    elif isinstance(m, str) and not gpu:
        return "2-core CPU" if "2-core" in m else m
    return f"1× {gpu}" + (", MPS" if record.get("mps") else "")


# -- colosync bench --------------------------------------------------------------------------------


def medians(record: Record) -> dict[str, float]:
    return {r["path"]: r["median_ms"] for r in record["results"]}


def ms(x: float) -> str:
    return f"{x:.3f} ms" if x < 10 else f"{x:.1f} ms" if x < 100 else f"{x:.0f} ms"


def seed_lora(record: Record) -> tuple[str, str, str]:
    m = medians(record)
    head = f"`cuda_ipc` **{ms(m['cuda_ipc'])}**, + arena **{ms(m['cuda_ipc+arena'])}**, `shm` **{ms(m['shm'])}**"
    ref = f"fresh handle {ms(m['ref:fresh_ipc'])}; `.to('cpu')` + pickle {ms(m['ref:pickle'])}"
    floor = f"D2H ‖ H2D {ms(m['floor:pinned d2h || h2d'])}; device copy {ms(m['floor:device copy'])}"
    if "floor:ipc mechanism" in m:  # the bare cuda_ipc mechanism, timed in the same run
        floor += f"; bare `cuda_ipc` mechanism {ms(m['floor:ipc mechanism'])}"
    return head, ref, floor


def full_sync_alone(record: Record) -> tuple[str, str, str]:
    """A ``cuda_ipc``-only run (``--references none --no-floor``) on a card with no references recorded."""
    slots = record["results"][0]["config"]["slots"]
    return f"`cuda_ipc`, {slots} × 4 GiB slots: **{ms(medians(record)['cuda_ipc'])}**", "–", "–"


def full_sync(record: Record) -> tuple[str, str, str]:
    m, old = medians(record), medians(load("full-sync", "references.json"))
    slots = record["results"][0]["config"]["slots"]
    head = f"`cuda_ipc`, {slots} × 4 GiB slots: **{ms(m['cuda_ipc'])}**"
    ref = f"fresh handle {ms(old['ref:fresh_ipc'])} (`references.json`, older tree)"
    floor = f"device copy {ms(old['floor:device copy'])}; D2H ‖ H2D {ms(old['floor:pinned d2h || h2d'])}"
    return head, ref, floor


# -- other tools -----------------------------------------------------------------------------------


def colocated_step(record: Record) -> tuple[str, str, str]:
    head, _, floor = colocated_step_alone(record)
    tms = load("colocated-step", "tms.json")["modes"][0]["summary"]
    ref = (
        f"torch_memory_saver trainer {tms['median_handoff_plus_sync_s']:.2f} s "
        f"({tms['handoff_plus_sync_over_floor']:.2f}×)"
    )
    return head, ref, floor


def colocated_step_alone(record: Record) -> tuple[str, str, str]:
    """A run with no reference beside it on its machine (the torch_memory_saver one ran on another card)."""
    s = record["modes"][0]["summary"]
    head = (
        f"handoff + 16 GB sync **{s['median_handoff_plus_sync_s']:.2f} s** "
        f"({s['handoff_plus_sync_over_floor']:.2f}× floor), host copies {s['host_peak_over_larger_copy']:.3f}× "
        f"the larger copy, {s['violations']} invariants broken"
    )
    floor = f"pinned copies {s['median_floor_s']:.2f} s"
    if "median_floor_with_allocator_s" in s:  # runs that also timed the allocator
        floor += (
            f"; with the allocator's calls (an estimate) {s['median_floor_with_allocator_s']:.2f} s "
            f"({s['handoff_plus_sync_over_floor_with_allocator']:.2f}×)"
        )
    return head, "–", floor


def handoff(record: Record) -> tuple[str, str, str]:
    by = {r["backend"]: r for r in record["results"]}
    t, tms = by["torch"], by["torch_memory_saver"]
    gb = t["bytes"] / 1e9
    head = f"trainer sleep **{t['sleep_gbps_median']:.1f}** / wake **{t['wake_gbps_median']:.1f} GB/s** ({gb:.0f} GB)"
    ref = f"torch_memory_saver {tms['sleep_gbps_median']:.1f} / {tms['wake_gbps_median']:.1f} GB/s"
    pin = t["reference_pinned_copy"]
    return head, ref, f"pinned copy {pin['d2h_gbps']:.1f} / {pin['h2d_gbps']:.1f} GB/s"


def engine_transaction(record: Record) -> tuple[str, str, str]:
    m = record["medians_ms"]

    def pair(path: str) -> str:
        return f"{statistics.median(m[path]['old']):.3f} → {statistics.median(m[path]['new']):.3f}"

    head = f"after/before, ms: `cuda_ipc` {pair('cuda_ipc')}, arena {pair('cuda_ipc+arena')}, `shm` {pair('shm')}"
    ref = f"the tree before, `{record['old_commit']}`, alternated in one run ({len(m['cuda_ipc']['old'])} pairs)"
    return head, ref, f"D2H ‖ H2D {pair('floor:pinned d2h || h2d')}"


def two_contexts(record: Record) -> tuple[str, str, str]:
    mps = load("two-contexts", "mps.json")
    head = (
        f"{record['mib']} MiB read then copy, two processes: **{record['two_processes_minus_pipe_us']:.0f} µs** "
        f"(one process {record['one_process_us']:.0f} µs)"
    )
    ref = f"under MPS {mps['two_processes_minus_pipe_us']:.0f} µs"
    return head, ref, f"read {record['read_alone_us']:.0f} + copy {record['copy_alone_us']:.0f} µs alone"


def kernels(record: Record) -> tuple[str, str, str]:
    rows = [r for r in record["rows"] if r["workload"] == "seed-lora"]
    pack = min(r["ms"] for r in rows if r["path"].startswith("pack: gather"))
    land = min(r["ms"] for r in rows if r["path"].startswith("land: copy_check"))
    old = next(r["ms"] for r in rows if r["path"].startswith("pack: foreach_copy_"))
    floor = next(r["ms"] for r in rows if r["path"] == "land: device copy (floor)")
    head = f"seed-lora: gather pack + fingerprint **{pack:.3f} ms**, landing copy + check **{land:.3f} ms**"
    return head, f"`_foreach_copy_` + fingerprint pass {old:.3f} ms", f"device copy {floor:.3f} ms"


def channel(record: Record) -> tuple[str, str, str]:
    ref = load("channel", "reference-asyncio.json")
    head = (
        f"`Status` round trip **{record['status_round_trip_ms']['median']:.3f} ms**, "
        f"four pipelined {record['four_pipelined_ms']['median']:.3f} ms"
    )
    return head, f"asyncio loop + engine thread {ref['status_round_trip_ms']['median']:.3f} ms", "–"


def channel_h200(record: Record) -> tuple[str, str, str]:
    head = (
        f"`Status` round trip **{record['status_round_trip_ms']['median']:.3f} ms**, "
        f"four pipelined {record['four_pipelined_ms']['median']:.3f} ms"
    )
    return head, "–", "–"


def fsdp_source(record: Record) -> tuple[str, str, str]:
    run = record["runs"][0]
    by = {r["path"]: r for r in run["results"]}
    cfg = run["config"]
    head = (
        f"`FsdpSource` gather + push **{by['fsdp_source']['median_s']:.2f} s** "
        f"({cfg['tensors']} tensors, {cfg['size_bytes'] / 1e6:.0f} MB, world size {cfg['world_size']})"
    )
    return head, f"per-parameter `full_tensor()` {by['full_tensor_stream']['median_s']:.2f} s", "–"


def trl_sync(record: Record) -> tuple[str, str, str]:
    r = record["results"]
    head = f"`sync_weights` per GRPO step, colosync verified **{r['colosync']['median_sync_seconds']:.2f} s**"
    return head, f"stock TRL {r['stock']['median_sync_seconds']:.2f} s", "–"


def verify_cost(record: Record) -> tuple[str, str, str]:
    head = (
        f"verified LoRA push **{record['verified_push_ms_median']:.1f} ms** "
        f"(engine scoring {record['engine_verify_ms_median']:.1f} ms)"
    )
    return head, f"the same push unverified {record['push_ms_median']:.1f} ms", "–"


def mutation(record: Record) -> tuple[str, str, str]:
    t = record["total"]
    head = f"**{t['score']:.1%}** killed ({t['killed']}/{t['mutants']}, 1-in-{record['sample']} sample)"
    ref = f"{t['equivalent']} survivors explained as equivalent: {t['score_without_equivalent']:.0%} without them"
    return head, ref, "–"


def demo_soak(record: Record) -> tuple[str, str, str]:
    head = (
        f"{len(record['steps'])} training steps, reward {record['first3_reward']:.2f} → {record['last3_reward']:.2f}, "
        f"median sync **{record['median_sync_ms']:.0f} ms**, parity error {record['max_parity_err']:g}"
    )
    return head, "–", "–"


def separated(record: Record) -> tuple[str, str, str]:
    by = {r["path"]: r["median_ms"] for r in record["results"]}
    paths = [p for p in ("p2p", "broadcast", "shm") if p in by]
    fastest = min((p for p in paths if p != "shm"), key=by.__getitem__, default=paths[0])
    head = f"{record['workload']['name']} to {record['engines']} engines as one set: `{fastest}` **{ms(by[fastest])}**"
    head += f", `shm` {ms(by['shm'])}" if "shm" in by and fastest != "shm" else ""
    backend = "gloo" if record.get("device", "cpu") == "cpu" else "NCCL"
    raw = min(v for p, v in by.items() if p.startswith("raw:"))
    return head, f"bare {backend} group {ms(raw)}", "–"


def async_commit(record: Record) -> tuple[str, str, str]:
    by = {r["path"]: r for r in record["results"]}
    new, old, none = by["inflight"], by["wait"], by["no pushes"]
    head = (
        f"a LoRA pushed every {record['config']['every']} requests while vLLM generates, `inflight`: push "
        f"**{new['push_ms_median']:.0f} ms** (waits for no request), {new['tokens_per_s']:.0f} tokens/s"
    )
    ref = f"`wait` (drain, swap): push {old['push_ms_median']:.0f} ms, {old['tokens_per_s']:.0f} tokens/s"
    return head, ref, f"no pushes: {none['tokens_per_s']:.0f} tokens/s"


@dataclass(frozen=True)
class Row:
    subject: str
    folder: str
    record: str
    figures: Callable[[Record], tuple[str, str, str]]


ROWS = [
    Row("seed-lora sync (624 tensors, 169 MB)", "seed-lora", "record.json", seed_lora),
    Row("seed-lora sync, under MPS", "seed-lora", "mps.json", seed_lora),
    Row("seed-lora sync, H100", "seed-lora", "h100.json", seed_lora),
    Row("seed-lora sync, H100 under MPS", "seed-lora", "h100-mps.json", seed_lora),
    Row("full-weight sync (llama8b-full, 16 GB)", "full-sync", "record.json", full_sync),
    Row("full-weight sync, H100 under MPS", "full-sync", "h100-mps.json", full_sync_alone),
    Row("colocated step (16 GB, KV filling the GPU)", "colocated-step", "record.json", colocated_step),
    Row("colocated step, H100 (16 GB, KV filling the GPU)", "colocated-step", "h100.json", colocated_step_alone),
    Row("handoff: trainer sleep/wake", "handoff", "record.json", handoff),
    Row("engine-side transaction, A/B", "engine-transaction", "one-owner/summary.json", engine_transaction),
    Row("seed-lora, layouts in one pass, A/B (H100)", "seed-lora", "layout-guard/summary.json", engine_transaction),
    Row("two CUDA contexts taking turns", "two-contexts", "record.json", two_contexts),
    Row("sync kernels alone", "kernels", "record.json", kernels),
    Row("control channel", "channel", "record.json", channel),
    Row("control channel, H200 host", "channel", "h200.json", channel_h200),
    Row("separated mode (gloo, CPU)", "separated", "record.json", separated),
    Row("commits beside running requests (vLLM CPU)", "async-commit", "record.json", async_commit),
    Row("FSDP2 source", "fsdp-source", "record.json", fsdp_source),
    Row("TRL GRPOTrainer sync", "trl-sync", "record.json", trl_sync),
    Row("verification cost", "verify-cost", "record.json", verify_cost),
    Row("mutation score of the core", "mutation", "results.json", mutation),
    Row("demo soak (hf engine, CPU)", "demo-soak", "record.json", demo_soak),
]

SUBJECTS = sorted({row.folder for row in ROWS})

PLOTS = {"seed-lora": "seed-lora.png", "handoff": "sleep-wake.png"}

HEAD = """# Benchmarks

Generated by `python benchmarks/index.py` from each folder's record; edit the records, not this page.
Every row is the current figure of its subject; each folder's README gives the command, what the
figure means, and the figures beside it. Superseded results are in git history.

| subject | current figure | reference | floor | machine | date | commit | folder |
|---|---|---|---|---|---|---|---|
"""

TAIL = """
`gpu/` holds the scripts run on a GPU host that are not one subject's: the gpu-marked tests in
parallel streams (`test-streams.sh`), a before/after A/B of seed-lora (`ab.sh`), the sync with and
without CUDA MPS (`bench-mps.sh`), each GPU test against the feature it guards taken out
(`gpu-mutants.sh`), traced timelines of one sync (`trace.sh`, `gpu_timeline.py`), and the demo on CUDA
(`demo.sh`).
"""


def readme() -> str:
    lines = [HEAD]
    for row in ROWS:
        record = load(row.folder, row.record)
        head, ref, floor = row.figures(record)
        m = meta(record)
        date = str(m["date"])[:10]
        link = f"[`{row.folder}/`]({row.folder}/)"
        cells = [row.subject, head, ref, floor, machine(record), date, f"`{m['commit']}`", link]
        lines.append("| " + " | ".join(cells) + " |\n")
    lines.append("\n")
    for folder, name in PLOTS.items():
        lines.append(f"![{folder}]({folder}/{name})\n")
    lines.append(TAIL)
    return "".join(lines)


# -- plots -----------------------------------------------------------------------------------------


def plot_seed_lora(path: Path) -> None:
    import matplotlib.pyplot as plt

    bars = [
        ("cuda_ipc + arena", "cuda_ipc+arena", "tab:blue"),
        ("cuda_ipc", "cuda_ipc", "tab:blue"),
        ("shm", "shm", "tab:blue"),
        ("ref: fresh handle", "ref:fresh_ipc", "tab:red"),
        ("floor: D2H ‖ H2D", "floor:pinned d2h || h2d", "tab:gray"),
        ("floor: device copy", "floor:device copy", "tab:gray"),
    ]
    runs = [("no MPS", medians(load("seed-lora"))), ("MPS", medians(load("seed-lora", "mps.json")))]
    fig, ax = plt.subplots(figsize=(8, 4))
    height = 0.38
    for i, (_label, key, color) in enumerate(bars):
        for j, (name, m) in enumerate(runs):
            y = i + (j - 0.5) * height
            ax.barh(y, m[key], height, color=color, alpha=1.0 if j == 0 else 0.55)
            ax.text(m[key] * 1.05, y, f"{m[key]:.3g} ms ({name})", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("median ms per update (log scale); dark: no MPS, light: under MPS")
    ax.set_title("seed-lora sync, 624 tensors / 169 MB, one H200: colosync (blue), reference (red), floors (gray)")
    ax.title.set_fontsize(9)
    ax.set_xlim(right=max(m[b[1]] for _, m in runs for b in bars) * 6)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_sleep_wake(path: Path) -> None:
    import matplotlib.pyplot as plt

    by = {r["backend"]: r for r in load("handoff")["results"]}
    pin = by["torch"]["reference_pinned_copy"]
    groups = [
        ("colosync torch backend", by["torch"]["sleep_gbps_median"], by["torch"]["wake_gbps_median"], "tab:blue"),
        ("torch_memory_saver", by["torch_memory_saver"]["sleep_gbps_median"],
         by["torch_memory_saver"]["wake_gbps_median"], "tab:red"),
        ("pinned copy (floor)", pin["d2h_gbps"], pin["h2d_gbps"], "tab:gray"),
    ]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.38
    for i, (_label, sleep, wake, color) in enumerate(groups):
        for j, (what, value) in enumerate((("sleep", sleep), ("wake", wake))):
            x = i + (j - 0.5) * width
            ax.bar(x, value, width, color=color, alpha=1.0 if j == 0 else 0.55)
            ax.text(x, value + 0.8, f"{what}\n{value:.1f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("GB/s (median)")
    ax.set_ylim(0, 66)
    gb = by["torch"]["bytes"] / 1e9
    ax.set_title(f"trainer sleep / wake, {gb:.0f} GB in 400 bf16 tensors, one H200", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder for README.md and the plots (default: here)")
    parser.add_argument("--no-plots", action="store_true", help="write the README only")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "README.md").write_text(readme())
    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        for folder in PLOTS:
            (args.out / folder).mkdir(exist_ok=True)
        plot_seed_lora(args.out / "seed-lora" / PLOTS["seed-lora"])
        plot_sleep_wake(args.out / "handoff" / PLOTS["handoff"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
