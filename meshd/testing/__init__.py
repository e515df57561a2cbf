"""Test fixtures that only tests and benchmarks import (enforced by tests/test_layout_imports.py).

    models.py  seeded random Llama / Gemma 3 artifacts (re-exports the packaged SmolLM2)
    procs.py   start and stop ``meshd worker`` subprocesses
"""
