"""Adapters that put colosync's sync under a training framework's own loop.

A framework that builds its inference engine and pushes weights itself (TRL's colocated
vLLM, say) leaves no hook for a different sync, so each adapter here replaces the one
framework class that does both, checks that the framework's internals are what it was
tested against before a step runs (``colosync.errors.IntegrationError`` otherwise), and
imports the framework only when used.

- ``trl``: ``GRPOTrainer`` and the trainers sharing ``VLLMGeneration`` (RLOO, ...) with
  adapter-only, verified LoRA pushes into their colocated vLLM (full weights when not PEFT).
"""
