"""Continuous batching on the llama.cpp lane: one llama_batch over several sequences.

SmolLM2-135M (the packaged GGUF), whole and split at layer 15: sessions
driven from several threads share forwards (rows merged, checked). With one
KV stream per session (``kv_unified=False``, the product default through
``native.factory``) each session's greedy tokens and logits equal the same
request run alone bit for bit (max logit difference 0.0, asserted), the
non-tail hops' rows batched too (``stream_groups``). With the shared KV pool
(llama.cpp's ``kv_unified``, opt-in with ``llama_kv_streams = 0``) running
sessions drift from the alone run -- with or without batching -- once another
session is released: llama.cpp's ``find_slot`` searches from cell 0 again
when enough cells before its head are free, so the running sessions' next
tokens land in the freed cells, before their own earlier ones, and flash
attention (which walks cells in index order, accumulating V in f16) sums them
in another order (logits off by ~0.5-1; interleaving alone, without a
release, stays exact). ``test_a_release_mid_run_...`` replays that case
deterministically; the threaded test measures and prints the difference and
asserts only what holds (rows merged, every session finished).
"""
from __future__ import annotations

import numpy as np
import pytest

from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
from native.packaged import smollm2_gguf_path
from shard.model.backend import LayerRange
from tests._batching_helpers import Gate, concurrent, generate, max_diff, services

pytestmark = pytest.mark.native

PROMPTS = [[504, 3458, 314, 260], [1], [28, 43, 3015, 1235, 9, 9, 7], [3000, 4000], [12, 13, 14, 15, 16]]
N_NEW = 6
LAYERS = 30


def _backends(cuts, unified=False):
    bounds = [0, *cuts, LAYERS]
    config = LlamaBackendConfig(kv_budget_tokens=8192, max_sessions=16, kv_unified=unified)
    return [LlamaRangeBackend(smollm2_gguf_path(), LayerRange(a, b, LAYERS), config, progress=None)
            for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("cuts", [[], [15]], ids=["whole", "split"])
@pytest.mark.parametrize("chunk", [0, 3], ids=["prefill", "chunked"])
def test_llama_batched_greedy_equals_alone(cuts, chunk):
    backends = _backends(cuts)
    try:
        alone = [generate(services(backends, batching=False), f"a{i}", p, N_NEW, chunk)
                 for i, p in enumerate(PROMPTS)]
        chain = services(backends)
        gate = Gate(chain[0], len(PROMPTS) - 1)
        together = concurrent(chain, PROMPTS, N_NEW, chunk)
        assert gate.opened and chain[0].batcher.batched_rows >= len(PROMPTS) - 1
        diff = max(max_diff(a, b) for a, b in zip(alone, together))
        print(f"llama.cpp batched vs alone ({cuts=}, {chunk=}): max logit diff {diff:.3g}, "
              f"merged rows {chain[0].batcher.batched_rows}")
        assert [r.tokens for r in together] == [r.tokens for r in alone]
        assert diff == 0.0
    finally:
        for b in backends:
            b.close()


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
def test_llama_shared_kv_pool_drift_is_measured(batching):
    backends = _backends([], unified=True)
    try:
        alone = [generate(services(backends, batching=False), f"a{i}", p, N_NEW + 4)
                 for i, p in enumerate(PROMPTS)]
        together = concurrent(services(backends, batching=batching), PROMPTS, N_NEW + 4)
        diff = max(max_diff(a, b) for a, b in zip(alone, together))
        same = sum(a.tokens == b.tokens for a, b in zip(alone, together))
        print(f"llama.cpp shared KV pool, concurrent ({batching=}): max logit diff {diff:.3g}, "
              f"{same}/{len(PROMPTS)} sessions' greedy tokens equal alone")
        assert all(len(r.tokens) == N_NEW + 4 for r in together)
    finally:
        for b in backends:
            b.close()


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "shared-pool"])
def test_a_release_mid_run_refills_cells_out_of_order_only_in_the_shared_pool(unified):
    """A and B run, B is released, C starts in B's freed cells while A decodes on. Per-session
    streams: A's logits equal A alone bit for bit (asserted). Shared pool: measured and printed."""
    from native.gguf_range import model_info, open_reader
    from native.llama_engine import EngineConfig, LlamaEngine

    path = smollm2_gguf_path()
    info = model_info(open_reader(path))
    engine = LlamaEngine(path, EngineConfig(n_threads=1, n_ctx=2048, n_seq_max=8, kv_unified=unified),
                         n_embd=info.hidden_size, n_vocab=info.vocab_size, capture_layer=None)

    def decode(seq, pos, tokens):
        return engine.decode(seq, pos, np.asarray(tokens, np.int32), want_hidden=False)

    def run_a(seq, others):
        prompt = PROMPTS[0]
        x, pos, logits = decode(seq, 0, prompt), len(prompt), []
        for step in range(N_NEW + 4):
            others(step)
            logits.append(x)
            x = decode(seq, pos, [int(np.argmax(x))])
            pos += 1
        engine.forget(seq)
        return logits

    try:
        alone = run_a(0, lambda step: None)
        state = {}

        def others(step):
            if step == 0:
                decode(1, 0, PROMPTS[2])                      # B: 7 cells after A's prompt
            elif step == 2:
                engine.forget(1)                              # B leaves: its cells are free
            elif step == 3:
                state["c"] = decode(2, 0, PROMPTS[4])         # C: refills them
                state["pos"] = len(PROMPTS[4])
            elif step > 3:
                state["c"] = decode(2, state["pos"], [int(np.argmax(state["c"]))])
                state["pos"] += 1

        mixed = run_a(3, others)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(alone, mixed))
        print(f"llama.cpp {'shared pool' if unified else 'per-session streams'}: A after a release and a "
              f"refill vs A alone: max logit diff {diff:.3g}")
        if not unified:
            assert diff == 0.0
    finally:
        engine.close()


def test_llama_stream_per_session_caps_a_session():
    (backend,) = _backends([])
    try:
        with pytest.raises(Exception, match="one session's stream holds 512"):
            backend.new_cache(513)
    finally:
        backend.close()


def test_llama_forward_batch_refuses_one_row_and_runs_the_others():
    (backend,) = _backends([])
    try:
        caches = [backend.new_cache(64) for _ in range(3)]
        bad = np.asarray([backend.vocab_size + 1], np.int64)
        results = backend.forward_batch(caches, [np.asarray([1, 2], np.int64), bad, np.asarray([3], np.int64)],
                                        effective_start=0)
        assert isinstance(results[1], Exception) and caches[1].past_len == 0
        assert caches[0].past_len == 2 and caches[2].past_len == 1
        alone = backend.new_cache(64)
        assert np.array_equal(results[2], backend.forward(alone, np.asarray([3], np.int64), effective_start=0))
    finally:
        backend.close()


def test_the_factorys_kv_streams_give_per_session_streams():
    """``meshd worker --llama-kv-streams N`` (``[worker] llama_kv_streams``) reaches llama.cpp:
    N sequences, kv_unified off, a session over budget / N refused for good; the default (auto)
    gives streams too, and 0 the shared pool."""
    from native.factory import load_gguf_backend
    from shard.errors import ResourceExhausted

    backend = load_gguf_backend(smollm2_gguf_path(), 0, None, kv_budget_tokens=2048, kv_streams=4, progress=None)
    try:
        assert backend.config.kv_unified is False and backend.config.max_sessions == 4
        backend.new_cache(512).release()
        with pytest.raises(ResourceExhausted) as refused:
            backend.new_cache(513)
        assert not refused.value.retryable
    finally:
        backend.close()
    default = load_gguf_backend(smollm2_gguf_path(), 0, None, kv_budget_tokens=4096, progress=None)
    try:
        assert default.config.kv_unified is False and default.config.max_sessions == 2
        assert default.session_capacity == 2   # meshd worker admits (and evicts idle) against it
    finally:
        default.close()
    shared = load_gguf_backend(smollm2_gguf_path(), 0, None, kv_budget_tokens=4096, kv_streams=0, progress=None)
    try:
        assert shared.config.kv_unified is True
    finally:
        shared.close()
