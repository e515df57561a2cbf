"""meshd's two Kademlia RPCs (GET_VALUE, PUT_VALUE) over py-libp2p's Kademlia wire, cancel-safe.

Why not the library's ``ValueStore._get_from_peer`` / ``_store_at_peer``:
both end with ``finally: await stream.close()``. A caller's deadline
(DhtNode bounds every RPC) cancels that close too, so the stream is never
closed nor reset: the peer's handler -- py-libp2p 0.8.1's KadDHT serves a
stream in a loop until EOF, with no idle deadline -- waits on it for as long
as the connection lives, holding one of its inbound DHT slots, and the
stream keeps one of the connection's 256 yamux stream slots on our side.
Measured in ``meshd bench dht`` at 200 nodes: after a burst of timeouts
hundreds of such handlers per process, and the leaked slots fed more
timeouts. Here a stream that does not end in a complete answer is reset,
and the reset (or the close of a good one) runs shielded from the caller's
cancellation, bounded by CLEANUP_S.

Wire (the library's, unchanged): one varint-length-prefixed ``Message``
each way, on the swarm's protocol id (``/meshd/kad/<tag>/1.0.0``,
dht/host/swarm_scope.py; ``protocol``, the default swarm's when not given) in
place of the library's ``/ipfs/kad/1.0.0``; a request carries our signed peer record (``senderRecord``) as
the library's client does; a GET_VALUE answer's ``closerPeers`` addresses
go into the peerstore (ADDR_TTL_S) so that a lookup can dial them.

``Session``: one operation's streams, kept open between its RPCs to the
same peer. A publish asks the k closest peers of a key (GET_VALUE, its
lookup's last round) and then PUTs to those same peers; over a kept stream
the PUT is one message each way, where a new stream costs a yamux SYN, a
multistream negotiation and a FIN on both sides besides (measured here:
0.5 ms CPU per RPC on a kept stream, 1.7 ms on a new one, both ends
counted). A session holds at most one idle stream per peer and closes them
all when the operation ends, so a peer's inbound DHT slots are held only
while an operation that talks to it runs.

``RpcTimer`` (sans-I/O, in dht/kademlia/book.py with the rest of a node's
RPC bookkeeping; re-exported here) derives the deadline of the next RPC from
the latencies measured so far, as TCP derives its retransmission timeout
(RFC 6298: SRTT + 4 RTTVAR), clamped to [floor, ceiling].
"""
from __future__ import annotations

import logging

import trio
import varint
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE
from libp2p.kad_dht.pb.kademlia_pb2 import Message, Record
from libp2p.peer.id import ID
from libp2p.peer.peerstore import env_to_send_in_RPC
from libp2p.utils.varint import read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from dht.host.swarm_scope import DEFAULT_SCOPE
from dht.kademlia.book import RpcTimer

__all__ = ["ADDR_TTL_S", "CLEANUP_S", "DEFAULT_PROTOCOL", "RpcTimer", "Session", "get_value", "put_value",
           "reset_stream"]

log = logging.getLogger(__name__)

# A reset or close is a frame or two: bounded so a wedged connection cannot hold the caller.
CLEANUP_S = 1.0
# How long the addresses a GET_VALUE answer names stay in the peerstore (the library's value).
ADDR_TTL_S = 600
# The DHT protocol of the default swarm (a DhtNode passes its own swarm's).
DEFAULT_PROTOCOL = TProtocol(DEFAULT_SCOPE.dht_protocol)


async def _end(stream, peer, *, good: bool) -> None:
    """Close a stream that ended in a complete answer, reset any other; shielded from the
    caller's cancellation and bounded (CLEANUP_S)."""
    with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_S):
        try:
            if good:
                await stream.close()
            else:
                await stream.reset()
        except Exception as exc:  # noqa: BLE001 - the stream may already be gone with its connection
            log.debug("cleaning up a DHT stream to %s: %s", peer, exc)


async def reset_stream(stream, peer) -> None:
    """Reset ``stream`` (shielded, bounded): a probe that only wanted to know the peer speaks it."""
    await _end(stream, peer, good=False)


async def _ask(stream, request: Message) -> Message:
    data = request.SerializeToString()
    await stream.write(varint.encode(len(data)) + data)
    raw = await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
    answer = Message()
    answer.ParseFromString(raw)
    return answer


class Session:
    """Streams kept open between the RPCs of one operation (see the module docstring).

    ``exchange`` takes this peer's idle stream if there is one, else opens
    one; after a complete answer the stream is idle again, after anything
    else (an error, the caller's deadline) it is reset and forgotten.
    ``aclose`` closes every idle stream. State: peer -> idle stream; counts
    of streams ``opened`` and RPCs that ``reused`` one."""

    def __init__(self, host, protocol: str = DEFAULT_PROTOCOL) -> None:
        self.host = host
        self.protocol = TProtocol(protocol)
        self._idle: dict = {}
        self._envelope: bytes | None = None
        self.opened = 0
        self.reused = 0

    async def exchange(self, peer: ID, request: Message) -> Message:
        if self._envelope is None:
            self._envelope, _ = env_to_send_in_RPC(self.host)
        request.senderRecord = self._envelope
        stream = self._idle.pop(peer, None)
        if stream is None:
            stream = await self.host.new_stream(peer, [self.protocol])  # the library resets it if negotiation fails
            self.opened += 1
        else:
            self.reused += 1
        answered = False
        try:
            answer = await _ask(stream, request)
            answered = True
        finally:
            if not answered:
                await _end(stream, peer, good=False)
        if peer in self._idle:          # a concurrent RPC to this peer left one idle already
            await _end(stream, peer, good=True)
        else:
            self._idle[peer] = stream
        return answer

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for peer, stream in idle.items():
            await _end(stream, peer, good=True)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def _exchange(host, peer: ID, request: Message, session: Session | None = None,
                    protocol: str = DEFAULT_PROTOCOL) -> Message:
    """Send ``request`` to ``peer`` and return the answer: over ``session``'s streams when
    given, else over a stream of its own, closed after a complete answer and reset otherwise
    (a failure, or the caller's cancellation), shielded and bounded (CLEANUP_S)."""
    if session is not None:
        return await session.exchange(peer, request)
    async with Session(host, protocol) as one:
        return await one.exchange(peer, request)


async def get_value(host, peer: ID, key: bytes, session: Session | None = None,
                    protocol: str = DEFAULT_PROTOCOL) -> tuple[Record | None, list[ID]]:
    """GET_VALUE ``key`` at ``peer``: (the record it holds or None, the peers it knows closest to ``key``).

    Raises on a failed dial or stream (the caller tells a dead peer from a slow one)."""
    request = Message(type=Message.MessageType.GET_VALUE, key=key)
    answer = await _exchange(host, peer, request, session, protocol)
    if answer.type != Message.MessageType.GET_VALUE:
        raise ValueError(f"answer of type {answer.type} to GET_VALUE")
    me = host.get_id()
    peerstore = host.get_peerstore()
    closer: list[ID] = []
    for entry in answer.closerPeers:
        try:
            pid = ID(entry.id)
        except Exception:  # noqa: BLE001 - a malformed entry is skipped, as the library does
            continue
        if pid == me:
            continue
        closer.append(pid)
        if entry.addrs:
            try:
                peerstore.add_addrs(pid, [Multiaddr(a) for a in entry.addrs], ADDR_TTL_S)
            except Exception:  # noqa: BLE001 - unparsable addresses: the peer stays undialable
                pass
    record = answer.record if answer.HasField("record") and answer.record.value else None
    return record, closer


async def put_value(host, peer: ID, key: bytes, value: bytes, session: Session | None = None,
                    protocol: str = DEFAULT_PROTOCOL) -> bool:
    """PUT_VALUE ``key`` = ``value`` at ``peer``; True when it acknowledged (stored it).

    A peer refuses (resets) a value its validator rejects or that is not newer
    than what it holds; that raises like any failed stream."""
    request = Message(type=Message.MessageType.PUT_VALUE, key=key, record=Record(key=key, value=value))
    answer = await _exchange(host, peer, request, session, protocol)
    return answer.type == Message.MessageType.PUT_VALUE and answer.key == key
