"""Which process the demo's first CUDA weight syncs grow, and by how much (run 3 of this record).

The demo's pair without the handoff: the hf engine on CUDA in an ``EngineProcess`` (warmed up
by one generate), a PEFT LoRA trainer on CUDA here (warmed up by one train step), a
``Sender`` over ``cuda_ipc``; then six pushes of the LoRA, with anon+shmem (what the handoff
executor counts as host copies) of this process and of the engine process before and after
each. ``imports``: what importing peft costs a process that has torch, CUDA and transformers.
Set ``COLOSYNC_NO_TRITON`` / ``COLOSYNC_NO_CUDA_GRAPHS`` to take those parts out.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

MB = 2**20


def anon_shmem(pid: int) -> float:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                fields[key] = int(rest.split()[0]) * 1024
    return (fields.get("RssAnon", 0) + fields.get("RssShmem", 0)) / MB


def imports() -> dict:
    torch.zeros(1, device="cuda")
    import transformers  # noqa: F401

    out = {"after_torch_cuda_transformers_mb": anon_shmem(os.getpid())}
    import peft  # noqa: F401

    out["after_import_peft_mb"] = anon_shmem(os.getpid())
    return out


def sync() -> dict:
    from peft import LoraConfig, get_peft_model

    from colosync.testing import LORA_TARGETS, make_tiny_llama
    from colosync.demo.rl import policy_gradient_step
    from colosync.demo.tasks import CountTask
    from colosync.engines.config import EngineConfig, Generate
    from colosync.decoding import load_model
    from colosync.engines.process import EngineProcess
    from colosync.sync.sender import Sender

    model_dir = str(make_tiny_llama(tempfile.mkdtemp() + "/tiny", seed=0, vocab_size=CountTask().vocab_size))
    proc = EngineProcess(EngineConfig(engine="hf", model_dir=model_dir, device="cuda", max_lora_rank=16))
    rows: list[dict[str, Any]] = []
    try:
        proc.call(Generate([[1, 3, 4]], 6))
        torch.manual_seed(0)
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
        model = get_peft_model(load_model(model_dir, "cuda"), cfg).eval()
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        policy_gradient_step(model, opt, [[1, 3, 4]], [[5, 6]], [[1.0, -1.0]], 0.0)
        sender = Sender(proc.connect("trainer"), transport="cuda_ipc")
        me, engine = os.getpid(), proc.pid
        assert engine is not None
        rows.append({"at": "warmed up", "trainer_mb": anon_shmem(me), "engine_mb": anon_shmem(engine)})
        for i in range(6):
            policy_gradient_step(model, opt, [[1, 3, 4]], [[5, 6]], [[1.0, -1.0]], 0.0)
            t0 = time.perf_counter()
            sender.push_peft(model)
            seconds = time.perf_counter() - t0
            rows.append(
                {
                    "at": f"after push {i + 1}",
                    "push_s": round(seconds, 4),
                    "trainer_mb": anon_shmem(me),
                    "engine_mb": anon_shmem(engine),
                    "transport": sender.transport_name,
                }
            )
        sender.close()
    finally:
        proc.close()
    base = rows[0]
    for r in rows[1:]:
        r["trainer_growth_mb"] = round(r["trainer_mb"] - base["trainer_mb"], 1)
        r["engine_growth_mb"] = round(r["engine_mb"] - base["engine_mb"], 1)
    return {"env": {k: v for k, v in os.environ.items() if k.startswith("COLOSYNC_")}, "rows": rows}


if __name__ == "__main__":
    print(json.dumps({sys.argv[1]: {"imports": imports, "sync": sync}[sys.argv[1]]()}, indent=1))
