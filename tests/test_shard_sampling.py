"""Sampling: greedy ties, a pure function of (seed, position), top-k / top-p support, logprobs."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, ProtocolViolation
from proto.limits import MAX_TOP_LOGPROBS
from shard.model.sampling import (
    SamplingSpec,
    check_top_logprobs,
    draw_uniform,
    greedy_token,
    sample_token,
    token_logprobs,
)


def full_sort_reference(logits: np.ndarray, spec: SamplingSpec, position: int) -> int:
    """The module docstring's rules, literally: a full stable sort of the vocabulary."""
    x = logits.astype(np.float32)
    peak = float(x.max())
    w = np.exp((x.astype(np.float64) - peak) / spec.temperature)
    order = np.argsort(-x, kind="stable")
    if spec.top_k:
        order = order[:spec.top_k]
    running = np.cumsum(w[order])
    mass = float(running[-1]) if spec.top_k else float(w.sum())
    if spec.top_p < 1.0:
        cut = int(np.searchsorted(running, spec.top_p * mass))
        if cut < running.size:
            running = running[:cut + 1]
            mass = float(running[-1])
    index = int(np.searchsorted(running, draw_uniform(spec.seed, position) * mass, side="right"))
    return int(order[min(index, running.size - 1)])


def test_greedy_breaks_ties_to_lowest_id():
    assert greedy_token(np.array([0.0, 3.0, 1.0, 3.0], np.float32)) == 1
    assert sample_token(np.array([5.0, 5.0], np.float32), SamplingSpec(), 9) == 0


def test_the_draw_is_a_pure_function_of_seed_and_position():
    logits = np.random.default_rng(0).normal(size=500).astype(np.float32)
    spec = SamplingSpec(temperature=1.0, seed=42)
    first = [sample_token(logits, spec, p) for p in range(50)]
    # any order, any repetition: position p always draws the same token (a replacement tail does too)
    assert [sample_token(logits, spec, p) for p in reversed(range(50))][::-1] == first
    assert sample_token(logits, spec, 17) == first[17]
    assert len(set(first)) > 10                                  # positions draw different uniforms
    other = [sample_token(logits, SamplingSpec(temperature=1.0, seed=43), p) for p in range(50)]
    assert other != first
    assert draw_uniform(42, 3) == draw_uniform(42, 3) != draw_uniform(42, 4)
    assert all(0.0 <= draw_uniform(s, p) < 1.0 for s in (0, 1, 2**64 - 1) for p in (0, 1, 10**9))


def test_draw_uniform_is_philox_keyed_by_the_seed_with_counter_p():
    raw = int(np.random.Philox(key=1234, counter=56).random_raw())
    assert draw_uniform(1234, 56) == (raw >> 11) / 2**53


def test_top_k_restricts_support():
    logits = np.arange(100, dtype=np.float32)
    spec = SamplingSpec(temperature=5.0, top_k=3, seed=1)
    assert {sample_token(logits, spec, p) for p in range(200)} == {97, 98, 99}


def test_top_p_restricts_support():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float64)).astype(np.float32)
    spec = SamplingSpec(temperature=1.0, top_p=0.75, seed=3)
    assert {sample_token(logits, spec, p) for p in range(300)} == {0, 1}


def test_frequencies_follow_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    logits = np.log(probs).astype(np.float32)
    spec = SamplingSpec(temperature=1.0, seed=5)
    counts = np.bincount([sample_token(logits, spec, p) for p in range(3000)], minlength=3) / 3000
    assert np.abs(counts - probs).max() < 0.04


def test_a_flat_vocabulary_needs_the_whole_sort_and_still_matches():
    logits = np.zeros(5000, np.float32)
    logits[::7] = 0.001  # ties everywhere, a flat distribution: the selection must grow to the vocabulary
    for spec in (SamplingSpec(1.0, 0, 1.0, 9), SamplingSpec(1.0, 0, 0.999, 9), SamplingSpec(2.0, 4000, 1.0, 9)):
        assert [sample_token(logits, spec, p) for p in range(40)] == \
               [full_sort_reference(logits, spec, p) for p in range(40)]


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_k=-1),
                                dict(top_p=0.0), dict(top_p=1.5), dict(temperature=1e9), dict(seed=2**64)])
def test_invalid_specs_are_protocol_violations(kw):
    with pytest.raises(ProtocolViolation):
        SamplingSpec(**kw)


def test_from_pb_defaults_and_round_trip():
    spec = SamplingSpec.from_pb(pb.SamplingParams())
    assert spec.greedy and spec.top_p == 1.0
    spec = SamplingSpec(temperature=0.5, top_k=7, top_p=0.75, seed=2**63 + 5)
    assert SamplingSpec.from_pb(spec.to_pb()) == spec


def test_logprobs_are_the_raw_log_softmax():
    logits = np.random.default_rng(2).normal(size=300).astype(np.float32) * 4
    lp, top = token_logprobs(logits, 17, 5)
    x = logits.astype(np.float64)
    ref = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    assert lp == pytest.approx(ref[17], abs=1e-12)
    assert [i for i, _ in top] == list(np.argsort(-ref, kind="stable")[:5])
    assert [v for _, v in top] == pytest.approx(sorted(ref, reverse=True)[:5], abs=1e-12)
    assert token_logprobs(logits, 3, 0)[1] == ()
    tied = np.zeros(10, np.float32)
    assert [i for i, _ in token_logprobs(tied, 0, 4)[1]] == [0, 1, 2, 3]   # ties to the lowest id


def test_top_logprobs_is_bounded_with_a_typed_error():
    assert check_top_logprobs(MAX_TOP_LOGPROBS) == MAX_TOP_LOGPROBS
    for bad in (MAX_TOP_LOGPROBS + 1, -1, True, 2.0):
        with pytest.raises(LimitExceeded):
            check_top_logprobs(bad)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(-50, 50, width=32), min_size=1, max_size=300),
       st.floats(0.05, 10), st.integers(0, 400), st.floats(0.01, 1.0), st.integers(0, 2**64 - 1),
       st.integers(0, 10**6))
def test_partial_selection_equals_the_full_sort(values, temperature, top_k, top_p, seed, position):
    logits = np.array(values, np.float32)
    spec = SamplingSpec(temperature, top_k, top_p, seed)
    token = sample_token(logits, spec, position)
    assert token == full_sort_reference(logits, spec, position)
    assert 0 <= token < len(values)
    if top_k:
        assert logits[token] >= np.sort(logits)[::-1][min(top_k, len(values)) - 1]
