"""``colosync demo``: a colocated RL loop on a tiny local model, with a colosync push every step.

Top of the layer stack: nothing in the library imports it. ``tasks`` is the toy task, ``rl``
the learner, ``actors`` the trainer actor, ``cli`` the command; the step they run (cluster,
handoff, sync) is the library's ``colosync.colocated``.
"""
