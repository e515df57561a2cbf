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


PROMPT = list(range(5, 45))


def hops_for(workers, specs, num_layers):
    """Hops over disjoint ranges ``specs`` ("A:B") served by ``workers``."""
    from shard.backend import LayerRange
    from meshd.benchmarks.star_driver import Hop

    hops = []
    for w, spec in zip(workers, specs):
        a, b = (int(x) for x in spec.split(":"))
        hops.append(Hop(w.endpoint, LayerRange(a, b, num_layers), a))
    return hops


def check_route_equals_whole(path, workers, specs, num_layers, *, dtype="float32", prompt=PROMPT,
                             new_tokens=32, chunk=16, label=""):
    """32 greedy tokens through the workers equal the whole model; returns the max logit diff."""
    from meshd.benchmarks.star_driver import RouteDriver
    from shard.reference import WholeModel

    with RouteDriver(hops_for(workers, specs, num_layers), chunk_tokens=chunk) as driver:
        got = driver.generate(prompt, new_tokens)
    ref = WholeModel(path, dtype).generate(prompt, new_tokens, chunk_tokens=chunk)
    diff = max_diff(got.logits, ref.logits)
    print(f"\n[{label or path.name} {dtype} {len(specs)} workers] tokens equal: {got.tokens == ref.tokens}; "
          f"max abs logit diff: {diff}")
    assert got.tokens == ref.tokens
    return diff
