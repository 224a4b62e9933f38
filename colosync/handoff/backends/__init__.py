"""Participants on real memory: torch trainers and engines, torch_memory_saver, host pools.

These are the implementations the runtime's interfaces abstract over. They sit above the
runtime (they report in its ``OpReport`` terms) and below the engines and tools that wire
them to a particular framework, so swapping a backend never touches planning or execution.
"""
