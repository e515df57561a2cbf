"""dht/rpc.py: meshd's cancel-safe GET_VALUE / PUT_VALUE, its sessions and its deadline estimator.

RpcTimer is pure. The RPCs run between real py-libp2p hosts on loopback, each
with meshd's DhtNode (the library's KadDHT serving the other end). A peer's
busy inbound DHT handlers are read off its KadDHT's inbound limiter (one
token per stream being served). The one fault injected is a peer that
stalls before answering: its KadDHT handler waits on an event first.
"""
from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.kad_dht.common import PROTOCOL_ID

from dht import keys as K
from dht import rpc
from dht.node import DhtNode
from dht.records import parse_record_set_lenient
from dht.rpc import RpcTimer
from relay.host import connect_bootstrap, running_host
from tests._daemon_helpers import DIGEST, as_record_set, good, identity

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEST_TIMEOUT_S = 60
# how long the caller waits for a stalled peer before cutting the RPC (not a measured threshold)
CUT_S = 0.3


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
            with trio.fail_after(TEST_TIMEOUT_S):     # each in the other's table (an insertion may need a retry)
                while not (node.kad.routing_table.peer_in_table(prev.get_id())
                           and nodes[-1].kad.routing_table.peer_in_table(host.get_id())):
                    await node.sync_peers()
                    await nodes[-1].sync_peers()
                    await trio.sleep(0.05)
        nodes.append(node)
    return nodes


def _serving(node: DhtNode) -> int:
    """Inbound DHT streams ``node``'s KadDHT is serving now."""
    return int(node.kad._inbound_limiter.borrowed_tokens)


async def _until(predicate) -> None:
    with trio.fail_after(TEST_TIMEOUT_S):
        while not predicate():
            await trio.sleep(0.02)


def test_get_and_put_speak_the_librarys_wire_and_leave_no_stream_open():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b, c = await _nodes(stack, 3)
                b_id, c_id = b.host.get_id(), c.host.get_id()
                key = K.model_key(DIGEST).encode()
                value = as_record_set(good(identity(70), now=wall_ms()))
                assert await rpc.put_value(a.host, b_id, key, value) is True
                await _until(lambda: _serving(b) == 0)
                record, closer = await rpc.get_value(a.host, b_id, key)
                assert [r.peer_id for r in parse_record_set_lenient(record.value, wall_ms())] == [identity(70).peer_id]
                assert c_id in closer and a.host.get_id() not in closer
                assert a.host.get_peerstore().addrs(c_id)          # the answer's addresses: c is dialable
                record, _ = await rpc.get_value(a.host, b_id, K.model_key("sha256:" + "cd" * 32).encode())
                assert record is None
                await _until(lambda: _serving(b) == 0)
                # b's validator refuses a value under the wrong key: b resets, the caller sees an error
                with pytest.raises(Exception):
                    await rpc.put_value(a.host, b_id, K.peer_key(identity(71).peer_id).encode(), value)
                await _until(lambda: _serving(b) == 0)

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

                b.host.set_stream_handler(PROTOCOL_ID, stalled)
                with trio.move_on_after(CUT_S) as cut:
                    await rpc.get_value(a.host, b_id, K.model_key(DIGEST).encode())
                assert cut.cancelled_caught and len(entered) == 1 and _serving(b) == 1
                release.set()                       # b now reads the request, and then the reset
                await _until(lambda: _serving(b) == 0)
                conn = a.host.get_network().connections[b_id]
                conns = conn if isinstance(conn, list) else [conn]
                await _until(lambda: all(not c.muxed_conn.streams for c in conns))   # and a kept no stream

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
                    with pytest.raises(Exception):
                        await rpc.put_value(a.host, b_id, K.peer_key(identity(71).peer_id).encode(), value, session)
                    assert (await rpc.get_value(a.host, b_id, key, session))[0] is not None
                    assert session.opened == 2
                await _until(lambda: _serving(b) == 0)              # closed with the session

    trio.run(main)


def test_a_table_peer_whose_address_entry_expired_does_not_break_the_answers_naming_it():
    """relay/peer_record_gc.py: py-libp2p 0.8.1 raises inside KadDHT's answer for such a peer.

    ``c`` asks ``b`` once (so ``b`` holds ``c``'s signed peer record and has ``c`` in
    its table); ``c``'s entry at ``b`` then outlives its TTL (its last refresh moved
    into the past, as ten quiet minutes would). ``a``'s GET at ``b`` names ``c``:
    with the library's garbage collection ``b`` resets the stream, with ours it answers."""
    from relay import peer_record_gc

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
                    with pytest.raises(Exception):
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

                b.host.set_stream_handler(PROTOCOL_ID, silent)
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
                assert record is None and a._unanswered == {}
                hold.set()

    trio.run(main)


def test_a_stopping_host_closes_its_connections_so_its_peers_see_it_leave():
    """relay/host.py: py-libp2p 0.8.1's ``host.run`` leaves connections open when it
    exits; ``running_host`` closes them, so the peer stops holding a dead link."""
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with running_host(identity(80), LOOPBACK) as a:
                async with running_host(identity(81), LOOPBACK) as b:
                    await connect_bootstrap(b, [f"{a.get_addrs()[0]}/p2p/{a.get_id()}"], 10)
                    assert b.get_id() in a.get_network().connections
                await _until(lambda: b.get_id() not in a.get_network().connections)

    trio.run(main)
