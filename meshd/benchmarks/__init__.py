"""Benchmarks run by ``meshd bench``."""
