"""Swarm control between daemons: two small request/reply protocols over libp2p.

    /meshd/join/1        joiner -> tracker: JoinAsk;    <- JoinReply
    /meshd/directive/1   tracker -> node:   SignedRecord(kind DIRECTIVE); <- DirectiveAck

Why libp2p streams and not a DHT key per target peer: a directive is meant
for one peer, now; a stream delivers it in one round trip and returns the
node's verdict (accepted / refused and why), which the tracker logs and the
tests check. A DHT key would need a new record kind in the DHT validator,
be read only at the target's next refresh, and linger after it expired.
The stream is Noise-authenticated, but the directive is still a signed
record verified by the receiver (signature -> signer peer id), so the rules
in directives.py never depend on which connection carried it.

A peer we are not connected to is dialed at its direct addresses; one that
has none (behind NAT: its record lists only relayed addresses) through a
relay circuit (relay/client.py), so a tracker's directives reach relayed
nodes. Trackers themselves are always directly dialable (plan/tracker.py).

Each side sends exactly one length-prefixed frame (proto/frames.py) of at
most ``MAX_CONTROL_FRAME_BYTES``, and the whole exchange is bounded by
``EXCHANGE_TIMEOUT_S``. This module is the I/O edge; what to answer is the
caller's ``Handler``.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from dht.identity import peer_id_from_public_key
from proto import shard_runtime_pb2 as pb
from proto.errors import MeshdError, ProtocolViolation
from proto.frames import FrameReader, encode_frame
from proto.records import parse_directive, parse_signed_record, sign_record, verify_record_signature

log = logging.getLogger(__name__)

JOIN_PROTOCOL = "/meshd/join/1"
DIRECTIVE_PROTOCOL = "/meshd/directive/1"
# Control messages are a directive record (~400 bytes) or a short ask/ack.
MAX_CONTROL_FRAME_BYTES = 16 * 1024
# Dial + one request + one reply; a peer slower than this is treated as gone.
EXCHANGE_TIMEOUT_S = 10.0
# Relayed addresses of one peer tried per exchange (a node holds reservations on two relays).
MAX_CIRCUIT_TRIES = 4
READ_SIZE = 4096

Handler = Callable[[str, bytes], Awaitable[bytes]]  # (remote peer id, request body) -> reply body


class SwarmUnreachable(MeshdError):
    """A peer could not be reached for a join or directive exchange (retry later)."""


async def read_frame(stream) -> bytes:
    reader = FrameReader(MAX_CONTROL_FRAME_BYTES)
    while True:
        frame = reader.next_frame()
        if frame is not None:
            return frame
        try:
            data = await stream.read(READ_SIZE)
        except Exception as exc:  # py-libp2p: StreamEOF / StreamReset / closed connection
            raise ProtocolViolation(f"control stream ended: {type(exc).__name__}") from exc
        if not data:
            raise ProtocolViolation("control stream ended before a whole frame")
        reader.feed(data)


def serve(host, protocol: str, handler: Handler) -> None:
    """Register ``handler`` for ``protocol`` on ``host`` (one frame in, one frame out)."""

    async def on_stream(stream) -> None:
        remote = stream.muxed_conn.peer_id.to_base58()
        try:
            with trio.move_on_after(EXCHANGE_TIMEOUT_S):
                body = await read_frame(stream)
                reply = await handler(remote, body)
                await stream.write(encode_frame(reply, MAX_CONTROL_FRAME_BYTES))
        except MeshdError as exc:
            log.info("%s from %s refused: %s", protocol, remote[:16], exc)
        except Exception as exc:  # noqa: BLE001 - a peer's broken stream must never reach the daemon's nursery
            log.info("%s from %s failed: %s", protocol, remote[:16], exc)
        finally:
            try:
                await stream.close()
            except Exception:  # noqa: BLE001 - the peer may have reset it already
                pass

    host.set_stream_handler(protocol, on_stream)


async def exchange(host, peer_id: str, addrs: Sequence[str], protocol: str, body: bytes, *,
                   relayed: Sequence[str] = ()) -> bytes:
    """Dial ``peer_id`` if not connected -- at its direct ``addrs``, else through a relay
    circuit of ``relayed`` (a node behind NAT: how a tracker's directives reach it) --
    send one frame, return the reply frame."""
    import multiaddr
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from relay.client import dial_relayed, parse_relayed_addr

    pid = ID.from_base58(peer_id)
    with trio.move_on_after(EXCHANGE_TIMEOUT_S):
        try:
            if pid not in host.get_connected_peers():
                if addrs or not relayed:
                    maddrs = [multiaddr.Multiaddr(a.split("/p2p/")[0]) for a in addrs]
                    await host.connect(PeerInfo(pid, maddrs))
                else:
                    await _dial_circuit(host, pid, relayed, dial_relayed, parse_relayed_addr)
            stream = await host.new_stream(pid, [protocol])
            try:
                await stream.write(encode_frame(body, MAX_CONTROL_FRAME_BYTES))
                return await read_frame(stream)
            finally:
                try:
                    await stream.close()
                except Exception:  # noqa: BLE001 - the peer may have reset it already
                    pass
        except MeshdError:
            raise
        except Exception as exc:  # dial / negotiation / reset: all "unreachable" to the caller
            raise SwarmUnreachable(f"{protocol} with {peer_id[:16]}: {type(exc).__name__}: {exc}") from exc
    raise SwarmUnreachable(f"{protocol} with {peer_id[:16]}: no answer within {EXCHANGE_TIMEOUT_S:g} s")


async def _dial_circuit(host, pid, relayed: Sequence[str], dial_relayed, parse_relayed_addr) -> None:
    """One circuit to ``pid`` through the first relay of ``relayed`` that carries it."""
    last: Exception | None = None
    for addr in list(relayed)[:MAX_CIRCUIT_TRIES]:
        try:
            relay, dest = parse_relayed_addr(addr)
        except ValueError as exc:
            last = exc
            continue
        if dest != pid:
            continue
        try:
            await dial_relayed(host, relay, dest)
            return
        except Exception as exc:  # noqa: BLE001 - this relay lost it; the next may still carry it
            last = exc
    raise SwarmUnreachable(f"no relay circuit to {pid.to_base58()[:16]} ({last})")


def sign_directive(directive: pb.RebalanceDirective, key) -> bytes:
    return sign_record(pb.RECORD_KIND_DIRECTIVE, directive.SerializeToString(), key).SerializeToString()


def open_directive(data: bytes) -> tuple[pb.RebalanceDirective, str]:
    """Verify a signed directive record; returns (payload, the signer's peer id).

    Raises a ProtocolError (the sender's fault) for a bad record or signature.
    """
    rec = parse_signed_record(data)
    verify_record_signature(rec)
    directive = parse_directive(rec)
    try:
        signer = peer_id_from_public_key(rec.public_key)
    except MeshdError as exc:
        raise ProtocolViolation(f"directive signed by an unusable key: {exc}") from exc
    return directive, signer
