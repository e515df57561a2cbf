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
* Counting: circuits opened/active/refused and bytes forwarded, read by
  ``snapshot()`` for ``meshd status``. An optional ``tap`` sees every
  forwarded chunk (tests use it to prove the relay carries only ciphertext).

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
    bytes_forwarded: int = 0
    refused: Counter = field(default_factory=Counter)  # status name -> count


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
        try:
            await super()._handle_connect(stream, msg)
        finally:
            self.counters.circuits_active -= 1
            for counter, key in ((self._by_source, source), (self._by_dest, dest)):
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]

    # --------------------------------------------------------------- forwarding

    async def _relay_data(self, src_stream, dst_stream, peer_id, deadline=None,
                          circuit_data_limit=None) -> None:
        """Copy one direction until EOF, a limit, or the circuit deadline."""
        reason = "eof"
        with trio.move_on_at(_trio_deadline(deadline)) as scope:
            try:
                while True:
                    data = await src_stream.read(MAX_READ_LEN)
                    if not data:
                        break
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
            reason = "duration cap"
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
            "circuits_refused": dict(self.counters.refused),
            "bytes_forwarded": self.counters.bytes_forwarded,
            "limits": {name: getattr(self.hop_limits, name) for name in HopLimits.__slots__},
        }


def _trio_deadline(monotonic_deadline: float | None) -> float:
    """The library passes time.monotonic() deadlines; trio wants its own clock."""
    if monotonic_deadline is None:
        return float("inf")
    return trio.current_time() + (monotonic_deadline - time.monotonic())
