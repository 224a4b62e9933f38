"""Mutation-test colosync's core with mutmut, in a scratch copy of the tree, and record the run.

Why a scratch copy: mutmut 3 reads its settings only from ``pyproject.toml`` (or ``setup.cfg``)
and writes its ``mutants/`` tree beside them. Copying ``colosync/`` and ``tests/`` into a work
folder with a ``pyproject.toml`` that is the project's plus ``benchmarks/mutation/mutmut.toml``
keeps the project's own files untouched, freezes the snapshot the run measures (others may be
editing the tree meanwhile), and lets a later run resume where the last one stopped.

Why some functions are left out: of ``colosync/handoff/runtime/invariants.py`` only the
invariant checks are part of the core (``CORE``); the measurement and violation records
around them are the executor loop's, exercised by the handoff benchmarks rather than by
fast tests.

    .venv/bin/python benchmarks/mutation/mutate.py                 # the whole core, resuming, then a summary
    .venv/bin/python benchmarks/mutation/mutate.py --modules wire  # one group of modules
    .venv/bin/python benchmarks/mutation/mutate.py --survivors     # re-test only what survived last time
    .venv/bin/python benchmarks/mutation/mutate.py --summary-only --record  # write benchmarks/mutation/results.json
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks" / "mutation" / "mutmut.toml"
RECORD = ROOT / "benchmarks" / "mutation" / "results.json"
EQUIVALENT = ROOT / "benchmarks" / "mutation" / "equivalent.json"  # survivor -> why no test can kill it
MUTMUT = Path(sys.executable).parent / "mutmut"
# A private /dev/shm (a mount namespace of its own, needs root): tests/conftest.py fails a run if any
# /dev/shm/colosync-* segment appeared during it, including one another process made, so on a shared
# machine someone else's shm test can otherwise turn a surviving mutant into a false kill.
PRIVATE_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
PRIVATE_SHM += ['mount -t tmpfs -o size=8g,mode=1777 tmpfs /dev/shm && exec "$@"', "private-shm"]

_INVARIANTS = [
    "xǁNoCoexistingHostCopiesǁ*",
    "xǁWithinSimulationǁ*",
    "xǁMatchesPlanǁ*",
    "xǁ_Limitǁ*",
    "xǁHostBudgetǁ*",
    "xǁDeviceBudgetǁ*",
    "x_default_invariants__mutmut_*",
    "x__gb__mutmut_*",
]
# Mutant-name globs of each group (mutmut names a mutant module.function__mutmut_N).
CORE: dict[str, list[str]] = {
    "wire": ["colosync.wire.*"],
    "sync": ["colosync.sync.*"],
    "transports": ["colosync.transports.*"],
    "handoff": ["colosync.handoff.model.*"] + [f"colosync.handoff.runtime.invariants.{g}" for g in _INVARIANTS],
}
# mutmut's exit-code meaning (mutmut/stats.py), folded into the columns the record keeps.
STATUS: dict[int | None, str] = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests"}
STATUS.update({2: "interrupted", 34: "skipped", 35: "suspicious", 37: "caught by type check", None: "not checked"})
STATUS.update({36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"})
STATUS.update({-11: "segfault", -9: "segfault"})


def _equivalent() -> dict[str, str]:
    return dict(json.loads(EQUIVALENT.read_text())) if EQUIVALENT.exists() else {}


def sampled(name: str, sample: int) -> bool:
    """Whether ``name`` is in the 1-in-``sample`` subset (stable across runs and machines)."""
    return zlib.crc32(name.encode()) % sample == 0


def in_core(name: str, groups: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for grp in groups for g in CORE[grp])


def mirror(src: Path, dst: Path) -> None:
    """Make dst a copy of src, keeping mtimes (mutmut re-mutates only files that changed since its last run)."""
    wanted = {p.relative_to(src) for p in src.rglob("*") if "__pycache__" not in p.parts}
    if dst.exists():
        for p in sorted(dst.rglob("*"), reverse=True):
            rel = p.relative_to(dst)
            if "__pycache__" not in rel.parts and rel not in wanted:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    for rel in sorted(wanted):
        s, d = src / rel, dst / rel
        if s.is_dir():
            d.mkdir(parents=True, exist_ok=True)
        elif not d.exists() or d.stat().st_mtime != s.stat().st_mtime or d.stat().st_size != s.stat().st_size:
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)


def prepare(work: Path, keep_source: bool = False) -> dict[str, object]:
    """Refresh the scratch tree from the working tree; say which commit and whether it was dirty."""
    work.mkdir(parents=True, exist_ok=True)
    if keep_source and (work / "colosync").exists():
        # only the new gap tests: the rest of tests/ must stay the snapshot's, or it may import code the snapshot lacks
        for test in (ROOT / "tests").rglob("test_mutation_gaps.py"):
            (work / test.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(test, work / test.relative_to(ROOT))
    else:
        for folder in ("colosync", "tests", "stubs"):
            mirror(ROOT / folder, work / folder)
    pyproject = (ROOT / "pyproject.toml").read_text() + "\n" + CONFIG.read_text()
    if not (work / "pyproject.toml").exists() or (work / "pyproject.toml").read_text() != pyproject:
        (work / "pyproject.toml").write_text(pyproject)
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "colosync", "tests"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    snapshot = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"commit": head, "dirty": dirty, "snapshot_utc": snapshot, "source_kept": keep_source}


def statuses(work: Path) -> dict[str, tuple[str, float | None]]:
    """Every mutant mutmut knows in the work tree: name -> (status, seconds its tests took)."""
    out: dict[str, tuple[str, float | None]] = {}
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        for name, code in data["exit_code_by_key"].items():
            out[name] = (STATUS.get(code, f"exit {code}"), data["durations_by_key"].get(name))
    return out


def module_of(name: str) -> str:
    head = name.split(".x")[0] if ".x" in name else name.rsplit(".", 1)[0]
    return head.replace("ǁ", ".")


def summarize(work: Path, groups: list[str], sample: int = 1) -> dict[str, object]:
    rows: dict[str, Counter[str]] = {}
    known = {n: v for n, v in statuses(work).items() if in_core(n, groups) and sampled(n, sample)}
    for name, (status, _) in known.items():  # (mutmut's per-mutant durations read 0 under forkserver)
        rows.setdefault(module_of(name), Counter())[status] += 1
    table = {}
    total: Counter[str] = Counter()
    for mod in sorted(rows):
        c = rows[mod]
        total.update(c)
        table[mod] = {**dict(c), "mutants": sum(c.values())}
    total_n = sum(total.values())
    tested = total_n - total["not checked"] - total["skipped"]
    score = (total["killed"] + total["timeout"]) / tested if tested else 0.0
    # survivors (or load-induced timeouts) explained as equivalent in EQUIVALENT do not count against the tests
    equivalent = {n: why for n, why in _equivalent().items() if known.get(n, ("",))[0] in ("survived", "timeout")}
    eq_timeouts = sum(1 for n in equivalent if known[n][0] == "timeout")
    judged = tested - len(equivalent)
    adjusted = (total["killed"] + total["timeout"] - eq_timeouts) / judged if judged else 0.0
    return {
        "modules": table,
        "total": {
            **dict(total),
            "mutants": total_n,
            "score": round(score, 4),
            "equivalent": len(equivalent),
            "score_without_equivalent": round(adjusted, 4),
        },
        "equivalent": equivalent,
        "sample": sample,
        "survivors": sorted(n for n, (s, _) in known.items() if s == "survived"),
        "no_tests": sorted(n for n, (s, _) in known.items() if s == "no tests"),
        "timeouts": sorted(n for n, (s, _) in known.items() if s == "timeout"),
    }


def print_table(summary: dict[str, object]) -> None:
    cols = ["mutants", "killed", "survived", "timeout", "no tests", "not checked"]
    print("| module | " + " | ".join(cols) + " | score |")
    print("|---|" + "---|" * (len(cols) + 1))
    modules = summary["modules"]
    assert isinstance(modules, dict)
    for mod, row in modules.items():
        done = row["mutants"] - row.get("not checked", 0)
        score = (row.get("killed", 0) + row.get("timeout", 0)) / done if done else 0.0
        print(f"| {mod} | " + " | ".join(str(row.get(c, 0)) for c in cols) + f" | {score:.1%} |")
    total = summary["total"]
    assert isinstance(total, dict)
    print("| **total** | " + " | ".join(str(total.get(c, "")) for c in cols) + f" | **{total['score']:.1%}** |")
    print(
        f"score {total['score']:.1%}; {total['equivalent']} survivors explained as equivalent "
        f"(benchmarks/mutation/equivalent.json); without them {total['score_without_equivalent']:.1%}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=ROOT / ".mutation", help="scratch tree (default: .mutation/)")
    p.add_argument("--modules", default=",".join(CORE), help=f"comma-separated groups of {list(CORE)}")
    p.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default 1)")
    p.add_argument("--nice", type=int, default=10, help="niceness of the run (default 10: the CPU is shared)")
    p.add_argument("--sample", type=int, default=1, help="test one mutant in N, chosen by a hash of its name")
    p.add_argument("--retest", action="store_true", help="test chosen mutants again even if they have a verdict")
    p.add_argument("--survivors", action="store_true", help="re-test only last run's survivors and no-tests")
    p.add_argument(
        "--keep-source",
        action="store_true",
        help="copy in only the gap tests (tests/**/test_mutation_gaps.py): re-test against the same snapshot",
    )
    p.add_argument(
        "--private-shm",
        action="store_true",
        help="run mutmut with a /dev/shm of its own (root): other processes' shm segments cannot fail its tests",
    )
    p.add_argument("--summary-only", action="store_true", help="run nothing; summarize the last run")
    p.add_argument("--record", action="store_true", help=f"write the summary to {RECORD.relative_to(ROOT)}")
    p.add_argument("names", nargs="*", help="mutant names or globs (overrides --modules)")
    args = p.parse_args()
    groups = [g for g in args.modules.split(",") if g]
    unknown = set(groups) - set(CORE)
    if unknown:
        p.error(f"unknown module groups {sorted(unknown)}; choose from {list(CORE)}")

    info: dict[str, object] = {}
    seconds = None
    names: list[str] = []
    if not args.summary_only:
        info = prepare(args.work, args.keep_source)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        wrap = PRIVATE_SHM if args.private_shm else []
        if not any((args.work / "mutants").rglob("*.py.meta")):
            # mutmut makes its mutants (and its per-test stats) only inside `run`: a filter matching nothing
            # does those two steps and stops, so the names below can be chosen from what it made.
            print("generating mutants and test stats (first run in this work tree)", flush=True)
            subprocess.run(
                [*wrap, "nice", "-n", str(args.nice), str(MUTMUT), "run", "--", "-none-"], cwd=args.work, env=env
            )
        known = statuses(args.work)
        if args.survivors:
            names = [n for n, (st, _) in known.items() if st in ("survived", "no tests") and in_core(n, groups)]
        else:
            names = [n for n in (args.names or known) if n in known and (args.names or in_core(n, groups))]
            names = [n for n in names if sampled(n, args.sample)]
            if not args.retest:
                names = [n for n in names if known[n][0] == "not checked"]
        if not names:
            print("nothing to test: every chosen mutant has a verdict (--retest to test them again)")
        cmd = [
            *wrap,
            "nice",
            "-n",
            str(args.nice),
            str(MUTMUT),
            "run",
            "--max-children",
            str(args.max_children),
            *names,
        ]
        print(
            "running:", " ".join(cmd[: len(cmd) - len(names)]), f"<{len(names)} names>", f"in {args.work}", flush=True
        )
        start = time.monotonic()
        rc = subprocess.run(cmd, cwd=args.work, env=env).returncode if names else 0
        seconds = round(time.monotonic() - start, 1)
        print(f"mutmut exited {rc} after {seconds} s")
    summary = summarize(args.work, groups, args.sample)
    print_table(summary)
    if args.record:
        old = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        version = subprocess.run([str(MUTMUT), "--version"], capture_output=True, text=True, cwd=args.work)
        record = {**old, "tool": version.stdout.strip(), "groups": groups, **summary}
        if seconds is not None:  # each run says what it measured: the tree can change between runs
            run = {"groups": groups, "survivors_only": args.survivors, "names": len(names), "s": seconds, **info}
            run["private_shm"] = args.private_shm
            run["command"] = " ".join(["benchmarks/mutation/mutate.py", *sys.argv[1:]])
            record["runs"] = [*old.get("runs", []), run]
            # what benchmarks/index.py reads: the last run's command, date and commit
            record |= {"command": run["command"], "date": info["snapshot_utc"], "commit": str(info["commit"])[:7]}
        RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        print("recorded", RECORD.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
