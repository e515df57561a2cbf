"""Drafters and the adaptive draft length (speculative decoding; pure, no model)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.generate.draft import DraftPolicy, FixedDraftLength, PromptLookup, expected_tokens
from proto.errors import LocalError
from proto.limits import MAX_DRAFT_TOKENS


# -- drafters -----------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=60), st.integers(0, MAX_DRAFT_TOKENS),
       st.integers(1, 4))
def test_prompt_lookup_drafts_what_followed_an_earlier_occurrence(history, k, max_ngram):
    draft = PromptLookup(max_ngram=max_ngram).draft(history, k)
    assert len(draft) <= k
    if not draft:
        return
    # some n-gram ending the history occurred earlier, and the draft is what followed it there
    ok = False
    for n in range(1, max_ngram + 1):
        for i in range(len(history) - n):
            if history[i:i + n] == history[-n:] and tuple(history[i + n:i + n + len(draft)]) == draft:
                ok = True
    assert ok


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12, unique=True), st.integers(2, 5),
       st.integers(1, MAX_DRAFT_TOKENS))
def test_prompt_lookup_continues_a_repeated_run(pattern, reps, k):
    history = pattern * reps
    draft = PromptLookup().draft(history, k)
    assert draft == tuple((pattern * 2)[:min(k, len(pattern))])


@given(st.lists(st.integers(0, 10**6), max_size=50, unique=True), st.integers(0, MAX_DRAFT_TOKENS))
def test_prompt_lookup_without_a_repeat_has_no_guess(history, k):
    assert PromptLookup().draft(history, k) == ()


def test_prompt_lookup_bounds():
    with pytest.raises(LocalError):
        PromptLookup().draft([1, 2, 1], MAX_DRAFT_TOKENS + 1)
    with pytest.raises(LocalError):
        PromptLookup(max_ngram=0)
    with pytest.raises(LocalError):
        PromptLookup(window=2)
    history = [7, 8, 9] + list(range(100, 200)) + [7, 8]
    assert PromptLookup(window=200).draft(history, 2) == (9, 100)
    assert PromptLookup(window=50).draft(history, 2) == ()      # the earlier run is outside the window


# -- the draft length ------------------------------------------------------------------------------
def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)


def test_policy_measures_a_plain_step_first_then_drafts_where_round_trips_dominate():
    policy = DraftPolicy()
    assert policy.next_k() == 0
    policy.observe_plain(0.150)                 # three 50 ms legs, ~1 ms of compute
    assert policy.next_k() == policy.k_start
    for _ in range(10):
        policy.observe_verify(4, 4, 0.154)      # every draft right, 1 ms per extra position
    assert policy.next_k() == policy.k_max


def test_policy_starts_off_where_the_hops_compute_most_of_a_step():
    policy = DraftPolicy(probe_every=4)
    policy.observe_plain(0.010, compute_s=0.008)    # loopback: 80 % of the step is the hops' forward
    assert policy.next_k() == 0
    for _ in range(4):
        policy.observe_plain(0.010, compute_s=0.008)
    assert policy.next_k() == policy.k_start       # the probe measures what a verify step costs


def test_policy_turns_itself_off_where_compute_dominates_and_probes_again():
    policy = DraftPolicy(probe_every=3)
    policy.observe_plain(0.010)                 # loopback: the step is all compute
    for _ in range(5):
        policy.observe_verify(4, 1, 0.050)      # each extra position costs as much as a step
    assert policy.best_k() == 0
    assert policy.next_k() == 0
    for _ in range(3):
        policy.observe_plain(0.010)
    assert policy.next_k() == policy.k_start    # the probe
    policy.observe_verify(4, 0, 0.050)
    assert policy.next_k() == 0
    probes = []
    for step in range(200):                     # the gap doubles after each probe that did not pay
        k = policy.next_k()
        if k:
            probes.append(step)
            policy.observe_verify(k, 0, 0.050)
        else:
            policy.observe_plain(0.010)
    assert [b - a for a, b in zip(probes, probes[1:])] == [13, 25, 49, 97][:len(probes) - 1]


def test_policy_rejects_nonsense():
    with pytest.raises(LocalError):
        DraftPolicy(k_start=0)
    with pytest.raises(LocalError):
        DraftPolicy(k_max=MAX_DRAFT_TOKENS + 1)
    with pytest.raises(LocalError):
        DraftPolicy().observe_verify(2, 3, 0.1)
    with pytest.raises(LocalError):
        FixedDraftLength(-1)


def test_drafter_pool_leases_one_per_generation_and_falls_back_to_prompt_lookup(tmp_path):
    from meshd.generate.draft import DrafterPool

    made = []

    def make(path):
        made.append(PromptLookup(max_ngram=2, name=f"model-{len(made)}"))
        return made[-1]

    pool = DrafterPool(tmp_path / "draft.gguf", size=2, make=make)
    with pool.lease() as a, pool.lease() as b, pool.lease() as c:
        assert {a.name, b.name} == {"model-0", "model-1"} and c.name == "prompt-lookup"
    with pool.lease() as again:
        assert again.name in {"model-0", "model-1"} and len(made) == 2   # reused, not rebuilt
    with pytest.raises(LocalError):
        DrafterPool(tmp_path, size=0)
