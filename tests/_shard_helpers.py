"""Shared helpers for the shard tests (not a test module)."""
from __future__ import annotations

import numpy as np

from shard.reference import greedy


def run_split(parts, prompt, new_tokens, *, chunk=16, effective=None):
    """Greedy generation through in-process backends; returns (tokens, logits)."""
    caches = [p.new_cache(len(prompt) + new_tokens + 8) for p in parts]
    effective = effective or [p.layer_range.start for p in parts]

    def run(ids):
        x = np.array(ids, dtype=np.int64)
        for p, c, e in zip(parts, caches, effective):
            x = p.forward(c, x, effective_start=e)
        return x

    for first in range(0, len(prompt), chunk):
        logits = run(prompt[first:first + chunk])
    tokens, all_logits = [], []
    for i in range(new_tokens):
        all_logits.append(logits)
        tokens.append(greedy(logits))
        if i + 1 < new_tokens:
            logits = run([tokens[-1]])
    return tokens, all_logits


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))
