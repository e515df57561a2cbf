"""Speculative decoding on a star route: the same tokens as plain decoding, rollback, failover.

Shards of the tiny seeded Llama in memory (tests/_swarm_helpers.py): A [0,3),
B [3,6), and C [2,6) as B's replacement. Drafters that are right by
construction (an oracle reading the plain run's tokens), wrong by
construction, right for a few tokens then wrong, and the prompt lookup
exercise acceptance of every length; the tokens must equal the plain
driver's (and, greedy, the whole model's) in every case.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from meshd.generate.draft import FixedDraftLength, PromptLookup
from meshd.generate.driver import collect
from meshd.generate.speculative import SpeculativeDriver
from proto.errors import ProtocolError
from proto.frames import parse_request
from shard.model.sampling import SamplingSpec
from tests._swarm_helpers import PROMPT, MemorySwarm, whole_tokens
from tests._swarm_helpers import request as make_request

NEW_TOKENS = 24


# -- verify through a route -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm():
    swarm = MemorySwarm()
    swarm.start("peer-a", 0, 3)
    swarm.start("peer-b", 3, 6)
    swarm.start("peer-c", 2, 6, cost=5.0)
    return swarm


@dataclass
class Scripted:
    """Drafts the reference tokens (the first ``right`` of each draft), then wrong ones."""

    reference: Sequence[int]
    right: int = 99
    name: str = "scripted"

    def draft(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        at = len(history) - len(PROMPT)
        ahead = list(self.reference[at:at + k])
        return tuple(t if i < self.right else t - 1 if t else 1 for i, t in enumerate(ahead))


def spec_driver(swarm, drafter, k=4, **kw) -> SpeculativeDriver:
    return SpeculativeDriver(swarm.source(), swarm.connector(), fingerprint=swarm.fingerprint, replan_wait_s=0.0,
                             drafter=drafter, policy=FixedDraftLength(k), **kw)


def plain(swarm, **kw) -> list[int]:
    return collect(swarm.driver(), make_request(NEW_TOKENS, **kw))


@pytest.mark.parametrize("right", [99, 0, 2])
def test_greedy_tokens_equal_plain_decoding(swarm, right):
    reference = whole_tokens(NEW_TOKENS)
    assert plain(swarm) == reference
    driver = spec_driver(swarm, Scripted(reference, right))
    assert collect(driver, make_request(NEW_TOKENS)) == reference
    s = driver.spec
    assert s.verify_steps and s.accepted == sum(s.accepted_per_step)
    if right == 99:
        assert all(a == 4 for a in s.accepted_per_step[:-1]) and s.tokens_per_round_trip > 4
    else:
        assert set(s.accepted_per_step[:-1]) == {right}      # the last step drafts what the budget leaves
    assert swarm.idle()


def test_prompt_lookup_on_the_model_gives_the_plain_tokens(swarm):
    prompt = PROMPT + PROMPT[:10]                 # something to look up
    reference = plain(swarm, prompt=prompt)
    driver = spec_driver(swarm, PromptLookup(), k=5)
    assert collect(driver, make_request(NEW_TOKENS, prompt=prompt)) == reference
    assert driver.spec.verify_steps


@pytest.mark.parametrize("right", [99, 1])
def test_seeded_sampling_tokens_equal_plain_decoding(swarm, right):
    sampling = SamplingSpec(temperature=0.9, top_p=0.95, seed=1234)
    reference = plain(swarm, sampling=sampling)
    driver = spec_driver(swarm, Scripted(reference, right), k=3)
    assert collect(driver, make_request(NEW_TOKENS, sampling=sampling)) == reference
    assert driver.spec.accepted


def test_stop_token_inside_the_accepted_drafts_ends_the_generation(swarm):
    reference = whole_tokens(NEW_TOKENS)
    stop = reference[6]
    cut = reference[:reference.index(stop) + 1]
    driver = spec_driver(swarm, Scripted(reference), k=8)
    assert collect(driver, make_request(NEW_TOKENS, stop_ids=frozenset({stop}))) == cut
    assert swarm.idle()


def _verify_chunk_at(position: int):
    def match(body: bytes) -> bool:
        try:
            req = parse_request(body)
        except ProtocolError:
            return False
        return (req.WhichOneof("kind") == "chunk" and req.chunk.envelope.HasField("verify")
                and req.chunk.envelope.position.first_position == position)
    return match


@pytest.mark.parametrize("right", [99, 2])
def test_middle_hop_killed_mid_verify_fails_over_with_identical_tokens(right):
    swarm = MemorySwarm()
    swarm.start("peer-a", 0, 3)
    swarm.start("peer-b", 3, 6)
    swarm.start("peer-c", 2, 6, cost=5.0)
    reference = whole_tokens(NEW_TOKENS)
    driver = spec_driver(swarm, Scripted(reference, right), k=4)
    # the third verify step: two verify chunks (with rolled-back drafts) are history by then
    position = len(PROMPT) + 2 * (min(right, 4) + 1)
    swarm["peer-b"].hop.kill_on(_verify_chunk_at(position))
    assert collect(driver, make_request(NEW_TOKENS)) == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b"
    assert [h.peer_id for h in driver.stats.routes[-1].hops] == ["peer-a", "peer-c"]
    assert swarm.idle("peer-a", "peer-c")


def test_logprobs_fall_back_to_plain_steps(swarm):
    reference = whole_tokens(NEW_TOKENS)
    driver = spec_driver(swarm, Scripted(reference))
    assert [t.id for t in driver.generate(make_request(NEW_TOKENS, logprobs=True))] == reference
    assert driver.spec.verify_steps == 0


def test_concurrent_speculative_generations_equal_each_alone():
    """Batching on (the workers' default): verify chunks of several routes share forwards with each
    other's rows; every generation's tokens still equal the same request run alone."""
    import threading

    swarm = MemorySwarm()
    swarm.start("peer-a", 0, 3)
    swarm.start("peer-b", 3, 6)
    prompts = [PROMPT, PROMPT[::-1], PROMPT[:20] * 2, tuple(range(100, 130))]
    alone = [collect(spec_driver(swarm, PromptLookup(), k=3), make_request(NEW_TOKENS, prompt=p)) for p in prompts]
    together: list[list[int] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            together[i] = collect(spec_driver(swarm, PromptLookup(), k=3), make_request(NEW_TOKENS, prompt=prompts[i]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and together == alone
    assert swarm.idle()


def test_two_fresh_hops_over_a_new_boundary_replay_the_verify_chunks_exactly():
    """B [3,6) dies mid-verify; its replacement is D [2,4) entering at 3 and E [4,6): boundary 4 never
    existed, so D's replay of every verify chunk (rejected drafts too) must feed E."""
    swarm = MemorySwarm()
    swarm.start("peer-a", 0, 3)
    swarm.start("peer-b", 3, 6)
    swarm.start("peer-d", 2, 4)
    swarm.start("peer-e", 4, 6)
    reference = whole_tokens(NEW_TOKENS)
    driver = spec_driver(swarm, Scripted(reference, 1), k=3)
    swarm["peer-b"].hop.kill_on(_verify_chunk_at(len(PROMPT) + 3 * 2))
    assert collect(driver, make_request(NEW_TOKENS)) == reference
    (event,) = driver.stats.failovers
    assert [(h.peer_id, h.effective_start) for h in driver.stats.routes[-1].hops] == [
        ("peer-a", 0), ("peer-d", 3), ("peer-e", 4)]
    assert swarm.idle("peer-a", "peer-d", "peer-e")
