"""One copy of each layer on the llama.cpp lane: a route entering a range mid-way runs on the
weights already loaded (injection, native/llama_engine.py), exactly, with no second file mapped."""
from __future__ import annotations

import numpy as np
import pytest

from meshd.testing.models import smollm2_gguf_path
from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
from shard.model.backend import LayerRange
from shard.model.memory import process_memory

pytestmark = pytest.mark.native

CONFIG = LlamaBackendConfig(n_threads=2, kv_budget_tokens=512, max_sessions=4)
SMOL_PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378]  # token ids of SmolLM2's vocab
N_NEW = 16


def _greedy(hops, n_new: int = N_NEW):
    """Greedy decode through ``hops`` = [(backend, effective_start)]: tokens and logits."""
    caches = [b.new_cache(256) for b, _ in hops]
    try:
        inputs = np.asarray(SMOL_PROMPT, np.int64)
        tokens, logits = [], []
        for _ in range(n_new):
            x = inputs
            for (backend, start), cache in zip(hops, caches):
                x = backend.forward(cache, x, effective_start=start)
            logits.append(x.copy())
            tokens.append(int(np.argmax(x)))
            inputs = np.asarray(tokens[-1:], np.int64)
        return tokens, logits
    finally:
        for cache in caches:
            cache.release()


def _mapped_ggufs() -> set[str]:
    with open("/proc/self/maps") as fh:
        return {line.split()[-1] for line in fh if line.rstrip().endswith(".gguf")}


def test_mid_range_entry_is_exact_and_adds_no_weight_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_SLICE_CACHE", str(tmp_path))
    path, n = smollm2_gguf_path(), 30
    whole = LlamaRangeBackend(path, LayerRange(0, n, n), CONFIG, progress=None)
    first = LlamaRangeBackend(path, LayerRange(0, 10, n), CONFIG, progress=None)
    head = LlamaRangeBackend(path, LayerRange(0, 20, n), CONFIG, progress=None)
    tail = LlamaRangeBackend(path, LayerRange(10, n, n), CONFIG, progress=None)   # holds 10..29
    try:
        expected = _greedy([(whole, 0)])
        normal = _greedy([(first, 0), (tail, 10)])
        before, maps = process_memory(), _mapped_ggufs()
        files = sorted(p.name for p in tmp_path.iterdir())
        entered = _greedy([(head, 0), (tail, 20)])   # the route enters tail's range at layer 20
        after = process_memory()
        sub_range = tail.weight_bytes * 10 // 20    # what a second slice 20:30 would have mapped
        print(f"\nRSS before {before.rss >> 20} MiB, after {after.rss >> 20} MiB (file pages "
              f"{before.file >> 20} -> {after.file >> 20} MiB); a second slice would map ~{sub_range >> 20} MiB")
        for got in (normal, entered):                             # tokens and logits, bit for bit
            assert got[0] == expected[0]
            assert all(np.array_equal(a, b) for a, b in zip(got[1], expected[1]))
        assert _mapped_ggufs() == maps                            # no new model file mapped
        assert sorted(p.name for p in tmp_path.iterdir()) == files   # no slice written for 20:30
        kept = sum(a.nbytes for a in entered[1])                 # the logits this test keeps
        assert after.file - before.file < sub_range // 4 and after.rss - before.rss - kept < sub_range // 4
    finally:
        for backend in (whole, first, head, tail):
            backend.close()
