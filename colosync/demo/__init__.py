"""``colosync demo``: a colocated RL loop on a tiny local model, with a colosync push every step.

Top of the layer stack: nothing in the library imports it. ``models`` makes the tiny local
models tests and examples use; ``rl`` the toy task and learner; ``actors`` the trainer actor;
``cli`` the command.
"""
