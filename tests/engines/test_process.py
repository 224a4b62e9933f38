"""The engine process's life: it may start processes of its own, it never outlives the process that
started it, and a script that starts one without a ``__main__`` guard is told so.

Each test runs a real script in a fresh interpreter, since what is tested is what happens to a
user's program: its exit, its death by SIGKILL, its missing guard.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

STARTS_AN_ENGINE = """
import os, sys, time
from colosync.engines.process import EngineConfig, EngineProcess

def main():
    engine = EngineProcess(EngineConfig(engine="store"))
    print(engine.pid, os.path.dirname(engine.address.path), flush=True)
    {then}

{entry}
"""


def run_script(tmp_path: Path, then: str, guarded: bool = True, wait: bool = True) -> subprocess.Popen:
    entry = 'if __name__ == "__main__":\n    main()' if guarded else "main()"
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(STARTS_AN_ENGINE).format(then=then, entry=entry))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    if wait:
        proc.wait(timeout=120)
    return proc


def gone_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` ends within ``seconds``; if not, it is killed here (a failed test leaves no orphan)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # the engine leads its own group
    return False


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    proc = run_script(tmp_path, "engine.close()", guarded=False)
    err = proc.stderr.read()
    assert proc.returncode != 0
    assert "EngineError" in err and 'user_script.py has no `if __name__ == "__main__":` guard' in err, err
    assert "ConfigError: EngineProcess started while a spawned process imported its parent's script" in err, err


def test_an_engine_ends_when_its_script_exits_without_closing_it(tmp_path):
    start = time.monotonic()
    proc = run_script(tmp_path, "sys.exit(0)")  # no close(): the engine must not keep the script alive
    assert proc.returncode == 0, proc.stderr.read()
    assert time.monotonic() - start < 60
    pid, folder = proc.stdout.read().split()
    assert gone_within(int(pid), 15), "the engine process outlived its script"
    assert not Path(folder).exists(), "the engine's socket folder was left behind"


def test_an_engine_ends_when_its_script_is_killed(tmp_path):
    proc = run_script(tmp_path, "time.sleep(120)", wait=False)
    try:
        pid, folder = proc.stdout.readline().split()
        proc.send_signal(signal.SIGKILL)  # no exit handler runs: the engine must notice by itself
        proc.wait(timeout=30)
        assert gone_within(int(pid), 20), "the engine process outlived its killed script"
        assert not Path(folder).exists(), "the engine's socket folder was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
