"""The colocated step as a library: trainer and engine on one GPU, one call per step.

An RL job whose trainer and engine share the GPUs repeats one step: the engine rolls out, the
handoff gives the device to the trainer, the trainer steps, the handoff gives it back with the
weight sync inside, and the loop checks what the engine serves. This package is that step,
above the pieces it composes (``colosync.handoff``'s plans and executor, ``colosync.sync``'s
Sender, ``colosync.engines``' processes), one job per module:

* ``launch`` -- where a trainer actor runs: ``ActorProcess`` (a spawned process) or
  ``RayTrainer``, behind one ``call(method, *args)``;
* ``trainer`` -- what a trainer actor offers the controller (``ServedTrainer``, ``TrainerPlan``,
  ``engine_link``); ``synthetic`` -- a trainer of a given size to rehearse a job's step;
* ``cluster`` -- the engine and the trainer started together (``Cluster``);
* ``handoff`` -- the plan, the shared host arena and the executor (``Handoff``, ``PhaseStats``);
* ``sync`` -- the sync phase shared with loops colosync does not drive (``VerifiedSync``), and
  ``probe`` -- the trainer's proof of delivery;
* ``step`` -- ``Colocated.step(rollout, train, probe=, check=)`` -> ``StepRecord``.

Import from the modules; nothing is loaded here.
"""
