"""The bare torch split floor of ``meshd bench pipeline`` (meshd/benchmarks/torch_floor.py).

Real processes on a ring of pipes, each loading its range of a seeded model:
the floor's greedy tokens must equal the whole model's (a floor that computed
something else would make its figure meaningless), and it must stop cleanly.
"""
from __future__ import annotations

import torch

from meshd.benchmarks.torch_floor import TorchFloor
from meshd.testing.models import build_random_llama
from shard.model.reference import WholeModel

PROMPT = [5, 17, 3, 99, 42, 7, 8, 120, 33, 64]
NEW = 12


def test_the_bare_floor_splits_exactly_and_stops():
    path = build_random_llama()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = WholeModel(path).generate(PROMPT, NEW, chunk_tokens=4).tokens
    finally:
        torch.set_num_threads(threads)
    floor = TorchFloor(path, _thirds(path), threads=1)   # head, middle and tail
    try:
        run = floor.generate(PROMPT, NEW, chunk_tokens=4)
        again = floor.generate(PROMPT, NEW, chunk_tokens=4)   # a second generation starts from empty caches
    finally:
        floor.close()
    assert run.tokens == expected and again.tokens == expected
    assert len(run.step_ms) == NEW - 1 and run.decode_tok_s > 0 and run.prefill_s > 0
    assert all(not p.is_alive() for p in floor.procs)


def _layers(path) -> int:
    import json

    return json.loads((path / "config.json").read_text())["num_hidden_layers"]


def _thirds(path) -> list[str]:
    n = _layers(path)
    a, b = n // 3, 2 * n // 3
    return [f"0:{a}", f"{a}:{b}", f"{b}:{n}"]
