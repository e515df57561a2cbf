"""Client side of circuit relay v2: reserve a slot, dial a peer through a relay.

Data flow:
* ``reserve(host, relay)``: a node that cannot be dialed sends HOP RESERVE to a
  relay it is connected to; the answer carries the expiry and the relay's
  public addresses, from which ``relayed_addrs`` builds
  ``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<us>`` for Reachability.relayed_addrs.
* ``dial_relayed(host, addr)``: HOP CONNECT on a fresh stream to the relay;
  once the relay says OK the stream becomes a raw connection that the host
  upgrades exactly like a TCP one -- a Noise handshake between the two END
  peers (so the relay forwards only Noise ciphertext) and yamux on top. The
  swarm then holds a normal connection to the far peer; ``host.new_stream``
  uses it.
* ``stop_service(host)``: the STOP side (the library's CircuitV2Protocol
  without hop), which accepts circuits arriving for us through a relay and
  upgrades them the same way.

State: none here beyond the host's swarm; the reservation keeper
(relay/reachability.py) owns renewals. Every network wait is bounded by a
named timeout; library exceptions become relay.errors at this edge.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service

from relay.errors import RelayRefused, RelayUnreachable

__all__ = ["Reservation", "reserve", "dial_relayed", "relayed_addrs", "parse_relayed_addr",
           "stop_service", "CIRCUIT_DIAL_TIMEOUT_S", "RESERVE_TIMEOUT_S"]

# A relay answers RESERVE from memory; 10 s covers a loaded relay on a slow link.
RESERVE_TIMEOUT_S = 10.0
# CONNECT waits for the relay to open a STOP stream to the far peer and hear back,
# then both ends run the Noise + yamux upgrade: 3 round trips on two links.
CIRCUIT_DIAL_TIMEOUT_S = 15.0
# The library's relay messages are small; ours never carry more than a peer id.
_CIRCUIT_SUFFIX = "/p2p-circuit/p2p/"


@dataclass(frozen=True, slots=True)
class Reservation:
    """A slot on one relay: valid until ``expires_at_unix`` (seconds)."""

    relay_peer_id: str
    expires_at_unix: int
    relay_addrs: tuple[str, ...]      # the relay's public addresses, each ending in /p2p/<relay>
    limit_duration_s: int             # per-circuit caps the relay announced (0 = none)
    limit_data_bytes: int

    def __post_init__(self) -> None:
        if not self.relay_peer_id or self.expires_at_unix <= 0:
            raise ValueError("a reservation names its relay and a positive expiry")


def _status_name(code: int) -> str:
    try:
        return StatusCode(code).name
    except ValueError:
        return f"STATUS_{code}"


async def _hop_stream(host, relay_id: ID):
    try:
        return await host.new_stream(relay_id, [HOP_PROTOCOL])
    except Exception as exc:  # libp2p raises assorted stream/negotiation errors
        raise RelayUnreachable(f"cannot open a hop stream to relay {relay_id}: {exc}") from exc


async def _ensure_connected(host, relay: PeerInfo) -> None:
    if host.get_network().connections.get(relay.peer_id):
        return
    try:
        await host.connect(relay)
    except Exception as exc:
        raise RelayUnreachable(f"cannot reach relay {relay.peer_id}: {exc}") from exc


async def reserve(host, relay: PeerInfo, *, timeout_s: float = RESERVE_TIMEOUT_S) -> Reservation:
    """Reserve (or renew) a slot on ``relay``. RelayRefused / RelayUnreachable on failure."""
    with trio.move_on_after(timeout_s) as scope:
        await _ensure_connected(host, relay)
        stream = await _hop_stream(host, relay.peer_id)
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            answer = await read_delimited_msg(stream, HopMessage)
        except Exception as exc:
            raise RelayUnreachable(f"relay {relay.peer_id} dropped the reservation: {exc}") from exc
        finally:
            try:
                await stream.close()
            except Exception:  # noqa: BLE001 - a relay that already closed is fine
                pass
    if scope.cancelled_caught:
        raise RelayUnreachable(f"relay {relay.peer_id} did not answer RESERVE within {timeout_s:g} s")
    if answer.status != StatusCode.OK:
        raise RelayRefused(_status_name(answer.status), f"reservation on {relay.peer_id}")
    addrs = []
    for raw in answer.reservation.addrs:
        try:
            addrs.append(str(multiaddr.Multiaddr(bytes(raw))))
        except Exception:  # noqa: BLE001 - a malformed address from the relay is skipped, not fatal
            continue
    return Reservation(relay_peer_id=relay.peer_id.to_base58(),
                       expires_at_unix=int(answer.reservation.expire) or int(time.time()),
                       relay_addrs=tuple(addrs), limit_duration_s=int(answer.limit.duration),
                       limit_data_bytes=int(answer.limit.data))


def relayed_addrs(reservation: Reservation, own_peer_id: str) -> tuple[str, ...]:
    """The multiaddrs through which peers reach us on this reservation."""
    return tuple(f"{addr}{_CIRCUIT_SUFFIX}{own_peer_id}" for addr in reservation.relay_addrs)


def parse_relayed_addr(text: str) -> tuple[PeerInfo, ID]:
    """``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<dest>`` -> (relay info, dest id)."""
    if _CIRCUIT_SUFFIX not in text:
        raise ValueError(f"{text} is not a relayed address (no {_CIRCUIT_SUFFIX})")
    relay_part, dest = text.rsplit(_CIRCUIT_SUFFIX, 1)
    return info_from_p2p_addr(multiaddr.Multiaddr(relay_part)), ID.from_base58(dest)


async def dial_relayed(host, relay: PeerInfo, dest: ID, *,
                       timeout_s: float = CIRCUIT_DIAL_TIMEOUT_S):
    """Open a circuit to ``dest`` through ``relay``; returns the upgraded swarm connection."""
    with trio.move_on_after(timeout_s) as scope:
        await _ensure_connected(host, relay)
        stream = await _hop_stream(host, relay.peer_id)
        try:
            await write_delimited_msg(stream, HopMessage(
                type=HopMessage.CONNECT, peer=CircuitPeerId(id=dest.to_bytes())))
            answer = await read_delimited_msg(stream, HopMessage)
        except Exception as exc:
            await _reset(stream)
            raise RelayUnreachable(f"relay {relay.peer_id} dropped CONNECT to {dest}: {exc}") from exc
        if answer.status != StatusCode.OK:
            await _reset(stream)
            raise RelayRefused(_status_name(answer.status), f"circuit to {dest} via {relay.peer_id}")
        circuit = multiaddr.Multiaddr(f"/p2p/{relay.peer_id.to_base58()}{_CIRCUIT_SUFFIX}{dest.to_base58()}")
        raw = RawConnection(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED,
                            addresses=[circuit])
        try:
            # Noise handshake with DEST over the circuit (end-to-end), then yamux.
            return await host.upgrade_outbound_connection(raw, dest)
        except Exception as exc:
            await _reset(stream)
            raise RelayUnreachable(f"securing the circuit to {dest} failed: {exc}") from exc
    assert scope.cancelled_caught
    raise RelayUnreachable(f"no circuit to {dest} via {relay.peer_id} within {timeout_s:g} s")


async def _reset(stream) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001 - already gone
        pass


@asynccontextmanager
async def stop_service(host) -> AsyncIterator[CircuitV2Protocol]:
    """Accept circuits addressed to us (the STOP role); no hop, no relaying for others."""
    protocol = CircuitV2Protocol(host, allow_hop=False)
    async with background_trio_service(protocol):
        await protocol.event_started.wait()
        yield protocol
