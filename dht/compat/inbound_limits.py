"""Inbound connection limits that keep the door open, for py-libp2p 0.8.1 (the adjustment ``inbound_limits``).

Upstream: no upstream issue for a per-address cap found; the nearest are
https://github.com/libp2p/py-libp2p/issues/553 (connection management,
including rate limiting of incoming connections; open) and
https://github.com/libp2p/py-libp2p/issues/1451 (the inbound cap not
enforced atomically). Wraps ``Swarm._handle_inbound_connection`` and
``Swarm.upgrade_inbound_raw_conn`` (libp2p/network/swarm.py).

Why: py-libp2p 0.8.1's ``Swarm._handle_inbound_connection`` takes one slot of
a single inbound limiter (``max_connections - min_connections`` = 250 by
default) for every accepted TCP connection, before any handshake, and holds
it until the connection ends; an idle connection that never speaks holds it
for the 10 s inbound upgrade timeout. There is no per-address limit, so one
address holding 250 idle connections (re-opening each as it is closed) makes
the node close every new connection at once: a new node bootstrapping
through it fails, while peers already connected are fine.

What this does (``apply()``, the adjustment ``inbound_limits``): wraps that
method and ``Swarm.upgrade_inbound_raw_conn`` with a gate, one per swarm:

    accept ──▶ gate.open(ip)   refused at once (socket closed, no handshake) when
       │         - this address already has MAX_PENDING_PER_ADDR handshakes pending, or
       │         - it holds MAX_INBOUND_PER_ADDR upgraded inbound connections, or
       │         - MAX_PENDING_TOTAL handshakes are pending from all addresses
       ▼
    the library's handler (its own 250-slot limiter, connection gate, ...)
       ▼
    upgrade (Noise + yamux) under PRE_HANDSHAKE_TIMEOUT_S (the library's 10 s stays
    the outer bound) ──▶ ticket: pending -> upgraded; closed when the handler ends

So one address holds at most MAX_PENDING_PER_ADDR of the library's slots
while idle and MAX_INBOUND_PER_ADDR once upgraded, pending handshakes from
everyone together at most MAX_PENDING_TOTAL: at least
``250 - MAX_PENDING_TOTAL`` slots stay for peers that complete handshakes,
and a new peer from another address always finds a pending slot unless
MAX_PENDING_TOTAL / MAX_PENDING_PER_ADDR addresses attack at once. Per peer
(an authenticated id, known once Noise is done) the library's own
``max_connections_per_peer`` (3) applies when the connection is registered.
Loopback addresses are exempt from the per-address caps (a local swarm's
daemons all dial from 127.0.0.1; a local process can do worse anyway), not
from the deadline or the total.

Connections arriving over relay circuits reach ``upgrade_inbound_raw_conn``
from the STOP handler, not through the listener: no ticket, no change.

State: per swarm, the gate's counters (``gate_of(swarm).snapshot()``); the
patch is per process, applied by ``dht.compat.registry.apply_libp2p_adjustments``
(called by the host builder, never at import), only when ``dht.compat.gate``
lets it (the tested release, the two methods there). ``MESHD_INBOUND_LIMITS=0``
leaves the library untouched (for comparison).
"""
from __future__ import annotations

import collections
import contextvars
import ipaddress
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import trio

from dht.compat.gate import gate, installed_version

log = logging.getLogger(__name__)

__all__ = ["NAME", "apply", "check", "restore", "gate_of", "InboundGate", "APPLIED", "MAX_PENDING_PER_ADDR",
           "MAX_PENDING_TOTAL", "MAX_INBOUND_PER_ADDR", "PRE_HANDSHAKE_TIMEOUT_S", "DISABLE_ENV"]

NAME = "inbound_limits"
DISABLE_ENV = "MESHD_INBOUND_LIMITS"
# Handshakes one address may have in flight: a household behind one NAT starts
# a few nodes at once; more than this from one address is not a new peer.
MAX_PENDING_PER_ADDR = 8
# Upgraded inbound connections from one (non-loopback) address: several home
# nodes behind one router, each with a connection or two.
MAX_INBOUND_PER_ADDR = 32
# Handshakes in flight from every address together (of the library's 250 slots).
MAX_PENDING_TOTAL = 64
# multistream + Noise XX + yamux negotiation: 3-4 round trips, milliseconds on a
# LAN and well under a second across a continent; an idle dialer is cut here.
PRE_HANDSHAKE_TIMEOUT_S = 5.0
# Refusals of one kind are logged at most once per this period (with the running count).
LOG_EVERY_S = 10.0
# Loopback dialers skip the per-address caps (see above); tests turn this off.
EXEMPT_LOOPBACK = True

APPLIED = False
_ORIGINAL_HANDLE: Callable[..., Coroutine[Any, Any, None]] | None = None   # the library's, while patched
_ORIGINAL_UPGRADE: Callable[..., Coroutine[Any, Any, Any]] | None = None
_TICKET: contextvars.ContextVar = contextvars.ContextVar("meshd_inbound_ticket", default=None)
_GATE_ATTR = "_meshd_inbound_gate"


def _is_loopback(ip: str | None) -> bool:
    if ip is None or not EXEMPT_LOOPBACK:
        return False
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


class _Ticket:
    __slots__ = ("gate", "ip", "state")

    def __init__(self, gate: InboundGate, ip: str) -> None:
        self.gate, self.ip, self.state = gate, ip, "pending"

    def upgraded(self) -> None:
        if self.state == "pending":
            self.gate._move(self.ip, pending=-1, upgraded=+1)
            self.state = "upgraded"

    def close(self) -> None:
        if self.state == "pending":
            self.gate._move(self.ip, pending=-1)
        elif self.state == "upgraded":
            self.gate._move(self.ip, upgraded=-1)
        self.state = "closed"


class InboundGate:
    """Counters of one swarm's inbound connections by remote address (sync, no awaits)."""

    def __init__(self) -> None:
        self.pending: collections.Counter[str] = collections.Counter()
        self.upgraded: collections.Counter[str] = collections.Counter()
        self.pending_total = 0
        self.refused: collections.Counter[str] = collections.Counter()
        self._logged_at: dict[str, float] = {}

    def open(self, ip: str | None) -> _Ticket | None:
        """A ticket for a new inbound connection from ``ip``, or None (refuse it; counted)."""
        key = ip or "?"
        local = _is_loopback(ip)
        reason = None
        if self.pending_total >= MAX_PENDING_TOTAL:
            reason = "pending_total"
        elif not local and self.pending[key] >= MAX_PENDING_PER_ADDR:
            reason = "pending_per_addr"
        elif not local and self.upgraded[key] >= MAX_INBOUND_PER_ADDR:
            reason = "inbound_per_addr"
        if reason is not None:
            self.refused[reason] += 1
            now = time.monotonic()
            if now - self._logged_at.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:   # a flood: one line per period
                self._logged_at[reason] = now
                log.warning("inbound connection from %s refused (%s; %d refused so far)", key, reason,
                            self.refused[reason])
            return None
        self._move(key, pending=+1)
        return _Ticket(self, key)

    def _move(self, ip: str, *, pending: int = 0, upgraded: int = 0) -> None:
        self.pending[ip] += pending
        self.pending_total += pending
        self.upgraded[ip] += upgraded
        for counter in (self.pending, self.upgraded):
            if counter[ip] <= 0:
                del counter[ip]

    def snapshot(self) -> dict:
        return {"pending": self.pending_total, "upgraded": sum(self.upgraded.values()),
                "refused": dict(self.refused)}


def gate_of(swarm) -> InboundGate:
    gate = getattr(swarm, _GATE_ATTR, None)
    if gate is None:
        gate = InboundGate()
        setattr(swarm, _GATE_ATTR, gate)
    return gate


def _remote_ip(read_write_closer) -> str | None:
    try:
        addr = read_write_closer.get_remote_address()
    except Exception:  # noqa: BLE001 - a transport without addresses: counted under "?"
        return None
    return addr[0] if addr else None


async def _handle_inbound_connection(self, read_write_closer, maddr) -> None:
    ticket = gate_of(self).open(_remote_ip(read_write_closer))
    if ticket is None:
        try:
            await read_write_closer.close()
        except Exception:  # noqa: BLE001 - already gone
            pass
        return
    token = _TICKET.set(ticket)
    original = _ORIGINAL_HANDLE
    assert original is not None   # this replacement is installed only with the original saved
    try:
        await original(self, read_write_closer, maddr)
    finally:
        _TICKET.reset(token)
        ticket.close()


async def _upgrade_inbound_raw_conn(self, raw_conn, maddr):
    ticket = _TICKET.get()
    if ticket is None or ticket.state != "pending":
        # a circuit (STOP handler), or a task that inherited an upgraded connection's context
        return await _ORIGINAL_UPGRADE(self, raw_conn, maddr)
    from libp2p.network.exceptions import SwarmException

    with trio.move_on_after(PRE_HANDSHAKE_TIMEOUT_S) as scope:
        muxed = await _ORIGINAL_UPGRADE(self, raw_conn, maddr)
    if scope.cancelled_caught:
        ticket.gate.refused["handshake_deadline"] += 1
        raise SwarmException(f"no handshake from {ticket.ip} within {PRE_HANDSHAKE_TIMEOUT_S:g} s")
    ticket.upgraded()
    return muxed


def check(version: str) -> str | None:
    """None when the gate fits ``version`` and the installed library; else why it stays off."""
    return gate(version, module="libp2p.network.swarm", what="swarm", owner="Swarm",
                needs=("_handle_inbound_connection", "upgrade_inbound_raw_conn"), disable_env=DISABLE_ENV)


def apply(version: str | None = None) -> bool:
    """Install the gate (idempotent). True when it is in place."""
    global APPLIED, _ORIGINAL_HANDLE, _ORIGINAL_UPGRADE
    if APPLIED:
        return True
    if version is None:
        version = installed_version()
    if check(version) is not None:
        return False
    from libp2p.network.swarm import Swarm

    _ORIGINAL_HANDLE = Swarm._handle_inbound_connection
    _ORIGINAL_UPGRADE = Swarm.upgrade_inbound_raw_conn
    Swarm._handle_inbound_connection = _handle_inbound_connection
    Swarm.upgrade_inbound_raw_conn = _upgrade_inbound_raw_conn
    APPLIED = True
    return True


def restore() -> None:
    """Put the library's methods back (tests compare both)."""
    global APPLIED
    if APPLIED and _ORIGINAL_HANDLE is not None and _ORIGINAL_UPGRADE is not None:
        from libp2p.network.swarm import Swarm

        Swarm._handle_inbound_connection = _ORIGINAL_HANDLE
        Swarm.upgrade_inbound_raw_conn = _ORIGINAL_UPGRADE
        APPLIED = False
