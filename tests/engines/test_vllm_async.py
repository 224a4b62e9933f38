"""A real ``vllm.AsyncLLM`` (CPU backend, one worker) committing beside the requests on its event loop.

Asynchronous RL frameworks drive vLLM's ``AsyncLLM``: requests are coroutines on its event loop and
never stop for a sync. Here a loop keeps four requests on leased versions (``lease_async``) of the
default adapter and of a named one in flight while a trainer thread pushes versions of both,
verified ones included; every finished request's tokens are compared with PEFT's for the
(adapter, version) it reports. A long request started before a commit finishes on its version,
and the commit did not wait for it. The engine is this module's own (started and shut down here).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from colosync.errors import DeliveryError
from colosync.sync.sender import Sender
from colosync.testing import fill_lora, greedy

from .conftest import MAX_LORA_RANK, _vllm_env
from .test_vllm import NEW, PROMPTS, adapter, trainer_probe

LONG = 160


@pytest.fixture(scope="module")
def loop():
    """The engine's event loop, in a thread of its own (the trainer pushes from the test's thread)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def on(loop, coro, timeout_s=300):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)


@pytest.fixture(scope="module")
def engine(loop, vllm_model_dir):
    pytest.importorskip("vllm")
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from colosync.engines.vllm.client import AsyncVllmEngine
    from colosync.engines.vllm.worker import WORKER_EXTENSION

    args = AsyncEngineArgs(
        model=str(vllm_model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=MAX_LORA_RANK,
        max_loras=3,  # the default adapter's two versions at once, and one named adapter
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        worker_extension_cls=WORKER_EXTENSION,
    )

    async def start():
        with _vllm_env(1):
            llm = AsyncLLM.from_engine_args(args)
        return await AsyncVllmEngine.create(llm, commit_mode="inflight", versions_in_flight=2)

    client = on(loop, start())
    yield client
    client.engine.shutdown()


def params(new):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)


_ids = itertools.count()


async def generate(engine, prompt, new, lane=None):
    """One request on its leased version: (its adapter's version as vLLM reports it, the leased one, tokens)."""
    from vllm import TokensPrompt

    leasing = lane.lease_async() if lane is not None else engine.lease_async()
    async with leasing as lease:
        out = None
        async for item in engine.engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params(new), f"t-{next(_ids)}", lora_request=lease.lora_request
        ):
            out = item  # the last is the final output
    return engine.version_of(out), lease.update_id, list(out.outputs[0].token_ids)


def test_a_commit_does_not_wait_for_a_long_request_on_the_loop(engine, loop, vllm_model_dir):
    trainer = adapter(vllm_model_dir, rank=8, seed=500)
    with Sender(engine.link, transport="shm") as sender:
        first = sender.push_peft(trainer).update_id
        long_tokens = greedy(trainer, PROMPTS[1:2], LONG)[0][0]
        long = asyncio.run_coroutine_threadsafe(generate(engine, PROMPTS[1], LONG), loop)
        while not engine.link.versions.in_flight():
            time.sleep(0.005)
        fill_lora(trainer, 501, scale=0.08)
        started = time.perf_counter()
        second = sender.push_peft(trainer).update_id
        pushed_s = time.perf_counter() - started
        assert not long.done(), "the commit returned before the long request ended"
        after = on(loop, generate(engine, PROMPTS[2], NEW))
        assert after == (second, second, greedy(trainer, PROMPTS[2:], NEW)[0][0])
        version, leased, tokens = long.result(300)
        waited_s = time.perf_counter() - started
    assert (version, leased, tokens) == (first, first, long_tokens)  # it finished on the version it began with
    assert pushed_s < waited_s, (pushed_s, waited_s)
    deadline = time.monotonic() + 30
    while engine.link.versions.installed() != [second]:  # the first retires from a thread, off the loop
        assert time.monotonic() < deadline, engine.link.versions.installed()
        time.sleep(0.01)


def test_two_adapters_pushed_while_the_loop_never_stops_generating(engine, loop, vllm_model_dir):
    lane = engine.lane("reference")
    trainers = {"": adapter(vllm_model_dir, rank=8, seed=510), "reference": adapter(vllm_model_dir, rank=4, seed=511)}

    refs: dict[tuple[str, int], list[list[int]]] = {}
    stop = asyncio.Event()
    done: list[tuple[str, int, int, int, list[int]]] = []

    async def keep_generating():
        async def one(i):
            name = "reference" if i % 2 else ""
            prompt = i % len(PROMPTS)
            version, leased, tokens = await generate(engine, PROMPTS[prompt], NEW, lane if name else None)
            done.append((name, prompt, version, leased, tokens))

        i = 0
        running: set[asyncio.Task] = set()
        while not stop.is_set() or running:
            while not stop.is_set() and len(running) < 4:
                running.add(asyncio.ensure_future(one(i)))
                i += 1
            finished, running = await asyncio.wait(running, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()

    senders = {"": Sender(engine.link, transport="shm"), "reference": Sender(lane, transport="shm")}
    for name, sender in senders.items():  # a first version of each before generation starts
        refs[name, sender.push_peft(trainers[name]).update_id] = greedy(trainers[name], PROMPTS, NEW)[0]
    generating = asyncio.run_coroutine_threadsafe(keep_generating(), loop)
    try:
        for i in range(6):
            for name, sender in senders.items():
                model = trainers[name]
                fill_lora(model, 520 + 10 * i + len(name), scale=0.08)
                probe = trainer_probe(model) if i % 3 == 1 else None
                uid = sender.push_peft(model, verify=probe).update_id
                refs[name, uid] = greedy(model, PROMPTS, NEW)[0]
            if i == 3:  # a version of the named adapter that fails verification goes back, alone
                model = trainers["reference"]
                fill_lora(model, 999, scale=0.08)
                with pytest.raises(DeliveryError, match="rolled back"):
                    senders["reference"].push_peft(model, verify=trainer_probe(model, shift=0.5))
                fill_lora(model, 520 + 10 * i + len("reference"), scale=0.08)  # the served version again
            time.sleep(0.05)
    finally:
        loop.call_soon_threadsafe(stop.set)
        generating.result(300)
        for sender in senders.values():
            sender.close()
    for name, prompt, version, leased, tokens in done:
        assert version == leased, "one version per request: the one it was given"
        assert tokens == refs[name, leased][prompt], f"{name or 'default'} version {leased} is not PEFT's"
    seen = {name: {leased for n, _, _, leased, _ in done if n == name} for name in senders}
    assert all(len(versions) >= 3 for versions in seen.values()), f"generation must overlap the commits: {seen}"
