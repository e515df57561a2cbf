"""Tracker duty that cannot stall, with REAL daemons under real NAT.

Topology (tests/_netns.py): the public namespace runs `meshd relay` and a public daemon P
(layers [3, 6)); home1 runs H, the only server of layer 0 ([0, 3)), behind NAT: reachable only
through the relay. Under the old rule (heads first, reachability ignored) H held tracker duty and
a `--layers auto` joiner, which dials the tracker's direct addresses, could not reach it until duty
rotated. Now only directly dialable nodes (signed record lists direct addresses) are candidates,
so every node computes P as the tracker. A `--layers auto` daemon J in home2 joins: it names P as
tracker from its first view on, never logs an unreachable tracker, and gets a range from P's
signed directive; H's own view names P too (the same rule everywhere).
If namespaces cannot be created the test FAILS and says why.
"""
from __future__ import annotations

import time

import pytest

from meshd.benchmarks import relay_harness as H
from meshd.daemon.local_swarm import LocalDaemon, wait_for
from tests._netns import NetnsUnavailable, new_topology
from tests.test_relayd_netns import START_TIMEOUT_S, NsDaemon

pytestmark = pytest.mark.netns


def test_an_auto_join_never_waits_on_a_tracker_behind_nat(tmp_path):
    from meshd.testing.models import build_random_llama

    model = build_random_llama(seed=0)
    topo = new_topology()
    relay = None
    daemons: list[LocalDaemon] = []
    try:
        try:
            topo.up()
        except NetnsUnavailable as exc:
            pytest.fail(f"cannot build the NAT topology: {exc}")
        pub = topo.prefix(topo.public)
        pub_ip = topo.public_ip(1)
        relay = H.spawn_relay(tmp_path / "r", f"/ip4/{pub_ip}/tcp/4001", prefix=pub)
        relay_addr = relay.ready["addrs"][0]
        public = NsDaemon(tmp_path, "public", model, prefix=pub, listen=f"/ip4/{pub_ip}/tcp/4003", layers="3:6",
                          bootstrap=[relay_addr])
        daemons.append(public)
        public_addr = public.address()
        head = NsDaemon(tmp_path, "home1", model, prefix=topo.prefix(topo.homes[0]),
                        listen=f"/ip4/{topo.home_ip(1)}/tcp/4002", layers="0:3", bootstrap=[relay_addr, public_addr])
        daemons.append(head)
        head.address()
        public_id, head_id = (wait_for(lambda d=d: (s := d.query("status")) and s["peer_id"], f"{d.name}'s status",
                                       START_TIMEOUT_S, d) for d in (public, head))

        def view_of(d: LocalDaemon) -> dict | None:
            v = d.swarm()
            return v if v and v.get("coverage") and v["coverage"]["fully_covered"] and len(v["ads"]) >= 2 else None

        seen = wait_for(lambda: view_of(public), "the public daemon to see both ranges", START_TIMEOUT_S, public)
        assert head_id in seen["relayed"], seen            # the head is advertised through the relay only
        assert seen["tracker"] == public_id, seen          # ...so it is not on duty
        assert wait_for(lambda: view_of(head), "the head to see both ranges", START_TIMEOUT_S, head)["tracker"] \
            == public_id

        started = time.monotonic()
        joiner = NsDaemon(tmp_path, "home2", model, prefix=topo.prefix(topo.homes[1]),
                          listen=f"/ip4/{topo.home_ip(2)}/tcp/4004", layers="auto", bootstrap=[relay_addr, public_addr],
                          extra=("--memory", "1GiB"))
        daemons.append(joiner)
        trackers: set = set()

        def joined():
            v = joiner.swarm()
            if v and v.get("tracker"):
                trackers.add(v["tracker"])
            return v if v and v.get("layers") and v.get("serving") else None
        got = wait_for(joined, "the auto joiner to get a range and serve it", START_TIMEOUT_S, joiner)
        took = time.monotonic() - started
        print(f"auto joiner serves layers {got['layers']} {took:.1f} s after it started; trackers it saw: "
              f"{sorted(t[:16] for t in trackers)}")
        assert trackers == {public_id}, trackers
        log = joiner.text()
        assert not [line for line in log.splitlines() if "tracker" in line and "unreachable" in line], log[-3000:]
        assert "no tracker for the model yet" not in log          # it was directed, it did not self-plan
        joiner_id = joiner.query("status")["peer_id"]
        wait_for(lambda: (v := public.swarm()) and any(a["peer_id"] == joiner_id for a in v["ads"]) or None,
                 "the tracker to see the joiner's range", START_TIMEOUT_S, public)
    finally:
        for d in reversed(daemons):
            d.stop()
        if relay is not None:
            relay.stop()
        topo.down()
