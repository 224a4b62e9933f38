"""Running a plan: the participant interfaces, the executor and the memory samplers.

Separate from ``model`` because it measures a live machine (torch, ``/proc``), and from
``backends`` because it only needs the interfaces: any trainer or engine that implements
``TrainerMemory`` / ``EngineMemory`` can be executed and checked, whatever holds its memory.
"""
