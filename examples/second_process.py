"""A second process talks to a running engine: hand it ``engine.address``, it calls ``connect``."""

import multiprocessing as mp
import tempfile

import msgspec

from colosync import Sender
from colosync.control.channel import EngineAddress
from colosync.engines.config import EngineConfig, Generate
from colosync.engines.process import EngineProcess, connect
from colosync.testing import greedy, load_model, make_tiny_llama, random_lora


def driver(address: bytes, done: mp.Queue) -> None:
    """Another process (a rollout worker, a Ray actor...): connect, generate, report the version."""
    link = connect(msgspec.msgpack.decode(address, type=EngineAddress), "hf", name="driver")
    gen = link.call(Generate(prompts=[[1, 5, 9]], max_new_tokens=4))
    done.put((gen.update_id, gen.tokens[0]))
    link.close()


if __name__ == "__main__":
    model_dir = make_tiny_llama(tempfile.mkdtemp() + "/tiny-llama", seed=0)
    engine = EngineProcess(EngineConfig(engine="hf", model_dir=str(model_dir)))
    with engine, Sender(engine.link, transport="shm") as sender:
        peft_model = random_lora(load_model(model_dir), seed=1)
        report = sender.push_peft(peft_model)
        ctx = mp.get_context("spawn")
        done = ctx.Queue()
        child = ctx.Process(target=driver, args=(msgspec.msgpack.encode(engine.address), done))
        child.start()
        served, tokens = done.get(timeout=120)
        child.join()
        assert served == report.update_id and tokens == greedy(peft_model, [[1, 5, 9]], 4)[0][0], (served, tokens)
        print(f"the driver process was served update {served}: {tokens}")
