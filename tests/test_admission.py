"""Admission against real budgets, end to end through the route driver and the API's mapping.

Shards of the seeded random Llama in memory (real ShardServices, in-memory
transports): A serves [0,3), B [3,6) and C [2,6) (a more expensive replica of
B's layers).
A worker whose KV budget another peer's sessions fill refuses a new session
with RESOURCE_EXHAUSTED and a retry hint; the driver then takes the replica
(same greedy tokens); with every replica full it fails at once with
SwarmFull, which the API answers with 429 and Retry-After. The planner and the
worker size KV with the same setting.
"""
from __future__ import annotations

import os
import time

import pytest

from meshd.api.errors import api_error
from meshd.config import DEFAULT_KV_BUDGET_TOKENS, WorkerConfig
from meshd.daemon.worker_process import WorkerSpec
from meshd.generate.driver import GenerationRequest, PromptTooLarge, SwarmFull, collect
from meshd.generate.routes import LoadBook
from meshd.plan.assignment import JoinRequest
from meshd.reach.tls import load_or_create_tls
from shard.session.sessions import Owner, SessionKey, SessionPolicy
from tests._swarm_helpers import MemorySwarm, tiny_llama, whole_tokens

PROMPT = tuple(range(5, 37))
NEW_TOKENS = 8
HOG = Owner.of("noise:hog", os.urandom(32))


@pytest.fixture
def swarm():
    swarm = MemorySwarm()
    swarm.start("peer-a", 0, 3)
    swarm.start("peer-b", 3, 6)
    swarm.start("peer-c", 2, 6, cost=5.0)
    return swarm


@pytest.fixture
def shards(swarm):
    return swarm.shards


def fill(local) -> None:
    """Another peer's session takes the shard's whole KV budget (and keeps using it)."""
    m = local.service.manager
    m.open(SessionKey("hog", 0), m.policy.kv_budget_tokens, HOG)


def test_a_full_worker_refuses_and_the_driver_takes_the_replica(swarm, shards):
    fill(shards["peer-b"])
    driver = swarm.driver()
    tokens = collect(driver, GenerationRequest(PROMPT, NEW_TOKENS))
    assert tokens == whole_tokens(NEW_TOKENS, PROMPT)
    [failover] = driver.stats.failovers
    assert failover.failed_peer == "peer-b" and "RESOURCE_EXHAUSTED" in failover.detail
    assert [h.peer_id for h in driver.stats.routes[-1].hops] == ["peer-a", "peer-c"]
    assert shards["peer-b"].service.manager.past_len(SessionKey("hog", 0)) == 0   # the hog was not evicted


def test_every_replica_full_fails_at_once_with_a_retry_hint_and_the_api_says_429(swarm, shards):
    fill(shards["peer-b"])
    fill(shards["peer-c"])
    t0 = time.monotonic()
    with pytest.raises(SwarmFull) as err:
        collect(swarm.driver(), GenerationRequest(PROMPT, NEW_TOKENS))
    assert time.monotonic() - t0 < 20          # no replan wait: the peers said when to come back
    assert err.value.retry_after_ms > 0 and "full" in str(err.value)
    http = api_error(err.value)
    assert http.status == 429 and http.type == "rate_limit_error"
    assert int(http.headers()["retry-after"]) == -(-err.value.retry_after_ms // 1000)


def test_planned_kv_equals_admitted_kv_by_default(tmp_path):
    w = WorkerConfig()
    assert w.kv_budget_tokens == DEFAULT_KV_BUDGET_TOKENS
    assert JoinRequest("me", 1 << 30).kv_budget_tokens == w.kv_budget_tokens       # what the planner sizes
    spec = WorkerSpec(model=tmp_path, layers=(0, 3), run_dir=tmp_path,               # what the worker admits
                      tls=load_or_create_tls(tmp_path / "tls", "node"))
    cmd = spec.command(tmp_path / "ready.json")
    assert cmd[cmd.index("--kv-budget-tokens") + 1] == str(w.kv_budget_tokens)
    import argparse

    from meshd.cli.worker import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).kv_budget_tokens == w.kv_budget_tokens


def test_concurrent_generations_spread_over_replicas_by_the_entrys_load():
    # Two replicas of [3,6) with the same measured speed: B and C.
    swarm = MemorySwarm()
    made = [swarm.start("peer-a", 0, 3), swarm.start("peer-b", 3, 6), swarm.start("peer-c", 3, 6)]
    book = LoadBook()
    source = swarm.source(load=book)
    streams, tails = [], []
    for _ in range(4):   # four generations running at once (each holds its route after its first token)
        d = swarm.driver(source=source)
        gen = d.generate(GenerationRequest(PROMPT, NEW_TOKENS))
        next(gen)
        streams.append(gen)
        tails.append(d.stats.routes[-1].hops[-1].peer_id)
    assert sorted(tails) == ["peer-b", "peer-b", "peer-c", "peer-c"]
    assert book.snapshot() == {"peer-a": 4, "peer-b": 2, "peer-c": 2}
    assert [s.active_sessions() for s in made] == [4, 2, 2]
    for gen in streams:
        gen.close()
    assert book.snapshot() == {}


def test_a_generation_past_the_models_context_is_refused_at_once(swarm, shards):
    driver = swarm.driver()
    driver.context_tokens = len(PROMPT) + NEW_TOKENS - 1
    with pytest.raises(PromptTooLarge) as err:
        collect(driver, GenerationRequest(PROMPT, NEW_TOKENS))
    assert "context" in str(err.value) and api_error(err.value).status == 400
    assert driver.stats.routes == [] and all(s.active_sessions() == 0 for s in shards.values())
    driver.context_tokens = len(PROMPT) + NEW_TOKENS          # exactly the context: runs
    assert len(collect(driver, GenerationRequest(PROMPT, NEW_TOKENS))) == NEW_TOKENS


def test_a_prompt_over_every_replicas_whole_kv_budget_is_refused_at_once(swarm, shards):
    for peer in ("peer-b", "peer-c"):
        shards[peer].service.manager.policy = SessionPolicy(kv_budget_tokens=len(PROMPT))
    t0 = time.monotonic()
    driver = swarm.driver()
    driver.replan_wait_s = 30.0                                  # the daemon's wait: not spent here
    with pytest.raises(PromptTooLarge) as err:
        collect(driver, GenerationRequest(PROMPT, NEW_TOKENS))
    assert time.monotonic() - t0 < 20
    assert "KV budget" in str(err.value) and api_error(err.value).status == 400
    assert {e.failed_peer for e in driver.stats.failovers} == {"peer-b"}   # then C, the replica, refused too


def test_the_entry_reads_the_models_context(tmp_path):
    from meshd.plan.modelinfo import model_context_tokens
    from native.packaged import smollm2_gguf_path

    assert model_context_tokens(tiny_llama()) == 1024           # config.json max_position_embeddings
    assert model_context_tokens(smollm2_gguf_path()) == 8192    # GGUF context_length
    assert model_context_tokens(tmp_path) == 0                  # says nothing: unchecked
