"""Multi-process (gloo) tests of the Megatron source against a real megatron-core GPTModel.

World of 4 ranks at TP=2 x PP=2 and TP=4. Each rank builds the real Megatron model of its
stage, loads its shards of a seeded HF Llama + PEFT LoRA, and the source streams the update
through a Sender into a recording engine. The stream must equal the HF/PEFT reference
bit for bit at every bucket size, from one tensor per bucket (a flush after every tensor)
to everything in one bucket, and only one rank may ever hold or send the payload.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_helpers import Geometry, make_reference
from megatron_workers import exactness_worker

RANK, ALPHA = 6, 9.0  # deliberately not PEFT's defaults (8, 8)
BUCKETS = [64, 2048, 1 << 16, 1 << 30]  # 64 B: every tensor is its own bucket; 1 GiB: one bucket


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = make_reference(Geometry(), RANK, ALPHA, seed=3)
    path = tmp_path_factory.mktemp("megatron") / "reference.pt"
    torch.save({**ref, "rank": RANK, "alpha": ALPHA}, path)
    return str(path), ref


@pytest.mark.parametrize(("tp", "pp", "convention"), [(2, 2, "peft"), (4, 1, "nemo")], ids=["tp2pp2", "tp4"])
def test_stream_equals_hf_peft_reference_at_every_bucket_size(cpu_world, reference, tp, pp, convention):
    path, ref = reference
    ranks = cpu_world.run(exactness_worker, tp, pp, path, convention, BUCKETS)

    # the real Megatron model of each stage was fully described by the converter's naming table
    names = {n for r in ranks for n in r["param_names"]}
    suffix = "lora_A.weight" if convention == "peft" else "adapter.linear_in.weight"
    assert any(n.endswith(f"self_attention.linear_qkv.{suffix}") for n in names)
    assert {(r["stage"], r["tp_rank"]) for r in ranks} == {(s, t) for s in range(pp) for t in range(tp)}

    pushes = [r["pushes"] for r in ranks]
    for i, first in enumerate(pushes[0]):
        records = [p[i] for p in pushes]
        senders = [rec for rec in records if rec["is_sender"]]
        assert len(senders) == 1, "exactly one rank talks to the engine"
        sender = senders[0]
        expected = ref["lora"] if first["kind"] == "lora" else ref["full"]
        assert sender["tensors"] == len(expected)
        if first["bucket_bytes"] == BUCKETS[0]:
            assert sender["buckets"] == sender["tensors"], "one tensor per bucket: a flush after every tensor"
        if first["bucket_bytes"] == BUCKETS[-1]:
            assert sender["buckets"] == 1
        if first["kind"] == "lora":
            assert (sender["manifest_rank"], sender["manifest_alpha"]) == (RANK, ALPHA)
        # no N^2 fan-out: others only contribute their own shards, each shard crosses once
        others = [rec for rec in records if not rec["is_sender"]]
        for rec in others:
            assert rec["stats"]["tensors_yielded"] == 0
            assert rec["stats"]["largest_held"] <= rec["max_local_shard"]
        contributed = sum(rec["stats"]["bytes_contributed"] for rec in others)
        assert contributed == sender["stats"]["bytes_received"] > 0
        payload = sum(t.numel() * t.element_size() for t in expected.values())
        assert sender["stats"]["bytes_received"] < payload

    lazy = [r["lazy"] for r in ranks]
    (sender_lazy,) = [x for x in lazy if x["is_sender"]]
    assert sender_lazy["at_first"] == 1, "the first tensor must come out before the rest is gathered"
    assert sender_lazy["yielded"] == len(ref["lora"])
    assert all(x["yielded"] == 0 for x in lazy if not x["is_sender"])

    failure = [r["failure"] for r in ranks]
    assert all(f["raised"] for f in failure), "every rank must raise when the push fails"
    (sender_failure,) = [f for f in failure if "committed_after_failure" in f]
    assert sender_failure["raised"] == "EngineError"
    assert {f["raised"] for f in failure if f is not sender_failure} <= {"ConversionError"}
    assert sender_failure["committed_after_failure"] == 0
    assert sender_failure["committed_after_retry"] > 0 and sender_failure["retry_equal"]

    if pp > 1:
        other = [(r["stage"], r["tp_rank"]) for r in ranks if r["other_sender"]["is_sender"]]
        assert other == [(pp - 1, 0)]
        assert all(r["other_sender"]["equal"] for r in ranks if r["other_sender"]["is_sender"])
