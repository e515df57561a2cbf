"""Speculative decoding on the llama.cpp lane: SmolLM2-135M split at layer 15, in memory.

Sequence position removal rolls a hop's KV back (LlamaSeqCache.truncate);
the tail returns every position's logits for a verify step. llama.cpp is not
batch-shape invariant (a position inside a (k+1)-row batch can differ from the
same position decoded alone), so the lane's drift is measured first: the
largest logit difference between a verify chunk's rows and one-row decoding
of the same positions. The speculative tokens must equal plain decoding, or
diverge first where plain decoding's top-2 logit gap is below that drift (a
near-tie, printed with its position and gap).
"""
from __future__ import annotations

import numpy as np
import pytest

from meshd.generate.draft import FixedDraftLength, PromptLookup
from meshd.generate.driver import GenerationRequest, SwarmDriver
from meshd.generate.gguf_tokenizer import gguf_tokenizer
from meshd.generate.routes import FactoryConnector, fixed_route
from meshd.generate.speculative import SpeculativeDriver
from native.draft_model import LlamaDrafter
from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
from native.packaged import smollm2_gguf_path
from shard.edges.memory import MemoryNetwork
from shard.model.backend import LayerRange
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy

pytestmark = pytest.mark.native

LAYERS = 30
NEW_TOKENS = 40
TEXT = ("Copy this passage exactly.\n"
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "Copy:\ndef add(a, b):\n")


@pytest.fixture(scope="module")
def lane():
    config = LlamaBackendConfig(kv_budget_tokens=4096, max_sessions=4)
    backends = [LlamaRangeBackend(smollm2_gguf_path(), LayerRange(a, b, LAYERS), config, progress=None)
                for a, b in ((0, 15), (15, LAYERS))]
    network = MemoryNetwork()
    for i, backend in enumerate(backends):
        network.add(f"mem-{i}", ShardService(backend, SessionPolicy(kv_budget_tokens=4096)))
    source = fixed_route([("mem-0", 0, 15), ("mem-1", 15, LAYERS)], LAYERS)
    prompt = tuple(gguf_tokenizer(smollm2_gguf_path()).tokenizer.encode(TEXT).ids)
    yield backends, network, source, prompt
    for backend in backends:
        backend.close()


def measured_drift(backends, prompt, k: int = 5) -> float:
    """Largest logit difference between a (k+1)-row verify forward and one-row decoding of the same
    positions, on this lane, after the prompt."""
    head, tail = backends
    ids = np.asarray(prompt, np.int64)
    tail_ids = ids[-(k + 1):]
    caches = [[b.new_cache(512) for b in backends] for _ in range(2)]
    try:
        for pair in caches:
            tail.forward(pair[1], head.forward(pair[0], ids[:-(k + 1)], effective_start=0), effective_start=15)
        pair = caches[0]
        pair[1].logits_rows = True
        rows = tail.forward(pair[1], head.forward(pair[0], tail_ids, effective_start=0), effective_start=15)
        pair = caches[1]
        alone = [tail.forward(pair[1], head.forward(pair[0], tail_ids[i:i + 1], effective_start=0),
                              effective_start=15) for i in range(k + 1)]
        return float(np.abs(rows - np.stack(alone)).max())
    finally:
        for pair in caches:
            for cache in pair:
                cache.release()


def top2_gap(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def test_greedy_speculative_tokens_equal_plain_or_diverge_at_a_near_tie(lane):
    backends, network, source, prompt = lane
    drift = measured_drift(backends, prompt)
    connector = FactoryConnector(network.transport)
    fingerprint = backends[0].fingerprint
    request = GenerationRequest(prompt, NEW_TOKENS, chunk_tokens=64)
    plain_driver = SwarmDriver(source, connector, fingerprint=fingerprint)
    plain_out = plain_driver.generate(GenerationRequest(prompt, NEW_TOKENS, chunk_tokens=64, return_logits=True))
    plain = [t.id for t in plain_out]
    driver = SpeculativeDriver(source, connector, fingerprint=fingerprint, drafter=PromptLookup(),
                               policy=FixedDraftLength(5))
    spec = [t.id for t in driver.generate(request)]
    s = driver.spec
    print(f"llama.cpp verify drift {drift:.3g}; acceptance {s.acceptance_rate:.2f}, "
          f"tokens per round trip {s.tokens_per_round_trip:.2f}, {s.verify_steps} verify steps")
    assert s.verify_steps and s.accepted
    if spec != plain:
        at = next(i for i, (a, b) in enumerate(zip(spec, plain)) if a != b)
        gap = top2_gap(plain_driver.stats.logits[at])
        print(f"divergence at token {at} (position {len(prompt) + at}): top-2 gap {gap:.3g}")
        assert gap <= drift


def test_draft_model_reuses_its_kv_and_drafts_what_it_would_alone(lane):
    _, _, _, prompt = lane
    drafter, fresh = LlamaDrafter(smollm2_gguf_path()), LlamaDrafter(smollm2_gguf_path())
    try:
        first = drafter.draft(prompt, 4)
        assert len(first) == 4 and drafter.draft(prompt, 4) == first
        longer = (*prompt, *first[:2], 7)            # two drafts kept, then another token
        assert drafter.draft(longer, 3) == fresh.draft(longer, 3)
        assert drafter.draft(prompt[:5], 2) == fresh.draft(prompt[:5], 2)   # rolled far back
        assert drafter.draft(prompt, 0) == ()
    finally:
        drafter.close()
        fresh.close()


def test_draft_model_on_the_same_model_is_accepted_with_the_plain_tokens(lane):
    backends, network, source, prompt = lane
    connector = FactoryConnector(network.transport)
    fingerprint = backends[0].fingerprint
    plain = [t.id for t in SwarmDriver(source, connector, fingerprint=fingerprint).generate(
        GenerationRequest(prompt, NEW_TOKENS, chunk_tokens=64))]
    drafter = LlamaDrafter(smollm2_gguf_path())
    try:
        driver = SpeculativeDriver(source, connector, fingerprint=fingerprint, drafter=drafter,
                                   policy=FixedDraftLength(4))
        spec = [t.id for t in driver.generate(GenerationRequest(prompt, NEW_TOKENS, chunk_tokens=64))]
    finally:
        drafter.close()
    s = driver.spec
    print(f"draft model = target (Q4_1): acceptance {s.acceptance_rate:.2f}, "
          f"tokens per round trip {s.tokens_per_round_trip:.2f}")
    assert spec == plain
    assert s.acceptance_rate > 0.8
