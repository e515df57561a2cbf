"""Entry side of relayed hops: circuits to relayed peers through the daemon's own host.

The route driver runs in a worker thread; the libp2p host lives in the
daemon's trio loop. The dialer reaches that loop through the daemon's
``relay.portal.Portal`` (the one thread-to-loop bridge: no second host, no
second loop). ``RelayDialer.transport(peer, relayed_addrs)``:

    for each relayed addr of the peer, in the advertised order:
        skip relays that failed within FAILED_RELAY_MEMORY_S
        dial_relayed (relay/client.py): HOP CONNECT + Noise + yamux end to end
        -> circuit_transport: a HopTransport (proto.hop_transport) whose Session
           streams are opened ON THAT circuit connection (not whatever connection
           the swarm would pick), carrying the same frames as a gRPC hop
    none worked -> HopFailure (the driver avoids the peer)

With an ``upgrader`` (meshd/reach/direct_upgrade.py), every transport handed out on
a circuit also asks for a background DCUtR upgrade to that peer (bounded,
rate-limited per peer, silent on failure). Once an attempt found a verified
direct connection, ``transport`` opens NEW session streams on it instead (same
protocol, same frames, still Noise); sessions already on the circuit keep it.
A hop that fails on the direct connection drops it: the retry takes the circuit.

When a relayed hop fails mid-generation the driver asks
``retry_same_peer(peer)``: the relay the hop used is remembered as failed
and its circuit closed; if another advertised relay is left, the driver
rebuilds the hop on the SAME peer (its route, hence its output, unchanged)
and ``transport`` dials through the next relay. A peer that is really gone
fails every relay and is then avoided like any failed peer.

State (guarded by one lock: one dialer per daemon, shared by the driver
threads of concurrent generations): failed relays with their expiry, and per
peer the circuit in use, the relay it went through and the relays offered.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence

import trio
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

from meshd.errors import HopFailure
from relay.client import dial_relayed, parse_relayed_addr
from relay.errors import RelayError, RelayRefused, RelayUnreachable
from relay.portal import Portal
from relay.syncchannel import RelayedTransport
from relay.transport import OPEN_STREAM_TIMEOUT_S, SESSION_PROTOCOL, RelayedFrameChannel

__all__ = ["RelayDialer", "circuit_transport", "FAILED_RELAY_MEMORY_S"]

# A relay that failed is skipped for this long: long enough to finish the
# generation on another relay, short enough that a restarted relay is used again.
FAILED_RELAY_MEMORY_S = 120.0
# A relay's death closes our connection to it at once (TCP reset or EOF); allow the
# swarm this long to notice before we conclude the relay is alive.
RELAY_DEATH_GRACE_S = 1.0
# Relayed peers (and relays) whose state we remember; a home swarm has far fewer.
# Beyond it the oldest entries are forgotten (a forgotten relay is simply tried again).
MAX_TRACKED_PEERS = 1024
# Multistream negotiation of the session protocol on a live circuit (seconds, int for the library).
NEGOTIATE_TIMEOUT_S = 10


async def open_session_on(host, conn) -> RelayedFrameChannel:
    """A new SESSION_PROTOCOL stream on one given swarm connection (our circuit)."""
    with trio.move_on_after(OPEN_STREAM_TIMEOUT_S):
        try:
            stream = await conn.new_stream()
            selected = await host.multiselect_client.select_one_of(
                [SESSION_PROTOCOL], MultiselectCommunicator(stream), NEGOTIATE_TIMEOUT_S)
            stream.set_protocol(selected)
        except Exception as exc:  # closed circuit, refused protocol, reset
            raise RelayUnreachable(f"cannot open a session stream on the circuit: {exc}") from exc
        return RelayedFrameChannel(stream, side="e")
    raise RelayUnreachable(f"no session stream on the circuit within {OPEN_STREAM_TIMEOUT_S:g} s")


def circuit_transport(portal: Portal, host, conn) -> RelayedTransport:
    """A HopTransport whose Session streams open on one libp2p connection (a circuit, or the
    direct connection a DCUtR upgrade found)."""
    return RelayedTransport(portal, functools.partial(open_session_on, host, conn), conn=conn)


class RelayDialer:
    def __init__(self, host, portal: Portal, *, clock: Callable[[], float] = time.monotonic,
                 memory_s: float = FAILED_RELAY_MEMORY_S, upgrader=None) -> None:
        self.host, self.portal, self.clock, self.memory_s = host, portal, clock, memory_s
        self.upgrader = upgrader   # DirectUpgrader or None (no direct upgrades)
        self._lock = threading.Lock()
        self._failed: dict[str, float] = {}          # relay peer id -> skip until (clock)
        self._circuits: dict[str, tuple[str, object]] = {}   # peer id -> (relay peer id, connection)
        self._offered: dict[str, tuple[str, ...]] = {}       # peer id -> relays it advertised
        self._last_relay: dict[str, str] = {}                 # peer id -> relay of its latest circuit

    def relay_failed_recently(self, relay_peer_id: str) -> bool:
        with self._lock:
            until = self._failed.get(relay_peer_id)
            if until is not None and until <= self.clock():
                del self._failed[relay_peer_id]
                return False
            return until is not None

    def mark_failed(self, relay_peer_id: str) -> None:
        with self._lock:
            self._failed[relay_peer_id] = self.clock() + self.memory_s

    def transport(self, peer_id: str, relayed_addrs: Sequence[str]) -> RelayedTransport:
        """A transport to ``peer_id`` through the first relay of ``relayed_addrs`` that works."""
        targets = []
        for addr in relayed_addrs:
            try:
                relay, dest = parse_relayed_addr(addr)
            except Exception:  # noqa: BLE001 - a malformed advertised address is skipped
                continue
            if dest.to_base58() == peer_id:
                targets.append((relay.peer_id.to_base58(), relay, dest))
        with self._lock:
            self._offered[peer_id] = tuple(dict.fromkeys(t[0] for t in targets))
            held = self._circuits.get(peer_id)
            for table in (self._failed, self._offered, self._last_relay, self._circuits):
                while len(table) > MAX_TRACKED_PEERS:
                    table.pop(next(iter(table)))
        direct = self.upgrader.direct_for_session(peer_id) if self.upgrader is not None else None
        if direct is not None:
            return circuit_transport(self.portal, self.host, direct)
        if held is not None and not getattr(held[1], "is_closed", True) \
                and not self.relay_failed_recently(held[0]):
            return self._on_circuit(peer_id, held[1])
        tried = []
        for relay_id, relay, dest in targets:
            if self.relay_failed_recently(relay_id):
                tried.append(f"{relay_id[:12]}: failed recently")
                continue
            try:
                conn = self.portal.run(dial_relayed, self.host, relay, dest)
            except RelayRefused as exc:   # the relay is alive; the peer holds no slot there
                tried.append(f"{relay_id[:12]}: {exc}")
                continue
            except RelayError as exc:
                self.mark_failed(relay_id)
                tried.append(f"{relay_id[:12]}: {exc}")
                continue
            with self._lock:
                self._circuits[peer_id] = (relay_id, conn)
                self._last_relay[peer_id] = relay_id
            return self._on_circuit(peer_id, conn)
        raise HopFailure(0, peer_id, "no relay reaches the peer (" + ("; ".join(tried) or "no relayed address")
                         + ")")

    def _on_circuit(self, peer_id: str, conn) -> RelayedTransport:
        if self.upgrader is not None:
            self.upgrader.request(peer_id)   # background, bounded; never delays or fails this hop
        return circuit_transport(self.portal, self.host, conn)

    def retry_same_peer(self, peer_id: str) -> bool:
        """The hop to ``peer_id`` failed. If its relay is gone (our connection to it closed: the
        circuit rides on it), remember the relay as failed and return True when another
        advertised relay or an open direct connection is left; if the relay is alive the peer
        is to blame (False). A direct connection (DCUtR) that closed since is dropped (True,
        once): the circuit is the way left.

        One dialer serves every generation of the daemon: when two generations lose the same
        circuit, the second one finds it already handled and gets the same answer."""
        if self.upgrader is not None and self.upgrader.take_lost(peer_id):
            return True   # our direct connection to the peer closed: the circuit is the way left
        with self._lock:
            held = self._circuits.get(peer_id)
            last = self._last_relay.get(peer_id)
        if held is None:
            return last is not None and self.relay_failed_recently(last) and self._other_way_left(peer_id, last)
        relay_id, conn = held
        try:
            relay_alive = self.portal.run(_still_connected, self.host, relay_id)
            if not relay_alive:
                self.portal.run(_close, conn)
        except RelayError:
            return False
        if relay_alive:
            return False
        self.mark_failed(relay_id)
        with self._lock:
            if self._circuits.get(peer_id) is held:
                del self._circuits[peer_id]
        return self._other_way_left(peer_id, relay_id)

    def _other_way_left(self, peer_id: str, failed_relay: str) -> bool:
        """Another advertised relay that has not failed, or an open direct connection."""
        if self.upgrader is not None and self.upgrader.direct(peer_id) is not None:
            return True
        with self._lock:
            offered = self._offered.get(peer_id, ())
        return any(r != failed_relay and not self.relay_failed_recently(r) for r in offered)


async def _still_connected(host, relay_id: str) -> bool:
    from libp2p.peer.id import ID

    relay = ID.from_base58(relay_id)
    with trio.move_on_after(RELAY_DEATH_GRACE_S):
        # py-libp2p has no connection-closed event to wait on: poll the connections.
        while any(not c.is_closed for c in host.get_network().get_connections(relay)):  # noqa: ASYNC110 - see above
            await trio.sleep(0.05)
        return False
    return True


async def _close(conn) -> None:
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - already gone
        pass
