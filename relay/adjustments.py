"""Explicit adjustments to py-libp2p: applied by the host builder, gated on the exact version.

meshd changes a few things inside py-libp2p 0.8.1 (see each module for why):

    yamux_release_on_read   PY_YAMUX_RELEASE_ON_READ=0, the library's own knob (unless the user set it)
    yamux_window_batching   relay/yamux_tuning.py: WINDOW_UPDATEs at half the window
    libp2p_fastpath         relay/libp2p_fastpath.py: leaner TCP/Noise/yamux data path
                            (MESHD_LIBP2P_FASTPATH=0 leaves it off)
    inbound_limits          relay/inbound_limits.py: per-address caps on pending and upgraded
                            inbound connections, a total pending cap, a 5 s pre-handshake
                            deadline (MESHD_INBOUND_LIMITS=0 leaves it off)
    dial_head_start         relay/dial_head_start.py: no fixed 250 ms wait in every new dial
                            (MESHD_DIAL_HEAD_START=0 leaves it off)
    no_auto_connect         relay/auto_connect.py: the swarm's AutoConnector dials nobody (it aimed
                            at 200 connections per host: a full mesh in a 200-node DHT)
                            (MESHD_NO_AUTO_CONNECT=0 leaves it on)
    peer_record_gc          relay/peer_record_gc.py: a peer whose address-book entry expired no
                            longer makes KadDHT reset every request naming it
                            (MESHD_PEER_RECORD_GC=0 leaves the library's)
    dht_inbound_handlers    dht/node.py: KadDHT serves 64 inbound DHT streams at once, not 12
                            (recorded by the daemon for its DhtNode: ``record_dht_node``)
    dht_maintenance         dht/node.py: KadDHT's 10-minute maintenance loop (library lookups, all
                            nodes started together at once) replaced by DhtNode's jittered refresh
    dcutr_policy            meshd/reach/direct_upgrade.py: our DCUtR service narrows the library's
                            (no auto-drive, no relay close, bounded inbound punches); recorded here
                            by the code that sets DCUtR up

Nothing here runs at import. ``apply_libp2p_adjustments()`` is called by
``relay.host.build_host`` (so every process that builds a host -- daemon,
relay mode, ``python -m relay.node``, the benchmark harness -- gets the same
data path before its first connection exists); each adjustment is applied
only when the installed library is exactly ``TESTED_LIBP2P_VERSION`` (and
still has what it replaces). Anything else leaves the library untouched and
says why.

State: the registry, name -> ``Adjustment`` (applied or not, and the reason),
one per process, guarded by a lock; ``snapshot()`` is what ``meshd status``
shows. Patches are process-wide and never undone by this module: once an
adjustment is on, a later call keeps reporting it on.
"""
from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass

from relay.library_gate import TESTED_LIBP2P_VERSION, installed_version

__all__ = ["Adjustment", "TESTED_LIBP2P_VERSION", "installed_version", "version_gate", "record",
           "snapshot", "apply_libp2p_adjustments", "record_dht_node", "library_status", "render_library",
           "RELEASE_ON_READ_ENV"]

# py-libp2p's own yamux knob (read at call time): "0" stops crediting partial reads at once.
RELEASE_ON_READ_ENV = "PY_YAMUX_RELEASE_ON_READ"


@dataclass(frozen=True, slots=True)
class Adjustment:
    name: str
    applied: bool
    reason: str            # why it is on, or why it is off
    library_version: str   # the libp2p version the decision was made for ("" if none is installed)


_lock = threading.Lock()
_apply_lock = threading.Lock()     # one apply at a time (two threads building hosts at once)
_registry: dict[str, Adjustment] = {}


def version_gate(version: str) -> str | None:
    """None when ``version`` is the tested one; else the reason every adjustment stays off."""
    if not version:
        return "off: py-libp2p is not installed"
    if version != TESTED_LIBP2P_VERSION:
        return f"off: libp2p {version} is installed, written for {TESTED_LIBP2P_VERSION} only"
    return None


def record(name: str, applied: bool, reason: str, version: str) -> Adjustment:
    """Remember the decision for ``name``; an adjustment already on stays on (patches are not undone)."""
    with _lock:
        old = _registry.get(name)
        if old is not None and old.applied and not applied:
            return old
        adj = Adjustment(name, applied, reason, version)
        _registry[name] = adj
        return adj


def snapshot() -> list[dict]:
    """The registry as JSON-able rows, by name (``meshd status``)."""
    with _lock:
        return [asdict(_registry[name]) for name in sorted(_registry)]


def _on(version: str) -> str:
    return f"on: libp2p {version}, the version it was written for"


def _release_on_read(version: str) -> Adjustment:
    prior = _registry.get("yamux_release_on_read")
    if prior is not None and prior.applied:
        return prior
    user = os.environ.get(RELEASE_ON_READ_ENV)
    if user is not None and user != "0":
        return record("yamux_release_on_read", False, f"off: {RELEASE_ON_READ_ENV}={user} set by the user, kept",
                      version)
    if user == "0":     # inherited from a meshd parent, or the user's own choice: the same setting
        return record("yamux_release_on_read", True,
                      _on(version) + f" ({RELEASE_ON_READ_ENV}=0, already in the environment)", version)
    os.environ[RELEASE_ON_READ_ENV] = "0"
    return record("yamux_release_on_read", True, _on(version) + f" ({RELEASE_ON_READ_ENV}=0)", version)


def apply_libp2p_adjustments(version: str | None = None) -> list[Adjustment]:
    """Apply the data-path adjustments (idempotent); returns their registry entries.

    ``version`` is the library version to decide for (default: the installed one);
    tests pass another string to see the gate refuse."""
    from relay import auto_connect, dial_head_start, inbound_limits, libp2p_fastpath, peer_record_gc, yamux_tuning

    version = installed_version() if version is None else version
    refused = version_gate(version)
    with _apply_lock:
        out = [record("yamux_release_on_read", False, refused, version) if refused else _release_on_read(version)]
        for name, module in (("yamux_window_batching", yamux_tuning), ("libp2p_fastpath", libp2p_fastpath),
                             ("inbound_limits", inbound_limits), ("dial_head_start", dial_head_start),
                             ("no_auto_connect", auto_connect), ("peer_record_gc", peer_record_gc)):
            reason = refused or module.check(version)
            if reason is None and module.apply(version):
                out.append(record(name, True, _on(version), version))
            else:
                out.append(record(name, False, reason or "off: the library lacks what it replaces", version))
        return out


def record_dht_node(dht_node, version: str | None = None) -> list[Adjustment]:
    """Record dht/node.py's per-node adjustments (KadDHT's inbound stream cap, 12 -> 64; its
    maintenance loop replaced by meshd's jittered refresh)."""
    from dht.node import DHT_INBOUND_HANDLERS, REFRESH_INTERVAL_S

    version = installed_version() if version is None else version
    out = []
    for name, off, on in (
            ("dht_inbound_handlers", dht_node.inbound_handlers_off, f" ({DHT_INBOUND_HANDLERS} streams)"),
            ("dht_maintenance", dht_node.maintenance_off,
             f" (meshd's refresh, every {REFRESH_INTERVAL_S:g} s at a random phase)")):
        out.append(record(name, True, _on(version) + on, version) if off is None else record(name, False, off, version))
    return out


def library_status() -> dict:
    """The ``libp2p`` section of ``meshd status``: installed version and every adjustment's decision."""
    return {"version": installed_version(), "tested_version": TESTED_LIBP2P_VERSION, "adjustments": snapshot()}


def render_library(status: dict | None) -> list[str]:
    """Text lines for a ``library_status()`` dict (pure; used by both status views)."""
    if not status:
        return []
    rows = status.get("adjustments") or []
    lines = [f"libp2p     {status.get('version') or '(not installed)'} "
             f"({sum(1 for r in rows if r['applied'])} of {len(rows)} adjustments on)"]
    width = max((len(r["name"]) for r in rows), default=0)
    for r in rows:
        lines.append(f"  {'on ' if r['applied'] else 'off'}  {r['name'].ljust(width)}  {r['reason']}")
    return lines
