"""The DHT simulation: 1,000 nodes of the product's Kademlia core on a virtual clock.

dht/kademlia/scenario.py on dht/kademlia/sim.py: nodes join through one
bootstrap node, publish signed records, read them, 20% of them die at once
and the survivors republish within one interval; 10% are NAT'd, 10% slow.
Every verdict is on virtual time and the trace is a function of the seed, so
no verdict depends on this machine's load. A seed runs twice: here, and at
the same time in another process (with another hash seed) through
``meshd bench dht --sim --json``, at TWIN_NODES nodes (a second 1,000-node
run would double the module's 45 s of CPU); the two reports and traces must
be equal, and another seed's trace must differ.

The network's own rules (a dead peer refuses after a round trip, a NAT'd one
never answers a dial, a slow one is cut by the deadline, peers meet in each
other's tables when a connection comes up, NAT'd ones never) are checked on
small networks, at exact virtual times.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import trio

from dht.kademlia import ops
from dht.kademlia.book import DIAL_TIMEOUT_S, RPC_TIMEOUT_S
from dht.kademlia.scenario import RECORD_TTL_S, SimConfig, identity, simulate
from dht.kademlia.sim import DIAL_ROUND_TRIPS, Network, run_on_mock_clock
from meshd.testing.procs import REPO_ROOT, child_env

NODES = 1000
SEED = 1
TWIN_NODES = 200
# How long the twin process may take beyond this process's run of the same (seconds of CPU each).
TWIN_TIMEOUT_S = 100
# Wall and CPU seconds are the machine's; every other key is the simulation's.
MACHINE_KEYS = {"wall_s", "cpu_s"}


@pytest.fixture(scope="module")
def report():
    return simulate(SimConfig(nodes=NODES, seed=SEED))


def test_every_record_is_found_within_log_n_plus_two_rounds(report):
    print(json.dumps(report, sort_keys=True))
    assert report["nodes"] == NODES and report["reads"] == 50 * 10
    assert report["found_fraction"] == 1.0
    assert report["round_bound"] == math.ceil(math.log2(NODES)) + 2 == 12
    assert report["max_lookup_rounds"] <= report["round_bound"]
    assert report["max_lookup_rounds_after_churn"] <= report["round_bound"]
    assert (report["nat_nodes"], report["slow_nodes"]) == (100, 100)
    assert report["min_record_replicas_before"] >= 20          # k = 20: every record at its k closest


def test_after_a_fifth_of_the_nodes_die_the_views_are_complete_again_within_one_republish_interval(report):
    assert report["killed_nodes"] == NODES // 5
    assert report["republish_interval_s"] == RECORD_TTL_S / 3
    assert report["churn_converged_s"] is not None
    assert 0 < report["churn_converged_s"] <= report["republish_interval_s"]      # virtual seconds
    assert report["complete_after_republish"] and report["missing_after_republish"] == 0
    assert report["min_record_replicas_after_republish"] >= 20


def test_the_same_seed_gives_the_same_trace_in_another_process_and_another_seed_another():
    env = child_env()
    env["PYTHONHASHSEED"] = "12345"      # set and str hashes differ from this process's
    twin = subprocess.Popen([sys.executable, "-m", "meshd", "bench", "dht", "--sim", "--nodes", str(TWIN_NODES),
                             "--seed", str(SEED), "--json"], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        here = simulate(SimConfig(nodes=TWIN_NODES, seed=SEED))
        out, err = twin.communicate(timeout=TWIN_TIMEOUT_S)
    finally:
        if twin.poll() is None:
            twin.kill()
            twin.wait()
    assert twin.returncode == 0, err[-3000:]
    there = json.loads(out)
    assert len(here["trace_digest"]) == 64 and here["found_fraction"] == 1.0
    assert {k: v for k, v in there.items() if k not in MACHINE_KEYS} == \
        {k: v for k, v in here.items() if k not in MACHINE_KEYS}
    assert simulate(SimConfig(nodes=TWIN_NODES, seed=SEED + 1))["trace_digest"] != here["trace_digest"]


def test_the_simulation_uses_the_daemons_record_ttl():
    from meshd.config import DEFAULT_RECORD_TTL_S

    assert RECORD_TTL_S == DEFAULT_RECORD_TTL_S


@pytest.mark.parametrize("bad", [dict(nodes=1), dict(churn_fraction=1.0), dict(nat_fraction=-0.1),
                                 dict(readers_per_model=0)])
def test_a_bad_configuration_is_refused(bad):
    with pytest.raises(ValueError):
        SimConfig(**bad)


# ------------------------------------------------------------------------------ the network's rules

def _network(count: int, *, nat=frozenset(), slow=frozenset()) -> Network:
    return Network([identity(99, i).peer_id_bytes for i in range(count)], seed=5, nat=nat, slow=slow)


def _run(net: Network, script) -> object:
    """Run ``script(net)`` (an async function) on the simulation's clock; its result."""
    async def main(clock):
        net.attach(clock)
        return await script(net)

    return run_on_mock_clock(main)


async def _ask(net: Network, a: int, b: int) -> tuple[ops.Outcome, float]:
    """One GET from ``a`` to ``b``: its outcome and how long it took (virtual seconds)."""
    got: list = []
    start = net.now

    def one():
        return (yield ops.Get(b, b"/meshd/model/x"))

    net.start(net.nodes[a], one(), got.append)
    await net.run_until(math.inf, stop=lambda: bool(got))
    assert trio.current_time() == pytest.approx(net.now)       # trio's clock is the virtual one
    return got[0], net.now - start


def test_a_dial_connects_both_tables_and_an_answer_comes_after_the_handshake_and_a_round_trip():
    net = _network(3)

    async def script(net):
        out, took = await _ask(net, 0, 1)
        rtt = 2 * net.links.one_way(0, 1)
        assert out.kind == ops.ANSWERED and out.connected and took == pytest.approx((DIAL_ROUND_TRIPS + 1) * rtt)
        assert 1 in net.nodes[0].table and 0 in net.nodes[1].table and 2 not in net.nodes[0].table
        out, took = await _ask(net, 0, 1)                        # connected: one round trip
        assert took == pytest.approx(rtt)

    _run(net, script)


def test_a_dead_peer_refuses_after_a_round_trip_and_a_nat_peer_never_answers_a_dial():
    net = _network(4, nat=frozenset({3}))

    async def script(net):
        net.kill([2])
        out, took = await _ask(net, 0, 2)
        assert (out.kind, out.connected) == (ops.FAILED, False) and took == pytest.approx(2 * net.links.one_way(0, 2))
        out, took = await _ask(net, 0, 3)
        assert (out.kind, out.connected) == (ops.TIMED_OUT, False) and took == pytest.approx(DIAL_TIMEOUT_S)
        out, _ = await _ask(net, 3, 0)                           # a NAT'd peer dials out
        assert out.kind == ops.ANSWERED and 3 not in net.nodes[0].table and 0 in net.nodes[3].table
        out, _ = await _ask(net, 0, 3)                           # and is reached over its connection
        assert out.kind == ops.ANSWERED

    _run(net, script)


def test_a_slow_peer_is_cut_by_the_callers_deadline_on_a_live_connection():
    net = _network(2, slow=frozenset({1}))

    async def script(net):
        await _ask(net, 0, 1)                                    # connect
        outcomes = [await _ask(net, 0, 1) for _ in range(40)]
        late = [took for out, took in outcomes if out.kind == ops.TIMED_OUT]
        assert late and all(out.connected for out, _ in outcomes)
        assert all(took >= RPC_TIMEOUT_S for took in late)       # each at its deadline, never before

    _run(net, script)


def test_a_killed_peers_rpcs_in_flight_fail_when_the_reset_arrives():
    net = _network(2)

    async def script(net):
        await _ask(net, 0, 1)                                    # connected
        got: list = []

        def one():
            return (yield ops.Get(1, b"/meshd/model/x"))

        net.start(net.nodes[0], one(), got.append)
        await net.run_until(net.now + net.links.one_way(0, 1) / 2)     # the request is on its way
        killed_at = net.now
        net.kill([1])
        await net.run_until(math.inf, stop=lambda: bool(got))
        assert (got[0].kind, got[0].connected) == (ops.FAILED, False)
        assert net.now == pytest.approx(killed_at + net.links.one_way(0, 1))
        assert 1 not in net.nodes[0].conns

    _run(net, script)
