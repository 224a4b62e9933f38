"""Your own engine behind colosync: describe the model once, split "build" from "install"."""

import torch

from colosync import EngineTarget, LocalLink, ModelSpec, ParamSpec, Receiver, ReceiverPolicy, Sender


class MyEngine(EngineTarget):
    """Serves one torch module; an update is built beside it and swapped in whole."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def model_spec(self) -> ModelSpec:  # names, shapes and dtypes it accepts (LoRA modules too, if any)
        return ModelSpec({n: ParamSpec(tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()})

    def prepare(self, manifest, tensors):  # cast and assemble; must not change what is served
        return {name: t.clone() for name, t in tensors.items()}

    def commit(self, prepared, update_id):  # install, between engine steps
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in prepared:
                    p.copy_(prepared[name])

    def discard(self, prepared):  # free a prepared update that will not commit
        prepared.clear()


if __name__ == "__main__":
    served = torch.nn.Linear(4, 2)
    receiver = Receiver(MyEngine(served), device="cpu", policy=ReceiverPolicy(reject_nonfinite=True, timeout_s=60))
    trainer = torch.nn.Linear(4, 2)  # the trainer's copy, after a training step
    with Sender(LocalLink(receiver), transport="shm") as sender:  # LocalLink: the engine in this process
        report = sender.push(trainer.named_parameters())
    assert torch.equal(served.weight, trainer.weight) and receiver.committed_update_id == report.update_id
    print(f"committed update {report.update_id}: {report.tensors} tensors, {report.bytes} bytes")
    receiver.close()
