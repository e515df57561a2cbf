"""Real py-libp2p hosts on loopback: Noise-only transport and the record validator in a live DHT."""
from __future__ import annotations

import time
from contextlib import AsyncExitStack

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.peer.peerinfo import PeerInfo

from dht import keys as K
from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.node import DhtNode
from dht.records import validate_capability
from meshd.errors import RecordRejected
from tests._daemon_helpers import DIGEST, as_record_set, forged_records, good, identity

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEST_TIMEOUT_S = 60


def wall_ms() -> int:
    return int(time.time() * 1000)


async def _swarm(stack: AsyncExitStack, idents):
    nodes = []
    for ident in idents:
        host = await stack.enter_async_context(running_host(ident, LOOPBACK))
        node = await stack.enter_async_context(DhtNode(host, wall_ms).running())
        nodes.append(node)
    boot = [str(nodes[0].host.get_addrs()[0])]
    for node in nodes[1:]:
        assert await connect_bootstrap(node.host, boot, 10) == [idents[0].peer_id]
    for node in nodes:
        await node.sync_peers()
    return nodes


def test_records_propagate_and_forgeries_are_refused_locally_and_remotely():
    victim, attacker, other = identity(21), identity(22), identity(23)

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                a, b, c = await _swarm(stack, [victim, attacker, other])
                now = wall_ms()
                stored = validate_capability(good(victim, seq=10, now=now), now)
                assert await a.publish(stored) > 0
                for node in (a, b, c):
                    seen = await node.fetch(K.model_key(DIGEST))
                    assert [r.peer_id for r in seen] == [victim.peer_id]
                    assert [r.peer_id for r in await node.fetch(K.span_key(DIGEST, 0, 4))] == [victim.peer_id]
                snapshot = {k: b.store.get(k.encode()).value
                            for k in (K.peer_key(victim.peer_id), K.model_key(DIGEST))}
                table = forged_records(victim, attacker, now=now)
                for name, raw in table.items():
                    # locally: the validator refuses before anything is stored
                    for key, value in ((K.peer_key(victim.peer_id), raw),
                                       (K.model_key(DIGEST), as_record_set(raw))):
                        with pytest.raises(RecordRejected):
                            a.store_locally(key, value)
                        # remotely: pushed straight to peer b with a raw PUT_VALUE
                        ok = await c.kad.value_store._store_at_peer(
                            b.host.get_id(), key.encode(), value, record=Record(key=key.encode(), value=value))
                        assert not ok, f"{name} accepted by a remote peer under {key}"
                for key, value in snapshot.items():
                    assert b.store.get(key.encode()).value == value, f"{key} changed"
                # a newer record does replace, everywhere
                newer = validate_capability(good(victim, seq=11, now=wall_ms(), start=2, end=6), wall_ms())
                await a.publish(newer)
                assert [(r.sequence, r.span) for r in await c.fetch(K.model_key(DIGEST))] == [(11, (2, 6))]
                assert [r.sequence for r in await b.fetch(K.peer_key(victim.peer_id))] == [11]

    trio.run(main)


@pytest.mark.parametrize("offer", ["plaintext", "secio"])
def test_dialer_without_noise_is_refused(offer):
    import libp2p.security.secio.transport as secio
    from libp2p.custom_types import TProtocol
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with running_host(identity(31), LOOPBACK) as ours:
                kp = create_new_key_pair()
                sec = ({TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)} if offer == "plaintext"
                       else {TProtocol(secio.ID): secio.Transport(kp)})
                dialer = new_host(key_pair=kp, sec_opt=sec)
                async with dialer.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                    with pytest.raises(Exception) as info:
                        await dialer.connect(PeerInfo(ours.get_id(), ours.get_addrs()))
                    assert "connect" in str(info.value).lower()
                    assert dialer.get_connected_peers() == []
                    assert ours.get_connected_peers() == []

    trio.run(main)


def test_default_libp2p_dialer_negotiates_noise():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with running_host(identity(32), LOOPBACK) as ours:
                dialer = new_host(key_pair=create_new_key_pair())  # offers noise, tls, secio, plaintext
                async with dialer.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                    await dialer.connect(PeerInfo(ours.get_id(), ours.get_addrs()))
                    conn = dialer.get_network().connections[ours.get_id()][0]
                    session = conn.muxed_conn.secured_conn
                    assert "noise" in type(session.conn).__module__
                    assert type(conn.muxed_conn).__name__ == "Yamux"
    trio.run(main)
