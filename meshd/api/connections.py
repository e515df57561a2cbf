"""Who holds the API's connection slots, and for how long (sans-I/O; the trio edge is server.py).

A connection is a slot from accept to close. The table decides three things:

    admit(address, now)     a new connection: take a free slot; at the per-address
                            cap, or with every slot taken, close the oldest connection
                            that has no request in flight -- of this address, or of the
                            address that holds the most -- to make room (its ids come
                            back in ``evict``); if every candidate is busy, refuse it.
    deadline(conn)          when a connection with nothing in flight is closed:
                            FIRST_REQUEST_S after accept if it never sent a whole
                            request (slowloris headers, an HTTP/2 preface and nothing
                            else), IDLE_S after its last request ended (keep-alive).
                            None while a request is in flight (the app bounds those:
                            body read timeout, generation deadline).
    request_started/ended   fed by the ASGI layer (``tracked``), keyed by the peer's
                            (host, port): what the app sees is the truth about a
                            connection, whatever the HTTP library thinks of it.

So a client that hoards sockets holds at most ``per_address`` of them, holds each
for seconds, and never keeps a newcomer out: a new address always gets a slot
while any connection is idle. Only connections with a request in flight are
safe from eviction -- those are bounded by the entry's admission (meshd/api/entry.py).

State: the connections (id -> record) and the counts of what was refused,
evicted and expired (``snapshot``: ``meshd status``). Times are the caller's
clock (trio's in the server, so tests run it on MockClock). Not thread-safe:
one trio loop owns it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

# Default slot counts: the daemon's api.max_connections is the total; one address may hold half, so
# a single hoarding host always leaves the other half to everyone else.
PER_ADDRESS_SHARE = 0.5
# A connection must deliver one whole request (headers; the body has the app's own bound) this soon
# after accept. Browsers and SDKs send theirs at once; 10 s leaves room for a slow link.
FIRST_REQUEST_S = 10.0
# A connection with no request in flight is closed this long after its last one ended (keep-alive;
# the same value Hypercorn uses for HTTP/1.1: meshd/api/server.py KEEP_ALIVE_S).
IDLE_S = 5.0

REASONS = ("refused", "evicted", "first_request_timeout", "idle_timeout")


@dataclass(slots=True)
class Conn:
    id: int
    address: str
    peer: tuple[str, int]
    opened_at: float
    idle_since: float
    in_flight: int = 0
    requests: int = 0

    @property
    def busy(self) -> bool:
        return self.in_flight > 0


@dataclass(frozen=True, slots=True)
class Admission:
    conn: Conn | None                 # None: refused (close the socket at once)
    evict: tuple[int, ...] = ()       # connections to close first (they had nothing in flight)


@dataclass
class ConnectionTable:
    max_connections: int
    per_address: int = 0              # 0: max_connections * PER_ADDRESS_SHARE
    first_request_s: float = FIRST_REQUEST_S
    idle_s: float = IDLE_S
    conns: dict[int, Conn] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if not self.per_address:
            self.per_address = max(1, int(self.max_connections * PER_ADDRESS_SHARE))
        self._ids = itertools.count(1)
        self._by_peer: dict[tuple[str, int], int] = {}

    # ------------------------------------------------------------------ admission
    def _of(self, address: str) -> list[Conn]:
        return [c for c in self.conns.values() if c.address == address]

    @staticmethod
    def _oldest_idle(conns: list[Conn]) -> Conn | None:
        idle = [c for c in conns if not c.busy]
        return min(idle, key=lambda c: (c.idle_since, c.id)) if idle else None

    def _victim(self, address: str) -> Conn | None:
        """Room for a connection of ``address``: its own oldest idle one at its cap; else, with every slot
        taken, the oldest idle one of the address holding the most (ties: the oldest connection)."""
        own = self._of(address)
        if len(own) >= self.per_address:
            return self._oldest_idle(own)
        if len(self.conns) < self.max_connections:
            return None
        by_address: dict[str, list[Conn]] = {}
        for c in self.conns.values():
            by_address.setdefault(c.address, []).append(c)
        for _, conns in sorted(by_address.items(), key=lambda kv: -len(kv[1])):
            victim = self._oldest_idle(conns)
            if victim is not None:
                return victim
        return None

    def admit(self, peer: tuple[str, int], now: float) -> Admission:
        address = peer[0]
        full = len(self._of(address)) >= self.per_address or len(self.conns) >= self.max_connections
        evict: tuple[int, ...] = ()
        if full:
            victim = self._victim(address)
            if victim is None:
                self.counts["refused"] += 1
                return Admission(None)
            self.remove(victim.id)
            self.counts["evicted"] += 1
            evict = (victim.id,)
        conn = Conn(next(self._ids), address, peer, now, now)
        self.conns[conn.id] = conn
        self._by_peer[peer] = conn.id
        return Admission(conn, evict)

    def remove(self, conn_id: int) -> None:
        conn = self.conns.pop(conn_id, None)
        if conn is not None and self._by_peer.get(conn.peer) == conn_id:
            del self._by_peer[conn.peer]

    # ------------------------------------------------------------------ requests
    def find(self, peer: tuple[str, int] | None) -> Conn | None:
        conn_id = self._by_peer.get((peer[0], peer[1])) if peer else None   # ASGI may give a list
        return self.conns.get(conn_id) if conn_id is not None else None

    def request_started(self, conn: Conn) -> None:
        conn.in_flight += 1
        conn.requests += 1

    def request_ended(self, conn: Conn, now: float) -> None:
        conn.in_flight = max(0, conn.in_flight - 1)
        if not conn.in_flight:
            conn.idle_since = now

    # ------------------------------------------------------------------ deadlines
    def deadline(self, conn: Conn) -> float | None:
        if conn.busy:
            return None
        return conn.opened_at + self.first_request_s if not conn.requests else conn.idle_since + self.idle_s

    def expire(self, conn: Conn, now: float) -> str | None:
        """The reason ``conn`` is closed now (and forget it), or None when it may stay."""
        deadline = self.deadline(conn)
        if deadline is None or now < deadline or conn.id not in self.conns:
            return None
        reason = "first_request_timeout" if not conn.requests else "idle_timeout"
        self.counts[reason] += 1
        self.remove(conn.id)
        return reason

    def snapshot(self) -> dict:
        busy = sum(1 for c in self.conns.values() if c.busy)
        return {"open": len(self.conns), "busy": busy, "max": self.max_connections,
                "per_address": self.per_address, "addresses": len({c.address for c in self.conns.values()}),
                "closed": dict(self.counts)}
