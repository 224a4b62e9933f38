"""The gather kernel packs a bucket and fingerprints it in one pass, exactly as ``Plan.pack`` and
``fingerprint_tensor`` do in two, wherever the sources move between launches.

The kernel itself runs on the CPU here through Triton's interpreter (``TRITON_INTERPRET=1``,
set before Triton is imported, so in a child process); on a GPU the same checks run compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from colosync.kernels.gather import CHUNK, GatherTable
from colosync.sync.plan import Plan

ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import torch
    from colosync.sync.plan import Plan, ViewKey
    from colosync.kernels import gather
    from colosync.wire.bucket import fingerprint_tensor

    device = torch.device(DEVICE)
    if device.type == "cpu":
        gather._gather.kernel = gather._build()  # the interpreter: enabled() is for GPUs
        gather._selftest(device)
    else:
        assert gather.enabled(device)
    specs = [("a", (3, 40), torch.bfloat16), ("big", (CHUNK + 5,), torch.int64), ("c", (10,), torch.float32),
             ("none", (0, 4), torch.float32), ("d", (9, 8), torch.int8), ("e", (4,), torch.float64)]
    plan = Plan(specs, 1 << 30)
    g = torch.Generator().manual_seed(5)

    def sources():
        return [torch.randint(-100, 100, shape, generator=g).to(dtype).to(device) for _, shape, dtype in specs]

    table = plan.gather_table(0, device)
    for round in range(3):  # new storage every round: the same table, rewritten
        srcs = sources()
        assert table.bind(srcs)
        assert table.ptrs == tuple(s.data_ptr() for s in srcs)
        got = torch.full((plan.sizes[0],), 0x5A, dtype=torch.uint8, device=device)  # poisoned
        out = torch.zeros(2, dtype=torch.int64, device=device)
        plan.zero_gaps(0, got)
        gather.launch(table.table, got, out)
        want = torch.zeros(plan.sizes[0], dtype=torch.uint8, device=device)
        plan.drop_views()  # (its cached views are of the last round's buffer)
        plan.pack(ViewKey(0, 0), want, srcs)
        assert torch.equal(got, want), round
        assert int(out[0]) == int(fingerprint_tensor(want)) and int(out[1]) == 0, round
    print("gather ok")
    """
)


def run_check(device: str, interpret: bool) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    code = f"DEVICE = {device!r}\nCHUNK = {CHUNK}\n" + CHECK
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "gather ok" in done.stdout, done.stdout + done.stderr


def test_the_kernel_packs_and_fingerprints_like_pack_in_the_interpreter():
    pytest.importorskip("triton")
    run_check("cpu", interpret=True)


@pytest.mark.gpu
def test_the_kernel_packs_and_fingerprints_like_pack_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_check("cuda", interpret=False)


def test_sources_the_kernel_cannot_read_are_refused():
    specs = [("w", (4, 6), torch.float32), ("v", (16,), torch.int8)]
    plan = Plan(specs, 1 << 20)
    table = plan.gather_table(0, torch.device("cpu"))
    w, v = torch.randn(4, 6), torch.zeros(16, dtype=torch.int8)
    assert table.bind([w, v]) and table.ptrs == (w.data_ptr(), v.data_ptr())
    assert not table.bind([torch.randn(6, 4).t(), v])  # not contiguous
    odd = torch.zeros(17, dtype=torch.int8)[1:]  # 16 bytes one byte past an aligned start
    assert not table.bind([w, odd])
    assert (
        not Plan([("x", (3,), torch.bfloat16)], 1 << 20)
        .gather_table(0, torch.device("cpu"))
        .bind([torch.zeros(3, dtype=torch.bfloat16)])
    )  # 6 bytes: not a whole number of words
    assert table.ptrs == (w.data_ptr(), v.data_ptr())  # a refusal leaves the rows as they were


def test_bound_rows_are_kept_for_the_same_addresses_and_layout_and_refused_once_it_changes():
    """``bind`` skips its checks only for the very addresses and layout number it bound: a source turned
    non-contiguous in place (same address, same shape) gets a new number and is refused."""
    plan = Plan([("w", (4, 4), torch.float32), ("v", (16,), torch.int8)], 1 << 20)
    table = plan.gather_table(0, torch.device("cpu"))
    w, v = torch.randn(4, 4), torch.zeros(16, dtype=torch.int8)
    assert table.bind([w, v], plan.layout_number(0, [w, v]))
    assert table.bind([w, v], plan.layout_number(0, [w, v])) and table.layout_number == plan.layout_number(0, [w, v])
    w.data = w.data.t()  # in place: the rows' address, the plan's shape, not contiguous
    assert not table.bind([w, v], plan.layout_number(0, [w, v]))
    assert not table.bind([w, v])  # and without a number, read in full


def test_rows_cover_every_word_once_in_chunks():
    specs = [("a", (2 * CHUNK + 3,), torch.int64), ("b", (5,), torch.int64), ("c", (0,), torch.int64)]
    plan = Plan(specs, 1 << 30)
    table = GatherTable(plan.metas, torch.device("cpu"))
    a, b, c = torch.zeros(2 * CHUNK + 3, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), torch.zeros(0)
    assert table.bind([a, b, c.long()])
    rows = table.table.tolist()
    assert [n for _, _, n in rows] == [CHUNK, CHUNK, 3, 5]
    assert [addr - a.data_ptr() for addr, _, _ in rows[:3]] == [0, CHUNK * 8, 2 * CHUNK * 8]
    assert rows[3][0] == b.data_ptr() and rows[3][1] == plan.metas[1].offset // 8
    assert [first for _, first, _ in rows[:3]] == [0, CHUNK, 2 * CHUNK]
