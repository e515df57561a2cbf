"""Zero-config LAN swarms (mDNS), scoped by a swarm name: REAL daemons on one bridge.

Topology (tests/_lan_netns.py): four namespaces on one Ethernet bridge, no
default route, no NAT: a home LAN. Every daemon runs ``meshd join`` with the
defaults for the network -- no ``--listen`` (all interfaces, port 4001), no
``--advertise-host``, and no ``--bootstrap`` except where a test of the
scoping needs one -- on one seeded model file:

  * A and B: no ``--swarm`` (swarm "default"). A serves layers [0, 3); B joins
    with ``--layers auto --memory 1GiB`` and gets a range covering the gap from
    A, the tracker.
  * C: ``--swarm red``, the whole model on one node.
  * D: ``--swarm red --layers none`` (client-only), bootstrapped by hand to A,
    a node of the other swarm: connected, but no DHT between them.

Checks, each a bounded wait on a condition: A and B find each other by mDNS and
their swarm covers every layer; each node's mDNS saw the other swarm's
announcements and ignored them (the multicast crossed the bridge); greedy
tokens through A and through D equal the whole model's; A's and B's views hold
only A and B, C's and D's only C; A and C never connect; D's foreign bootstrap
peer is named in its log and A lists D as a connected peer of another swarm;
the wildcard listeners' dial-back probes found them reachable on their LAN
addresses.
If namespaces cannot be created the test FAILS and says why.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshd.daemon.local_swarm import REPO_ROOT, LocalDaemon, child_env, wait_for
from tests._lan_netns import new_lan
from tests._netns import NetnsUnavailable

pytestmark = pytest.mark.netns

# Every wait below is on a condition; this only bounds a run that went wrong.
WAIT_S = 90
PROMPT = "two households share one LAN"
NEW_TOKENS = 12


class LanDaemon(LocalDaemon):
    """``meshd join`` on one machine of the LAN, with the network defaults (no --listen)."""

    def __init__(self, root: Path, name: str, model: Path, *, prefix: list[str], layers: str,
                 extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.data_dir = root / name
        self.log = root / f"{name}.log"
        args = [*prefix, sys.executable, "-m", "meshd", "join", "--model", str(model), "--layers", layers,
                "--data-dir", str(self.data_dir), "--record-ttl", "8", "--api-listen", "off", "--threads", "1",
                *extra]
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=child_env(1), stdout=self._log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def peer_id(self) -> str:
        return wait_for(lambda: (m := re.search(r"peer id (\S+)", self.text())) and m.group(1),
                        f"{self.name}'s peer id", WAIT_S, self)

    def status(self) -> dict:
        return wait_for(lambda: self.query("status"), f"{self.name}'s status", WAIT_S, self)


def _generate(d: LocalDaemon) -> dict:
    done = None
    for event in d.generate(PROMPT, max_tokens=NEW_TOKENS, raw=True):
        if event.get("done"):
            done = event
        assert "error" not in event, event
    assert done is not None
    return done


def test_two_swarms_on_one_lan_find_their_own_and_stay_apart(tmp_path):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.testing.models import build_random_llama
    from shard.model.reference import WholeModel

    torch.set_num_threads(1)
    model = build_random_llama(seed=0)
    lan = new_lan(4)
    daemons: list[LanDaemon] = []
    started = time.monotonic()
    try:
        try:
            lan.up()
        except NetnsUnavailable as exc:
            pytest.fail(f"cannot build the LAN: {exc}")
        a = LanDaemon(tmp_path, "A", model, prefix=lan.prefix(1), layers="0:3")
        c = LanDaemon(tmp_path, "C", model, prefix=lan.prefix(3), layers="0:6", extra=("--swarm", "red"))
        b = LanDaemon(tmp_path, "B", model, prefix=lan.prefix(2), layers="auto", extra=("--memory", "1GiB"))
        daemons += [a, c, b]
        # the whole model's greedy tokens, computed while the daemons start
        tok = EntryTokenizer(model)
        ids = tok.encode_prompt(PROMPT, raw=True)
        expected = WholeModel(model).generate(ids, NEW_TOKENS).tokens
        cut = next((i for i, t in enumerate(expected) if t in tok.stop_ids), None)
        expected = expected if cut is None else expected[:cut + 1]
        a_id, b_id, c_id = a.peer_id(), b.peer_id(), c.peer_id()
        wait_for(lambda: "mdns: announcing" in a.text(), "A to announce itself", WAIT_S, a)
        d = LanDaemon(tmp_path, "D", model, prefix=lan.prefix(4), layers="none",
                      extra=("--swarm", "red", "--bootstrap", f"/ip4/{lan.ip(1)}/tcp/4001/p2p/{a_id}"))
        daemons.append(d)
        d_id = d.peer_id()

        def complete(node: LanDaemon, members: set[str]):
            v = node.swarm()
            return v if v and v.get("serving", True) and (v.get("coverage") or {}).get("fully_covered") \
                and {ad["peer_id"] for ad in v["ads"]} == members else None

        view_b = wait_for(lambda: complete(b, {a_id, b_id}), "B to take the gap and the swarm to cover it", WAIT_S, b)
        # B's range came from A's directive, or -- when A's worker was not ready within B's grace --
        # from B's own plan; either way it covers the gap
        assert view_b["layers"][0] <= 3 and view_b["layers"][1] == 6 and view_b["tracker"] in (a_id, b_id), view_b
        wait_for(lambda: complete(a, {a_id, b_id}), "A to see the whole default swarm", WAIT_S, a)
        wait_for(lambda: complete(c, {c_id}), "C to serve the red swarm", WAIT_S, c)
        wait_for(lambda: (v := d.swarm()) and (v.get("coverage") or {}).get("fully_covered") and v,
                 "D to see the red swarm", WAIT_S, d)

        def mdns_of(node: LanDaemon) -> dict:
            return node.status()["discovery"]["mdns"]

        # the multicast crossed the bridge: each node saw the other swarm's announcements, and
        # ignored them; the default swarm found itself by mDNS (no --bootstrap anywhere)
        for node, machine in ((a, 1), (b, 2), (c, 3), (d, 4)):
            got = wait_for(lambda n=node: (m := mdns_of(n)) and m["ignored"].get("other_swarm", 0) >= 2 and m,
                           f"{node.name} to see the other swarm's two announcements", WAIT_S, node)
            assert got["state"] == "on" and got["announced"] == [f"/ip4/{lan.ip(machine)}/tcp/4001"], got
        found_by_b = {p["peer_id"]: p for p in mdns_of(b)["peers"]}
        assert found_by_b[a_id]["addrs"] == [f"/ip4/{lan.ip(1)}/tcp/4001"], found_by_b
        assert {p["peer_id"] for p in mdns_of(c)["peers"]} == {d_id}
        assert {p["peer_id"] for p in mdns_of(a)["peers"]} == {b_id}

        # one swarm serves a generation equal to the whole model, and so does the other
        through_a = _generate(a)
        assert through_a["tokens"] == expected, (through_a, expected)
        assert {h.split(":")[0] for h in through_a["route"]} <= {a_id, b_id}, through_a["route"]
        through_d = _generate(d)
        assert through_d["tokens"] == expected and [h.split(":")[0] for h in through_d["route"]] == [c_id]

        # apart: views, connections, and the foreign peer D brought in by hand
        for node, members in ((a, {a_id, b_id}), (b, {a_id, b_id}), (c, {c_id}), (d, {c_id})):
            assert {ad["peer_id"] for ad in node.swarm()["ads"]} == members, node.name
            coverage = node.status()["coverage"]
            assert {e["peer_id"] for entries in coverage.values() for e in entries} == members, node.name
        assert c_id not in a.status()["peers"] and a_id not in c.status()["peers"]
        assert "is not in swarm 'red'" in d.text() and a_id in d.text()
        foreign = wait_for(lambda: (f := a.status()["discovery"]["foreign_peers"]) and f,
                           "A to list D as a peer of another swarm", WAIT_S, a)
        assert foreign == [d_id]
        status_a = a.status()["discovery"]
        assert status_a["swarm"]["name"] == "default" and c.status()["discovery"]["swarm"]["name"] == "red"
        # listening on 0.0.0.0 with no --advertise-host: peers dialed the LAN address back
        for node in (a, b):   # the dial-back probe runs in the background: wait for its verdict
            wait_for(lambda n=node: n.status()["reachability"]["verdict"] != "unknown" or None,
                     f"{node.name}'s reachability verdict", WAIT_S, node)
        assert a.status()["reachability"]["verdict"] == b.status()["reachability"]["verdict"] == "public"
        print(f"LAN swarms formed and generated in {time.monotonic() - started:.1f} s; A's mDNS: {mdns_of(a)}")
    finally:
        for node in reversed(daemons):
            node.stop()
        lan.down()
