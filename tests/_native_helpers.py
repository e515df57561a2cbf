"""Helpers for the native tests: greedy generation through in-process backends."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shard.model.backend import LayerRange


@dataclass
class Greedy:
    tokens: list[int]
    logits: list[np.ndarray]


def greedy_chain(backends, prompt: list[int], n_new: int, max_tokens: int = 256) -> Greedy:
    """Greedy decode through ``backends`` (contiguous ranges, head first), releasing caches."""
    caches = [b.new_cache(max_tokens) for b in backends]
    try:
        inputs = np.asarray(prompt, np.int64)
        tokens, logits = [], []
        for _ in range(n_new):
            x = inputs
            for backend, cache in zip(backends, caches):
                x = backend.forward(cache, x, effective_start=backend.layer_range.start)
            logits.append(x)
            nxt = int(np.argmax(x))
            tokens.append(nxt)
            inputs = np.asarray([nxt], np.int64)
        return Greedy(tokens, logits)
    finally:
        for cache in caches:
            cache.release()


def ranges(cuts: list[int], num_layers: int) -> list[LayerRange]:
    bounds = [0, *cuts, num_layers]
    return [LayerRange(a, b, num_layers) for a, b in zip(bounds, bounds[1:])]


def max_logit_diff(a: Greedy, b: Greedy) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits))
