"""No background dialing by py-libp2p 0.8.1's AutoConnector (the adjustment ``no_auto_connect``).

Upstream: https://github.com/libp2p/py-libp2p/issues/1451 (the
auto-connector's dial bursts and wasted dials at scale). Replaces
``AutoConnector.run_background_task`` and ``AutoConnector.maybe_connect``
(libp2p/network/auto_connector.py).

py-libp2p 0.8.1's swarm runs an ``AutoConnector`` (network/auto_connector.py):
while a host has fewer than ``low_watermark`` (100) connections it dials up to
32 peers of its peerstore per cycle -- every 10 s below ``min_connections``
(50), every 30 s otherwise, and again after every disconnect -- aiming at 200
connections (the midpoint of the 100/300 watermarks). Every peer a DHT answer
names lands in the peerstore, so in a DHT of a few hundred nodes each host
dials nearly every other: a near-full mesh, each connection a Noise handshake,
an identify exchange and yamux keep-alive pings, and after churn the
survivors' reconnect storm starved every DHT RPC (``meshd bench dht`` at 200
nodes: docs/measurements/2026-12-04.md).

meshd dials the peers it needs itself -- bootstrap (``connect_bootstrap``,
re-bootstrapped by the daemon's peer sync), the peers a DHT lookup asks,
relays, route hops -- so this adjustment makes the AutoConnector's two entry
points (``run_background_task``, ``maybe_connect``) do nothing. State: the
original methods, to restore (tests). Applied by dht/compat/registry.py when
``dht.compat.gate`` lets it and the library still has both methods;
``MESHD_NO_AUTO_CONNECT=0`` leaves the library's auto-connector on.
"""
from __future__ import annotations

from dht.compat.gate import gate, installed_version

NAME = "no_auto_connect"
DISABLE_ENV = "MESHD_NO_AUTO_CONNECT"
METHODS = ("run_background_task", "maybe_connect")
APPLIED = False
_ORIGINAL: dict = {}


def check(version: str) -> str | None:
    """None when the adjustment fits ``version`` and the installed library; else why it stays off."""
    return gate(version, module="libp2p.network.auto_connector", what="auto-connector", owner="AutoConnector",
                needs=METHODS, disable_env=DISABLE_ENV)


async def _no_background_task(self, nursery) -> None:
    """meshd: no periodic auto-connect loop (dht/compat/no_auto_connect.py)."""


async def _no_connect(self) -> None:
    """meshd: no auto-connect dials (dht/compat/no_auto_connect.py)."""


def apply(version: str | None = None) -> bool:
    """Make the AutoConnector inert (idempotent). True when it is in place."""
    global APPLIED
    if APPLIED:
        return True
    if version is None:
        version = installed_version()
    if check(version) is not None:
        return False
    from libp2p.network.auto_connector import AutoConnector

    for name, replacement in zip(METHODS, (_no_background_task, _no_connect)):
        _ORIGINAL[name] = AutoConnector.__dict__[name]
        setattr(AutoConnector, name, replacement)
    APPLIED = True
    return True


def restore() -> None:
    """Put the library's methods back (tests compare both)."""
    global APPLIED
    if APPLIED:
        from libp2p.network.auto_connector import AutoConnector

        for name, original in _ORIGINAL.items():
            setattr(AutoConnector, name, original)
        _ORIGINAL.clear()
        APPLIED = False
