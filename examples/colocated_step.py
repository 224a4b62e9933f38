"""The colocated step as one call: engine and trainer in processes of their own, this script the controller."""

import tempfile

import torch

from colosync.colocated.cluster import Cluster
from colosync.colocated.step import Colocated
from colosync.engines.synthetic import Digest, SyntheticModel

MiB = 1 << 20

if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # 8 MiB of weights and a 2 MiB KV cache, in 1 MiB tensors: the synthetic engine serves them,
    # the synthetic trainer trains them (bf16 weights, fp32 Adam) and pushes them whole every step.
    folder = str(SyntheticModel(8 * MiB, 2 * MiB, MiB).save(tempfile.mkdtemp()))
    trainer = dict(model_dir=folder, engine_name="synthetic", device=device, bucket_bytes=MiB)
    with (
        Cluster(
            "process",
            engine="synthetic",
            model_dir=folder,
            device=device,
            trainer_actor="colosync.colocated.synthetic:SyntheticTrainer",
            trainer_kwargs=trainer,
        ) as cluster,
        Colocated(cluster, peak_device="gpu", bucket_bytes=MiB) as colo,
    ):
        colo.init()  # the plan's init phase: the trainer loaded and asleep, the engine back
        for _ in range(3):
            record = colo.step(
                rollout=lambda: cluster.driver.call(Digest()),  # the engine reads every weight it serves
                train=lambda served: (cluster.trainer.call("train_step"), cluster.trainer.call("digest")),
                check=lambda trained, sync: cluster.driver.call(Digest()).fingerprints == trained[1],
            )
            assert record.checked and not record.violations, record.violations
            print(
                f"update {record.sync.update_id}: {record.sync.bytes / MiB:.0f} MiB synced in "
                f"{record.sync_s * 1e3:.0f} ms inside train_to_rollout ({record.train_to_rollout.seconds:.2f} s); "
                f"the engine serves the trainer's weights: {record.checked}"
            )
