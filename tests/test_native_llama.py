"""llama.cpp execution of layer ranges: exact splits, drift, session semantics, errors.

Split-vs-whole compares the same GGUF on the same runtime, so tokens AND
logits must be identical (boundary states travel as float32, llama.cpp's
compute dtype). Printed figures (run with -s) are the reported differences.
"""
from __future__ import annotations

import numpy as np
import pytest

from meshd.testing.models import build_random_llama, smollm2_gguf_path
from native.convert import convert
from native.errors import ArtifactError, RangeUnavailable
from native.llama_backend import KvBudgetExhausted, LlamaBackendConfig, LlamaRangeBackend
from proto.errors import LimitExceeded, LocalError, ProtocolViolation
from shard.model.backend import BackendCache, LayerRange, RangeBackend
from tests._native_helpers import greedy_chain, max_logit_diff, ranges

pytestmark = pytest.mark.native

CONFIG = LlamaBackendConfig(n_threads=2, kv_budget_tokens=512, max_sessions=4)
PROMPT = [5, 17, 99, 200, 3, 44, 12, 8, 150, 77]
SMOL_PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378]  # token ids of SmolLM2's vocab
N_NEW = 32


def _backends(path, layer_ranges, config=CONFIG):
    return [LlamaRangeBackend(path, r, config, progress=None) for r in layer_ranges]


def _close(backends):
    for backend in backends:
        backend.close()


@pytest.fixture(scope="module")
def random_ggufs():
    artifact = build_random_llama()
    return {q: convert(artifact, q, progress=None) for q in ("F16", "BF16", "Q8_0", "Q4_K_M")}


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
@pytest.mark.parametrize("cuts", [[3], [2, 4]])
def test_random_split_equals_whole(random_ggufs, qtype, cuts):
    whole = _backends(random_ggufs[qtype], ranges([], 6))
    split = _backends(random_ggufs[qtype], ranges(cuts, 6))
    try:
        a = greedy_chain(whole, PROMPT, N_NEW)
        b = greedy_chain(split, PROMPT, N_NEW)
    finally:
        _close(whole + split)
    diff = max_logit_diff(a, b)
    print(f"\nrandom llama {qtype} cuts {cuts}: tokens equal={a.tokens == b.tokens} max|dlogit|={diff}")
    assert a.tokens == b.tokens
    assert diff == 0.0


@pytest.mark.parametrize("cuts", [[15], [10, 20]])
def test_smollm2_split_equals_whole(cuts):
    path = smollm2_gguf_path()
    whole = _backends(path, ranges([], 30))
    split = _backends(path, ranges(cuts, 30))
    try:
        a = greedy_chain(whole, SMOL_PROMPT, N_NEW)
        b = greedy_chain(split, SMOL_PROMPT, N_NEW)
    finally:
        _close(whole + split)
    diff = max_logit_diff(a, b)
    print(f"\nSmolLM2 Q4_1 cuts {cuts}: tokens equal={a.tokens == b.tokens} max|dlogit|={diff}")
    assert a.tokens == b.tokens and diff == 0.0


def test_quantized_drift_is_reported(random_ggufs):
    reference = _backends(random_ggufs["F16"], ranges([], 6))
    try:
        base = greedy_chain(reference, PROMPT, N_NEW)
    finally:
        _close(reference)
    for qtype in ("BF16", "Q8_0", "Q4_K_M"):
        backends = _backends(random_ggufs[qtype], ranges([3], 6))
        try:
            got = greedy_chain(backends, PROMPT, N_NEW)
        finally:
            _close(backends)
        same = sum(x == y for x, y in zip(base.tokens, got.tokens))
        first = next((i for i, (x, y) in enumerate(zip(base.tokens, got.tokens)) if x != y), None)
        print(f"\n{qtype} split vs F16 whole: {same}/{N_NEW} tokens equal, first divergence {first}, "
              f"first-step max|dlogit|={float(np.abs(base.logits[0] - got.logits[0]).max()):.4f}")
        assert len(got.tokens) == N_NEW


def test_effective_start_inside_the_range(random_ggufs):
    path = random_ggufs["F16"]
    whole = _backends(path, ranges([], 6))
    head, tail = _backends(path, [LayerRange(0, 3, 6), LayerRange(2, 6, 6)])
    try:
        a = greedy_chain(whole, PROMPT, 8)
        caches = [head.new_cache(64), tail.new_cache(64)]
        x = np.asarray(PROMPT, np.int64)
        tokens = []
        for _ in range(8):
            h = head.forward(caches[0], x, effective_start=0)
            logits = tail.forward(caches[1], h, effective_start=3)  # overlap: skip layer 2
            tokens.append(int(np.argmax(logits)))
            x = np.asarray(tokens[-1:], np.int64)
        assert tokens == a.tokens
        with pytest.raises(RangeUnavailable):
            tail.forward(caches[1], h, effective_start=2)  # a session keeps its start
        with pytest.raises(RangeUnavailable):
            tail.forward(tail.new_cache(8), h, effective_start=1)
    finally:
        _close(whole + [head, tail])


def test_backend_satisfies_the_protocol(random_ggufs):
    (backend,) = _backends(random_ggufs["F16"], [LayerRange(0, 3, 6)])
    try:
        assert isinstance(backend, RangeBackend)
        cache = backend.new_cache(16)
        assert isinstance(cache, BackendCache)
        out = backend.forward(cache, np.asarray(PROMPT[:4]), effective_start=0)
        assert out.shape == (4, 64) and out.dtype == np.float32 and cache.past_len == 4
        assert backend.backend_name == "llama.cpp" and backend.boundary_dtype == np.float32
        cache.release()
    finally:
        backend.close()


def test_fingerprints_name_backend_and_quantization(random_ggufs):
    f16, q8 = (_backends(random_ggufs[q], [LayerRange(0, 6, 6)])[0] for q in ("F16", "Q8_0"))
    try:
        assert f16.fingerprint.model_artifact_digest != q8.fingerprint.model_artifact_digest
        assert f16.fingerprint.runtime_recipe_digest != q8.fingerprint.runtime_recipe_digest
        assert f16.fingerprint.recipe_id.startswith("llama.cpp/gguf-llama-F16")
    finally:
        _close([f16, q8])


def test_sessions_are_isolated_and_released(random_ggufs):
    backends = _backends(random_ggufs["F16"], ranges([3], 6))
    try:
        alone = greedy_chain(backends, PROMPT, 6)
        other = greedy_chain(backends, PROMPT[:5], 6)
        # Interleave two sessions step by step: each must match its solo run.
        caches = {name: [b.new_cache(64) for b in backends] for name in ("a", "b")}
        feeds = {"a": np.asarray(PROMPT, np.int64), "b": np.asarray(PROMPT[:5], np.int64)}
        got = {"a": [], "b": []}
        for _ in range(6):
            for name in ("a", "b"):
                x = feeds[name]
                for backend, cache in zip(backends, caches[name]):
                    x = backend.forward(cache, x, effective_start=backend.layer_range.start)
                got[name].append(int(np.argmax(x)))
                feeds[name] = np.asarray(got[name][-1:], np.int64)
        assert got["a"] == alone.tokens and got["b"] == other.tokens
        for cache_list in caches.values():
            for cache in cache_list:
                cache.release()
                cache.release()  # idempotent
        with pytest.raises(LocalError):
            backends[0].forward(caches["a"][0], np.asarray([1]), effective_start=0)
        # Released sequences are reused from a clean state.
        assert greedy_chain(backends, PROMPT, 6).tokens == alone.tokens
    finally:
        _close(backends)


def test_session_and_token_budgets(random_ggufs):
    (backend,) = _backends(random_ggufs["F16"], [LayerRange(0, 6, 6)],
                           LlamaBackendConfig(kv_budget_tokens=64, max_sessions=2))
    try:
        a = backend.new_cache(32)
        with pytest.raises(KvBudgetExhausted):
            backend.new_cache(40)  # 32 + 40 > 64 tokens
        b = backend.new_cache(32)
        with pytest.raises(KvBudgetExhausted):
            backend.new_cache(1)  # both sequences taken
        with pytest.raises(KvBudgetExhausted):
            backend.forward(a, np.arange(33), effective_start=0)  # over its reservation
        backend.forward(a, np.arange(10), effective_start=0)
        a.release()
        backend.new_cache(32).release()
        b.release()
    finally:
        backend.close()


def test_bad_inputs_are_protocol_violations(random_ggufs):
    head, tail = _backends(random_ggufs["F16"], ranges([3], 6))
    try:
        cache = head.new_cache(16)
        for bad in (np.asarray([384]), np.asarray([-1]), np.zeros((2, 64), np.float32), np.asarray([], np.int64)):
            with pytest.raises(ProtocolViolation):
                head.forward(cache, bad, effective_start=0)
        cache = tail.new_cache(16)
        for bad in (np.zeros((2, 63), np.float32), np.asarray([1, 2]), np.full((1, 64), np.nan, np.float32)):
            with pytest.raises(ProtocolViolation):
                tail.forward(cache, bad, effective_start=3)
        with pytest.raises(LimitExceeded):
            tail.forward(cache, np.zeros((600, 64), np.float32), effective_start=3)
    finally:
        _close([head, tail])


def test_wrong_range_and_truncated_file(random_ggufs, tmp_path):
    with pytest.raises(RangeUnavailable, match="6 layers"):
        LlamaRangeBackend(random_ggufs["F16"], LayerRange(0, 4, 8), CONFIG, progress=None)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(random_ggufs["F16"].read_bytes()[:-1000])
    with pytest.raises(ArtifactError, match="truncated"):
        LlamaRangeBackend(cut, LayerRange(0, 6, 6), CONFIG, progress=None)


def test_skipping_the_vocab_projection_changes_nothing(random_ggufs):
    """The head stops its graph after the last block; letting it finish gives the same residual."""
    outs = []
    for skip in (True, False):
        config = LlamaBackendConfig(kv_budget_tokens=64, max_sessions=1, skip_vocab_projection=skip)
        (backend,) = _backends(random_ggufs["F16"], [LayerRange(0, 3, 6)], config)
        try:
            cache = backend.new_cache(32)
            outs.append(backend.forward(cache, np.asarray(PROMPT), effective_start=0))
            outs.append(backend.forward(cache, np.asarray([7]), effective_start=0))
        finally:
            backend.close()
    assert np.array_equal(outs[0], outs[2]) and np.array_equal(outs[1], outs[3])


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_smollm2_converted_split_equals_whole(qtype):
    """SmolLM2's dequantized artifact converted to F16/BF16 GGUF: 2 and 3 ranges == whole."""
    from meshd.testing.models import smollm2_artifact

    path = convert(smollm2_artifact("float32"), qtype, tokenizer_pre="smollm", progress=None)
    whole = _backends(path, ranges([], 30))
    try:
        a = greedy_chain(whole, SMOL_PROMPT, N_NEW)
    finally:
        _close(whole)
    for cuts in ([15], [10, 20]):
        split = _backends(path, ranges(cuts, 30))
        try:
            b = greedy_chain(split, SMOL_PROMPT, N_NEW)
        finally:
            _close(split)
        diff = max_logit_diff(a, b)
        print(f"\nSmolLM2 {qtype} GGUF cuts {cuts}: tokens equal={a.tokens == b.tokens} max|dlogit|={diff}")
        assert a.tokens == b.tokens and diff == 0.0
