"""What one node learns from its own RPCs: deadlines, per-peer health, outcome counts (pure).

Data flow: the edge that carries an RPC (dht/node.py over libp2p streams,
dht/kademlia/sim.py over the simulated network) asks ``deadline`` before
sending and reports how it ended: ``answered`` (with its latency),
``failed`` (dial refused, stream reset, connection gone) or ``timed_out``
(our deadline cut it), which says what to do with the peer's connection:
WAIT, KEEP or CLOSE (dht/peer_health.py). The caller passes the time.

Deadlines come from ``RpcTimer`` (RFC 6298's estimator over measured
latencies): one timer for peers we are connected to, between RPC_TIMEOUT_S
and RPC_TIMEOUT_CEILING_S, one for peers we must dial first, between
DIAL_TIMEOUT_S and the same ceiling. A busy machine's slow answers raise the
deadline instead of turning into failures that widen every lookup; fast
answers never lower it below the first one. A connected peer that leaves an
RPC unanswered gets its own deadline doubled per consecutive miss; its first
miss also counts as a latency sample (an overloaded machine raises every
deadline, one stuck peer only its own). After STUCK_AFTER misses in a row its
connection is closed and it leaves the routing table (a peer whose host exited
without closing its connections must not cost every later lookup a deadline)
-- unless other connected peers missed deadlines too within
CONGESTION_WINDOW_S: then this machine or the network is congested and the
peer is kept (``stuck_kept``), since closing a busy peer's connection fails
its RPCs in flight both ways and makes the next one pay a handshake.

Peers of another swarm (``ForeignPeers``): the edge checks whether a connected
peer speaks our swarm's DHT protocol (dht/node.py ``speaks_dht``: identify's
list, else a probe stream) and reports a peer that does not; it stays out of
the routing table and the lookup seeds until FOREIGN_RECHECK_S later, when it
is checked again.

State: the two timers, the PeerHealth, the foreign peers, the counts; owned by one node.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from dht.peer_health import CLOSE, KEEP, PeerHealth

# One slow peer must not stall a publish or a read for long; a live peer answers
# a DHT RPC in milliseconds on a LAN, well under a second across the internet.
# These are the first deadlines; measured latencies move them (RpcTimer).
RPC_TIMEOUT_S = 3.0
# Dialing a peer we are not connected to: on loopback or a LAN a live peer
# answers in milliseconds; a gone one would otherwise hold a publish for long.
DIAL_TIMEOUT_S = 2.0
# A measured deadline never goes below the first one (RPC_TIMEOUT_S, DIAL_TIMEOUT_S)
# and never above RPC_TIMEOUT_CEILING_S (one dead peer would stall a lookup round).
# Not lower: a deadline cut loses the answer, and quiet-time latencies (tens of
# ms) say nothing about a burst -- measured with 200 real hosts on 2 cores with
# a 1 s floor: a burst of lookups on a starved machine cut 12% of all RPCs and
# found a quarter of the records. A dead peer's connection is gone (a failed
# dial costs no deadline); a connected peer that is late is busy.
RPC_TIMEOUT_CEILING_S = 10.0
# Consecutive unanswered RPCs after which a connected peer's connection is closed --
# unless another connected peer also left an RPC unanswered within CONGESTION_WINDOW_S
# (see the module docstring).
STUCK_AFTER = 3
CONGESTION_WINDOW_S = 30.0
RECENT_MISSES = 64
# A peer we could not reach (dial refused, no connection) is left out of our lookups for
# UNREACHABLE_S, unless it is connected again (it came back and dialed us); at most
# MAX_UNREACHABLE remembered (the oldest forgotten first).
UNREACHABLE_S = 300.0
MAX_UNREACHABLE = 1024

# A connected peer found not to speak our swarm's DHT protocol (another swarm, another libp2p
# program) stays out of the routing table and lookups this long before it is checked again
# (a peer that restarted into our swarm is in again within that); at most MAX_FOREIGN remembered.
FOREIGN_RECHECK_S = 60.0
MAX_FOREIGN = 1024

OUTCOMES = ("answered", "timed_out", "failed", "stuck_closed", "stuck_kept")


class RpcTimer:
    """Deadline for the next RPC from measured latencies (RFC 6298's estimator; pure).

    SRTT + 4 RTTVAR, clamped to [floor, ceiling], as TCP derives its
    retransmission timeout. State: ``srtt`` and ``rttvar`` (seconds; None
    before the first sample)."""

    ALPHA = 1 / 8
    BETA = 1 / 4

    def __init__(self, initial_s: float, floor_s: float, ceiling_s: float) -> None:
        if not 0 < floor_s <= initial_s <= ceiling_s:
            raise ValueError("need 0 < floor <= initial <= ceiling")
        self.initial_s, self.floor_s, self.ceiling_s = initial_s, floor_s, ceiling_s
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.samples = 0

    def timeout(self, backoff: int = 0) -> float:
        """Deadline for the next RPC; ``backoff`` = that peer's consecutive unanswered RPCs
        doubles it per miss (RFC 6298 5.5) for that peer only, within the ceiling."""
        base = self.initial_s if self.srtt is None else max(self.floor_s, self.srtt + 4 * self.rttvar)
        return min(self.ceiling_s, base * 2 ** min(max(backoff, 0), 16))

    def observe(self, seconds: float) -> None:
        """One RPC answered after ``seconds``."""
        seconds = max(0.0, seconds)
        self.samples += 1
        if self.srtt is None:
            self.srtt, self.rttvar = seconds, seconds / 2
            return
        self.rttvar = (1 - self.BETA) * self.rttvar + self.BETA * abs(self.srtt - seconds)
        self.srtt = (1 - self.ALPHA) * self.srtt + self.ALPHA * seconds

    def snapshot(self) -> dict:
        return {"timeout_s": round(self.timeout(), 3), "srtt_s": None if self.srtt is None else round(self.srtt, 4),
                "samples": self.samples}


def peer_health() -> PeerHealth:
    """A node's PeerHealth with the limits above."""
    return PeerHealth(stuck_after=STUCK_AFTER, congestion_window_s=CONGESTION_WINDOW_S,
                      recent=RECENT_MISSES, unreachable_s=UNREACHABLE_S, max_unreachable=MAX_UNREACHABLE)


class ForeignPeers:
    """Peers found not to speak our swarm's DHT protocol, each until its recheck time (pure;
    the caller passes the time). State: peer -> recheck time, oldest finding first, at most
    ``limit``; ``seen``: how many peers were found foreign while not remembered as such."""

    def __init__(self, recheck_s: float = FOREIGN_RECHECK_S, limit: int = MAX_FOREIGN) -> None:
        if recheck_s <= 0 or limit < 1:
            raise ValueError("need recheck_s > 0 and limit >= 1")
        self.recheck_s, self.limit = recheck_s, limit
        self._until: OrderedDict[Hashable, float] = OrderedDict()
        self.seen = 0

    def __len__(self) -> int:
        return len(self._until)

    def excluded(self, peer: Hashable, now: float) -> bool:
        """Is ``peer`` kept out now (found foreign, not yet due for a recheck)?"""
        until = self._until.get(peer)
        return until is not None and until > now

    def speaks(self, peer: Hashable) -> None:
        """A check found that ``peer`` speaks our protocol: forgotten as foreign."""
        self._until.pop(peer, None)

    def found(self, peer: Hashable, now: float) -> bool:
        """A check found that ``peer`` does not speak our protocol: out until ``now`` +
        recheck_s. True when it was not remembered as foreign (worth one log line)."""
        new = peer not in self._until
        if new:
            self.seen += 1
        self._until.pop(peer, None)
        self._until[peer] = now + self.recheck_s
        while len(self._until) > self.limit:
            self._until.popitem(last=False)
        return new


class RpcBook:
    """One node's deadlines, peer health and RPC outcome counts (see the module docstring)."""

    def __init__(self) -> None:
        self.connected = RpcTimer(RPC_TIMEOUT_S, RPC_TIMEOUT_S, RPC_TIMEOUT_CEILING_S)
        self.dialed = RpcTimer(DIAL_TIMEOUT_S, DIAL_TIMEOUT_S, RPC_TIMEOUT_CEILING_S)
        self.health = peer_health()
        self.foreign = ForeignPeers()
        self.counts = dict.fromkeys(OUTCOMES, 0)

    def timer(self, connected: bool) -> RpcTimer:
        return self.connected if connected else self.dialed

    def misses(self, peer: Hashable, connected: bool) -> int:
        """The misses in a row that back off the next RPC's deadline (a connected peer's own)."""
        return self.health.misses(peer) if connected else 0

    def deadline(self, peer: Hashable, connected: bool) -> float:
        """How long the next RPC to ``peer`` may take: its timer's, doubled per miss of a connected peer."""
        return self.timer(connected).timeout(self.misses(peer, connected))

    def answered(self, peer: Hashable, connected: bool, elapsed: float) -> None:
        self.timer(connected).observe(elapsed)
        self.counts["answered"] += 1
        self.health.answered(peer)

    def failed(self, peer: Hashable) -> None:
        self.counts["failed"] += 1
        self.health.failed(peer)

    def timed_out(self, peer: Hashable, connected: bool, elapsed: float, now: float, misses: int) -> str | None:
        """Our deadline cut an RPC to ``peer``, sent when it had ``misses`` in a row. For a
        connected peer: WAIT, KEEP or CLOSE (its connection; see peer_health.py); None for a
        peer we were dialing."""
        self.counts["timed_out"] += 1
        if not connected:
            return None
        if misses == 0:                            # its first miss is a latency sample of at least the deadline
            self.connected.observe(elapsed)        # (its later misses are its own: backoff)
        verdict = self.health.missed(peer, now)
        if verdict == KEEP:
            self.counts["stuck_kept"] += 1         # busy among busy peers: kept, at its backoff
        elif verdict == CLOSE:
            self.counts["stuck_closed"] += 1
        return verdict
