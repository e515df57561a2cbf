"""Test fixtures that only tests and benchmarks import (enforced by tests/test_layout_imports.py).

    models.py  seeded random Llama / Gemma 3 artifacts (re-exports the packaged SmolLM2, Gemma-3 GGUF)
    gguf_models.py  seeded random llama / qwen2 / qwen3 / gemma3 GGUFs written with gguf's writer
    procs.py   start and stop ``meshd worker`` subprocesses
"""
