"""The daemon's reachability part (meshd/reach/relaying.py) with real libp2p hosts on loopback:
relays found through the DHT, reservations on two of them, the verdict of the probe."""
from __future__ import annotations

import functools
import time
from contextlib import AsyncExitStack

import trio

from dht.node import DhtNode
from dht.relay_records import sign_relay, validate_relay
from meshd.config import DaemonConfig
from relay.host import connect_bootstrap, running_host
from dht.identity import Identity
from meshd.reach.relaying import MAX_RELAY_SLOTS, Relaying, relay_candidates
from relay.client import parse_relayed_addr
from relay.reachability import Verdict, serve_dialback
from meshd.daemon.relay_mode import run_relay

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEST_TIMEOUT_S = 90


def wall_ms() -> int:
    return int(time.time() * 1000)


async def wait_for(cond, timeout_s: float = 30.0, step_s: float = 0.05) -> None:
    with trio.fail_after(timeout_s):
        while not cond():
            await trio.sleep(step_s)


def test_relay_candidates_prefer_dht_records_then_bootstrap_never_self():
    ids = [Identity.from_seed(bytes([n]) * 32) for n in (61, 62, 63)]
    addr = lambda i, port: f"/ip4/127.0.0.1/tcp/{port}/p2p/{i.peer_id}"  # noqa: E731
    recs = [validate_relay(sign_relay([addr(i, 4000 + n)], i.signing_key, peer_id=i.peer_id, sequence=n,
                                      now_ms=wall_ms(), ttl_ms=60_000), wall_ms()) for n, i in enumerate(ids[:2])]
    got = relay_candidates(recs, [addr(ids[0], 9), addr(ids[2], 9)], own_peer_id=ids[1].peer_id)
    assert [c.peer_id.to_base58() for c in got] == [ids[0].peer_id, ids[2].peer_id]


async def _relay(nursery, tmp_path, name: str):
    config = DaemonConfig(data_dir=tmp_path / name, listen=tuple(LOOPBACK), record_ttl_s=30.0)
    return await nursery.start(functools.partial(run_relay, config, lambda line: None, control=False))


def test_a_private_node_finds_relays_in_the_dht_and_holds_two_reservations(tmp_path):
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as outer, AsyncExitStack() as stack:
                relays = [await _relay(outer, tmp_path, f"relay{i}") for i in range(2)]
                home_id = Identity.from_seed(b"\x07" * 32)
                host = await stack.enter_async_context(running_host(home_id, LOOPBACK))
                dht = await stack.enter_async_context(DhtNode(host, wall_ms).running())
                await connect_bootstrap(host, [r.addrs()[0] for r in relays], 10)
                await dht.sync_peers()
                changes = []
                # no bootstrap fallback: the relays can only come from their DHT records
                part = Relaying(host, dht, mode="private", bootstrap=(), on_change=lambda: changes.append(1))
                nursery = await stack.enter_async_context(trio.open_nursery())
                await nursery.start(part.run)
                await wait_for(lambda: len(part.relayed_addrs) == MAX_RELAY_SLOTS)
                assert part.private and changes
                held = {parse_relayed_addr(a)[0].peer_id.to_base58() for a in part.relayed_addrs}
                assert held == {r.peer_id for r in relays}
                assert all(a.endswith(f"/p2p-circuit/p2p/{home_id.peer_id}") for a in part.relayed_addrs)
                status = part.status()
                assert status["verdict"] == "private" and len(status["relayed_addrs"]) == 2
                await wait_for(lambda: all(r.hop.snapshot()["reservations_active"] == 1 for r in relays))
                status = await relays[0].handle({"op": "status"})
                assert status["announced"]["addrs"] == [relays[0].addrs()[0]]
                nursery.cancel_scope.cancel()
                outer.cancel_scope.cancel()

    trio.run(main)


def test_auto_mode_probes_public_on_loopback_and_unknown_alone():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b = [await stack.enter_async_context(running_host(Identity.from_seed(bytes([n]) * 32), LOOPBACK))
                        for n in (71, 72)]
                for h in (a, b):
                    serve_dialback(h)
                alone = Relaying(b, None, mode="auto", bootstrap=(), on_change=lambda: None)
                await alone._decide()
                assert alone.verdict is Verdict.UNKNOWN and alone.decided and not alone.private
                await connect_bootstrap(b, [f"{a.get_addrs()[0]}"], 10)
                part = Relaying(b, None, mode="auto", bootstrap=(), on_change=lambda: None)
                nursery = await stack.enter_async_context(trio.open_nursery())
                await nursery.start(part.run)
                await wait_for(lambda: part.decided)
                assert part.verdict is Verdict.PUBLIC and part.relayed_addrs == ()
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_auto_mode_checks_again_and_follows_a_changed_network(monkeypatch):
    """Public, then the listeners close (a router that stops forwarding): the next check says
    private and the node starts relaying; a listener again: public, the relay slots are let go."""
    import multiaddr

    from meshd.reach import relaying
    monkeypatch.setattr(relaying, "RECHECK_S", 0.2)

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b = [await stack.enter_async_context(running_host(Identity.from_seed(bytes([n]) * 32), LOOPBACK))
                        for n in (73, 74)]
                for h in (a, b):
                    serve_dialback(h)
                await connect_bootstrap(b, [f"{a.get_addrs()[0]}"], 10)
                changes: list = []
                part = Relaying(b, None, mode="auto", bootstrap=(),
                                on_change=lambda: changes.append(part.verdict))
                nursery = await stack.enter_async_context(trio.open_nursery())
                await nursery.start(part.run)
                await wait_for(lambda: part.decided)
                assert part.verdict is Verdict.PUBLIC
                for listener in list(b.get_network().listeners.values()):
                    await listener.close()
                b.get_network().listeners.clear()       # so that listen() below opens a new one
                await wait_for(lambda: part.private)
                assert changes[-1] is Verdict.PRIVATE and part.status()["verdict"] == "private"
                await b.get_network().listen(multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0"))
                # the verdict flips first; the relay slots are let go (and on_change called)
                # once the relaying tasks have wound down, which takes a moment under load
                await wait_for(lambda: changes[-1] is Verdict.PUBLIC)
                assert part.verdict is Verdict.PUBLIC and part.relayed_addrs == ()
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_reachability_config_flag_and_status_rendering(tmp_path):
    import pytest

    from meshd.config import load_config
    from meshd.errors import ConfigError
    from meshd.cli.status_view import render_status

    assert load_config(None, {"data_dir": tmp_path}).reachability == "auto"
    assert load_config(None, {"data_dir": tmp_path, "reachability": "private"}).reachability == "private"
    with pytest.raises(ConfigError, match="reachability"):
        load_config(None, {"data_dir": tmp_path, "reachability": "sometimes"})
    relayed = "/ip4/203.0.113.7/tcp/4001/p2p/R/p2p-circuit/p2p/P"
    text = render_status({"peer_id": "P", "addresses": [], "peers": [], "routing_table": 0, "own": {"layers": None},
                          "worker": {"state": "none"}, "coverage": {},
                          "reachability": {"mode": "auto", "verdict": "private", "relayed_addrs": [relayed]}})
    assert "reachable  private (mode auto)" in text and f"relayed  {relayed}" in text
