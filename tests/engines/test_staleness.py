"""``max_lag`` on a hosted hf engine: no generation starts on a version too far behind its trainer.

The trainer's newest version is the newest update it began; each update that fails (a probe that
deviates, a NaN) leaves the served version one further behind. In an engine process with
``EngineConfig(max_lag=1)`` a ``Generate`` of that adapter is refused at once past the bound (the
host serves one request at a time, so it cannot wait for the commit), named by its type across the
process boundary; ``Score``, the other adapters and, after a good push, generation itself go on.
"""

from __future__ import annotations

import pytest
import torch

from colosync.engines.config import EngineConfig, Generate, Score
from colosync.engines.process import EngineProcess
from colosync.errors import ConfigError, DeliveryError, NonFiniteError, VersionLagError
from colosync.sync.sender import Sender
from colosync.sync.staleness import UpdateIds
from colosync.testing import fill_lora, greedy, load_model, random_lora
from colosync.wire.protocol import Probe

PROMPTS = [[1, 5, 9, 13], [2, 7, 11, 3]]
NEW = 5


def served(engine, adapter: str = "") -> tuple[int, list[list[int]]]:
    gen = engine.call(Generate(PROMPTS, NEW, adapter=adapter))
    return gen.update_id, gen.tokens


def test_generation_on_a_version_more_than_max_lag_behind_is_refused_until_a_push_commits(tiny_model_dir):
    config = EngineConfig(engine="hf", model_dir=str(tiny_model_dir), max_lora_rank=16, max_loras=2, max_lag=1)
    policy = random_lora(load_model(tiny_model_dir), rank=8, seed=3)
    with EngineProcess(config) as engine, Sender(engine.connect(adapter="policy"), transport="shm") as sender:
        good = sender.push_peft(policy).update_id
        pushed = UpdateIds()  # the trainer's own record of what committed (the failed pushes are not versions)
        pushed.add(good)
        want = (good, greedy(policy, PROMPTS, NEW)[0])
        base = served(engine)
        fill_lora(policy, 4)
        probe = Probe.from_model(policy, PROMPTS, max_new_tokens=3)
        lying = Probe(probe.prompts, probe.completions, [[lp - 1.0 for lp in row] for row in probe.logprobs])
        with pytest.raises(DeliveryError):
            sender.push_peft(policy, verify=lying)
        assert served(engine, "policy") == want  # one behind: allowed

        poisoned = next(p for n, p in policy.named_parameters() if "lora_B" in n)
        saved = poisoned.detach().clone()
        with torch.no_grad():
            poisoned.view(-1)[0] = float("nan")
        with pytest.raises(NonFiniteError):
            sender.push_peft(policy)
        with pytest.raises(VersionLagError, match=rf"update {good}: the trainer began 2 updates after it.*max_lag=1"):
            served(engine, "policy")
        scores = engine.call(Score(PROMPTS, want[1], adapter="policy"))
        assert scores.update_id == good  # scoring is not a sample: it is served
        assert served(engine) == base  # the default adapter lags nothing

        with torch.no_grad():
            poisoned.copy_(saved)
        report = sender.push_peft(policy, verify=probe)
        pushed.add(report.update_id)
        assert served(engine, "policy") == (report.update_id, greedy(policy, PROMPTS, NEW)[0])
        assert (pushed.after(good), pushed.after(report.update_id)) == (1, 0)  # a sample's lag, trainer-side
        sender.drop_adapter()


def test_a_negative_max_lag_is_refused_before_an_engine_starts(tiny_model_dir):
    with pytest.raises(ConfigError, match="max_lag"):
        EngineConfig(engine="hf", model_dir=str(tiny_model_dir), max_lag=-1)
