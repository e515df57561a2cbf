"""The daemon's reachability part (meshd/reach/relaying.py) with real libp2p hosts on loopback:
relays found through the DHT, reservations on two of them, the verdict of the probe."""
from __future__ import annotations

import functools
import time
from contextlib import AsyncExitStack

import trio

from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.identity import Identity
from dht.node import DhtNode
from dht.relay_records import sign_relay, validate_relay
from meshd.config import DaemonConfig
from meshd.daemon.relay_mode import run_relay
from meshd.reach.relaying import MAX_RELAY_SLOTS, Relaying, relay_candidates
from relay.client import parse_relayed_addr
from relay.reachability import Verdict, serve_dialback
from tests.conftest import wait_until

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEST_TIMEOUT_S = 90


def wall_ms() -> int:
    return int(time.time() * 1000)


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
                await wait_until(lambda: len(part.relayed_addrs) == MAX_RELAY_SLOTS, 30, "every relay slot reserved")
                assert part.private and changes
                held = {parse_relayed_addr(a)[0].peer_id.to_base58() for a in part.relayed_addrs}
                assert held == {r.peer_id for r in relays}
                assert all(a.endswith(f"/p2p-circuit/p2p/{home_id.peer_id}") for a in part.relayed_addrs)
                status = part.status()
                assert status["verdict"] == "private" and len(status["relayed_addrs"]) == 2
                await wait_until(lambda: all(r.hop.snapshot()["reservations_active"] == 1 for r in relays), 30,
                                 "one reservation at every relay")
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
                await wait_until(lambda: part.decided, 30, "a reachability verdict")
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
                await wait_until(lambda: part.decided, 30, "a reachability verdict")
                assert part.verdict is Verdict.PUBLIC
                for listener in list(b.get_network().listeners.values()):
                    await listener.close()
                b.get_network().listeners.clear()       # so that listen() below opens a new one
                await wait_until(lambda: part.private, 30, "the private verdict")
                assert changes[-1] is Verdict.PRIVATE and part.status()["verdict"] == "private"
                await b.get_network().listen(multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0"))
                # the verdict flips first; the relay slots are let go (and on_change called)
                # once the relaying tasks have wound down, which takes a moment under load
                await wait_until(lambda: changes[-1] is Verdict.PUBLIC, 30, "the public verdict")
                assert part.verdict is Verdict.PUBLIC and part.relayed_addrs == ()
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_reachability_config_flag_and_status_rendering(tmp_path):
    import pytest

    from meshd.cli.status_view import render_status
    from meshd.config import load_config
    from meshd.errors import ConfigError

    assert load_config(None, {"data_dir": tmp_path}).reachability == "auto"
    assert load_config(None, {"data_dir": tmp_path, "reachability": "private"}).reachability == "private"
    with pytest.raises(ConfigError, match="reachability"):
        load_config(None, {"data_dir": tmp_path, "reachability": "sometimes"})
    relayed = "/ip4/203.0.113.7/tcp/4001/p2p/R/p2p-circuit/p2p/P"
    text = render_status({"peer_id": "P", "addresses": [], "peers": [], "routing_table": 0, "own": {"layers": None},
                          "worker": {"state": "none"}, "coverage": {},
                          "reachability": {"mode": "auto", "verdict": "private", "relayed_addrs": [relayed]}})
    assert "reachable  private (mode auto)" in text and f"relayed  {relayed}" in text
    assert "relay connections lost" not in text
    lost = render_status({"peer_id": "P", "addresses": [], "peers": [], "routing_table": 0, "own": {"layers": None},
                          "worker": {"state": "none"}, "coverage": {},
                          "reachability": {"mode": "auto", "verdict": "private", "relayed_addrs": [relayed],
                                           "relays_held": ["R"], "relay_losses": 2}})
    assert "relay connections lost: 2" in lost


def test_two_slots_started_together_claim_distinct_relays():
    """Both keepers read the list before either holds a reservation (each RESERVE takes a
    while): the claims still put them on two relays, and the union lists each relay once."""
    from relay.client import Reservation
    from relay.reachability import keep_reserved

    class Info:
        def __init__(self, name):
            self.peer_id = name

    class SelfId(str):
        def to_base58(self):
            return str(self)

    class FakeHost:
        def get_id(self):
            return SelfId("12D3KooWself")

    claims: dict[int, str | None] = {0: None, 1: None}
    slots: dict[int, tuple] = {0: (), 1: ()}
    calls: list[str] = []

    def claim(slot, relay):
        if relay is not None and any(c == relay for i, c in claims.items() if i != slot):
            return False
        claims[slot] = relay
        return True

    def listing(slot):
        return [r for r in (Info("A"), Info("B")) if r.peer_id not in {c for i, c in claims.items() if i != slot}]

    async def slow_reserve(host, relay):
        calls.append(relay.peer_id)
        await trio.sleep(1.0)
        return Reservation(relay_peer_id=relay.peer_id, expires_at_unix=int(trio.current_time()) + 600,
                           relay_addrs=(f"/ip4/1.2.3.4/tcp/1/p2p/{relay.peer_id}",),
                           limit_duration_s=0, limit_data_bytes=0)

    async def main():
        with trio.move_on_after(100):
            async with trio.open_nursery() as nursery:
                for slot in (0, 1):
                    nursery.start_soon(functools.partial(
                        keep_reserved, FakeHost(), functools.partial(listing, slot),
                        functools.partial(slots.__setitem__, slot), wall=trio.current_time,
                        reserve_fn=slow_reserve, claim=functools.partial(claim, slot)))

    import trio.testing
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(calls[:2]) == ["A", "B"]
    assert {slots[0][0].split("/p2p/")[1].split("/")[0], slots[1][0].split("/p2p/")[1].split("/")[0]} == {"A", "B"}
    assert {claims[0], claims[1]} == {"A", "B"}


def test_a_lost_relay_is_noticed_at_its_connection_close_and_replaced(tmp_path):
    """Three relays, two slots. The relay of one slot stops: its connection closes, the slot's
    addresses are withdrawn and it reserves on the third relay -- long before any renewal
    (reservations live an hour; renewal is at half of that)."""
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as outer, AsyncExitStack() as stack:
                scopes, relays = [], []
                for i in range(3):
                    scope = trio.CancelScope()
                    scopes.append(scope)

                    async def run_one(name, scope=scope, *, task_status=trio.TASK_STATUS_IGNORED):
                        with scope:
                            config = DaemonConfig(data_dir=tmp_path / name, listen=tuple(LOOPBACK),
                                                  record_ttl_s=600.0)
                            await run_relay(config, lambda line: None, control=False, task_status=task_status)
                    relays.append(await outer.start(run_one, f"relay{i}"))
                home_id = Identity.from_seed(b"\x09" * 32)
                host = await stack.enter_async_context(running_host(home_id, LOOPBACK))
                dht = await stack.enter_async_context(DhtNode(host, wall_ms).running())
                changes: list[tuple] = []
                part = Relaying(host, dht, mode="private", bootstrap=tuple(r.addrs()[0] for r in relays),
                                on_change=lambda: changes.append(part.relayed_addrs))
                nursery = await stack.enter_async_context(trio.open_nursery())
                await nursery.start(part.run)
                await wait_until(lambda: len(part.relayed_addrs) == MAX_RELAY_SLOTS, 30, "every relay slot reserved")
                held = {parse_relayed_addr(a)[0].peer_id.to_base58() for a in part.relayed_addrs}
                assert len(held) == 2
                victim = next(i for i, r in enumerate(relays) if r.peer_id in held)
                spare = next(r.peer_id for r in relays if r.peer_id not in held)
                before = len(changes)
                scopes[victim].cancel()
                await wait_until(lambda: any(relays[victim].peer_id not in "".join(c) and len(c) == 1
                                             for c in changes[before:]), 30, "the lost relay's slot given up")
                await wait_until(lambda: len(part.relayed_addrs) == MAX_RELAY_SLOTS, 30, "every relay slot reserved")
                now_held = {parse_relayed_addr(a)[0].peer_id.to_base58() for a in part.relayed_addrs}
                assert now_held == (held - {relays[victim].peer_id}) | {spare}, \
                    (sorted(now_held), sorted(held), relays[victim].peer_id, spare, changes)
                status = part.status()
                assert status["relay_losses"] == 1 and sorted(status["relays_held"]) == sorted(now_held)
                nursery.cancel_scope.cancel()
                outer.cancel_scope.cancel()

    trio.run(main)


def test_a_relay_hands_its_record_to_a_peer_that_connects(tmp_path):
    """The relay announced before anyone was connected; a node that connects later holds the
    record in its own DHT store without asking (the next republish would be 200 s away)."""
    from dht import keys as K
    from dht.relay_records import parse_relay_set_lenient

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as outer, AsyncExitStack() as stack:
                config = DaemonConfig(data_dir=tmp_path / "relay", listen=tuple(LOOPBACK), record_ttl_s=600.0)
                relay = await outer.start(functools.partial(run_relay, config, lambda line: None, control=False))
                await wait_until(lambda: relay.announced is not None, 30, "the relay's announcement")
                host = await stack.enter_async_context(running_host(Identity.from_seed(b"\x0b" * 32), LOOPBACK))
                dht = await stack.enter_async_context(DhtNode(host, wall_ms).running())
                kb = K.relays_key().encode()
                assert dht.store.get(kb) is None
                await connect_bootstrap(host, [relay.addrs()[0]], 10)
                await wait_until(lambda: dht.store.get(kb) is not None, 30, "the relay record in the DHT")
                got = parse_relay_set_lenient(dht.store.get(kb).value, wall_ms())
                assert [r.peer_id for r in got] == [relay.peer_id]
                outer.cancel_scope.cancel()

    trio.run(main)
