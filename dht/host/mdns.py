"""LAN discovery by mDNS: announce this node, find the nodes of its swarm, dial them.

Data flow (``MdnsDiscovery.run``, a child of the daemon's nursery)::

    zeroconf loop thread (owned: started here, joined on exit)
      ├── our announcement: libp2p's PeerBroadcaster builds it (dht/compat/mdns_broadcaster.py),
      │   registered with zeroconf's coroutine, unregistered (goodbye) on exit
      └── AsyncServiceBrowser(_p2p._udp.local.) -> _on_change (instance name, added/removed)
            │ TrioToken.run_sync_soon -> bounded channel (EVENT_BUFFER; overflow counted)
    trio
      ├── _events: name -> MdnsPeers.seen (dht/host/mdns_core.py): only our swarm's names are
      │   resolved (zeroconf's async_request, awaited from trio, RESOLVE_TIMEOUT_MS), the TXT
      │   record parsed and bounded by the core
      └── _dialer: MdnsPeers.due -> host.connect under DIAL_TIMEOUT_S, at most MAX_PARALLEL_DIALS
          at once; woken by every new peer, else every MAINTAIN_S (connections lost are redialed)

A connected peer is the DHT's to judge: DhtNode adds it to the routing table
only if it speaks our swarm's DHT protocol, and believes only signed records.

What mDNS shows the LAN (multicast, by nature): our peer id, the addresses
we listen on (one per interface mDNS runs on, and the port), and our swarm's
tag -- not its name (dht/host/swarm_scope.py). Where it runs: only on the
IPv4 interfaces the node listens on (dht/host/interfaces.py): a node on
loopback runs none, one on 0.0.0.0 every non-loopback interface.
zeroconf's receive socket binds the mDNS port on every address (port 5353 is
shared by every responder on a machine) and joins the mDNS group only on
those interfaces. IPv4 only: libp2p's IPv6 mDNS needs link-local scopes
py-libp2p's dialer does not handle, and a home LAN has IPv4.

State: the zeroconf instance and browser (this task's; closed in ``finally``),
the core's peer table, the event channel, counters for ``meshd status``.
"""
from __future__ import annotations

import asyncio
import logging
import random
import string
from collections.abc import Callable, Sequence
from typing import Any

import trio

from dht.compat.gate import installed_version
from dht.compat.registry import decide
from dht.host.interfaces import IfaceAddr, mdns_interfaces, read_ipv4_interfaces
from dht.host.mdns_core import MAX_PEER_ADDRS, MdnsPeers
from dht.host.swarm_scope import SwarmScope

log = logging.getLogger(__name__)

__all__ = ["MdnsDiscovery", "SERVICE_TYPE"]

# libp2p's mDNS service type (the spec's; py-libp2p 0.8.1's libp2p.discovery.mdns.mdns.SERVICE_TYPE).
SERVICE_TYPE = "_p2p._udp.local."
# Random characters after "meshd-<tag>-": the spec wants a random instance name; 24 of 36
# symbols never collide on a LAN, and the whole label stays under DNS's 63.
INSTANCE_RANDOM_CHARS = 24
# Instance events waiting for trio: a LAN announces a few; beyond this a flood is dropped (counted).
EVENT_BUFFER = 64
# A TXT record of a LAN peer arrives in milliseconds; a silent one is given up after this.
RESOLVE_TIMEOUT_MS = 3000
MAX_PARALLEL_RESOLVES = 4
# A LAN peer answers a dial in milliseconds; a dead address fails by this.
DIAL_TIMEOUT_S = 5.0
MAX_PARALLEL_DIALS = 4
# Connections to the peers found are checked this often (one dropped is redialed).
MAINTAIN_S = 5.0


def _listen_pairs(listen_addrs: Sequence[str]) -> list[tuple[str, int]]:
    """(ip, port) of every /ip4/IP/tcp/PORT listen address (others are not announced by mDNS)."""
    out = []
    for text in listen_addrs:
        parts = text.split("/")
        if len(parts) >= 5 and parts[1] == "ip4" and parts[3] == "tcp" and parts[4].isdigit():
            out.append((parts[2], int(parts[4])))
    return out


def announced_addrs(listen_addrs: Sequence[str], ifaces: Sequence[IfaceAddr]) -> list[str]:
    """The /ip4/IP/tcp/PORT addresses we announce: a wildcard listener's port on every mDNS
    interface, a specific listener's address when mDNS runs on its interface (pure)."""
    out: list[str] = []
    ips = {a.ip for a in ifaces}
    for ip, port in _listen_pairs(listen_addrs):
        for addr_ip in ([a.ip for a in ifaces] if ip == "0.0.0.0" else [ip] if ip in ips else []):
            text = f"/ip4/{addr_ip}/tcp/{port}"
            if text not in out and len(out) < MAX_PEER_ADDRS:
                out.append(text)
    return out


class MdnsDiscovery:
    """mDNS for one host (see the module docstring). ``status()`` is what ``meshd status`` shows."""

    def __init__(self, host, scope: SwarmScope, *, listen_addrs: Sequence[str],
                 ifaces: Sequence[IfaceAddr] | None = None, on_connected: Callable[[str], None] | None = None,
                 progress: Callable[[str], None] = lambda line: None) -> None:
        self.host, self.scope = host, scope
        self.listen_addrs = list(listen_addrs)
        self._ifaces = ifaces
        self.on_connected = on_connected
        self.progress = progress
        self.me = host.get_id().to_base58()
        self.table = MdnsPeers(self.me, scope.mdns_prefix, SERVICE_TYPE)
        self.state, self.reason = "starting", ""
        self.interfaces: list[IfaceAddr] = []
        self.announced: list[str] = []
        self.instance = ""
        self.dropped_events = 0
        self.resolve_failures = 0
        self._zc: Any = None        # the zeroconf.Zeroconf this task opened (None outside ``run``)
        self._token: trio.lowlevel.TrioToken | None = None
        self._send: trio.MemorySendChannel | None = None
        self._wake = trio.Event()

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        return {"state": self.state, "reason": self.reason, "service": SERVICE_TYPE, "instance": self.instance,
                "interfaces": [f"{a.iface} {a.ip}/{a.prefix}" for a in self.interfaces],
                "announced": list(self.announced), "dropped_events": self.dropped_events,
                "resolve_failures": self.resolve_failures, **self.table.snapshot()}

    def _off(self, state: str, reason: str) -> None:
        self.state, self.reason = state, reason
        self.progress(f"mdns: {reason}")

    # ------------------------------------------------------------------ run
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        ifaces = self._ifaces if self._ifaces is not None else read_ipv4_interfaces()
        self.interfaces = mdns_interfaces([ip for ip, _ in _listen_pairs(self.listen_addrs)], ifaces)
        self.announced = announced_addrs(self.listen_addrs, self.interfaces)
        if not self.interfaces or not self.announced:
            self._off("off", "off: no LAN interface among the listen addresses (loopback only, or IPv6 only)")
            task_status.started()
            return
        try:
            from zeroconf import IPVersion, Zeroconf
            zc = Zeroconf(interfaces=[a.ip for a in self.interfaces], ip_version=IPVersion.V4Only, use_asyncio=False)
        except Exception as exc:  # noqa: BLE001 - sockets, multicast membership: mDNS is optional
            self._off("failed", f"failed: cannot open mDNS on {', '.join(a.ip for a in self.interfaces)}: {exc}")
            task_status.started()
            return
        self._zc, self._token = zc, trio.lowlevel.current_trio_token()
        send, receive = trio.open_memory_channel(EVENT_BUFFER)
        self._send = send
        browser = None
        try:
            info = self._announcement(zc)
            if info is None:
                task_status.started()
                return
            try:
                await self._in_loop(self._register(zc, info))
                browser = await self._in_loop(self._browse(zc))
            except Exception as exc:  # noqa: BLE001 - zeroconf refused (name conflict, sockets): no mDNS
                self._off("failed", f"failed: zeroconf refused our announcement: {exc}")
                task_status.started()
                return
            self.state = "on"
            self.progress(f"mdns: announcing {' '.join(self.announced)} as {self.instance} (swarm {self.scope.name})")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._events, receive, nursery)
                nursery.start_soon(self._dialer)
                task_status.started()
        finally:
            self._send = None
            send.close()
            with trio.CancelScope(shield=True):
                if browser is not None:
                    try:
                        await self._in_loop(browser.async_cancel())
                    except Exception as exc:  # noqa: BLE001 - the loop may be gone already
                        log.debug("cancelling the mDNS browser: %s", exc)
                await trio.to_thread.run_sync(zc.close)   # goodbye packets, then its loop thread is joined
            self._zc = None
            if self.state == "on":
                self.state = "off"

    def _announcement(self, zc):
        from dht.compat import mdns_broadcaster

        version = installed_version()
        self.instance = self.scope.mdns_prefix + "".join(
            random.SystemRandom().choice(string.ascii_lowercase + string.digits) for _ in range(INSTANCE_RANDOM_CHARS))
        port = _listen_pairs(self.announced)[0][1]
        try:
            broadcaster, off = mdns_broadcaster.broadcaster(
                version, [a.ip for a in self.interfaces], zeroconf=zc, service_type=SERVICE_TYPE,
                service_name=f"{self.instance}.{SERVICE_TYPE}", peer_id=self.me, port=port,
                listen_addrs=list(self.announced), host=None)
        except Exception as exc:  # noqa: BLE001 - a library that changed shape: no mDNS, said so
            self._off("failed", f"failed: libp2p's mDNS broadcaster refused: {exc}")
            return None
        if broadcaster is None:
            self._off("off", off or "off: libp2p has no mDNS broadcaster")
            return None
        decide(mdns_broadcaster.NAME, off, version, mdns_broadcaster.DETAIL)
        return broadcaster.service_info

    @staticmethod
    async def _register(zc, info) -> None:
        announce = await zc.async_register_service(info)
        await announce

    async def _browse(self, zc):
        from zeroconf.asyncio import AsyncServiceBrowser

        return AsyncServiceBrowser(zc, SERVICE_TYPE, handlers=[self._on_change])

    # ------------------------------------------------------------------ zeroconf's thread -> trio
    async def _in_loop(self, coro):
        """Run ``coro`` in zeroconf's asyncio loop and await its result from trio (cancel-safe:
        a cancelled wait cancels the coroutine)."""
        assert self._zc is not None and self._zc.loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._zc.loop)
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future.add_done_callback(wake)
        try:
            await done.wait()
        finally:
            if not future.done():
                future.cancel()
        return future.result()

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        """zeroconf's loop thread: hand the instance name to trio, nothing else."""
        from zeroconf import ServiceStateChange

        token = self._token
        if token is None:
            return
        try:
            token.run_sync_soon(self._enqueue, name, state_change is ServiceStateChange.Removed)
        except trio.RunFinishedError:
            pass

    def _enqueue(self, name: str, removed: bool) -> None:
        send = self._send
        if send is None:
            return
        try:
            send.send_nowait((name, removed))
        except trio.WouldBlock:
            self.dropped_events += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    # ------------------------------------------------------------------ trio tasks
    async def _events(self, receive: trio.MemoryReceiveChannel, nursery: trio.Nursery) -> None:
        limiter = trio.CapacityLimiter(MAX_PARALLEL_RESOLVES)
        async with receive:
            async for name, removed in receive:
                if name == f"{self.instance}.{SERVICE_TYPE}":
                    continue                        # our own announcement
                log.debug("mdns: %s %s", "removed" if removed else "announced", name)
                if removed:
                    self.table.removed(name)
                elif self.table.seen(name):
                    nursery.start_soon(self._resolve, name, limiter)

    async def _resolve(self, name: str, limiter: trio.CapacityLimiter) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        async with limiter:
            zc = self._zc
            if zc is None:
                return
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            try:
                ok = await self._in_loop(info.async_request(zc, RESOLVE_TIMEOUT_MS))
            except Exception as exc:  # noqa: BLE001 - zeroconf errors of every kind: counted, not fatal
                log.debug("resolving %s: %s", name, exc)
                ok = False
            if not ok:
                self.resolve_failures += 1
                return
            networks = [a.network for a in self.interfaces]
            self.table.resolved(name, dict(info.properties or {}), networks, trio.current_time())
            self._wake.set()

    async def _dialer(self) -> None:
        limiter = trio.CapacityLimiter(MAX_PARALLEL_DIALS)
        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                connected = {p.to_base58() for p in self.host.get_connected_peers()}
                for peer in self.table.due(now, connected):
                    nursery.start_soon(self._dial, peer.peer_id, peer.addrs, peer.attempts, limiter)
                nxt = self.table.next_due()
                wait = MAINTAIN_S if nxt is None else min(MAINTAIN_S, max(0.0, nxt - now))
                with trio.move_on_after(wait):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _dial(self, peer_id: str, addrs: tuple[str, ...], attempts: int, limiter: trio.CapacityLimiter) -> None:
        import multiaddr
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo

        error = ""
        async with limiter:
            try:
                info = PeerInfo(ID.from_base58(peer_id), [multiaddr.Multiaddr(a) for a in addrs])
            except Exception as exc:  # noqa: BLE001 - the core checked the shape; the library may still refuse
                self.table.dialed(peer_id, False, trio.current_time(), f"unusable address: {exc}")
                return
            if attempts:
                # py-libp2p 0.8.1 refuses to redial a peer whose dial failed in the last 60 s (its
                # negative cache, see dht/host/bootstrap.py); a retry here is a deliberate redial
                unblock = getattr(self.host.get_network(), "unblock_peer", None)
                if unblock is not None:
                    unblock(info.peer_id)
            with trio.move_on_after(DIAL_TIMEOUT_S) as scope:
                try:
                    await self.host.connect(info)
                except Exception as exc:  # noqa: BLE001 - refused, negotiation failed, ...
                    error = f"{type(exc).__name__}: {exc}"[:200]
            if scope.cancelled_caught:
                error = f"no answer within {DIAL_TIMEOUT_S:g} s"
        self.table.dialed(peer_id, not error, trio.current_time(), error)
        if error:
            log.info("mdns: dialing %s at %s failed: %s", peer_id, ", ".join(addrs), error)
        else:
            self.progress(f"mdns: connected to {peer_id} at {', '.join(addrs)}")
            if self.on_connected is not None:
                self.on_connected(peer_id)
        self._wake.set()
