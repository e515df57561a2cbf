"""Test fixtures that only tests and benchmarks import (enforced by tests/test_layout_imports.py).

    models.py  seeded random Llama / Gemma 3 / Qwen3-MoE / Qwen2-MoE artifacts (re-exports the packaged
               SmolLM2, Gemma-3 GGUF)
    gguf_models.py  seeded random llama / qwen2 / qwen3 / gemma3 GGUFs written with gguf's writer
    procs.py   start and stop ``meshd worker`` subprocesses
    experts.py expert peers in-process and as ``meshd worker --experts`` subprocesses, greedy /
               teacher-forced runs through one backend (MoE tests and ``meshd bench moe``)
"""
