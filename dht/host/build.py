"""A node's libp2p host: Noise as the only security transport, yamux as the only muxer.

py-libp2p's ``new_host`` offers Noise, TLS, secio *and plaintext* unless the
security options are restricted, so this module passes exactly one security
transport (``/noise``) and one muxer (``/yamux/1.0.0``): a dialer that offers
anything else fails multistream negotiation and never gets a connection.

Library adjustments: ``build_host`` applies them (dht/compat/registry.py)
before the host exists; nothing is patched at import.

Data flow: ``running_host(identity, listen)`` builds the host from the
persistent identity and listens only on the configured multiaddrs; it raises
``PortInUse`` when a listener could not bind (the library only logs that).
On the way out it closes the host's connections itself: py-libp2p 0.8.1's
``host.run`` stops listening but leaves them open
(https://github.com/libp2p/py-libp2p/issues/1485). Dialing the bootstrap
peers is dht/host/bootstrap.py.
"""
from __future__ import annotations

import errno
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from dht.host.errors import ListenAddressInvalid, PortInUse
from dht.identity import Identity

log = logging.getLogger(__name__)

NOISE_PROTOCOL = "/noise"
# Bound on closing a host's connections when it stops (py-libp2p 0.8.1's ``host.run``
# leaves them open: the peer would keep a live-looking connection nobody reads).
CLOSE_S = 5.0
YAMUX_PROTOCOL = "/yamux/1.0.0"


def security_options(key_pair) -> dict:
    """Noise only: no plaintext, no secio, no TLS fallback."""
    from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
    from libp2p.custom_types import TProtocol
    from libp2p.security.noise.transport import PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    assert PROTOCOL_ID == NOISE_PROTOCOL
    return {TProtocol(PROTOCOL_ID): NoiseTransport(key_pair, noise_privkey=new_x25519().private_key)}


def muxer_options() -> dict:
    from libp2p.custom_types import TProtocol
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID, Yamux

    return {TProtocol(PROTOCOL_ID): Yamux}


def build_host(identity: Identity):
    """A BasicHost with the persistent identity, Noise-only security and yamux.

    Applies meshd's py-libp2p adjustments first (dht/compat/registry.py: version-gated,
    idempotent), so the host's connections are built on the adjusted data path."""
    from libp2p import new_host

    from dht.compat.registry import apply_libp2p_adjustments

    apply_libp2p_adjustments()
    key_pair = identity.libp2p_key_pair()
    return new_host(key_pair=key_pair, sec_opt=security_options(key_pair), muxer_opt=muxer_options(),
                    disable_identify_address_discovery=True)


def _parse_listen(listen: Sequence[str]) -> list:
    import multiaddr

    out = []
    for text in listen:
        addr = multiaddr.Multiaddr(text)
        protos = [p.name for p in addr.protocols()]
        if protos[:1] not in (["ip4"], ["ip6"]) or "tcp" not in protos:
            raise ListenAddressInvalid(f"listen address {text} must be /ip4/HOST/tcp/PORT (or /ip6/...)")
        out.append(addr)
    return out


def _bind_error(addr) -> str:
    """Reproduce the bind failure the library swallowed, for a precise message."""
    values = {p.name: addr.value_for_protocol(p.code) for p in addr.protocols()}
    host = values.get("ip4") or values.get("ip6")
    port = int(values["tcp"])
    family = socket.AF_INET6 if "ip6" in values else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"port {port} on {host} is already in use; pick another with --listen"
        return f"cannot listen on {addr}: {exc.strerror}"
    return f"cannot listen on {addr}"


@asynccontextmanager
async def running_host(identity: Identity, listen: Sequence[str]) -> AsyncIterator:
    """Run a host listening on exactly ``listen``; yields the host."""
    addrs = _parse_listen(listen)
    host = build_host(identity)
    failure: PortInUse | None = None
    async with host.run(addrs):
        try:
            bound = host.get_transport_addrs()
            if len(bound) < len(addrs):
                bound_text = {str(a) for a in bound}
                missing = [a for a in addrs if str(a) not in bound_text and not str(a).endswith("/tcp/0")]
                failure = PortInUse(_bind_error(missing[0] if missing else addrs[0]))
            else:
                yield host
        finally:
            await _close_connections(host)
    if failure is not None:
        # raised outside the library's nursery so the caller sees one plain error
        raise failure


async def _close_connections(host) -> None:
    """Close every connection of a stopping host, shielded and bounded (CLOSE_S): py-libp2p
    0.8.1's ``host.run`` stops listening but leaves open connections behind, so a peer would
    keep sending RPCs into a connection nobody reads until its own deadlines fire."""
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_S):
        try:
            await host.get_network().close()
        except Exception as exc:  # noqa: BLE001 - connections may already be gone
            log.debug("closing a stopping host's connections: %s", exc)
