"""An FSDP2 trainer's LoRA into an engine: two gloo ranks gather in buckets, rank 0 sends."""

import os
import socket
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from colosync import Sender
from colosync.engines.config import Generate
from colosync.engines.process import EngineConfig, EngineProcess, connect
from colosync.sources.fsdp import FsdpSource
from colosync.testing import greedy, load_model, make_tiny_llama, random_lora


def train_rank(rank, model_dir, address):
    dist.init_process_group("gloo", rank=rank, world_size=2)  # torchrun does this in a real job
    model = random_lora(load_model(model_dir), seed=1)  # your trainer's PEFT model, the same on every rank
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # FSDP2: every parameter is now a DTensor shard
    source = FsdpSource(model, kind="lora")  # kind="full" sends the base weights under HF names
    sender = Sender(connect(address, "hf"), bucket_bytes=source.bucket_bytes) if source.is_sender else None
    report = source.push(sender)  # every rank calls it; only rank 0 talks to the engine
    if sender is not None:
        sender.close()
        print(f"rank {rank}: update {report.update_id}, {report.tensors} tensors in {report.buckets} buckets")
    dist.barrier()  # leave together: a rank that tears its group down early can abort its peer
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: on a loaded 2-core machine a rank's gloo threads
    # were seen to abort it there ("terminate called without an active exception", SIGABRT) after
    # all its work was done, failing the run (see pytorch/pytorch #179291 on gloo at finalization).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":  # mp.spawn and the engine start fresh processes: guard the entry point
    model_dir = str(make_tiny_llama(tempfile.mkdtemp() + "/tiny-llama", seed=0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    with EngineProcess(EngineConfig(engine="hf", model_dir=model_dir)) as engine:
        mp.spawn(train_rank, args=(model_dir, engine.address), nprocs=2)
        gen = engine.call(Generate(prompts=[[1, 5, 9]], max_new_tokens=8))
    assert gen.tokens == greedy(random_lora(load_model(model_dir), seed=1), [[1, 5, 9]], 8)[0]
    print("the engine generates what the unsharded PEFT model generates:", gen.tokens[0])
