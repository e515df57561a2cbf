"""DCUtR direct upgrade of relayed peers: a best-effort, bounded background attempt.

Every daemon runs ``DirectUpgrader.run`` in its nursery. It hosts py-libp2p's
DCUtR service (``/libp2p/dcutr``) on the daemon's host, so the node answers
hole-punch requests from peers that reached it through a relay, and it owns
the attempts this node starts itself:

    RelayDialer (driver thread) has an open circuit to peer P
      -> upgrader.request(P)            thread-safe, never raises, returns at once
         policy.admit(P, now)?          at most once per peer per RETRY_AFTER_S
         queue (bounded, full = drop)   -> run loop in the daemon's trio loop
      -> attempt(P) under UPGRADE_TIMEOUT_S:
         DCUtR initiate_hole_punch(P)   (unilateral dial first, then CONNECT/SYNC)
         direct_connection(host, P)     an open, Noise-authenticated connection
                                        to P whose transport is not a circuit
      -> found: remembered; RelayDialer.transport(P) opens NEW session streams on it
         none:  nothing changes; nothing is logged above DEBUG

The library's service is narrowed (``QuietDCUtR``): no auto-drive loop (it
would punch every relayed peer every 2 s, outside our per-peer policy), and
no closing of the relayed connection after an upgrade (a live session may
keep its circuit). The library logs hole-punch failures at WARNING/ERROR;
``quiet_dcutr_logs`` demotes its records to DEBUG (fall back silently).

These overrides reach into py-libp2p 0.8.1's private methods, so they are a
library adjustment like the data-path patches (dht/compat/): ``run`` checks
the exact version and the methods first (``dcutr_policy_check``, through
``dht.compat.gate``) and records the decision as ``dcutr_policy`` in the
registry ``meshd status`` shows. Upstream: no upstream issue found; the
overridden members are ``DCUtRProtocol``'s (libp2p/relay/circuit_v2/dcutr.py).
On any other version the DCUtR service is not started at all (the
library's own policy would punch every relayed peer and close circuits under
live sessions): relayed hops simply stay relayed, and status says why.

State owned here: the policy table (peer -> last attempt), the direct
connections found (peer -> connection), both bounded by MAX_TRACKED_PEERS and
guarded by one lock (read from driver threads, written in the trio loop).
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.tools.anyio_service import background_trio_service

from dht.compat.gate import gate, installed_version
from dht.compat.registry import Adjustment, record
from relay.portal import Portal

log = logging.getLogger(__name__)

__all__ = ["DirectUpgrader", "UpgradePolicy", "QuietDCUtR", "direct_connection", "is_relayed",
           "quiet_dcutr_logs", "dcutr_policy_check", "apply_dcutr_policy", "UPGRADE_TIMEOUT_S", "RETRY_AFTER_S"]

# One attempt: a unilateral dial (DCUTR_DIAL_TIMEOUT_S), the CONNECT/SYNC
# exchange over the relay, then up to three hole-punch rounds of 5 s with 2 s
# pauses (the library's schedule): about 30 s; past this the circuit is kept.
UPGRADE_TIMEOUT_S = 30.0
# A peer whose upgrade failed is not tried again for this long: NAT
# behaviour rarely changes within minutes, and each attempt costs a few
# dials and relay round trips.
RETRY_AFTER_S = 300.0
# Requests waiting for the loop; beyond it a request is dropped (the next
# generation asks again once the policy allows).
MAX_PENDING_REQUESTS = 16
# Attempts running at once: each holds a few sockets and a relay stream.
MAX_CONCURRENT_ATTEMPTS = 4
# Peers remembered (policy and direct connections); the oldest are forgotten.
MAX_TRACKED_PEERS = 1024
# Hole punches we answer at once: each makes us dial up to 20 addresses the
# peer chose, three rounds; a peer may run one at a time.
MAX_INBOUND_PUNCHES = 4
# The library's per-step bounds (ints for the library): a CONNECT/SYNC message
# crosses the relay twice; a dial to a punched or loopback address is quick.
DCUTR_READ_TIMEOUT_S = 10
DCUTR_WRITE_TIMEOUT_S = 10
DCUTR_DIAL_TIMEOUT_S = 5

_DCUTR_LOGGER = "libp2p.relay.circuit_v2.dcutr"
# Library loggers that report the failed dials of a hole punch at ERROR; demoted
# only inside an upgrade (their other records keep their level).
_DIAL_LOGGERS = ("libp2p.transport.tcp.tcp", "libp2p.network.swarm", "libp2p.host.basic_host",
                 "libp2p.network.connection.swarm_connection", "libp2p.transport.upgrader")
_CIRCUIT = "/p2p-circuit"

# Set in the tasks of an upgrade (ours and the library's responder); child tasks inherit it.
_IN_UPGRADE: contextvars.ContextVar[bool] = contextvars.ContextVar("meshd_in_upgrade", default=False)


class _DemoteToDebug(logging.Filter):
    """Rewrite a record to DEBUG (always, or only inside an upgrade), then let the logger's level decide."""

    def __init__(self, only_in_upgrade: bool) -> None:
        super().__init__()
        self.only_in_upgrade = only_in_upgrade

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG or (self.only_in_upgrade and not _IN_UPGRADE.get()):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_ALWAYS = _DemoteToDebug(only_in_upgrade=False)
_IN_ATTEMPT = _DemoteToDebug(only_in_upgrade=True)


def quiet_dcutr_logs() -> None:
    """Hole-punch chatter (the library logs every failed dial at WARNING/ERROR) becomes DEBUG. Idempotent."""
    for name, flt in [(_DCUTR_LOGGER, _ALWAYS)] + [(n, _IN_ATTEMPT) for n in _DIAL_LOGGERS]:
        logger = logging.getLogger(name)
        if flt not in logger.filters:
            logger.addFilter(flt)


class QuietDCUtR(DCUtRProtocol):
    """The library's DCUtR service without its own initiative: we decide when to punch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._inbound: set = set()    # peers whose hole punch we are answering
        self.inbound_refused = 0

    async def _auto_drive_loop(self) -> None:
        return None

    async def _handle_dcutr_stream(self, stream) -> None:
        """Answer a peer's hole punch only over a circuit, one per peer, MAX_INBOUND_PUNCHES in all."""
        peer = stream.muxed_conn.peer_id
        if (not is_relayed(stream.swarm_conn) or peer in self._inbound
                or len(self._inbound) >= MAX_INBOUND_PUNCHES):
            self.inbound_refused += 1
            await _reset(stream)
            return
        _IN_UPGRADE.set(True)   # this task only: the peer's hole punch is an upgrade too
        self._inbound.add(peer)
        try:
            await super()._handle_dcutr_stream(stream)
        finally:
            self._inbound.discard(peer)

    def _schedule_relay_close(self, peer_id: ID) -> None:
        return None


# The library's members our overrides replace or use (py-libp2p 0.8.1's DCUtRProtocol).
_DCUTR_MEMBERS = ("_auto_drive_loop", "_handle_dcutr_stream", "_schedule_relay_close", "initiate_hole_punch")
DCUTR_POLICY = "dcutr_policy"


def dcutr_policy_check(version: str) -> str | None:
    """None when our DCUtR overrides fit ``version`` and the installed class; else why not."""
    return gate(version, module="libp2p.relay.circuit_v2.dcutr", what="DCUtR service", owner="DCUtRProtocol",
                needs=_DCUTR_MEMBERS)


def apply_dcutr_policy(version: str | None = None) -> Adjustment:
    """Decide (and record) whether this process runs our narrowed DCUtR; quiets its logs when on.

    Returns this decision (the registry keeps an earlier "on" for the process)."""
    version = installed_version() if version is None else version
    reason = dcutr_policy_check(version)
    if reason is not None:
        decision = Adjustment(DCUTR_POLICY, False, reason + "; direct upgrades disabled (hops stay relayed)",
                              version)
    else:
        quiet_dcutr_logs()
        decision = Adjustment(DCUTR_POLICY, True, f"on: libp2p {version}, the version it was written for", version)
    record(decision.name, decision.applied, decision.reason, decision.library_version)
    return decision


async def _reset(stream) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001 - already gone
        pass


class UpgradePolicy:
    """Sans-I/O: may we try peer P now? At most once per ``retry_after_s`` per peer."""

    def __init__(self, retry_after_s: float = RETRY_AFTER_S, max_peers: int = MAX_TRACKED_PEERS) -> None:
        if retry_after_s <= 0 or max_peers <= 0:
            raise ValueError("retry_after_s and max_peers must be positive")
        self.retry_after_s, self.max_peers = retry_after_s, max_peers
        self._last: dict[str, float] = {}

    def admit(self, peer_id: str, now: float) -> bool:
        last = self._last.get(peer_id)
        if last is not None and now - last < self.retry_after_s:
            return False
        self._last.pop(peer_id, None)
        self._last[peer_id] = now
        while len(self._last) > self.max_peers:
            self._last.pop(next(iter(self._last)))
        return True


def is_relayed(conn) -> bool:
    """True for a circuit connection (or one we cannot classify: never take it for direct)."""
    try:
        addrs = conn.get_transport_addresses()
    except Exception:  # noqa: BLE001 - an unreadable connection is not a verified direct one
        return True
    return not addrs or any(_CIRCUIT in str(a) for a in addrs)


def direct_connection(host, peer_id: ID):
    """An open connection to ``peer_id`` that is not a circuit, or None.

    The swarm keeps a connection under a peer id only after the Noise
    handshake proved that identity, so such a connection is authenticated."""
    for conn in host.get_network().get_connections(peer_id):
        if getattr(conn, "is_closed", True) or is_relayed(conn):
            continue
        if getattr(conn.muxed_conn, "peer_id", None) == peer_id:
            return conn
    return None


class DirectUpgrader:
    def __init__(self, host, *, timeout_s: float = UPGRADE_TIMEOUT_S, policy: UpgradePolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, dcutr_factory=QuietDCUtR,
                 libp2p_version: str | None = None) -> None:
        self.host, self.timeout_s, self.clock = host, timeout_s, clock
        self._libp2p_version = libp2p_version    # decide for this version (default: the installed one)
        self.policy = policy or UpgradePolicy()
        self._dcutr_factory = dcutr_factory
        self._dcutr: Any = None   # the factory's DCUtR service (the library's class, or a test's), made in run()
        self._lock = threading.Lock()
        self._direct: dict[str, object] = {}
        self._send, self._receive = trio.open_memory_channel[str](MAX_PENDING_REQUESTS)
        self._portal: Portal | None = None   # the daemon's loop, for request() from driver threads
        self.attempts = 0      # started
        self.upgraded = 0      # found a direct connection
        self.in_flight = 0     # queued or running
        self.sessions_direct = 0   # session channels handed out on a direct connection
        self.adjustment: Adjustment | None = None   # the dcutr_policy decision, once run

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve /libp2p/dcutr and run requested attempts until cancelled.

        When the overrides do not fit the installed library (``apply_dcutr_policy``), no
        DCUtR runs: ``request`` returns False and relayed hops stay relayed."""
        self.adjustment = apply_dcutr_policy(self._libp2p_version)
        if not self.adjustment.applied:
            log.info("DCUtR direct upgrades disabled: %s", self.adjustment.reason)
            task_status.started()
            await trio.sleep_forever()
        self._dcutr = self._dcutr_factory(self.host, read_timeout=DCUTR_READ_TIMEOUT_S,
                                          write_timeout=DCUTR_WRITE_TIMEOUT_S, dial_timeout=DCUTR_DIAL_TIMEOUT_S)
        async with background_trio_service(self._dcutr):
            await self._dcutr.event_started.wait()
            self._portal = Portal.current()
            task_status.started()
            limiter = trio.CapacityLimiter(MAX_CONCURRENT_ATTEMPTS)
            async with trio.open_nursery() as nursery:
                async for peer_id in self._receive:
                    nursery.start_soon(self._attempt, peer_id, limiter)

    def request(self, peer_id: str) -> bool:
        """From a driver thread: queue an attempt to ``peer_id`` if the policy allows.

        Never raises and never waits for the attempt (at most one quick hop into the loop)."""
        portal = self._portal
        if portal is None:
            return False
        with self._lock:
            held = self._direct.get(peer_id)
            if held is not None and not getattr(held, "is_closed", True):
                return False
            if not self.policy.admit(peer_id, self.clock()):
                return False
        try:
            portal.run_sync(self._enqueue, peer_id)
        except Exception as exc:  # noqa: BLE001 - full queue or stopped loop: no attempt, no harm
            log.debug("direct upgrade to %s not queued: %r", peer_id[:16], exc)
            return False
        return True

    def _enqueue(self, peer_id: str) -> None:
        self._send.send_nowait(peer_id)   # raises trio.WouldBlock when full: dropped
        self.in_flight += 1

    def direct(self, peer_id: str):
        """The verified direct connection to ``peer_id`` found by an attempt, if it is still open."""
        with self._lock:
            conn = self._direct.get(peer_id)
        return None if conn is None or getattr(conn, "is_closed", True) else conn

    def direct_for_session(self, peer_id: str):
        """``direct`` for a new session: counted, so status shows the upgrade in use."""
        conn = self.direct(peer_id)
        if conn is not None:
            with self._lock:
                self.sessions_direct += 1
        return conn

    def take_lost(self, peer_id: str) -> bool:
        """True (once) when ``peer_id`` had a direct connection that has closed since."""
        with self._lock:
            conn = self._direct.get(peer_id)
            if conn is None or not getattr(conn, "is_closed", True):
                return False
            del self._direct[peer_id]
            return True

    def snapshot(self) -> dict:
        with self._lock:
            direct = sum(1 for c in self._direct.values() if not getattr(c, "is_closed", True))
        return {"attempts": self.attempts, "upgraded": self.upgraded, "in_flight": self.in_flight,
                "direct_now": direct, "sessions_direct": self.sessions_direct,
                "enabled": bool(self.adjustment and self.adjustment.applied)}

    async def _attempt(self, peer_id: str, limiter: trio.CapacityLimiter) -> None:
        _IN_UPGRADE.set(True)
        try:
            async with limiter:
                await self._attempt_locked(peer_id)
        finally:
            self.in_flight -= 1

    async def _attempt_locked(self, peer_id: str) -> None:
        """One bounded attempt; on any failure or at the bound the circuit simply stays."""
        self.attempts += 1
        conn = None
        with trio.move_on_after(self.timeout_s):
            try:
                pid = ID.from_base58(peer_id)
                # our policy paces attempts; the library's own budget (3 per connection) would
                # otherwise end them for good on a long-lived circuit
                self._dcutr._hole_punch_attempts.pop(pid, None)
                await self._dcutr.initiate_hole_punch(pid)
                conn = direct_connection(self.host, pid)
            except Exception as exc:  # noqa: BLE001 - any failure means: keep the circuit
                log.debug("direct upgrade to %s failed: %r", peer_id[:16], exc)
        if conn is None:
            log.debug("direct upgrade to %s: none within %g s, keeping the circuit", peer_id[:16],
                      self.timeout_s)
            return
        with self._lock:
            self._direct.pop(peer_id, None)
            self._direct[peer_id] = conn
            while len(self._direct) > MAX_TRACKED_PEERS:
                self._direct.pop(next(iter(self._direct)))
        self.upgraded += 1
        log.debug("direct upgrade to %s: %s", peer_id[:16], conn.get_transport_addresses())
