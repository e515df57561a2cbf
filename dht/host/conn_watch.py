"""Connection notifications from the host's swarm as trio events (py-libp2p's INotifee).

    ConnectionWatch(host)          registered once on host.get_network()
    ├── closed(peer) -> trio.Event set when the LAST connection to ``peer`` closes
    │                               (at once if there is none now)
    └── on_connect(callback)       callback(peer_id_text) for every new connection

The reservation keeper (relay/reachability.py) waits on ``closed(relay)`` so
a dead relay is noticed when its connection goes (the swarm's disconnected
notification), not at the renewal minutes later; relay mode uses
``on_connect`` to hand its record to a peer that just connected.

State: the per-peer events handed out and not yet fired, and the connect
callbacks. Callbacks run inside the swarm's notification nursery: they must
not block (they set events, nothing else).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from libp2p.abc import INotifee

log = logging.getLogger(__name__)

__all__ = ["ConnectionWatch", "peer_text"]

# Events handed out per peer and still waiting (a keeper holds one per slot);
# beyond this the oldest are fired early (a spurious wake is harmless: the
# waiter checks the connection again).
MAX_WATCHED = 256


def peer_text(peer) -> str:
    """A peer id as base58 text (an ID, or a string already)."""
    return peer.to_base58() if hasattr(peer, "to_base58") else str(peer)


class ConnectionWatch(INotifee):
    def __init__(self, host) -> None:
        self.host = host
        self._closed: dict[str, list[trio.Event]] = {}
        self._on_connect: list[Callable[[str], None]] = []
        host.get_network().register_notifee(self)

    def connected_to(self, peer) -> bool:
        conns = self.host.get_network().connections
        for pid, value in conns.items():
            if peer_text(pid) == peer_text(peer):
                return bool(value) if isinstance(value, (list, tuple)) else value is not None
        return False

    def closed(self, peer) -> trio.Event:
        """An event set once no connection to ``peer`` is left (already set if none is open)."""
        event = trio.Event()
        if not self.connected_to(peer):
            event.set()
            return event
        waiting = self._closed.setdefault(peer_text(peer), [])
        waiting[:] = [e for e in waiting if not e.is_set()]
        waiting.append(event)
        if sum(len(v) for v in self._closed.values()) > MAX_WATCHED:
            oldest = next(iter(self._closed))
            for e in self._closed.pop(oldest):
                e.set()
        return event

    def on_connect(self, callback: Callable[[str], None]) -> None:
        self._on_connect.append(callback)

    # ------------------------------------------------------------------ INotifee
    async def connected(self, network, conn) -> None:
        pid = peer_text(conn.muxed_conn.peer_id)
        for callback in self._on_connect:
            callback(pid)

    async def disconnected(self, network, conn) -> None:
        pid = peer_text(conn.muxed_conn.peer_id)
        if pid in self._closed and not self.connected_to(pid):
            log.debug("last connection to %s closed", pid)
            for event in self._closed.pop(pid):
                event.set()

    async def opened_stream(self, network, stream) -> None:
        pass

    async def closed_stream(self, network, stream) -> None:
        pass

    async def listen(self, network, multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr) -> None:
        pass
