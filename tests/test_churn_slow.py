"""Churn in a larger real swarm: 12 daemons, 4 SIGKILLed at once mid-generation.

Twelve real ``meshd join`` daemons on loopback (LocalSwarm) split the tiny
seeded 6-layer Llama: three fixed ranges (the entry 0:2, then 2:4 and 4:6)
and nine ``--layers auto`` joiners whose memory fits two layers, so the
tracker spreads them coverage-first and then by redundancy: every layer is
served by several peers.

One long greedy generation goes through the entry's control socket (as
``meshd generate`` does). Right after its first tokens, four daemons (each
with its worker: the machines are gone) are SIGKILLed together: every
server of one layer span the entry does not serve -- so the route's hop
there is among them and the kill opens a real coverage gap -- plus, when
that span has fewer than four, peers of the best-served other span (never
the last server of any other layer, never a layer-0 server: the entry and
the tracker stay). Then:

* the entry's driver fails over, finds no peer for the gap and waits (its
  refill wait) while the dead records expire, the tracker confirms the gap
  and moves a fully redundant auto node into it (plan_rebalance); the
  generation resumes with a re-prefill and its tokens equal the whole
  model's (shard/model/reference.py);
* a survivor's ``swarm`` view (what ``meshd status`` shows) reports full
  coverage with no killed peer in it, the gap served by a survivor that
  moved there, within a bounded wait.

Every wait is bounded; the whole test takes a few minutes on 2 busy cores.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from meshd.daemon.local_swarm import LocalSwarm, wait_for

pytestmark = pytest.mark.slow

NODES = 12
KILLED = 4
FIXED = ("0:2", "2:4", "4:6")     # the entry first: it is every other daemon's bootstrap peer
KV_TOKENS = 1024
# Two layers' weights and KV with the embeddings or the head, plus one batched forward's scratch
# (tests/test_swarm_e2e.py: the tracker gives such a node two layers of the 6-layer model).
LAYERS_MEMORY = 1_100_000
# Short records: a killed node leaves everyone's map after at most this long (the tracker can only
# see a gap once the dead servers' records expire).
RECORD_TTL_S = 10.0
# The entry's refill wait (--refill-wait): a record TTL, the tracker's gap confirmations (3 x 3 s),
# a worker load and the new record's propagation fit well inside it on a busy machine.
REFILL_WAIT_S = 150.0
START_TIMEOUT_S = 240
REFILL_TIMEOUT_S = 150
NEW_TOKENS = 400
KILL_AT_TOKEN = 4
PROMPT = "the swarm answers"


def memory_for(model) -> int:
    from meshd.plan.footprint import artifact_footprint

    return LAYERS_MEMORY + artifact_footprint(model, "churn").scratch_bytes(KV_TOKENS, tail=True)


@pytest.fixture(scope="module")
def model():
    from meshd.testing.models import build_random_llama

    return build_random_llama(seed=3)


@pytest.fixture(scope="module")
def whole(model):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from shard.model.reference import WholeModel

    torch.set_num_threads(1)
    return WholeModel(model), EntryTokenizer(model)


def expected_tokens(whole, n: int) -> list[int]:
    model, tok = whole
    tokens = model.generate(tok.encode_prompt(PROMPT, raw=True), n).tokens
    cut = next((i for i, t in enumerate(tokens) if t in tok.stop_ids), None)
    return tokens if cut is None else tokens[:cut + 1]


def generate(daemon, n: int, on_token=None) -> tuple[dict, list[float]]:
    done, times, prompt_tokens = None, [], None
    for event in daemon.generate(PROMPT, max_tokens=n, raw=True):
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


def choose_victims(ads: list[dict], entry_id: str, route_peers: list[str]) -> tuple[list[str], tuple[int, int]]:
    """KILLED peers whose death empties one layer span the entry does not serve (see the module doc)."""
    num_layers = max(a["end"] for a in ads)
    serving = {layer: {a["peer_id"] for a in ads if a["start"] <= layer < a["end"]} for layer in range(num_layers)}
    keep = {a["peer_id"] for a in ads if a["start"] == 0} | {entry_id}   # layer-0 servers: entry, tracker
    options = []
    for layer in range(num_layers):
        servers = serving[layer]
        if 2 <= len(servers) <= KILLED and not servers & keep:
            options.append((len(servers), layer, sorted(servers)))
    assert options, f"no layer span can be emptied by {KILLED} kills: {ads}"
    _, layer, victims = min(options)
    gap = [layer for layer in range(num_layers) if serving[layer] <= set(victims)]
    others = sorted((a for a in ads if a["peer_id"] not in keep and a["peer_id"] not in victims),
                    key=lambda a: (a["peer_id"] not in route_peers,
                                   -min(len(serving[layer]) for layer in range(a["start"], a["end"])), a["peer_id"]))
    for ad in others:
        if len(victims) == KILLED:
            break
        dead = set(victims) | {ad["peer_id"]}
        if all(len(serving[layer] - dead) >= 2 for layer in range(num_layers) if layer not in gap):
            victims.append(ad["peer_id"])   # its layers keep two servers: one gap only, a redundant mover left
    assert len(victims) == KILLED, (victims, ads)
    return victims, (min(gap), max(gap) + 1)


def test_twelve_daemons_survive_four_killed_at_once(model, whole, tmp_path_factory):
    t_start = time.monotonic()
    root = tmp_path_factory.mktemp("churn")
    swarm = LocalSwarm(root, model, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S,
                       extra=("--refill-wait", str(REFILL_WAIT_S)))
    try:
        entry = swarm.add(layers=FIXED[0], name="entry")
        for layers in FIXED[1:]:
            swarm.add(layers=layers)
        for _ in range(NODES - len(FIXED)):
            swarm.add(memory=memory_for(model))
        for d in swarm.daemons:
            swarm.wait_serving(d, START_TIMEOUT_S)
        before = swarm.wait_covered(60, peers=NODES, via=entry)
        t_ready = time.monotonic()
        print("ranges:", sorted((a["start"], a["end"]) for a in before["ads"]), "counts:",
              before["coverage"]["counts"])
        assert min(before["coverage"]["counts"]) >= 2          # redundancy: every layer has two servers or more

        expected = expected_tokens(whole, NEW_TOKENS)
        assert len(expected) > 3 * KILL_AT_TOKEN, "the reference stops too early to kill mid-generation"
        warm, _ = generate(entry, 8)
        assert warm["tokens"] == expected[:8] and not warm["failovers"]
        route_peers = [hop.split(":")[0] for hop in warm["route"]]
        victims, gap = choose_victims(before["ads"], before["peer_id"], route_peers)
        assert set(victims) & set(route_peers), (victims, route_peers)
        by_peer = {d.swarm()["peer_id"]: d for d in swarm.daemons}
        doomed = [by_peer[p] for p in victims]
        print("route:", warm["route"], "victims:", [p[-8:] for p in victims], "gap:", gap)

        killed_at: list[float] = []

        def kill(count: int) -> None:
            if count == KILL_AT_TOKEN and not killed_at:
                killed_at.append(time.monotonic())
                for d in doomed:   # all four machines at once: SIGKILL every daemon and worker, then reap
                    for pid in d.worker_pids():
                        _sigkill(pid)
                    _sigkill(d.proc.pid)
                for d in doomed:
                    d.kill()

        done, times = generate(entry, NEW_TOKENS, on_token=kill)
        t_done = time.monotonic()
        print("failovers:", json.dumps(done["failovers"], indent=1)[:4000])
        assert killed_at and done["tokens"] == expected
        failed = {f["failed_peer"] for f in done["failovers"]}
        assert failed & set(victims) and failed <= set(victims) | {a["peer_id"] for a in before["ads"]}
        assert all(f["position"] > done["prompt_tokens"] for f in done["failovers"])   # mid-decode
        final_route = [hop.split(":")[0] for hop in done["route"]]
        assert not set(final_route) & set(victims)
        after_kill = [t for t in times if t > killed_at[0]]
        stall = max(b - a for a, b in zip([killed_at[0], *after_kill], after_kill))

        survivors = [d for d in swarm.daemons if d not in doomed]
        observer = next(d for d in survivors if d is not entry)   # a survivor other than the entry

        def refilled():
            v = observer.swarm()
            if not v or not v["coverage"] or not v["coverage"]["fully_covered"]:
                return None
            return v if not {a["peer_id"] for a in v["ads"]} & set(victims) else None
        after = wait_for(refilled, "coverage without the killed peers", REFILL_TIMEOUT_S, observer)
        t_refilled = time.monotonic()
        old = {a["peer_id"]: (a["start"], a["end"]) for a in before["ads"]}
        movers = [a for a in after["ads"] if (a["start"], a["end"]) != old.get(a["peer_id"])
                  and a["start"] < gap[1] and gap[0] < a["end"]]
        assert movers, f"no survivor moved into the gap {gap}: {after['ads']}"
        assert all(a["peer_id"] in old for a in movers)           # survivors re-directed, no newcomer
        print("churn:", json.dumps({
            "nodes": NODES, "killed": KILLED, "gap": list(gap), "tokens_equal": True,
            "failovers": len(done["failovers"]), "start_s": round(t_ready - t_start, 1),
            "generation_s": round(t_done - killed_at[0], 1), "stall_s": round(stall, 1),
            "covered_s": round(t_refilled - killed_at[0], 1),
            "movers": [(a["peer_id"][-8:], old[a["peer_id"]], (a["start"], a["end"])) for a in movers],
            "counts_after": after["coverage"]["counts"], "total_s": round(time.monotonic() - t_start, 1)}))
    finally:
        swarm.close()
        keep = Path(tempfile.gettempdir()) / "meshd-churn-logs"   # for a post-mortem of a failed run
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir()
        for d in swarm.daemons:
            shutil.copy(d.log, keep / d.log.name)
    assert not any(d.alive() for d in swarm.daemons)


def _sigkill(pid: int) -> None:
    import os
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
