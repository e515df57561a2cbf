"""Errors of a node's libp2p host, placed in the project's tree (proto.errors).

    MeshdError
    └── HostError                     the libp2p host cannot start or reach anyone
        ├── ListenAddressInvalid      a --listen address we cannot bind (fix the flag)
        ├── PortInUse                 another process holds the port (pick another)
        ├── BootstrapUnreachable      no bootstrap peer answered (check the addresses)
        └── SwarmNameInvalid          a --swarm name we cannot use (fix the flag)

libp2p's bind and dial failures are mapped to these at the host's edge
(dht/host/build.py, dht/host/bootstrap.py).
"""
from __future__ import annotations

from proto.errors import MeshdError

__all__ = ["HostError", "ListenAddressInvalid", "PortInUse", "BootstrapUnreachable", "SwarmNameInvalid"]


class HostError(MeshdError):
    """The libp2p host could not start or reach its bootstrap peers."""


class ListenAddressInvalid(HostError):
    """A listen address that is not /ip4|ip6/HOST/tcp/PORT."""


class PortInUse(HostError):
    """Another process holds the listen port."""


class BootstrapUnreachable(HostError):
    """None of the bootstrap peers answered."""


class SwarmNameInvalid(HostError):
    """A swarm name that is empty, too long or has characters we do not take."""
