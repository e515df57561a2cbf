"""Reachability: can peers dial us? If not, hold a relay reservation and advertise it.

Dial-back probe (``DIALBACK_PROTOCOL``): a node asks a connected peer to open
a NEW TCP connection to the addresses it listens on. The helper dials only
addresses whose IP is the one it observes on the asking connection (so the
service cannot be used to scan third parties), each with a short timeout, and
answers with the addresses that accepted. A home node behind NAT (inbound
SYNs dropped) gets an empty list: ``Verdict.PRIVATE``. We do not use
py-libp2p's AutoNAT: its server dials back with ``host.connect``, which
reuses the connection the request arrived on and so reports every asker as
public.

Reservation keeper (``keep_reserved``): while PRIVATE, hold a reservation on
one relay from the list (given on the command line or found in the DHT),
renew it at ``RENEW_FRACTION`` of its remaining life, move to the next relay
when one fails, and report the relayed multiaddrs (for
Reachability.relayed_addrs) through ``on_addrs`` whenever they change (an
empty tuple while no relay holds us). Several keepers share one list through
``claim`` (each relay held or tried by one keeper at a time). The held
relay's connection closing (dht/host/conn_watch.py, the swarm's disconnected
notification) ends the wait at once: addresses withdrawn, a log line, a new
reservation elsewhere. The schedule is a pure function (``renew_delay``)
tested with trio's MockClock.

DCUtR (hole punching) is not this module's: it needs both peers' observed
public addresses and TCP simultaneous open, which a stateful NAT that drops
inbound SYNs (our test topology, and many home routers) defeats, so the
reservation stays the way in. The entry tries a bounded, best-effort direct
upgrade of a relayed peer in the background (meshd/reach/direct_upgrade.py).
"""
from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable, Sequence

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import PeerInfo

from proto.errors import ProtocolError
from relay.client import Reservation, relayed_addrs, reserve
from relay.errors import RelayError
from relay.transport import RelayedFrameChannel

log = logging.getLogger(__name__)

__all__ = ["DIALBACK_PROTOCOL", "Verdict", "serve_dialback", "probe", "renew_delay", "keep_reserved"]

DIALBACK_PROTOCOL = TProtocol("/meshd/dialback/1")
# A request lists our own listen addresses: a handful, each a short multiaddr.
MAX_DIALBACK_ADDRS = 8
MAX_DIALBACK_FRAME = 4096
# One TCP handshake on the public internet; NAT drops make it time out, so keep it short.
DIALBACK_CONNECT_TIMEOUT_S = 3.0
# The whole probe (stream open, dials, answer).
PROBE_TIMEOUT_S = 15.0
# Renew when this fraction of the remaining reservation life has passed...
RENEW_FRACTION = 0.5
# ...but never sooner than this (a relay with a tiny TTL must not make us spin),
RENEW_MIN_DELAY_S = 5.0
# and retry a failed relay list after this long.
RETRY_DELAY_S = 10.0


class Verdict(enum.Enum):
    PUBLIC = "public"      # a helper opened a new connection to one of our addresses
    PRIVATE = "private"    # helpers answered, none could connect
    UNKNOWN = "unknown"    # no helper answered


def _ip_and_port(addr: str) -> tuple[str, int] | None:
    try:
        ma = multiaddr.Multiaddr(addr)
        values = {p.name: ma.value_for_protocol(p.code) for p in ma.protocols()}
    except Exception:  # a malformed address from a peer is ignored
        return None
    ip = values.get("ip4") or values.get("ip6")
    if ip is None or "tcp" not in values or "p2p-circuit" in values:
        return None
    return ip, int(values["tcp"])


def _observed_ip(stream) -> str | None:
    try:
        return stream.muxed_conn.get_remote_address()[0]   # type: ignore[index]
    except Exception:
        try:
            return stream.get_remote_address()[0]
        except Exception:
            return None


async def _tcp_reachable(ip: str, port: int) -> bool:
    with trio.move_on_after(DIALBACK_CONNECT_TIMEOUT_S):
        try:
            conn = await trio.open_tcp_stream(ip, port)
        except OSError:
            return False
        await conn.aclose()
        return True
    return False


def serve_dialback(host) -> None:
    """Answer dial-back requests from connected peers (relays and public nodes run this)."""

    async def handle(stream) -> None:
        channel = RelayedFrameChannel(stream, max_frame_bytes=MAX_DIALBACK_FRAME)
        try:
            with trio.fail_after(PROBE_TIMEOUT_S):
                body = await channel.receive()
                if body is None:
                    return
                addrs = json.loads(body.decode()).get("addrs", [])[:MAX_DIALBACK_ADDRS]
                observed = _observed_ip(stream)
                reached = []
                for addr in addrs:
                    target = _ip_and_port(addr) if isinstance(addr, str) else None
                    if target and target[0] == observed and await _tcp_reachable(*target):
                        reached.append(addr)
                await channel.send(json.dumps({"reachable": reached}).encode())
                await channel.close()
        except (ProtocolError, RelayError, ValueError, AttributeError, trio.TooSlowError) as exc:
            log.info("dial-back request refused: %s", exc)
            await channel.reset()

    host.set_stream_handler(DIALBACK_PROTOCOL, handle)


async def probe(host, helpers: Sequence, own_addrs: Sequence[str]) -> Verdict:
    """Ask each helper (peer ids we are connected to) to dial us back."""
    answered = False
    request = json.dumps({"addrs": list(own_addrs)[:MAX_DIALBACK_ADDRS]}).encode()
    for helper in helpers:
        with trio.move_on_after(PROBE_TIMEOUT_S):
            try:
                stream = await host.new_stream(helper, [DIALBACK_PROTOCOL])
                channel = RelayedFrameChannel(stream, max_frame_bytes=MAX_DIALBACK_FRAME)
                await channel.send(request)
                body = await channel.receive()
            except Exception as exc:  # noqa: BLE001 - any failure makes this helper unusable: ask the next
                log.info("dial-back probe via %s failed: %s", helper, exc)
                continue
            if body is None:
                continue
            answered = True
            try:
                if json.loads(body.decode()).get("reachable"):
                    return Verdict.PUBLIC
            except ValueError:
                continue
    return Verdict.PRIVATE if answered else Verdict.UNKNOWN


def renew_delay(reservation: Reservation, now_unix: float) -> float:
    """Seconds until we renew: RENEW_FRACTION of the remaining life, at least RENEW_MIN_DELAY_S."""
    remaining = reservation.expires_at_unix - now_unix
    return max(RENEW_MIN_DELAY_S, remaining * RENEW_FRACTION)


async def _wait_any(events: Sequence[trio.Event], timeout_s: float) -> None:
    """Return when one of ``events`` is set or after ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        if not events:
            await trio.sleep_forever()
        async with trio.open_nursery() as nursery:
            for event in events:
                async def one(e: trio.Event = event) -> None:
                    await e.wait()
                    nursery.cancel_scope.cancel()
                nursery.start_soon(one)


def _text(peer) -> str:
    return peer.to_base58() if hasattr(peer, "to_base58") else str(peer)


async def keep_reserved(host, relays: Callable[[], Sequence[PeerInfo]],
                        on_addrs: Callable[[tuple[str, ...]], None], *,
                        wall: Callable[[], float], reserve_fn=reserve,
                        claim: Callable[[str | None], bool] = lambda relay: True,
                        watch=None, wake: Callable[[], trio.Event] | None = None,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Hold a reservation on one of ``relays()`` forever; report relayed addrs on change.

    ``relays`` is re-read on every attempt (a DHT lookup or a fixed list);
    ``wall`` is the unix clock and ``reserve_fn`` the RESERVE call (both injected
    for the fake-clock schedule test). ``claim(relay_id)`` is asked, with no
    await between it and the RESERVE, before each attempt: False (another
    keeper holds or tries that relay) skips it; ``claim(None)`` lets go.
    ``watch`` (dht/host/conn_watch.py) wakes us when the held relay's connection
    closes: the addresses are withdrawn at once (``on_addrs(())``), logged,
    and we reserve elsewhere (the lost relay tried last). ``wake()`` is an
    event set when the relay list changed; an empty keeper tries again then.
    Started once the first attempt finished, successful or not.
    """
    own = host.get_id().to_base58()
    current: tuple[str, ...] | None = None
    holder: str | None = None      # the relay that holds our reservation: renew there first
    lost: str | None = None        # the relay whose connection just closed: tried last
    started = False
    while True:
        delay = RETRY_DELAY_S
        addrs: tuple[str, ...] = ()
        previous, holder = holder, None
        order = sorted(relays(), key=lambda r: (_text(r.peer_id) == lost, _text(r.peer_id) != previous))
        for relay in order:
            pid = _text(relay.peer_id)
            if not claim(pid):
                continue
            try:
                reservation = await reserve_fn(host, relay)
            except RelayError as exc:
                log.info("reservation on %s failed: %s", pid, exc)
                claim(None)
                continue
            addrs = relayed_addrs(reservation, own)
            delay = renew_delay(reservation, wall())
            holder = pid
            break
        if holder is None:
            claim(None)
        if previous is not None and holder != previous:
            log.warning("relay %s no longer holds our reservation; now %s", previous, holder or "none")
        lost = None
        if addrs != current:
            current = addrs
            on_addrs(addrs)
        if not started:
            started = True
            task_status.started(addrs)
        events = []
        closed = watch.closed(holder) if watch is not None and holder is not None else None
        if closed is not None:
            events.append(closed)
        if holder is None and wake is not None:
            events.append(wake())
        await _wait_any(events, delay)
        if closed is not None and closed.is_set():
            log.warning("connection to relay %s closed: withdrawing its relayed addresses, reserving again",
                        holder)
            lost = holder
            current = ()
            on_addrs(())
