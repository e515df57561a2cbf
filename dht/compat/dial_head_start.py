"""Dial without py-libp2p 0.8.1's fixed 250 ms wait (the adjustment ``dial_head_start``).

Upstream: no upstream issue found. Sets ``_HAPPY_EYEBALLS_DELAY`` in
libp2p/network/swarm.py (read by ``Swarm.dial_peer``).

py-libp2p 0.8.1's ``Swarm.dial_peer`` (network/swarm.py) starts a dial per
selected address (at most MAX_ADDRS_PER_PEER = 2) and, after each start,
waits ``_HAPPY_EYEBALLS_DELAY`` (0.25 s) unless that dial *failed*. A dial
that succeeds does not end the wait, and it also follows the last address,
so every new connection takes at least 250 ms however fast the peer
answers: a bootstrap on loopback, and every round of an iterative DHT
lookup that dials a new peer (docs/measurements/2026-12-02.md).

This adjustment sets the module's head start to 0: the (at most two)
selected addresses are dialed at once and the dial returns when they are
done. State: the original value, to restore (tests). Applied by
dht/compat/registry.py when ``dht.compat.gate`` lets it and the library
still has the constant; ``MESHD_DIAL_HEAD_START=0`` leaves it off.
"""
from __future__ import annotations

import importlib

from dht.compat.gate import gate, installed_version

NAME = "dial_head_start"
DISABLE_ENV = "MESHD_DIAL_HEAD_START"
LIBRARY_DELAY_S = 0.250
APPLIED = False
_ORIGINAL: float | None = None


def check(version: str) -> str | None:
    """None when the adjustment fits ``version`` and the installed library; else why it stays off."""
    refused = gate(version, module="libp2p.network.swarm", what="swarm", disable_env=DISABLE_ENV)
    if refused is not None:
        return refused
    delay = getattr(importlib.import_module("libp2p.network.swarm"), "_HAPPY_EYEBALLS_DELAY", None)
    if delay not in (LIBRARY_DELAY_S, 0.0):
        return f"off: the library's dial head start is {delay!r}, not the {LIBRARY_DELAY_S} s this was written for"
    return None


def apply(version: str | None = None) -> bool:
    """Set the head start to 0 (idempotent). True when it is in place."""
    global APPLIED, _ORIGINAL
    if APPLIED:
        return True
    if version is None:
        version = installed_version()
    if check(version) is not None:
        return False
    from libp2p.network import swarm

    _ORIGINAL = swarm._HAPPY_EYEBALLS_DELAY
    swarm._HAPPY_EYEBALLS_DELAY = 0.0
    APPLIED = True
    return True


def restore() -> None:
    """Put the library's value back (tests compare both)."""
    global APPLIED
    if APPLIED and _ORIGINAL is not None:
        from libp2p.network import swarm

        swarm._HAPPY_EYEBALLS_DELAY = _ORIGINAL
        APPLIED = False
