"""The memory handoff between a trainer and an engine, run step by step and checked as it runs."""

import torch

from colosync.handoff import build_plan
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.runtime.executor import HandoffExecutor

MiB = 1 << 20


def load_trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The trainer's model and optimizer, built when the plan's init phase loads them."""
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.ones(1, 1024)).sum().backward()
    optimizer.step()  # the optimizer's state exists from here on: it sleeps with the weights
    return model, optimizer


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    load_trainer()  # warm up once: a first optimizer step imports modules, memory the executor would count
    engine_model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)]).to(device)
    kv_cache = [torch.zeros(4 * MiB, device=device)]
    # One pool for both sides; its chunks are sized from the first copy (1/32 of it, 2 MiB to 1 GiB).
    pool = HostPool(pin="auto" if device == "cuda" else "none")
    trainer = TorchTrainerMemory(loader=load_trainer, pool=pool, device=device)
    engine = TorchEngineMemory(engine_model, kv_cache, pool=pool, device=device)
    plan = build_plan(peak_device="gpu")  # the order that keeps one host copy at a time
    executor = HandoffExecutor(trainer, engine)  # checks every invariant around every step

    executor.run_phase(plan, "init")  # loads the trainer, then sleeps it: the engine serves
    for _ in range(2):
        # generate() here: the engine serves
        executor.run_phase(plan, "rollout_to_train")
        # train() here: the trainer's Parameter objects are the same as before it slept
        executor.run_phase(plan, "train_to_rollout")
        # sync the weights here (a colosync Sender push)
    print(f"2 steps, no invariant broken; host pool {pool.capacity_bytes / MiB:.0f} MiB")
