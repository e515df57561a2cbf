"""Failover through real ``meshd join`` daemons on token-only tails: killed and frozen hops.

Six daemons with fixed ranges of the tiny seeded Llama (6 layers): the entry
serves 0:2, three serve 2:4 and two serve 4:6, so the middle and the tail
are redundant. Generations go through the entry's control socket, exactly as
``meshd generate`` does; the tail sends back only the token.

* greedy: the middle hop's daemon is SIGKILLed after the first token; the
  tokens equal the whole model's;
* seeded sampling: the TAIL's daemon is SIGKILLed mid-decode; the replacement
  tail draws the same tokens (the draw for position p is a pure function of
  (seed, p)), equal to the whole model sampled the same way;
* a middle hop frozen with SIGSTOP (daemon and worker: a suspended machine)
  mid-decode is cut by its step deadline and replaced; the tokens are the
  same and the stall (SIGSTOP -> next token) stays under 5 s.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from meshd.daemon.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow

KV_TOKENS = 1024
RECORD_TTL_S = 12.0
START_TIMEOUT_S = 300
PROMPT = "the swarm answers"
SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7}
# A user-visible stall bound for a frozen hop (the target).
MAX_FROZEN_STALL_S = 5.0


@pytest.fixture(scope="module")
def swarm(model, tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("failover"), model, kv_budget_tokens=KV_TOKENS,
                   record_ttl_s=RECORD_TTL_S)
    stopped: list[int] = []
    s.stopped = stopped
    try:
        for layers in ("0:2", "2:4", "2:4", "2:4", "4:6", "4:6"):
            s.add(layers=layers)
        for d in s.daemons:
            s.wait_serving(d, START_TIMEOUT_S)
        s.wait_covered(120, peers=6)
        yield s
    finally:
        for pid in stopped:              # a frozen process is woken before it is stopped for good
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        s.close()
        for d in s.daemons:
            assert not d.alive()


@pytest.fixture(scope="module")
def whole(model):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from shard.model.reference import WholeModel

    torch.set_num_threads(1)
    return WholeModel(model), EntryTokenizer(model)


def expected_tokens(whole, n: int, sampling=None) -> list[int]:
    from shard.model.sampling import SamplingSpec

    model, tok = whole
    spec = SamplingSpec(**sampling) if sampling else None
    tokens = model.generate(tok.encode_prompt(PROMPT, raw=True), n, sampling=spec).tokens
    cut = next((i for i, t in enumerate(tokens) if t in tok.stop_ids), None)
    return tokens if cut is None else tokens[:cut + 1]


def generate(daemon, n: int, on_token=None, **params) -> tuple[dict, list[float]]:
    done, times, prompt_tokens = None, [], None
    for event in daemon.generate(PROMPT, max_tokens=n, raw=True, **params):
        if event.get("event") == "start":
            prompt_tokens = event["prompt_tokens"]
        if "token" in event:
            times.append(time.monotonic())
            if on_token is not None:
                on_token(len(times))
        if event.get("done"):
            done = event
    assert done is not None
    return {**done, "prompt_tokens": prompt_tokens}, times


def daemon_of(swarm, peer_id: str):
    return next(d for d in swarm.daemons if d.alive() and (d.swarm() or {}).get("peer_id") == peer_id)


def node_pids(daemon) -> list[int]:
    """The daemon and its worker (its children)."""
    return [daemon.proc.pid, *daemon.worker_pids()]


def entry_of(swarm):
    """The only daemon serving layer 0, once its view holds no record of a daemon killed before
    (records outlive their node by up to RECORD_TTL_S; a route through one fails over at once,
    which would be a second failover in the counts below)."""
    from meshd.daemon.local_swarm import wait_for

    entry = swarm.daemons[0]
    alive = sum(d.alive() for d in swarm.daemons)
    wait_for(lambda: len((entry.swarm() or {}).get("ads", ())) == alive, "the dead daemons' records to expire",
             3 * RECORD_TTL_S, entry)
    return entry


def test_greedy_tokens_survive_a_killed_middle_hop(swarm, whole):
    n = 200
    expected = expected_tokens(whole, n)
    assert len(expected) > 10, "the reference stopped too early to test a failure mid-decode"
    entry = entry_of(swarm)
    plain, _ = generate(entry, n)
    assert plain["tokens"] == expected and not plain["failovers"]
    assert plain["tail_bytes_per_decode_step"] <= 64
    victim = daemon_of(swarm, plain["route"][1].split(":")[0])
    killed = []

    def kill(count: int) -> None:
        if count == 1 and not killed:
            victim.kill()
            killed.append(time.monotonic())

    done, _ = generate(entry, n, on_token=kill)
    print("greedy failover:", done["failovers"])
    assert done["tokens"] == expected
    assert len(done["failovers"]) == 1 and done["failovers"][0]["position"] > done["prompt_tokens"]  # mid-decode
    assert done["tail_bytes_per_decode_step"] <= 64


def test_seeded_sampling_survives_a_killed_tail(swarm, whole):
    n = 200
    expected = expected_tokens(whole, n, SAMPLING)
    assert len(expected) > 10
    entry = entry_of(swarm)
    plain, _ = generate(entry, n, **SAMPLING)
    assert plain["tokens"] == expected           # the tail's counter-based draw = the same draw in one process
    victim = daemon_of(swarm, plain["route"][-1].split(":")[0])
    killed = []

    def kill(count: int) -> None:
        if count == 3 and not killed:
            victim.kill()
            killed.append(time.monotonic())

    done, _ = generate(entry, n, on_token=kill, **SAMPLING)
    print("sampled failover:", done["failovers"])
    assert done["tokens"] == expected
    assert len(done["failovers"]) == 1 and done["failovers"][0]["failed_peer"] == plain["route"][-1].split(":")[0]
    assert done["route"][-1] != plain["route"][-1]      # another tail drew the rest
    assert done["tail_bytes_per_decode_step"] <= 64


def test_a_frozen_middle_hop_is_replaced_within_seconds(swarm, whole):
    n = 400
    expected = expected_tokens(whole, n)
    entry = entry_of(swarm)
    plain, _ = generate(entry, 4)
    victim = daemon_of(swarm, plain["route"][1].split(":")[0])
    pids = node_pids(victim)
    assert len(pids) == 2, pids                  # the daemon and its worker
    stopped_at: list[float] = []

    def freeze(count: int) -> None:
        if count == 3 and not stopped_at:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            swarm.stopped.extend(pids)
            stopped_at.append(time.monotonic())

    try:
        done, times = generate(entry, n, on_token=freeze)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        victim.kill()
    stall = times[3] - stopped_at[0]
    print(f"frozen hop: stall {stall:.2f} s; failovers {done['failovers']}")
    assert done["tokens"] == expected
    (event,) = done["failovers"]
    assert event["failed_peer"] == plain["route"][1].split(":")[0] and "step deadline" in event["detail"]
    assert stall < MAX_FROZEN_STALL_S
