"""dht/rpc.py: meshd's cancel-safe GET_VALUE / PUT_VALUE, its sessions and its deadline estimator.

RpcTimer is pure. The RPCs run between real py-libp2p hosts on loopback, each
with meshd's DhtNode (the library's KadDHT serving the other end). A peer's
busy inbound DHT handlers are read off its KadDHT's inbound limiter (one
token per stream being served). The one fault injected is a peer that
stalls before answering: its KadDHT handler waits on an event first.
"""
from __future__ import annotations

import functools
import time
from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.exceptions import BaseLibp2pError

from dht import keys as K
from dht import rpc
from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.node import DhtNode, replace_maintenance
from dht.records import parse_record_set_lenient
from dht.rpc import RpcTimer
from tests._daemon_helpers import DIGEST, as_record_set, good, identity
from tests.conftest import wait_until

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEST_TIMEOUT_S = 60
# how long the caller waits for a stalled peer before cutting the RPC (not a measured threshold)
CUT_S = 0.3
# the same where the second ask must answer within twice the deadline on a machine busy with other work
LATE_CUT_S = 1.0


def wall_ms() -> int:
    return int(time.time() * 1000)


# ------------------------------------------------------------------------------------- RpcTimer

def test_the_timer_starts_at_its_initial_deadline_and_follows_rfc_6298():
    t = RpcTimer(3.0, 0.5, 10.0)
    assert t.timeout() == 3.0 and t.srtt is None
    t.observe(1.0)                              # first sample: srtt = r, rttvar = r / 2
    assert (t.srtt, t.rttvar) == (1.0, 0.5) and t.timeout() == 3.0
    t.observe(2.0)                              # rttvar = 3/4 0.5 + 1/4 |1 - 2|, srtt = 7/8 1 + 1/8 2
    assert t.rttvar == pytest.approx(0.625) and t.srtt == pytest.approx(1.125)
    assert t.timeout() == pytest.approx(1.125 + 4 * 0.625)
    assert t.samples == 2


def test_the_deadline_stays_within_floor_and_ceiling():
    t = RpcTimer(2.0, 1.0, 4.0)
    for _ in range(50):
        t.observe(0.001)                        # a quiet LAN: the floor, not 5 ms
    assert t.timeout() == 1.0
    for _ in range(50):
        t.observe(9.0)                          # a starved machine: the ceiling
    assert t.timeout() == 4.0
    t.observe(-1.0)                             # a clock oddity counts as zero
    assert t.srtt >= 0


def test_a_peers_unanswered_rpcs_double_its_deadline_within_the_ceiling():
    t = RpcTimer(1.0, 0.5, 10.0)
    assert t.timeout(1) == 2.0                  # before any sample: the initial deadline, doubled
    t.observe(0.2)
    base = t.timeout()
    assert t.timeout(1) == pytest.approx(2 * base) and t.timeout(2) == pytest.approx(4 * base)
    assert t.timeout(7) == 10.0 and t.timeout(10_000) == 10.0     # capped, whatever the count
    assert t.timeout(-3) == base
    assert t.timeout() == base                  # the estimate itself is not moved by a miss
    assert "backoffs" not in t.snapshot() and t.snapshot()["samples"] == 1


@pytest.mark.parametrize("args", [(1.0, 2.0, 3.0), (5.0, 1.0, 3.0), (1.0, 0.0, 3.0)])
def test_the_timer_refuses_bounds_out_of_order(args):
    with pytest.raises(ValueError):
        RpcTimer(*args)


# ------------------------------------------------------------------------------------- over hosts

async def _nodes(stack: AsyncExitStack, count: int) -> list[DhtNode]:
    """``count`` DhtNodes; each after the first bootstraps through the one before it."""
    nodes: list[DhtNode] = []
    for i in range(count):
        host = await stack.enter_async_context(running_host(identity(70 + i), LOOPBACK))
        node = await stack.enter_async_context(DhtNode(host, wall_ms).running())
        if nodes:
            prev = nodes[-1].host
            await connect_bootstrap(host, [f"{prev.get_addrs()[0]}/p2p/{prev.get_id()}"], 10)
            await wait_until(functools.partial(_each_in_the_others_table, node, nodes[-1]), TEST_TIMEOUT_S,
                             "each node in the other's routing table")
        nodes.append(node)
    return nodes


async def _each_in_the_others_table(node: DhtNode, prev: DhtNode) -> bool:
    """An insertion may need a retry: sync both tables, then look."""
    await node.sync_peers()
    await prev.sync_peers()
    return (node.kad.routing_table.peer_in_table(prev.host.get_id())
            and prev.kad.routing_table.peer_in_table(node.host.get_id()))


async def _synced_knows(node: DhtNode, peer) -> bool:
    await node.sync_peers()
    return node.kad.routing_table.peer_in_table(peer)


def _serving(node: DhtNode) -> int:
    """Inbound DHT streams ``node``'s KadDHT is serving now."""
    return int(node.kad._inbound_limiter.borrowed_tokens)


def test_get_and_put_speak_the_librarys_wire_and_leave_no_stream_open():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b, c = await _nodes(stack, 3)
                b_id, c_id = b.host.get_id(), c.host.get_id()
                key = K.model_key(DIGEST).encode()
                value = as_record_set(good(identity(70), now=wall_ms()))
                assert await rpc.put_value(a.host, b_id, key, value) is True
                await wait_until(lambda: _serving(b) == 0, TEST_TIMEOUT_S, "b's inbound DHT streams closed")
                record, closer = await rpc.get_value(a.host, b_id, key)
                assert [r.peer_id for r in parse_record_set_lenient(record.value, wall_ms())] == [identity(70).peer_id]
                assert c_id in closer and a.host.get_id() not in closer
                assert a.host.get_peerstore().addrs(c_id)          # the answer's addresses: c is dialable
                record, _ = await rpc.get_value(a.host, b_id, K.model_key("sha256:" + "cd" * 32).encode())
                assert record is None
                await wait_until(lambda: _serving(b) == 0, TEST_TIMEOUT_S, "b's inbound DHT streams closed")
                # b's validator refuses a value under the wrong key: b resets, the caller sees an error
                with pytest.raises(BaseLibp2pError):
                    await rpc.put_value(a.host, b_id, K.peer_key(identity(71).peer_id).encode(), value)
                await wait_until(lambda: _serving(b) == 0, TEST_TIMEOUT_S, "b's inbound DHT streams closed")

    trio.run(main)


def test_a_get_cut_by_the_callers_deadline_resets_the_stream_and_frees_the_peers_handler():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b = await _nodes(stack, 2)
                b_id = b.host.get_id()
                release = trio.Event()
                entered = []

                async def stalled(stream):          # the fault: b stalls before it serves the stream
                    entered.append(stream)
                    async with b.kad._inbound_limiter:
                        await release.wait()
                        await b.kad._do_handle_stream(stream)

                b.host.set_stream_handler(b.protocol, stalled)
                with trio.move_on_after(CUT_S) as cut:
                    await rpc.get_value(a.host, b_id, K.model_key(DIGEST).encode())
                assert cut.cancelled_caught and len(entered) == 1 and _serving(b) == 1
                release.set()                       # b now reads the request, and then the reset
                await wait_until(lambda: _serving(b) == 0, TEST_TIMEOUT_S, "b's inbound DHT streams closed")
                conn = a.host.get_network().connections[b_id]
                conns = conn if isinstance(conn, list) else [conn]
                await wait_until(lambda: all(not c.muxed_conn.streams for c in conns), TEST_TIMEOUT_S,
                                 "a's connections without streams")   # and a kept no stream

    trio.run(main)


def test_a_session_reuses_one_stream_per_peer_and_closes_it_at_the_end():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b = await _nodes(stack, 2)
                b_id = b.host.get_id()
                key = K.model_key(DIGEST).encode()
                value = as_record_set(good(identity(70), now=wall_ms()))
                async with rpc.Session(a.host) as session:
                    assert (await rpc.get_value(a.host, b_id, key, session))[0] is None
                    assert await rpc.put_value(a.host, b_id, key, value, session) is True
                    record, _ = await rpc.get_value(a.host, b_id, key, session)
                    assert record is not None and record.value
                    assert (session.opened, session.reused) == (1, 2)
                    assert _serving(b) == 1                         # one stream, held open between the RPCs
                    # a refused PUT resets that stream; the next RPC opens a fresh one
                    with pytest.raises(BaseLibp2pError):
                        await rpc.put_value(a.host, b_id, K.peer_key(identity(71).peer_id).encode(), value, session)
                    assert (await rpc.get_value(a.host, b_id, key, session))[0] is not None
                    assert session.opened == 2
                await wait_until(lambda: _serving(b) == 0, TEST_TIMEOUT_S,
                                 "b's inbound stream closed")   # closed with the session

    trio.run(main)


def test_a_table_peer_whose_address_entry_expired_does_not_break_the_answers_naming_it():
    """dht/compat/peer_record_gc.py: py-libp2p 0.8.1 raises inside KadDHT's answer for such a peer.

    ``c`` asks ``b`` once (so ``b`` holds ``c``'s signed peer record and has ``c`` in
    its table); ``c``'s entry at ``b`` then outlives its TTL (its last refresh moved
    into the past, as ten quiet minutes would). ``a``'s GET at ``b`` names ``c``:
    with the library's garbage collection ``b`` resets the stream, with ours it answers."""
    from dht.compat import peer_record_gc

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b, c = await _nodes(stack, 3)
                b_id, c_id = b.host.get_id(), c.host.get_id()
                key = K.model_key(DIGEST).encode()
                await rpc.get_value(c.host, b_id, key)
                book = b.host.get_peerstore()
                assert book.get_peer_record(c_id) is not None and b.kad.routing_table.peer_in_table(c_id)
                book.peer_data_map[c_id].last_identified -= 100_000       # the entry's TTL is long over
                assert peer_record_gc.APPLIED
                _, closer = await rpc.get_value(a.host, b_id, key)
                assert c_id in closer
                assert book.get_peer_record(c_id) is None                  # collected, without an exception
                await rpc.get_value(c.host, b_id, key)                     # c speaks again: record and entry back
                book.peer_data_map[c_id].last_identified -= 100_000
                peer_record_gc.restore()
                try:
                    with pytest.raises(BaseLibp2pError):
                        await rpc.get_value(a.host, b_id, key)
                finally:
                    assert peer_record_gc.apply()

    trio.run(main)


def test_a_stuck_peer_doubles_only_its_own_deadline_and_is_closed_after_stuck_after_misses():
    """The fault: ``b`` takes every inbound DHT stream and never answers (a host whose
    reader is gone). ``a``'s RPCs to ``b`` time out; each later miss waits twice as long
    as the one before; only the first miss is a latency sample of the shared estimate;
    after STUCK_AFTER misses ``a`` closes the connection and drops ``b`` from its table."""
    from dht import node as node_mod

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b, c = await _nodes(stack, 3)
                await connect_bootstrap(a.host, [f"{c.host.get_addrs()[0]}/p2p/{c.host.get_id()}"], 10)
                b_id, c_id = b.host.get_id(), c.host.get_id()
                hold = trio.Event()

                async def silent(stream):
                    await hold.wait()

                b.host.set_stream_handler(b.protocol, silent)
                a.rpc_timer = RpcTimer(CUT_S, CUT_S, 20 * CUT_S)
                a.rpc_timer.observe(0.01)                           # a fast network so far
                key = K.model_key(DIGEST).encode()
                durations, deadlines = [], []
                for _ in range(node_mod.STUCK_AFTER):
                    start = trio.current_time()
                    got = await a._rpc(b_id, rpc.get_value, key)
                    durations.append(trio.current_time() - start)
                    deadlines.append(a.rpc_timer.timeout())
                    assert got is a._TIMED_OUT
                assert node_mod.STUCK_AFTER >= 2
                assert CUT_S <= deadlines[0] < 2 * CUT_S            # one sample of ~CUT_S moved it a little
                assert len(set(deadlines)) == 1                     # the later misses did not move it
                for before, after in zip(durations, durations[1:]):
                    assert after >= 2 * before * 0.9               # each miss waited twice as long
                assert a.rpc_counts["stuck_closed"] == 1
                assert b_id not in a.host.get_network().connections
                assert not a.kad.routing_table.peer_in_table(b_id)
                record, _ = await a._rpc(c_id, rpc.get_value, key)  # c still answers at once
                assert record is None and a.health.unanswered == {}
                hold.set()

    trio.run(main)


def test_peers_late_together_stay_connected_past_stuck_after():
    """The fault: ``b`` and ``c`` both take every inbound DHT stream and never answer (busy).
    ``a``'s RPCs to each time out STUCK_AFTER times in a row, but each peer's misses come
    while the other is late too (within CONGESTION_WINDOW_S): congestion, so neither
    connection is closed (``stuck_kept``), and an answer later clears the backoff."""
    from dht import node as node_mod

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b, c = await _nodes(stack, 3)
                await connect_bootstrap(a.host, [f"{c.host.get_addrs()[0]}/p2p/{c.host.get_id()}"], 10)
                hold = trio.Event()

                async def silent(stream):
                    with trio.move_on_after(TEST_TIMEOUT_S / 2):
                        await hold.wait()

                for busy in (b, c):
                    busy.host.set_stream_handler(busy.protocol, silent)
                a.rpc_timer = RpcTimer(CUT_S, CUT_S, 20 * CUT_S)
                a.rpc_timer.observe(0.01)
                key = K.model_key(DIGEST).encode()

                async def misses(peer):
                    for _ in range(node_mod.STUCK_AFTER):
                        assert await a._rpc(peer, rpc.get_value, key) is a._TIMED_OUT

                async with trio.open_nursery() as nursery:
                    for busy in (b, c):
                        nursery.start_soon(misses, busy.host.get_id())
                assert a.rpc_counts["stuck_closed"] == 0 and a.rpc_counts["stuck_kept"] == 2
                for busy in (b, c):
                    assert busy.host.get_id() in a.host.get_network().connections
                assert a.kad.routing_table.peer_in_table(b.host.get_id())      # (c was never put in it)
                b.host.set_stream_handler(b.protocol, b.kad.handle_stream)
                record, _ = await a._rpc(b.host.get_id(), rpc.get_value, key)
                assert record is None and b.host.get_id() not in a.health.unanswered
                hold.set()

    trio.run(main)


class _StallPutAcks:
    """A served stream whose PUT_VALUE acknowledgements wait for ``release`` (a peer busy
    after storing); everything else passes through."""

    def __init__(self, stream, release: trio.Event, stalled: list) -> None:
        self._stream, self._release, self._stalled = stream, release, stalled

    def __getattr__(self, name):
        return getattr(self._stream, name)

    async def write(self, data: bytes) -> None:
        from libp2p.kad_dht.pb.kademlia_pb2 import Message

        msg = Message()
        try:
            msg.ParseFromString(data)
        except Exception:  # noqa: BLE001 - a length prefix
            msg = None
        if len(data) > 8 and msg is not None and msg.type == Message.MessageType.PUT_VALUE:
            self._stalled.append(1)
            with trio.move_on_after(TEST_TIMEOUT_S / 2):
                await self._release.wait()
        await self._stream.write(data)


def test_a_put_cut_by_the_deadline_is_not_sent_again():
    """The fault: ``b`` answers GET_VALUE at once but acknowledges a PUT_VALUE only much
    later (busy). ``a``'s publish cuts the PUT at its deadline and does not send it again:
    a retry would only add work where there is too much (a refused PUT is retried)."""
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b = await _nodes(stack, 2)
                release, stalled = trio.Event(), []

                async def handler(stream):
                    async with b.kad._inbound_limiter:
                        await b.kad._do_handle_stream(_StallPutAcks(stream, release, stalled))

                b.host.set_stream_handler(b.protocol, handler)
                a.rpc_timer = RpcTimer(CUT_S, CUT_S, 20 * CUT_S)
                a.rpc_timer.observe(0.01)
                key = K.model_key(DIGEST)
                acked = await a.put_remote(key, as_record_set(good(identity(70), now=wall_ms())))
                assert acked == 0 and len(stalled) == 1
                assert a.rpc_counts["answered"] == 1 and a.rpc_counts["timed_out"] == 1   # the lookup's GET; the PUT
                assert b.store.get(key.encode()) is not None          # it did store: it was only late
                release.set()

    trio.run(main)


def test_a_read_asks_late_holders_once_more_when_several_are_late_and_gives_up_a_lone_one():
    """The fault: holders stall past the reader's deadline on their first GET_VALUEs (busy).
    Both holders late in one lookup (LATE_QUORUM): congestion, each is asked once more under
    its doubled deadline and the record is found. One holder late while the other answers:
    it is given up after one deadline (a host gone without closing its connection must not
    cost every read two more)."""
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b, c = await _nodes(stack, 3)
                await connect_bootstrap(a.host, [f"{c.host.get_addrs()[0]}/p2p/{c.host.get_id()}"], 10)
                key = K.model_key(DIGEST).encode()
                for holder in (b, c):
                    holder.store_locally(key.decode(), as_record_set(good(identity(70), now=wall_ms())))
                release = trio.Event()
                entered: dict[str, int] = {"b": 0, "c": 0}
                late_for = {"b": 1, "c": 1}            # how many of its first streams each holder stalls

                def busy(name: str, node: DhtNode):
                    async def handler(stream):
                        entered[name] += 1
                        async with node.kad._inbound_limiter:
                            if entered[name] <= late_for[name]:
                                with trio.move_on_after(3 * LATE_CUT_S if late_for[name] == 1 else TEST_TIMEOUT_S / 4):
                                    await release.wait()
                            await node.kad._do_handle_stream(stream)
                    return handler

                b.host.set_stream_handler(b.protocol, busy("b", b))
                c.host.set_stream_handler(c.protocol, busy("c", c))
                a.rpc_timer = RpcTimer(LATE_CUT_S, LATE_CUT_S, 20 * LATE_CUT_S)
                a.rpc_timer.observe(0.01)
                recs = await a.fetch(key.decode())
                assert [r.peer_id for r in recs] == [identity(70).peer_id]
                # each holder was cut once and answered its second ask (their stream counts may include
                # a routing-table ping of a's, so a's own RPC counts are the measure)
                assert a.rpc_counts == {"answered": 2, "timed_out": 2, "failed": 0, "stuck_closed": 0,
                                        "stuck_kept": 0}
                assert a.last_lookup.rounds == 2 and a.last_lookup.failed == 0
                await wait_until(lambda: _serving(b) == 0 and _serving(c) == 0, TEST_TIMEOUT_S,
                                 "b's and c's inbound streams closed")

                entered.update(b=0, c=0)               # b stalls for good, c answers at once
                late_for.update(b=1_000, c=0)
                counts_before = dict(a.rpc_counts)
                a.health.unanswered.clear()
                a.rpc_timer = RpcTimer(LATE_CUT_S, LATE_CUT_S, 20 * LATE_CUT_S)
                a.rpc_timer.observe(0.01)
                recs = await a.fetch(key.decode())
                assert [r.peer_id for r in recs] == [identity(70).peer_id]
                counts = {k: a.rpc_counts[k] - counts_before[k] for k in counts_before}
                assert counts == {"answered": 1, "timed_out": 1, "failed": 0, "stuck_closed": 0,
                                        "stuck_kept": 0}
                assert a.last_lookup.failed == 1
                assert b.host.get_id() in a.host.get_network().connections   # under STUCK_AFTER: connected
                release.set()

    trio.run(main)


def test_a_dead_peer_other_peers_still_name_is_dialed_once_then_left_out_of_lookups():
    """``c`` exits; ``b`` still lists it and names it in every answer. ``a``'s first lookup
    dials ``c`` (refused: it fails); its next lookups leave ``c`` out (UNREACHABLE_S), until
    that has passed."""
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b = await _nodes(stack, 2)
                async with AsyncExitStack() as c_stack:
                    c_host = await c_stack.enter_async_context(running_host(identity(79), LOOPBACK))
                    await c_stack.enter_async_context(DhtNode(c_host, wall_ms).running())
                    await connect_bootstrap(c_host, [f"{b.host.get_addrs()[0]}/p2p/{b.host.get_id()}"], 10)
                    await wait_until(lambda: _synced_knows(b, c_host.get_id()), TEST_TIMEOUT_S,
                                     "c in b's routing table")
                    c_id = c_host.get_id()
                    key = K.model_key(DIGEST).encode()
                    await a.lookup(key)                  # a learns c's address from b's answer, and asks it
                    assert a.rpc_counts["answered"] == 2
                await wait_until(lambda: c_id not in b.host.get_network().connections, TEST_TIMEOUT_S,
                                 "b's connection to c closed")
                assert b.kad.routing_table.peer_in_table(c_id)      # b has not tried c since: still names it
                await a.lookup(key)
                assert a.rpc_counts["failed"] == 1 and c_id in a.health.unreachable
                for _ in range(3):
                    await a.lookup(key)
                assert a.rpc_counts["failed"] == 1 and a.rpc_counts["answered"] == 6    # b each time, c never
                a.health.unreachable_s = 0.0
                await trio.sleep(0.01)
                await a.lookup(key)                  # past UNREACHABLE_S: dialed again
                assert a.rpc_counts["failed"] == 2

    trio.run(main)


def test_the_librarys_maintenance_loop_gives_way_to_a_jittered_refresh_through_meshds_lookups(monkeypatch):
    """py-libp2p's KadDHT maintenance (at start and every 600 s: a library lookup per bucket,
    every node started together at once) does not run; DhtNode's refresh does, at a random
    phase, through meshd's lookup (its RPC counts move)."""
    from libp2p.kad_dht.kad_dht import KadDHT

    from dht import node as node_mod

    library_refreshes = []

    async def library_refresh(self):
        library_refreshes.append(self)

    monkeypatch.setattr(KadDHT, "refresh_routing_table", library_refresh)
    monkeypatch.setattr(node_mod, "REFRESH_INTERVAL_S", 0.2)

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b = await _nodes(stack, 2)
                assert a.maintenance_off is None and a.kad._run_main_loop == a._maintain
                answered = a.rpc_counts["answered"]
                await wait_until(lambda: a.refreshes >= 2 and b.refreshes >= 2, TEST_TIMEOUT_S,
                                 "two refreshes on each node")
                assert a.rpc_counts["answered"] >= answered + 2        # its lookups asked b
                assert library_refreshes == []

    trio.run(main)


def test_the_maintenance_loop_is_left_alone_on_another_library_version():
    class Kad:
        async def _run_main_loop(self):
            pass

    kad = Kad()
    loop = object()
    assert replace_maintenance(kad, "0.9.0", loop).startswith("off: libp2p 0.9.0 is installed")
    assert "_run_main_loop" not in vars(kad)
    assert (replace_maintenance(object(), "0.8.1", loop)
            == "off: the library's KadDHT has no maintenance loop to replace")
    assert replace_maintenance(kad, "0.8.1", loop) is None and kad._run_main_loop is loop


def test_a_stopping_host_closes_its_connections_so_its_peers_see_it_leave():
    """dht/host/build.py: py-libp2p 0.8.1's ``host.run`` leaves connections open when it
    exits; ``running_host`` closes them, so the peer stops holding a dead link."""
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with running_host(identity(80), LOOPBACK) as a:
                async with running_host(identity(81), LOOPBACK) as b:
                    await connect_bootstrap(b, [f"{a.get_addrs()[0]}/p2p/{a.get_id()}"], 10)
                    assert b.get_id() in a.get_network().connections
                await wait_until(lambda: b.get_id() not in a.get_network().connections, TEST_TIMEOUT_S,
                                 "a's connection to b closed")

    trio.run(main)
