"""Relays that heal, with REAL daemons under real NAT in network namespaces.

Topology (tests/_netns.py): "public" runs two `meshd relay`s and a public daemon (tail layers
[4, 6), bootstrapping through both relays); home1 runs the middle layers [2, 4), home2 the entry
[0, 2), each bootstrapping through the public daemon ONLY, so the relays are found through their
DHT records (which each relay hands to a peer as it connects). Checks:
  * home1 holds reservations on BOTH relays (distinct slots), its advertised relayed addresses
    name each relay once, and the first reservation followed the "private" verdict (log lines;
    the gap is printed);
  * relay 1 is killed (SIGKILL) before any generation (so the entry holds no circuit to home1 and
    no hole-punched connection): within 10 s the entry's DHT view of home1 lists relayed
    addresses through relay 2 only (home1 noticed the closed connection and republished), and
    home1 logged the loss;
  * a generation through the entry equals the whole model's greedy tokens, middle hop home1,
    and its home-to-home hop crossed relay 2 (relay 2's own forwarded-bytes count).
If namespaces cannot be created the test FAILS and says why.
"""
from __future__ import annotations

import re
import time

import pytest

from meshd.benchmarks import relay_harness as H
from meshd.daemon.control import request as control_request
from meshd.daemon.local_swarm import LocalDaemon, wait_for
from tests._netns import NetnsUnavailable, new_topology
from tests.test_relayd_netns import START_TIMEOUT_S, NsDaemon

pytestmark = pytest.mark.netns

PROMPT = "two relays carry the home node and one of them dies"
NEW_TOKENS = 12
READVERTISE_WITHIN_S = 10.0


def _relay_of(addr: str) -> str:
    return addr.split("/p2p-circuit/")[0].rsplit("/p2p/", 1)[1]


def _log_seconds(text: str, pattern: str) -> int | None:
    """Seconds of the day of the first progress line matching ``pattern`` (HH:MM:SS prefix)."""
    for line in text.splitlines():
        m = re.match(r"(\d\d):(\d\d):(\d\d) (.*)", line)
        if m and re.search(pattern, m.group(4)):
            return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
    return None


def test_a_home_node_holds_two_relays_and_heals_when_one_dies(tmp_path):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.testing.models import build_random_llama
    from shard.model.reference import WholeModel

    torch.set_num_threads(1)
    model = build_random_llama(seed=0)
    tok = EntryTokenizer(model)
    ids = tok.encode_prompt(PROMPT, raw=True)
    expected = WholeModel(model).generate(ids, NEW_TOKENS).tokens
    cut = next((i for i, t in enumerate(expected) if t in tok.stop_ids), None)
    expected = expected if cut is None else expected[:cut + 1]

    topo = new_topology()
    relays: list[H.Child] = []
    daemons: list[LocalDaemon] = []
    try:
        try:
            topo.up()
        except NetnsUnavailable as exc:
            pytest.fail(f"cannot build the NAT topology: {exc}")
        pub = topo.prefix(topo.public)
        pub_ip = topo.public_ip(1)
        relays = [H.spawn_relay(tmp_path / f"r{i}", f"/ip4/{pub_ip}/tcp/{port}", prefix=pub)
                  for i, port in ((1, 4001), (2, 4005))]
        relay_ids = [r.ready["peer_id"] for r in relays]
        boot = NsDaemon(tmp_path, "public", model, prefix=pub, listen=f"/ip4/{pub_ip}/tcp/4003", layers="4:6",
                        bootstrap=[r.ready["addrs"][0] for r in relays])
        daemons.append(boot)
        boot_addr = boot.address()
        middle = NsDaemon(tmp_path, "home1", model, prefix=topo.prefix(topo.homes[0]),
                          listen=f"/ip4/{topo.home_ip(1)}/tcp/4002", layers="2:4", bootstrap=[boot_addr])
        entry = NsDaemon(tmp_path, "home2", model, prefix=topo.prefix(topo.homes[1]),
                         listen=f"/ip4/{topo.home_ip(2)}/tcp/4004", layers="0:2", bootstrap=[boot_addr])
        daemons += [middle, entry]

        def reach(d: LocalDaemon) -> dict:
            return (d.query("status") or {}).get("reachability") or {}

        both = wait_for(lambda: (r := reach(middle)) and set(r.get("relays_held", ())) == set(relay_ids) and r,
                        "home1 to hold reservations on both relays", START_TIMEOUT_S, middle)
        assert both["verdict"] == "private", both
        addrs = both["relayed_addrs"]
        assert len(addrs) == len(set(addrs)) and sorted({_relay_of(a) for a in addrs}) == sorted(relay_ids), addrs
        log = middle.text()
        t_private = _log_seconds(log, r"^reachability: private")
        t_first = _log_seconds(log, r"^relay slot \d: /")
        print(f"home1: 'private' at {t_private}, first reservation at {t_first}: "
              f"gap {None if None in (t_private, t_first) else t_first - t_private} s (1 s log resolution)")
        assert t_private is not None and t_first is not None and t_first >= t_private

        middle_id = middle.query("status")["peer_id"]

        def advertised_relays(view: dict | None) -> set[str] | None:
            if not view or not view.get("coverage") or not view["coverage"]["fully_covered"]:
                return None
            return {_relay_of(a) for a in (view.get("relayed") or {}).get(middle_id, ())}

        wait_for(lambda: advertised_relays(entry.swarm()) == set(relay_ids) or None,
                 "the entry to see home1 through both relays", START_TIMEOUT_S, entry)

        def generate() -> dict:
            done = None
            for event in entry.generate(PROMPT, max_tokens=NEW_TOKENS, raw=True):
                if event.get("done"):
                    done = event
            assert done is not None
            return done

        def forwarded(i: int) -> int:    # relay i's own count of circuit bytes (its control socket)
            return control_request(tmp_path / f"r{i + 1}" / "relay" / "control.sock", "status",
                                   timeout_s=30.0)["relay"]["bytes_forwarded"]

        # No generation before the kill: the entry has no circuit (and so no DCUtR upgrade) to home1
        # yet, so the generation after it must open its home-to-home hop through relay 2.
        relays[0].proc.kill()
        killed_at = time.monotonic()
        wait_for(lambda: advertised_relays(entry.swarm()) == {relay_ids[1]} or None,
                 "the entry to see home1 through relay 2 only", START_TIMEOUT_S, entry)
        readvertised_s = time.monotonic() - killed_at
        print(f"relay 1 killed: the entry's DHT view re-advertised home1 after {readvertised_s:.2f} s")
        assert readvertised_s <= READVERTISE_WITHIN_S, readvertised_s
        assert "connection to relay" in middle.text(), "home1 did not log the lost relay"
        after = reach(middle)
        assert after["relay_losses"] >= 1 and after["relays_held"] == [relay_ids[1]], after

        before = forwarded(1)
        again = generate()
        carried = forwarded(1) - before
        print("after the kill: route:", again["route"], "tokens:", again["tokens"], "failovers:", again["failovers"],
              f"relay 2 forwarded {carried} bytes")
        assert [h.split(":")[0] for h in again["route"]][1] == middle_id
        assert again["tokens"] == expected
        assert carried > 10_000, "the home-to-home hop did not cross relay 2"
    finally:
        for d in reversed(daemons):
            d.stop()
        for r in relays:
            r.stop()
        topo.down()
