"""What the demo's first CUDA step allocates that its baseline does not hold (run 2 of this record).

``host``: a process with a CUDA context and a few kernels already run (as the demo's trainer and
engine are when the executor takes its baseline), then the first ``fused.enabled`` (Triton's
import, JIT compile and self-test, which the first weight sync runs in the trainer and in the
engine): RssAnon before and after. ``device``: the demo trainer's warm-up (``TrainerActor._warm_up``
copied), then one real step of the demo's shape (4 prompts x 8 samples, 4 + 12 tokens) and a
score of the probe: device memory in use (all processes) and torch's reserved bytes after each.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time

import torch


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def host() -> dict:
    dev = torch.device("cuda", 0)
    x = torch.randn(1 << 20, device=dev)
    (x * 2).sum().item()  # context and a few kernels, as the warmed-up participants have
    out = {"rss_anon_after_cuda_mb": rss_anon() / 2**20}
    t0 = time.perf_counter()
    import triton  # noqa: F401  # the fused kernel's import, what the first sync pays

    out["rss_anon_after_import_triton_mb"] = rss_anon() / 2**20
    from colosync.kernels import fused

    ok = fused.enabled(dev)
    out["fused_enabled"] = ok
    out["first_fused_enabled_s"] = time.perf_counter() - t0
    out["rss_anon_after_fused_enabled_mb"] = rss_anon() / 2**20
    return out


def device() -> dict:
    from peft import LoraConfig, get_peft_model

    from colosync.testing import LORA_TARGETS, make_tiny_llama
    from colosync.demo.rl import policy_gradient_step
    from colosync.demo.tasks import CountTask
    from colosync.decoding import load_model, score

    dev = torch.device("cuda", 0)
    task = CountTask()
    model_dir = make_tiny_llama(tempfile.mkdtemp() + "/tiny", seed=0, vocab_size=task.vocab_size)

    def build():
        torch.manual_seed(0)
        cfg = LoraConfig(r=8, lora_alpha=16.0, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
        model = get_peft_model(load_model(model_dir, dev), cfg).eval()
        return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def mem(tag: str) -> None:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(dev)
        rows.append(
            {
                "at": tag,
                "used_mb": (total - free) / 2**20,
                "reserved_mb": torch.cuda.memory_reserved(dev) / 2**20,
                "allocated_mb": torch.cuda.memory_allocated(dev) / 2**20,
            }
        )

    rows: list[dict] = []
    torch.zeros(1, device=dev)
    mem("context")
    model, opt = build()  # the warm-up, as TrainerActor._warm_up
    policy_gradient_step(model, opt, [[1, 3, 4]], [[5, 6]], [[1.0, -1.0]], 0.0)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    mem("warm-up done, cache emptied (the demo's baseline)")
    model, opt = build()
    mem("real model built (trainer.load)")
    g = torch.Generator().manual_seed(0)
    prompts = [[1, *(3 + (s + k) % 29 for k in range(3))] for s in range(4) for _ in range(8)]
    comps = [torch.randint(3, task.vocab_size, (12,), generator=g).tolist() for _ in prompts]
    advs = [torch.randn(12, generator=g).tolist() for _ in prompts]
    policy_gradient_step(model, opt, prompts, comps, advs, 0.01)
    mem("after a real train step")
    score(model, prompts[::8], comps[::8])
    mem("after score of the probe")
    gc.collect()
    torch.cuda.empty_cache()
    mem("after empty_cache (trainer.clear_memory / sleep)")
    policy_gradient_step(model, opt, prompts, comps, advs, 0.01)
    score(model, prompts[::8], comps[::8])
    mem("after a second train step + score")
    return {"rows": rows, "max_reserved_mb": torch.cuda.max_memory_reserved(dev) / 2**20}


if __name__ == "__main__":
    print(json.dumps({sys.argv[1]: {"host": host, "device": device}[sys.argv[1]]()}, indent=1))
