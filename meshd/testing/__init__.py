"""Test fixtures that only tests and benchmarks import (enforced by tests/test_layout_imports.py).

    models.py  seeded random Llama / Gemma 3 / Qwen3-MoE / Qwen2-MoE artifacts (re-exports the packaged SmolLM2)
    procs.py   start and stop ``meshd worker`` subprocesses
    experts.py expert peers in-process and as ``meshd worker --experts`` subprocesses, greedy /
               teacher-forced runs through one backend (MoE tests and ``meshd bench moe``)
"""
