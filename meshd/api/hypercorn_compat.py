"""The one place meshd adjusts Hypercorn, gated on the exact version it was written for.

    h2_preface_idle   Hypercorn 0.18.0 never times out an HTTP/2 connection that sent its
                      preface (and SETTINGS) but no request. Its HTTP/1.1 parser marks the
                      connection busy when it reads a request line -- ``PRI * HTTP/2.0`` too --
                      *before* the switch to HTTP/2 (moved there by upstream da9262d to fix
                      pgjones/hypercorn#51, a slow response timed out during an h2c upgrade);
                      the HTTP/2 protocol marks it idle again only when a stream closes.
                      64 such sockets held every slot of the API and nothing was logged.
                      The adjustment: ``TCPServer`` subclassed so that the moment a
                      connection speaks HTTP/2, Hypercorn's own idle timer is armed; when it
                      fires, the connection is closed only if it still has no stream (an
                      upgrade's request in flight is left alone: the #51 case stays fixed).

Applied only when the installed Hypercorn is exactly TESTED_HYPERCORN_VERSION
and still has what the subclass uses; otherwise the plain ``TCPServer`` runs
and the reason says so -- meshd's own connection table (meshd/api/connections.py)
still closes a connection that sent no whole request within its first-request
deadline, on any version. ``meshd status`` shows the decision (``status()``).
Pure decision at import of the first server; no global state is patched.
"""
from __future__ import annotations

import importlib.metadata

from hypercorn.events import RawData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import TCPServer

TESTED_HYPERCORN_VERSION = "0.18.0"
UPSTREAM = "https://github.com/pgjones/hypercorn/issues/51"
NAME = "h2_preface_idle"
# What the subclass reads or calls on Hypercorn's classes.
_NEEDS = ((TCPServer, ("protocol_send", "_initiate_server_close", "_idle_timeout")), (H2Protocol, ("idle",)))


def installed_version() -> str:
    try:
        return importlib.metadata.version("hypercorn")
    except importlib.metadata.PackageNotFoundError:
        return ""


def gate(version: str) -> str | None:
    """None when the adjustment may go in for ``version``; else why it stays off."""
    if version != TESTED_HYPERCORN_VERSION:
        return (f"off: hypercorn {version or '(none)'} is installed, written for {TESTED_HYPERCORN_VERSION} only; "
                "meshd's first-request deadline still closes preface-only connections")
    missing = [f"{cls.__name__}.{name}" for cls, names in _NEEDS for name in names if not hasattr(cls, name)]
    if missing:
        return "off: hypercorn lacks " + ", ".join(missing)
    return None


class H2IdleTCPServer(TCPServer):
    """Hypercorn's TCPServer with its idle timer armed when a connection turns HTTP/2 (see module doc)."""

    _h2_armed = False

    async def protocol_send(self, event) -> None:
        await super().protocol_send(event)
        if (not self._h2_armed and isinstance(event, RawData)
                and isinstance(getattr(self.protocol, "protocol", None), H2Protocol)):
            self._h2_armed = True   # the server's own preface is the first thing an HTTP/2 connection sends
            await self.idle_task.restart(self._task_group, self._h2_idle_timeout)

    async def _h2_idle_timeout(self) -> None:
        # Hypercorn's _idle_timeout, but a connection whose stream runs (an h2c upgrade's request,
        # created without an idle update) is left to the stream's own idle update when it closes.
        import trio

        with trio.move_on_after(self.config.keep_alive_timeout):
            await self.context.terminated.wait()
        protocol = self.protocol.protocol
        if isinstance(protocol, H2Protocol) and protocol.idle:   # armed only once the connection is HTTP/2
            with trio.CancelScope(shield=True):
                await self._initiate_server_close()


def server_class(version: str | None = None) -> type[TCPServer]:
    return TCPServer if gate(installed_version() if version is None else version) else H2IdleTCPServer


def status(version: str | None = None) -> dict:
    """The ``http`` library section of ``meshd status`` (the same shape as the libp2p one)."""
    version = installed_version() if version is None else version
    refused = gate(version)
    reason = refused or (f"on: hypercorn {version}, the version it was written for: an HTTP/2 connection "
                         f"without a stream is closed after the keep-alive timeout ({UPSTREAM}, da9262d)")
    return {"library": "hypercorn", "version": version, "tested_version": TESTED_HYPERCORN_VERSION,
            "adjustments": [{"name": NAME, "applied": refused is None, "reason": reason, "link": UPSTREAM,
                             "library_version": version}]}
