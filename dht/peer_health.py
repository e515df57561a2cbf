"""What one DhtNode knows about its peers' answers (pure: the caller passes the time).

Data flow: ``dht/node.py``'s ``_rpc`` reports every RPC's outcome here
(``answered``, ``failed``, ``missed``) and asks how long this peer's next
deadline is backed off (``misses``); its lookups ask which peers to leave out
(``skip``) and report peers they could not dial (``unreachable``).

State, all bounded:
* consecutive unanswered RPCs per connected peer (its deadline doubles per
  miss; at ``stuck_after`` its connection is closed -- ``missed`` says so);
* the latest misses, (when, peer), at most ``recent`` of them: another peer's
  miss within ``congestion_window_s`` reads as congestion (this machine or
  the network is slow), and then a peer at ``stuck_after`` is kept, since
  closing a busy peer's connection fails its RPCs in flight both ways and
  makes its next one pay a handshake -- load added where there is too much;
* peers whose dial failed, with when, at most ``max_unreachable`` (oldest
  forgotten first): left out of lookups for ``unreachable_s`` unless
  connected again (after churn every answer still names the dead).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Container, Hashable

# What ``missed`` tells the caller to do with the peer's connection.
WAIT, CLOSE, KEEP = "wait", "close", "keep"


class PeerHealth:
    def __init__(self, *, stuck_after: int, congestion_window_s: float, recent: int,
                 unreachable_s: float, max_unreachable: int) -> None:
        if stuck_after < 1 or recent < 1 or max_unreachable < 1:
            raise ValueError("stuck_after, recent and max_unreachable must be positive")
        self.stuck_after = stuck_after
        self.congestion_window_s = congestion_window_s
        self.unreachable_s = unreachable_s
        self.max_unreachable = max_unreachable
        self.unanswered: dict = {}                       # peer -> consecutive misses
        self.recent: deque = deque(maxlen=recent)        # (when, peer) of the latest misses
        self.unreachable: dict = {}                      # peer -> when its dial failed (insertion-ordered)

    def misses(self, peer: Hashable) -> int:
        return self.unanswered.get(peer, 0)

    def answered(self, peer: Hashable) -> None:
        self.unanswered.pop(peer, None)

    failed = answered      # a failure (stream reset, connection gone) ends a run of misses too

    def missed(self, peer: Hashable, now: float) -> str:
        """A connected peer left an RPC unanswered: WAIT (below stuck_after), CLOSE its
        connection (stuck), or KEEP it (stuck_after reached while other peers are late too)."""
        misses = self.unanswered.get(peer, 0) + 1
        congested = any(other != peer and now - when <= self.congestion_window_s for when, other in self.recent)
        self.recent.append((now, peer))
        if misses < self.stuck_after:
            self.unanswered[peer] = misses
            return WAIT
        if congested:
            self.unanswered[peer] = misses
            return KEEP
        self.unanswered.pop(peer, None)
        return CLOSE

    def mark_unreachable(self, peer: Hashable, now: float) -> None:
        self.unreachable.pop(peer, None)
        self.unreachable[peer] = now
        while len(self.unreachable) > self.max_unreachable:
            del self.unreachable[next(iter(self.unreachable))]

    def skip(self, now: float, connected: Container) -> frozenset:
        """Peers a lookup leaves out: unreachable within unreachable_s and not connected since."""
        for peer in [p for p, when in self.unreachable.items() if now - when > self.unreachable_s or p in connected]:
            del self.unreachable[peer]
        return frozenset(self.unreachable)
