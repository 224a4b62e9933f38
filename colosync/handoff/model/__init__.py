"""The handoff as data: what a plan is, what it will cost, and what it asks of its two participants.

Its modules import no torch and no participant's implementation, so that a plan can be built,
validated, printed and simulated for a 32-node job on a laptop (``colosync plan``) with the
very semantics (``ops.effect``) that the runtime later checks the real run against. The
participants' interfaces live here too, below both the backends that implement them and the
runtime that drives them.
"""
