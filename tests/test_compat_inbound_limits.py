"""Inbound limits (dht/compat/inbound_limits.py) with real hosts and real idle TCP connections on loopback.

Loopback is exempt from the per-address caps in production (a local swarm dials from
127.0.0.1); these tests turn the exemption off so that one address here (127.0.0.2) plays
the flooder while a newcomer dials from 127.0.0.1.
The library's own behaviour is shown first (gate removed): idle connections from one address
fill its inbound slots and a new peer is turned away; with the gate the same flood leaves the
door open, and idle handshakes are cut at the pre-handshake deadline."""
from __future__ import annotations

import pytest
import trio

from dht.compat import inbound_limits as IL
from dht.host.conn_watch import peer_text
from tests._relay_helpers import LOOPBACK, info, new_host
from tests.conftest import wait_until

# More idle connections than py-libp2p 0.8.1's inbound cap (300 - 50 = 250).
FLOOD = 300
# The flood's one address (all of 127/8 is loopback on Linux); the newcomer dials from 127.0.0.1.
FLOOD_FROM = "127.0.0.2"
TEST_TIMEOUT_S = 90


def test_gate_counts_and_refuses_per_address_and_in_total(monkeypatch):
    monkeypatch.setattr(IL, "EXEMPT_LOOPBACK", True)
    gate = IL.InboundGate()
    tickets = [gate.open("203.0.113.9") for _ in range(IL.MAX_PENDING_PER_ADDR)]
    assert all(tickets) and gate.open("203.0.113.9") is None
    assert gate.refused["pending_per_addr"] == 1
    assert gate.open("127.0.0.1") is not None                   # loopback: no per-address cap
    tickets[0].upgraded()
    assert gate.snapshot()["pending"] == IL.MAX_PENDING_PER_ADDR and gate.snapshot()["upgraded"] == 1
    assert gate.open("203.0.113.9") is not None                 # an upgraded one left the pending count
    for t in tickets:
        t.close()
        t.close()                                               # closing twice counts once
    others = [gate.open(f"198.51.100.{i}") for i in range(IL.MAX_PENDING_TOTAL)]
    assert sum(t is not None for t in others) == IL.MAX_PENDING_TOTAL - 2   # two still pending above
    assert gate.refused["pending_total"] == 2


async def _flood(addr: tuple[str, int], count: int, stop: trio.Event, nursery) -> list:
    """``count`` idle TCP connections held open (never a byte sent), each re-opened when closed."""
    opened = []

    async def one() -> None:
        while not stop.is_set():
            try:
                conn = await trio.open_tcp_stream(*addr, local_address=FLOOD_FROM)
            except OSError:
                await trio.sleep(0.05)
                continue
            opened.append(1)
            try:
                with trio.move_on_after(30):
                    while await conn.receive_some(4096):   # the node's hello, if any: never answered
                        pass                               # b"" (or an error) once the node closes it
            except trio.BrokenResourceError:
                pass
            await conn.aclose()
            await trio.sleep(0.05)               # a bounded re-open rate: at most 20/s per connection
    for _ in range(count):
        nursery.start_soon(one)
    return opened


async def _can_connect(host, target, timeout_s: float = 8.0) -> bool:
    with trio.move_on_after(timeout_s):
        try:
            await host.connect(info(target))
        except Exception:  # noqa: BLE001 - refused, reset mid-handshake...
            return False
        return bool(host.get_network().connections.get(target.get_id()))
    return False


def _tcp_addr(host) -> tuple[str, int]:
    text = str(host.get_addrs()[0])
    parts = text.split("/")
    return parts[2], int(parts[4])


@pytest.mark.parametrize("gated", [False, True], ids=["library-alone", "with-gate"])
def test_one_address_with_idle_connections_cannot_shut_the_door(monkeypatch, gated):
    monkeypatch.setattr(IL, "EXEMPT_LOOPBACK", False)
    server = new_host()            # builds the host: the adjustments (the gate among them) go in
    newcomer = new_host()
    assert IL.APPLIED
    if not gated:
        IL.restore()               # after building both hosts (a build applies it again)

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with server.run(LOOPBACK), newcomer.run(LOOPBACK), trio.open_nursery() as nursery:
                stop = trio.Event()
                opened = await _flood(_tcp_addr(server), FLOOD, stop, nursery)
                await wait_until(lambda: len(opened) >= FLOOD, TEST_TIMEOUT_S, "the flood's connections opened")
                await trio.sleep(1.0)      # the flood's connections are accepted (or refused) by now
                ok = await _can_connect(newcomer, server)
                gate = IL.gate_of(server.get_network()).snapshot()
                stop.set()
                nursery.cancel_scope.cancel()
                return ok, gate

    try:
        ok, gate = trio.run(main)
    finally:
        IL.apply()
    print(f"{'with the gate' if gated else 'library alone'}: newcomer connected={ok}, gate {gate}")
    if gated:
        assert ok, gate
        assert gate["refused"].get("pending_per_addr", 0) > 0
    else:
        assert not ok, "py-libp2p let the newcomer in past a full inbound limiter: the flood test shows nothing"


def test_idle_handshakes_are_cut_at_the_deadline(monkeypatch):
    monkeypatch.setattr(IL, "EXEMPT_LOOPBACK", False)
    monkeypatch.setattr(IL, "PRE_HANDSHAKE_TIMEOUT_S", 0.5)
    server = new_host()
    assert IL.APPLIED

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with server.run(LOOPBACK):
                gate = IL.gate_of(server.get_network())
                conns = [await trio.open_tcp_stream(*_tcp_addr(server)) for _ in range(IL.MAX_PENDING_PER_ADDR)]
                closed = 0
                for conn in conns:         # each is closed by the node (b"" or reset), none hangs
                    try:
                        with trio.fail_after(30):
                            while await conn.receive_some(4096):
                                pass       # the node's multistream hello, if it sent one
                    except trio.BrokenResourceError:
                        pass
                    closed += 1
                    await conn.aclose()
                await wait_until(lambda: not gate.pending_total, TEST_TIMEOUT_S, "no connection pending at the gate")
                return closed, gate.snapshot()

    closed, snap = trio.run(main)
    assert closed == IL.MAX_PENDING_PER_ADDR
    assert snap["refused"]["handshake_deadline"] == IL.MAX_PENDING_PER_ADDR and snap["pending"] == 0


def test_peer_text_of_ids_and_strings():
    host = new_host()
    assert peer_text(host.get_id()) == host.get_id().to_base58() and peer_text("abc") == "abc"


def test_bootstrap_tries_again_when_no_peer_answered_the_first_round(monkeypatch):
    """The bootstrap peer is not listening yet when the first round dials (refused at once);
    it comes up during the pause and the second round reaches it. With one round: refused."""
    import socket

    from dht.host import bootstrap as B
    from dht.host.build import running_host
    from dht.host.errors import BootstrapUnreachable
    from dht.identity import Identity

    monkeypatch.setattr(B, "BOOTSTRAP_RETRY_PAUSES_S", (2.0, 2.0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    late = Identity.from_seed(b"\x2c" * 32)
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{late.peer_id}"

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with running_host(Identity.from_seed(b"\x2d" * 32), ["/ip4/127.0.0.1/tcp/0"]) as me:
                with pytest.raises(BootstrapUnreachable):
                    await B.connect_bootstrap(me, [addr], 5.0, rounds=1)
                async with trio.open_nursery() as nursery:
                    async def come_up_late():
                        await trio.sleep(0.3)
                        async with running_host(late, [f"/ip4/127.0.0.1/tcp/{port}"]):
                            await trio.sleep_forever()
                    nursery.start_soon(come_up_late)
                    reached = await B.connect_bootstrap(me, [addr], 5.0)
                    nursery.cancel_scope.cancel()
                return reached

    assert trio.run(main) == [late.peer_id]
