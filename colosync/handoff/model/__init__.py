"""The handoff as data: what a plan is and what it will cost, computed without touching memory.

Its modules import neither torch nor any participant, so that a plan can be built,
validated, printed and simulated for a 32-node job on a laptop (``colosync plan``) with the
very semantics (``ops.effect``) that the runtime later checks the real run against.
"""
