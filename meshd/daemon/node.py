"""The meshd daemon: one trio process, one tree of nurseries; threads only where a task waits.

    run_daemon(config)
    └── host (libp2p, Noise + yamux)              dht/host/build.py
        └── DHT service (KadDHT, our validator, the swarm's protocol id)   dht/node.py
            └── nursery
                ├── peer sync   (routing table <- connected peers, re-bootstrap)
                ├── mdns        (announce us, find and dial our swarm's LAN peers;
                │               --no-mdns turns it off)            dht/host/mdns.py
                ├── relaying    (dial-back probe; when private: STOP service,
                │               relay reservations, relayed addrs; relayed sessions
                │               to the worker's Unix socket, no thread)  meshd/reach/relaying.py
                ├── upgrader    (DCUtR handler; bounded background direct upgrades
                │               of relayed hops)                    meshd/reach/direct_upgrade.py
                ├── advertiser  (publish / republish / withdraw)   meshd/daemon/advertiser.py
                ├── free KV     (the worker's Health -> our record) [thread: each Health call]
                ├── control API (unix socket, JSON)                meshd/daemon/control.py
                ├── HTTP API    (OpenAI, Ollama, /metrics, dashboard; generations of
                │   │           both APIs pass its entry; PeerWatch's Health probes
                │   │           [thread each])                        meshd/daemon/api_part.py
                │   └── a generation's task (meshd/generate/service.py)
                │       └── [thread] the route driver (trio.to_thread: the task waits for it)
                │           └── [ThreadGroup route-<id>] watchdog, push readers, Health probes,
                │               close guards: joined before the driver thread returns
                ├── fetch port  (the model bytes we hold, served to peers over TLS
                │   │           [ThreadGroup fetch-port] accept, one per connection;
                │   │           joined when it stops)                 meshd/daemon/fetch_part.py
                │   └── fetching our range for --model ROOT ([thread] the fetch, its
                │               [ThreadGroup fetch] one per provider + the feeder; joined)
                ├── supervisor  (worker subprocess: its life, its Health calls [thread each],
                │               its output pumps)  meshd/daemon/supervisor.py, worker_process.py
                ├── swarm       (tracker duty, --layers auto, directives, generate;
                │               [thread] digest, footprint, tokenizer)  meshd/daemon/swarm_part.py
                ├── experts     (MoE, --experts: expert peer worker + its record, or the
                │               holder's directory of expert peers)  meshd/daemon/experts_part.py
                └── signals     (SIGINT/SIGTERM -> graceful leave)

Threads: trio owns the process. Blocking work leaves the loop only through
``trio.to_thread.run_sync`` -- the calling task waits for the thread, so its
nursery does (``[thread]`` above); a thread comes back into the loop only
through relay/portal.py (the daemon's ``Portal``: DHT snapshots, relay dials,
DCUtR requests, a generation's tokens in a bounded Outbox). The only threads
that are not a waiting task's are the route driver's helpers, in the
driver's ThreadGroup, joined when its generation ends
(tests/test_thread_ownership.py checks that none outlives the daemon), and
the fetch port's, in its ThreadGroup, joined when the fetch part stops.

Graceful leave: stop advertising and publish the withdrawal (bounded), then
cancel the tree: a generation's driver is cancelled (it releases its hops and
joins its threads; its task waits), the supervisor SIGTERMs the worker (it
stops its servers, joins its threads, exits 0) and waits for it, the DHT and
the host close last.

``Node`` is the composition root: it wires the parts and answers the
control API; each part owns its own state.

A client-only node (``--layers none``) starts no supervisor and no worker,
so it never claims a record; the swarm part still runs (digest, snapshot,
generate) and so do the DHT, the control socket and the HTTP API.
"""
from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import trio

from dht import keys as K
from dht.compat.registry import library_status
from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.host.interfaces import pick_advertise_host, read_default_route_iface, read_ipv4_interfaces
from dht.host.mdns import MdnsDiscovery
from dht.identity import Identity, load_or_create_identity
from dht.node import DhtNode
from dht.records import live
from meshd.config import DaemonConfig
from meshd.daemon.advertiser import Advertiser, claim_from_report
from meshd.daemon.api_part import ApiPart
from meshd.daemon.control import serve_control
from meshd.daemon.fetch_part import FetchPart
from meshd.daemon.free_kv import POLL_S as FREE_KV_POLL_S
from meshd.daemon.free_kv import FreeKvGate
from meshd.daemon.supervisor import Backoff, Supervisor, WorkerReady
from meshd.daemon.swarm_part import Swarm
from meshd.daemon.worker_process import WorkerProcess, WorkerSpec, fetch_health
from meshd.reach.direct_upgrade import DirectUpgrader
from meshd.reach.relay_dial import RelayDialer
from meshd.reach.relaying import Relaying
from meshd.reach.tls import TlsMaterial, load_or_create_tls, split_endpoint
from proto import shard_runtime_pb2 as pb
from relay.portal import Portal
from relay.reachability import serve_dialback
from shard.model.memory import process_memory

if TYPE_CHECKING:   # torch-heavy: imported when the node runs an expert part
    from meshd.daemon.experts_part import ExpertPart

log = logging.getLogger(__name__)

# Connected peers join the routing table within this delay.
PEER_SYNC_INTERVAL_S = 2.0
# With no peer at all, try the bootstrap list again this often.
REBOOTSTRAP_INTERVAL_S = 10.0
# `meshd status` waits at most this long for the DHT reads behind the coverage map.
STATUS_FETCH_TIMEOUT_S = 10.0
# Models shown in the coverage map: ours plus the indexes we hold, bounded.
MAX_STATUS_MODELS = 16
# Our record's daemon base is rounded up to this: the daemon grows by a few MiB as it meets peers
# and serves requests, and every change of the figure would republish the record.
DAEMON_BASE_STEP_BYTES = 8 << 20

Progress = Callable[[str], None]


def wall_ms() -> int:
    return int(time.time() * 1000)


def _ip_of(multiaddr_text: str) -> str | None:
    parts = multiaddr_text.split("/")
    if len(parts) >= 3 and parts[1] in ("ip4", "ip6"):
        return parts[2]
    return None


def direct_addrs_of(listen_addrs: list[str], advertise_host: str | None) -> tuple[str, ...]:
    """The direct addresses our record lists: listen addresses, an unspecified one (0.0.0.0, ::)
    rewritten to ``advertise_host`` when that is an IP literal of its family, else left out.
    Tracker duty goes only to nodes whose record lists one (meshd/plan/tracker.py)."""
    import ipaddress

    try:
        adv = ipaddress.ip_address(advertise_host) if advertise_host else None
    except ValueError:
        adv = None      # a host name: not an address others can dial from a multiaddr here
    out: list[str] = []
    for text in listen_addrs:
        for wildcard, version in (("/ip4/0.0.0.0/", 4), ("/ip6/::/", 6)):
            if wildcard in text:
                text = (text.replace(wildcard, f"/ip{version}/{adv}/") if adv is not None and adv.version == version
                        else "")
        if text and text not in out:
            out.append(text)
    return tuple(out[:16])


class Node:
    def __init__(self, config: DaemonConfig, identity: Identity, tls: TlsMaterial, host, dht: DhtNode,
                 progress: Progress) -> None:
        self.config = config
        self.identity = identity
        self.tls = tls
        self.host = host
        self.dht = dht
        self.progress = progress
        self.advertiser = Advertiser(identity, dht.publish, ttl_s=config.record_ttl_s, wall_ms=wall_ms)
        self.free_kv = FreeKvGate()   # our record's free KV follows the worker (meshd/daemon/free_kv.py)
        # The memory our record offers the tracker (--layers auto; 0: never moved by rebalancing). Part
        # of every claim refresh_claim builds: a claim rebuilt for a new verdict or free KV keeps it.
        self.memory_budget_bytes = 0
        self.supervisor: Supervisor | None = None
        self.swarm: Swarm | None = None  # meshd/daemon/swarm_part.py: tracker duty, --layers auto, generation
        self.experts: ExpertPart | None = None  # meshd/daemon/experts_part.py: MoE expert peer or holder (--experts)
        self.api = ApiPart(self)  # the entry every generation passes, the HTTP server (meshd/daemon/api_part.py)
        self.fetch = FetchPart(self)  # our fetch port and, with --model ROOT, fetching our range
        self.model_digest: str | None = None
        self.relaying = Relaying(host, dht, mode=config.reachability, bootstrap=config.bootstrap,
                                 on_change=self.refresh_claim, progress=progress, own_addrs=self.direct_addrs)
        self._ready: WorkerReady | None = None
        # circuits to relayed peers, shared by every generation (remembers relays that failed)
        self.upgrader = DirectUpgrader(host)   # answers peers' hole punches, tries ours
        self.relay_dialer = RelayDialer(host, Portal.current(), upgrader=self.upgrader)
        self.mdns: MdnsDiscovery | None = None   # dht/host/mdns.py (started by run_daemon unless --no-mdns)
        listen_ip = _ip_of(config.listen[0]) or "127.0.0.1"
        self.tls_bind_host = listen_ip
        unspecified = listen_ip in ("0.0.0.0", "::")
        # A wildcard listener with no --advertise-host offers peers its LAN address: the default
        # route's interface, else a private one (dht/host/interfaces.py); a LAN swarm needs no flags.
        self.picked_host = (pick_advertise_host(read_ipv4_interfaces(), read_default_route_iface())
                            if listen_ip == "0.0.0.0" and not config.advertise_host else None)
        self.advertise_host = config.advertise_host or self.picked_host or ("127.0.0.1" if unspecified else listen_ip)
        if self.picked_host:
            progress(f"listening on all interfaces: peers are told {self.picked_host} (this machine's LAN "
                     "address; set --advertise-host to choose another)")
        elif unspecified and not config.advertise_host:
            progress("note: listening on all interfaces but no --advertise-host given; peers are told "
                     "127.0.0.1 for our TLS gRPC endpoint (set advertise_host to a reachable address)")

    # ------------------------------------------------------------------ addresses

    def direct_addrs(self) -> tuple[str, ...]:
        return direct_addrs_of([str(a) for a in self.host.get_addrs()], self.config.advertise_host or self.picked_host)

    @property
    def expects_peers(self) -> bool:
        """Peers may still show up by themselves: bootstrap peers given, or mDNS running."""
        return bool(self.config.bootstrap) or (self.mdns is not None and self.mdns.state == "on")

    def discovery_status(self) -> dict:
        """The swarm this node belongs to, its mDNS, and connected peers of other swarms."""
        mdns = (self.mdns.status() if self.mdns is not None
                else {"state": "off", "reason": "off: --no-mdns (or mdns = false)"})
        return {"swarm": self.config.scope.status(), "mdns": mdns, "foreign_peers": self.dht.foreign_peers()}

    # ------------------------------------------------------------------ worker hooks

    async def on_worker_ready(self, ready: WorkerReady) -> None:
        self._ready = ready
        self.free_kv.reset()
        if ready.unix:   # relayed sessions reach the worker on its frame socket (a worker without one: none)
            self.relaying.serve_worker(ready.unix)
        self.refresh_claim()

    def refresh_claim(self) -> None:
        """(Re)build our claim from the ready worker and our reachability; the advertiser
        publishes it at once when it changed. Nothing is claimed before the verdict is known:
        a private node must never advertise endpoints nobody can dial."""
        if self.experts is not None:
            self.experts.refresh_claim()
        ready = self._ready
        if ready is None or not self.relaying.decided:
            return
        if self.relaying.private and not self.relaying.relayed_addrs and self.advertiser.claim is None:
            return   # not reachable yet: the first reservation will call us again
        if self.relaying.private:
            endpoint, frames, pin, fetch = "", "", b"", ""
            direct: tuple[str, ...] = ()
        else:
            port = split_endpoint(ready.tls_listen)[1] if ready.tls_listen else None
            endpoint = f"{self.advertise_host}:{port}" if port else ""
            frames_port = split_endpoint(ready.frames)[1] if ready.frames and endpoint else None
            frames = f"{self.advertise_host}:{frames_port}" if frames_port else ""
            direct, pin = self.direct_addrs(), (self.tls.sha256 if endpoint else b"")
            fetch = self.fetch.endpoint if pin else ""
        r = ready.report.shard_range
        held = self.fetch.held_for_claim((r.start_layer, r.end_layer)) if fetch else None
        claim = claim_from_report(ready.report, grpc_endpoint=endpoint, tls_cert_sha256=pin, direct_addrs=direct,
                                  free_kv_tokens=self.free_kv.published, frames_endpoint=frames,
                                  fetch_endpoint=fetch, held=held, artifact_sha256=self.fetch.artifact_sha256())
        if self.relaying.private:
            claim = replace(claim, relayed_addrs=self.relaying.relayed_addrs)
        if self.memory_budget_bytes:
            claim = replace(claim, memory_budget_bytes=self.memory_budget_bytes)
        claim = replace(claim, memory=self.memory_figures(ready.report))
        if claim == self.advertiser.claim:
            return
        first = self.advertiser.claim is None
        self.model_digest = claim.model_artifact_digest
        self.advertiser.set_claim(claim)
        if first:
            self.progress(f"ready: worker serves layers {claim.start_layer}:{claim.end_layer} of "
                          f"{claim.num_layers} ({claim.model_artifact_digest[:23]}...), advertising"
                          + (f" through {len(claim.relayed_addrs)} relayed addrs" if self.relaying.private else ""))

    def memory_figures(self, report) -> pb.MemoryFigures:
        """What our record says of our memory: the worker's measured parts plus this daemon's base
        (its peak resident set so far, rounded up to DAEMON_BASE_STEP_BYTES so that small growth
        does not republish the record)."""
        figures = pb.MemoryFigures()
        figures.CopyFrom(report.memory)
        peak = process_memory().peak
        figures.daemon_base_bytes = -(-peak // DAEMON_BASE_STEP_BYTES) * DAEMON_BASE_STEP_BYTES
        return figures

    async def on_worker_down(self) -> None:
        self._ready = None
        if self.advertiser.claim is not None:
            self.progress("worker down: withdrawing our records")
        self.advertiser.set_claim(None)

    # ------------------------------------------------------------------ tasks
    async def watch_free_kv(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Poll our worker's Health; republish our record when its free KV moved (FreeKvGate)."""
        task_status.started()
        while True:
            await trio.sleep(FREE_KV_POLL_S)
            ready = self._ready
            if ready is None:
                continue
            try:
                health = await trio.to_thread.run_sync(fetch_health, ready.listen)
            except Exception:  # noqa: BLE001 - the supervisor's own health watch judges the worker
                continue
            free = health.kv_budget_tokens - health.kv_tokens_used
            if ready is self._ready and self.free_kv.offer(free, health.kv_budget_tokens, trio.current_time()):
                self.refresh_claim()


    async def peer_sync(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        last_bootstrap = trio.current_time()
        while True:
            await self.dht.sync_peers()
            if (self.config.bootstrap and not self.host.get_connected_peers()
                    and trio.current_time() - last_bootstrap >= REBOOTSTRAP_INTERVAL_S):
                last_bootstrap = trio.current_time()
                try:
                    await connect_bootstrap(self.host, self.config.bootstrap, self.config.bootstrap_timeout_s,
                                            rounds=1)   # this loop is the retry
                except Exception as exc:  # noqa: BLE001 - keep trying; the status shows zero peers
                    log.info("re-bootstrap failed: %s", exc)
            await trio.sleep(PEER_SYNC_INTERVAL_S)

    async def handle(self, request: dict) -> dict:
        if request["op"] == "ping":
            return {"peer_id": self.identity.peer_id}
        if request["op"] == "swarm" and self.swarm is not None:
            return await self.swarm.view()
        return await self.status()

    async def handle_stream(self, request: dict, send) -> None:
        await self.api.entry.control_request(request, send)   # the same door as the HTTP API

    async def status(self) -> dict:
        digests = []
        own_digest = self.model_digest or (self.swarm.digest if self.swarm is not None else None) \
            or self.config.model_root
        if own_digest:   # a client-only node has no claim: its swarm part read the digest from the files
            digests.append(own_digest)
        digests += [d for d in self.dht.local_models() if d not in digests]
        coverage: dict[str, list[dict]] = {}
        now = wall_ms()

        async def fetch(digest: str) -> None:
            with trio.move_on_after(STATUS_FETCH_TIMEOUT_S):
                records = await self.dht.fetch(K.model_key(digest))
                coverage[digest] = [{
                    "peer_id": r.peer_id, "start": r.start_layer, "end": r.end_layer,
                    "num_layers": r.num_layers, "sequence": r.sequence,
                    "expires_in_s": round((r.expires_at_ms - now) / 1000, 1),
                    "grpc_endpoint": r.payload.reachability.grpc_endpoint,
                    "frames_endpoint": r.payload.reachability.frames_endpoint,
                    "tls_cert_sha256": r.payload.reachability.tls_cert_sha256.hex(),
                    "model_id": r.payload.model_id, "free_kv_tokens": r.payload.free_kv_tokens,
                    "memory": memory_dict(r.payload.memory),
                } for r in live(records, now)]

        async with trio.open_nursery() as nursery:
            for digest in digests[:MAX_STATUS_MODELS]:
                nursery.start_soon(fetch, digest)
        advert = self.advertiser.status()
        worker = self.supervisor.state.as_dict() if self.supervisor else {"state": "none"}
        return {
            "peer_id": self.identity.peer_id,
            "addresses": [str(a) for a in self.host.get_addrs()],
            "peers": sorted(p.to_base58() for p in self.host.get_connected_peers()),
            "routing_table": self.dht.routing_table_size(),
            "own": {
                "role": self.config.role,
                "model": str(self.config.model) if self.config.model else self.config.model_root,
                "layers": list(self.config.layers) if self.config.layers else None,
                "model_digest": own_digest,
                "advertising": advert.advertising, "sequence": advert.sequence,
                "expires_in_s": round((advert.expires_at_ms - now) / 1000, 1) if advert.expires_at_ms else None,
                "acks": advert.last_acks, "tls_cert_sha256": self.tls.sha256.hex(),
                # --memory is the whole node's promise: what it is, what we published, what we use now
                "memory": {"budget_bytes": self.config.memory_bytes or 0,
                           "published": memory_dict(self.advertiser.claim.memory)
                           if self.advertiser.claim is not None and self.advertiser.claim.memory else None,
                           "daemon_rss_bytes": process_memory().rss,
                           "daemon_peak_bytes": process_memory().peak},
            },
            "worker": worker,
            **({"experts": self.experts.status()} if self.experts is not None else {}),
            "fetch": self.fetch.status(),
            "reachability": self.relaying.status(),
            "direct_upgrades": self.upgrader.snapshot(),
            "discovery": self.discovery_status(),
            "libp2p": library_status(),
            "http": self.api.http_status(),
            "coverage": {d: sorted(v, key=lambda e: (e["start"], e["end"], e["peer_id"]))
                         for d, v in coverage.items()},
            # layers of our model without a server, and what closes them (meshd/swarm/view.py pool_status)
            "pool": self.swarm.pool_status() if self.swarm is not None else None,
            # our audits of the routes we drive (meshd/generate/audit.py): figures and the peers caught
            "audits": {"verify_rate": self.config.verify_rate,
                       **(self.swarm.audit_book.snapshot() if self.swarm is not None else {})},
        }


async def _warn_foreign_bootstrap(dht: DhtNode, reached: list[str], swarm: str, progress: Progress) -> None:
    """Say so when a bootstrap peer we reached is not in our swarm: connected, yet no DHT between us."""
    from libp2p.peer.id import ID

    for text in reached:
        if not await dht.speaks_dht(ID.from_base58(text)):
            progress(f"warning: bootstrap peer {text} is not in swarm {swarm!r} (it does not speak "
                     f"{dht.protocol}): no records are exchanged with it; give both nodes the same --swarm")


def memory_dict(figures: pb.MemoryFigures) -> dict[str, int]:
    """A record's measured memory for ``meshd status`` (bytes; shard/model/memory.py says what each is)."""
    return {"weight_bytes": figures.weight_bytes, "kv_bytes": figures.kv_bytes,
            "working_bytes": figures.working_bytes, "worker_base_bytes": figures.worker_base_bytes,
            "daemon_base_bytes": figures.daemon_base_bytes}


async def _wait_for_signal(cancel_scope: trio.CancelScope, node: Node, progress: Progress) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            progress(f"{signal.Signals(signum).name}: leaving the swarm (withdrawing records, stopping the worker)")
            await node.advertiser.withdraw_now()
            if node.experts is not None:
                await node.experts.withdraw_now()
            cancel_scope.cancel()
            return


async def run_daemon(config: DaemonConfig, progress: Progress, *, handle_signals: bool = True,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    identity = load_or_create_identity(config.data_dir)
    tls = load_or_create_tls(config.data_dir, identity.peer_id)
    progress(f"peer id {identity.peer_id}")
    async with running_host(identity, config.listen) as host:
        serve_dialback(host)   # every node answers other peers' reachability probes
        scope = config.scope
        dht = DhtNode(host, wall_ms, scope)   # records its library adjustments, shown by meshd status
        async with dht.running():
            progress("listening on " + " ".join(str(a) for a in host.get_addrs()))
            progress(f"swarm {scope.name} (DHT protocol {scope.dht_protocol})")
            reached = await connect_bootstrap(host, config.bootstrap, config.bootstrap_timeout_s)
            if config.bootstrap:
                progress(f"bootstrap: connected to {len(reached)} of {len(config.bootstrap)} peers")
                await _warn_foreign_bootstrap(dht, reached, scope.name, progress)
            await dht.join()
            node = Node(config, identity, tls, host, dht, progress)
            async with trio.open_nursery() as nursery:
                await nursery.start(node.peer_sync)
                if config.mdns:
                    node.mdns = MdnsDiscovery(host, scope, listen_addrs=[str(a) for a in host.get_addrs()],
                                              progress=progress)
                    await nursery.start(node.mdns.run)
                await nursery.start(node.upgrader.run)
                await nursery.start(node.relaying.run)
                await nursery.start(node.advertiser.run)
                await nursery.start(node.watch_free_kv)
                await nursery.start(partial(serve_control, stream_handler=node.handle_stream),
                                    config.control_socket, node.handle)
                await nursery.start(node.api.run)
                await nursery.start(node.fetch.run)
                if handle_signals:
                    nursery.start_soon(_wait_for_signal, nursery.cancel_scope, node, progress)
                if config.experts is not None or config.offload_experts:
                    from meshd.daemon.experts_part import ExpertPart

                    node.experts = ExpertPart(node)
                    await nursery.start(node.experts.run)
                if config.model is not None and config.layers is not None:
                    w = config.worker
                    moe = node.experts if node.experts is not None and node.experts.holder else None
                    spec = WorkerSpec.of_node(config, config.layers, tls=tls, tls_host=node.tls_bind_host,
                                              node_key=identity.signing_key,
                                              experts=config.experts if moe else None,
                                              expert_peers=moe.peers_file if moe else None,
                                              expert_act=config.expert_act, offload_experts=config.offload_experts)
                    worker = WorkerProcess(spec, progress=lambda line: progress(f"worker: {line}"))
                    node.supervisor = Supervisor(worker.life, on_ready=node.on_worker_ready,
                                                 on_down=node.on_worker_down,
                                                 backoff=Backoff(w.restart_backoff_s, w.restart_backoff_max_s,
                                                                 w.restart_backoff_reset_s))
                    progress(f"starting the worker for layers {config.layers[0]}:{config.layers[1]} of {config.model}")
                    await nursery.start(node.supervisor.run)
                if config.has_model:
                    node.swarm = Swarm(node)
                    await nursery.start(node.swarm.run)
                task_status.started(node)
    progress("stopped")
