"""The relay's hop service: circuit relay v2 with meshd's limits and counters.

py-libp2p's ``CircuitV2Protocol`` does the wire protocol (RESERVE, CONNECT,
STOP). Its defaults are not a design, and it has gaps, so ``HopService``
subclasses it and owns three decisions:

* Admission (``_handle_connect``): a circuit is refused unless the destination
  holds a live reservation here (NO_RESERVATION), the destination is under its
  circuit cap, the SOURCE is under its own cap (the library only caps sources
  that happen to hold a reservation) and the relay is under its total cap
  (RESOURCE_LIMIT_EXCEEDED). Admission is a pure function, ``admit``.
* Forwarding (``_relay_data``): one bounded copy loop per direction. It holds
  at most one read (MAX_READ_LEN bytes) per direction, shares one byte budget
  per circuit across both directions, and ends the circuit at its duration
  cap even when idle (the library only checks the deadline between reads).
  Unlike the library's loop it closes only its own two streams (the
  library's cleanup is keyed by peer id and can close a sibling circuit).
* Ending (``_Circuit``, ``_watch``): a circuit is one object owned by its
  CONNECT handler; both copy directions run in cancel scopes it holds, and
  whatever ends the circuit -- a reset or error in either direction, either
  end's connection to the relay closing, or no byte in either direction for
  ``circuit_idle_timeout_s`` -- cancels both at once. Waiting for the other
  direction's read to notice is not enough: py-libp2p 0.8.1's yamux drops a
  stream's wake-up event when the stream is reset locally, so a reader
  blocked on it sleeps forever (a SIGKILLed client left its circuit, and its
  per-source slot, pinned for good). The slot is freed as the handler
  returns; every limit counts live circuits only.
* Counting: circuits opened/active/closed (by reason)/refused and bytes
  forwarded, read by ``snapshot()`` for ``meshd status``. An optional ``tap``
  sees every forwarded chunk (tests use it to prove the relay carries only
  ciphertext).

What the relay sees is the Noise ciphertext of the two end peers: it never
parses a frame.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.constants import MAX_READ_LEN

log = logging.getLogger(__name__)

__all__ = ["HopLimits", "DEFAULT_HOP_LIMITS", "HopService", "RelayCounters", "admit"]

KIB, MIB, GIB = 1024, 1024 ** 2, 1024 ** 3

# --- per circuit -------------------------------------------------------------
# One circuit is one end-to-end connection between two peers and carries all
# their sessions. A decode step of a 8192-hidden model is 16 KiB of bf16 per
# direction; 16 GiB is ~500k decode steps or ~250 prompts of 32k tokens.
# (The library's 1 GiB default ends a busy route within minutes.)
CIRCUIT_MAX_BYTES = 16 * GIB
# Four hours outlasts any generation; a dialer simply opens a new circuit
# after it. It bounds how long a forgotten circuit pins a slot.
CIRCUIT_MAX_DURATION_S = 4 * 3600
# A live circuit is never silent for long: its two ends run yamux over it, and yamux pings
# every 30 s each way (py-libp2p 0.8.1's RTT_MEASURE_INTERVAL; go-yamux's keep-alive is 30 s
# too). No byte in either direction for four ping intervals means an end is gone without its
# TCP connection closing (a machine asleep or unplugged): the slot is freed then.
CIRCUIT_IDLE_TIMEOUT_S = 120.0
# --- per peer ----------------------------------------------------------------
# Circuits INTO one reserved peer: one per entry node routing through it; 16
# concurrent routes through one home node is more than its compute can serve.
CIRCUITS_PER_DESTINATION = 16
# Circuits FROM one peer: an entry node needs one per relayed hop of its routes
# (plus one spare while re-planning); 8 covers a route of 7 relayed hops.
CIRCUITS_PER_SOURCE = 8
# The library keys reservations by peer id: one slot per peer, renewed in place.
RESERVATIONS_PER_PEER = 1
# --- whole relay -------------------------------------------------------------
# ~24 MB/s of relayed throughput on one CPU: 64 circuits decoding at 10 tok/s
# with 16 KiB steps use ~10 MB/s, leaving room for prefill bursts.
CIRCUITS_TOTAL = 64
# A reservation is a dict entry and a voucher: cheap; 256 home nodes per relay.
RESERVATIONS_TOTAL = 256
# Short enough that a departed node's slot frees soon, long enough that
# renewals (at half the TTL) are rare: 30 minutes.
RESERVATION_TTL_S = 30 * 60


@dataclass(frozen=True, slots=True)
class HopLimits:
    """Every cap the hop service enforces (validated; see the constants' reasons)."""

    circuit_max_bytes: int = CIRCUIT_MAX_BYTES
    circuit_max_duration_s: int = CIRCUIT_MAX_DURATION_S
    circuit_idle_timeout_s: float = CIRCUIT_IDLE_TIMEOUT_S
    circuits_per_destination: int = CIRCUITS_PER_DESTINATION
    circuits_per_source: int = CIRCUITS_PER_SOURCE
    circuits_total: int = CIRCUITS_TOTAL
    reservations_total: int = RESERVATIONS_TOTAL
    reservation_ttl_s: int = RESERVATION_TTL_S

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) <= 0:
                raise ValueError(f"HopLimits.{name} must be positive")

    def library_limits(self) -> RelayLimits:
        return RelayLimits(duration=self.circuit_max_duration_s, data=self.circuit_max_bytes,
                           max_circuit_conns=self.circuits_per_destination,
                           max_reservations=self.reservations_total,
                           reservation_ttl=self.reservation_ttl_s)


DEFAULT_HOP_LIMITS = HopLimits()


@dataclass(slots=True)
class RelayCounters:
    """Mutable counters owned by one HopService (read through ``snapshot``)."""

    circuits_opened: int = 0
    circuits_active: int = 0
    circuits_closed: int = 0
    bytes_forwarded: int = 0
    refused: Counter = field(default_factory=Counter)  # status name -> count
    closed_by: Counter = field(default_factory=Counter)  # end reason -> count


@dataclass(slots=True)
class _Circuit:
    """One admitted circuit, owned by its CONNECT handler.

    ``streams`` is (source side, destination side) once the library's STOP handshake has
    succeeded and forwarding starts; ``end`` records the first reason and cancels both
    directions' scopes (registered in ``scopes``)."""

    source_stream: object
    last_active: float
    streams: tuple = ()
    started: trio.Event = field(default_factory=trio.Event)
    scopes: list = field(default_factory=list)
    reason: str = ""

    def end(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason
        for scope in self.scopes:
            scope.cancel()


def admit(limits: HopLimits, *, dest_reserved: bool, dest_circuits: int, source_circuits: int,
          total_circuits: int) -> StatusCode:
    """Pure admission decision for one CONNECT (OK or the refusal status)."""
    if not dest_reserved:
        return StatusCode.NO_RESERVATION
    if (dest_circuits >= limits.circuits_per_destination or source_circuits >= limits.circuits_per_source
            or total_circuits >= limits.circuits_total):
        return StatusCode.RESOURCE_LIMIT_EXCEEDED
    return StatusCode.OK


class HopService(CircuitV2Protocol):
    """Circuit relay v2 hop with meshd admission, bounded forwarding and counters."""

    def __init__(self, host, limits: HopLimits = DEFAULT_HOP_LIMITS,
                 tap: Callable[[bytes], None] | None = None) -> None:
        super().__init__(host, limits.library_limits(), allow_hop=True)
        self.hop_limits = limits
        self.counters = RelayCounters()
        self._by_source: Counter = Counter()   # admitted circuits per source peer
        self._by_dest: Counter = Counter()     # admitted circuits per destination peer
        self._circuits: dict[int, _Circuit] = {}   # id(source stream) -> its live circuit
        self._tap = tap

    # ---------------------------------------------------------------- admission

    async def _handle_connect(self, stream, msg: HopMessage) -> None:
        dest = ID(msg.peer.id)
        source = stream.muxed_conn.peer_id
        reservation = self.resource_manager.get_reservation(dest)
        # Count circuits at admission (the library counts only after the STOP handshake,
        # so two concurrent CONNECTs could both pass a cap of one).
        status = admit(self.hop_limits, dest_reserved=reservation is not None,
                       dest_circuits=self._by_dest[dest],
                       source_circuits=self._by_source[source],
                       total_circuits=self.counters.circuits_active)
        if status != StatusCode.OK:
            self.counters.refused[status.name] += 1
            log.info("refused circuit %s -> %s: %s", source, dest, status.name)
            await self._send_status(stream, status, "refused by meshd relay limits")
            await self._close_stream(stream)
            return
        self._by_source[source] += 1
        self._by_dest[dest] += 1
        self.counters.circuits_active += 1
        self.counters.circuits_opened += 1
        circuit = _Circuit(source_stream=stream, last_active=trio.current_time())
        self._circuits[id(stream)] = circuit
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, circuit)
                try:
                    await super()._handle_connect(stream, msg)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            del self._circuits[id(stream)]
            self.counters.circuits_active -= 1
            self.counters.circuits_closed += 1
            self.counters.closed_by[circuit.reason or "not established"] += 1
            for counter, key in ((self._by_source, source), (self._by_dest, dest)):
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]

    async def _watch(self, circuit: _Circuit) -> None:
        """End ``circuit`` when either end's connection to the relay closes or it goes idle."""
        await circuit.started.wait()
        async with trio.open_nursery() as nursery:
            async def on_close(event, side: str) -> None:
                await event.wait()
                circuit.end(f"{side} connection closed")
                nursery.cancel_scope.cancel()

            for side, stream in zip(("source", "destination"), circuit.streams):
                event = _closing_event(stream)
                if event is not None:
                    nursery.start_soon(on_close, event, side)
            idle_s = self.hop_limits.circuit_idle_timeout_s
            while True:   # each wake re-reads last_active: traffic moved the deadline on
                idle_deadline = circuit.last_active + idle_s
                if trio.current_time() >= idle_deadline:
                    break
                await trio.sleep_until(idle_deadline)
            circuit.end("idle")
            nursery.cancel_scope.cancel()

    # --------------------------------------------------------------- forwarding

    async def _relay_data(self, src_stream, dst_stream, peer_id, deadline=None,
                          circuit_data_limit=None) -> None:
        """Copy one direction until EOF, a limit, the circuit deadline, or the circuit's end."""
        circuit = self._circuits.get(id(src_stream)) or self._circuits.get(id(dst_stream))
        if circuit is None:   # not admitted through _handle_connect (no such caller in the library)
            circuit = _Circuit(source_stream=src_stream, last_active=trio.current_time())
        if not circuit.streams:
            circuit.streams = (src_stream, dst_stream)
            circuit.started.set()
        reason = "eof"
        with trio.move_on_at(_trio_deadline(deadline)) as scope:
            circuit.scopes.append(scope)
            if circuit.reason:
                scope.cancel()
            try:
                while True:
                    data = await src_stream.read(MAX_READ_LEN)
                    if not data:
                        break
                    circuit.last_active = trio.current_time()
                    if circuit_data_limit is not None:
                        if len(data) > circuit_data_limit[0]:
                            reason = "byte cap"
                            break
                        circuit_data_limit[0] -= len(data)
                    if self._tap is not None:
                        self._tap(data)
                    with trio.fail_after(self.write_timeout):
                        await dst_stream.write(data)
                    self.counters.bytes_forwarded += len(data)
            except Exception as exc:  # noqa: BLE001 - reset, closed or slow peer: this circuit ends
                reason = type(exc).__name__
        if scope.cancelled_caught:
            reason = circuit.reason or "duration cap"
        if reason != "eof":
            circuit.end(reason)   # the other direction's read may never wake by itself (docstring)
        log.debug("circuit direction from %s ends: %s", peer_id, reason)
        try:
            if reason == "eof":
                await dst_stream.close()   # half-close: the other direction keeps flowing
            else:
                # Reset both ends so the opposite direction's read wakes up too.
                await src_stream.reset()
                await dst_stream.reset()
        except Exception:  # noqa: BLE001 - already gone
            pass

    # ------------------------------------------------------------------ status

    def snapshot(self) -> dict:
        """A small JSON-able dict for ``meshd status``."""
        self.resource_manager._clean_expired()
        return {
            "reservations_active": len(self.resource_manager._reservations),
            "circuits_active": self.counters.circuits_active,
            "circuits_opened": self.counters.circuits_opened,
            "circuits_closed": self.counters.circuits_closed,
            "circuits_closed_by": dict(self.counters.closed_by),
            "circuits_refused": dict(self.counters.refused),
            "bytes_forwarded": self.counters.bytes_forwarded,
            "limits": {name: getattr(self.hop_limits, name) for name in HopLimits.__slots__},
        }


def _closing_event(stream) -> trio.Event | None:
    """The event py-libp2p's yamux sets when the stream's connection starts closing (a GO_AWAY,
    a local close, or a read error such as the TCP close of a crashed peer); None for a muxer
    without one (the idle deadline still ends such a circuit)."""
    conn = getattr(stream, "muxed_conn", None)
    for name in ("event_shutting_down", "event_closed"):
        event = getattr(conn, name, None)
        if isinstance(event, trio.Event):
            return event
    return None


def _trio_deadline(monotonic_deadline: float | None) -> float:
    """The library passes time.monotonic() deadlines; trio wants its own clock."""
    if monotonic_deadline is None:
        return float("inf")
    return trio.current_time() + (monotonic_deadline - time.monotonic())
