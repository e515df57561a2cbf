"""Where routes and hop transports come from, for the route driver.

``AdsRouteSource`` plans over a snapshot of live shard ads taken when asked
(``plan_route`` / ``replacement_route`` from routing.py, pinned to the
entry's runtime recipe). The snapshot function is the daemon's DHT read (or
a fixed list in tests); it runs on the driver's thread, so a daemon passes
one that hops back into trio. ``cached`` (optional) is the daemon's latest
snapshot, refreshed every few seconds: a replacement is looked for there
first, because a fresh DHT read waits up to the DHT's RPC timeout (3 s) on
a peer that froze -- the very peer being replaced -- and a failover should
not.

Load: ``load`` (optional) is the entry's ``LoadBook`` -- how many of its own
running generations hold a session on each peer (drivers hold and drop their
route's peers). Planning prices a peer holding n of them at (1 + n) x its
measured decode ms per layer (its one forward lock serves them in turn), so
concurrent generations spread over replicas instead of piling onto the
cheapest one; peers the swarm has filled are avoided through the free KV in
their records (routing.py's no-KV penalty, meshd/daemon/free_kv.py).

``FixedRouteSource`` is one route given up front -- tests, benchmarks, a
user's fixed split -- with no swarm behind it: ``plan`` returns it and
``replace`` finds nothing (MissingLayersError), so a failed hop ends the
generation with RouteFailed (a silent one is retried on the same peer
first). ``fixed_route(hops, num_layers)`` builds it from (endpoint, start,
end) triples; ``discover_fingerprint`` asks each direct hop's validated
capability and checks they name one artifact and recipe.

``PeerConnector`` turns a planned hop into a proto.hop_transport.HopTransport
(transports.py):
    * our own peer id      -> our worker's private frame socket, read and
                               written by the driver's own thread
                               (UnixFrameTransport: no gRPC, no thread hand-off),
                               else loopback plaintext gRPC to it
                               (meshd/reach/tls.py)
    * a peer with a pin     -> TLS, trusting only the certificate whose
                               SHA-256 the peer's signed record carries:
                               its framed fast path (Session frames over
                               TLS, TlsFrameTransport) when the
                               same record offers one, with pinned gRPC as
                               the fallback and for unary calls; else gRPC
    * a relayed hop         -> a circuit through one of the peer's relays
                               (meshd/reach/relay_dial.py RelayDialer, on the
                               daemon's own host); without a dialer, or when
                               no relay reaches the peer: HopFailure, so the
                               driver routes around it
``retry_same_peer(peer)``: after a relayed hop failed because its RELAY died,
True tells the driver to rebuild the hop on the same peer via another relay.
    * ``insecure_loopback`` -> plaintext to any loopback endpoint (in-process
                               tests and benchmarks only; refuses anything else)
``push_dial(hop)`` says how a worker would reach the hop to push to it (the
same endpoint and pin; push.py).

``FactoryConnector`` is a connector over any ``factory(endpoint)`` of
transports -- tests' workers in memory (shard/edges/memory.py), harnesses
with their own channels -- whose hops workers reach at the same endpoint.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as replace_fields
from typing import TYPE_CHECKING, Protocol

from meshd.errors import HopFailure
from meshd.generate.audit import auditor_hops
from meshd.generate.driver import PushDial
from meshd.generate.transports import GrpcTransport, TlsFrameTransport, UnixFrameTransport
from meshd.plan.adverts import ShardAd, Span
from meshd.plan.errors import MissingLayersError
from meshd.plan.routing import Hop, Route, RouteCosts, plan_route, replacement_route
from meshd.reach.tls import loopback_channel, pinned_channel
from proto import shard_runtime_pb2 as pb
from proto.frames import SCHEMA_VERSION
from proto.hop_transport import HopTransport, TransportError, Unary
from shard.edges.grpc_server import GRPC_OPTIONS
from shard.model.artifact import fingerprints_match

if TYPE_CHECKING:   # libp2p-heavy: a relay dialer exists only in a daemon
    from meshd.reach.relay_dial import RelayDialer

# A capability question is answered from memory; a worker that takes longer is unusable anyway.
CAPABILITY_TIMEOUT_S = 30.0

AdsSnapshot = Callable[[], Iterable[ShardAd]]


def wall_ms() -> int:
    return int(time.time() * 1000)


class LoadBook:
    """Sessions this entry's running generations hold per peer (thread-safe; drivers run in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def hold(self, peers: Iterable[str]) -> None:
        with self._lock:
            self._held.update(peers)

    def drop(self, peers: Iterable[str]) -> None:
        with self._lock:
            self._held.subtract(peers)
            self._held = Counter({p: n for p, n in self._held.items() if n > 0})

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)


def loaded(ads: Iterable[ShardAd], load: LoadBook | None) -> tuple[ShardAd, ...]:
    """The ads priced by the entry's own load on each peer ((1 + n) x its decode ms per layer)."""
    ads = tuple(ads)
    held = load.snapshot() if load is not None else {}
    if not held:
        return ads
    return tuple(replace_fields(ad, decode_ms_per_layer=ad.decode_ms_per_layer * (1 + held[ad.peer_id]))
                 if held.get(ad.peer_id) else ad for ad in ads)


@dataclass(slots=True)
class AdsRouteSource:
    ads: AdsSnapshot
    model_digest: str
    num_layers: int
    entry_peer_id: str
    recipe_digest: str | None = None
    costs: RouteCosts = field(default_factory=RouteCosts)
    clock: Callable[[], int] = wall_ms
    cached: AdsSnapshot | None = None
    load: LoadBook | None = None

    def plan(self, needed_tokens: int) -> Route:
        return plan_route(loaded(self.ads(), self.load), model_digest=self.model_digest, num_layers=self.num_layers,
                          now_ms=self.clock(), entry_peer_id=self.entry_peer_id, needed_tokens=needed_tokens,
                          costs=self.costs, recipe_digest=self.recipe_digest)

    def replace(self, route: Route, failed_peer: str, avoid: frozenset[str], needed_tokens: int) -> Route:
        def attempt(ads: Iterable[ShardAd]) -> Route:
            return replacement_route(route, failed_peer, loaded(ads, self.load), now_ms=self.clock(),
                                     entry_peer_id=self.entry_peer_id, needed_tokens=needed_tokens,
                                     costs=self.costs, avoid=avoid)
        if self.cached is not None:
            try:
                return attempt(self.cached())
            except MissingLayersError:
                pass                         # nothing in the latest snapshot: ask the DHT
        return attempt(self.ads())

    def auditors(self, hop: Hop, avoid: frozenset[str]) -> tuple[Hop, ...]:
        """Other live peers that can re-run ``hop``'s layers for an audit (meshd/generate/audit.py),
        from the latest snapshot when there is one (an audit never waits for the DHT)."""
        ads = self.cached() if self.cached is not None else self.ads()
        return auditor_hops(ads, hop, model_digest=self.model_digest, recipe_digest=self.recipe_digest,
                            now_ms=self.clock(), avoid=avoid)


@dataclass(frozen=True, slots=True)
class FixedRouteSource:
    """One route, no swarm: ``replace`` has nothing to offer (see the module docstring)."""

    route: Route
    static = True   # the driver does not wait for a replacement to appear

    def plan(self, needed_tokens: int) -> Route:
        return self.route

    def replace(self, route: Route, failed_peer: str, avoid: frozenset[str], needed_tokens: int) -> Route:
        hop = next((h for h in route.hops if h.peer_id == failed_peer), None)
        spans = [Span(hop.effective_start, hop.end)] if hop is not None else []
        raise MissingLayersError(spans, model_digest=route.model_digest or "(fixed route)",
                                 num_layers=route.num_layers, excluded=sorted(avoid),
                                 recipe_digest=route.recipe_digest)


def fixed_route(hops: Sequence[tuple[str, int, int]], num_layers: int, *, relayed: Sequence[bool] = (),
                model_digest: str = "", recipe_digest: str = "") -> FixedRouteSource:
    """``[(endpoint, start, end), ...]`` in layer order; each hop's peer id is its endpoint
    (``p2p:<peer id>`` endpoints are relayed hops)."""
    built = tuple(Hop(peer_id=endpoint, start=start, end=end, effective_start=start,
                      relayed=relayed[i] if relayed else endpoint.startswith("p2p:"), endpoint=endpoint)
                  for i, (endpoint, start, end) in enumerate(hops))
    return FixedRouteSource(Route(model_digest, num_layers, built, recipe_digest))


class TransportSource(Protocol):
    """What discover_fingerprint dials with (PeerConnector, a driver.HopConnector, or a benchmark's
    recording one)."""

    def transport(self, hop: Hop) -> HopTransport: ...


def discover_fingerprint(connector: TransportSource, route: Route) -> pb.Fingerprint:
    """The fingerprint every direct hop's validated capability names (HopFailure if one differs)."""
    found: pb.Fingerprint | None = None
    for i, hop in enumerate(route.hops):
        if hop.relayed:
            continue  # capabilities do not travel over relays; the route's sessions check it anyway
        transport = connector.transport(hop)
        try:
            report = pb.CapabilityReport.FromString(transport.unary(
                Unary.CAPABILITY, pb.CapabilityRequest(schema_version=SCHEMA_VERSION).SerializeToString(),
                CAPABILITY_TIMEOUT_S))
        except TransportError as exc:
            raise HopFailure(i, hop.peer_id, f"capability: {exc.status.value}") from exc
        finally:
            transport.close()
        if not report.validated:
            raise HopFailure(i, hop.peer_id, f"capability not validated: {report.detail}")
        if found is not None and not fingerprints_match(found, report.fingerprint):
            raise HopFailure(i, hop.peer_id, "hops serve different artifacts or recipes",
                             pb.ERROR_CODE_FINGERPRINT_MISMATCH)
        found = report.fingerprint
    if found is None:
        raise HopFailure(0, route.hops[0].peer_id, "no direct hop to ask for the fingerprint; pass it")
    return found


@dataclass(frozen=True, slots=True)
class PeerConnector:
    """The daemon's driver.HopConnector (see the module doc)."""

    self_peer_id: str = ""
    own_endpoint: str = ""                       # our worker's loopback plaintext endpoint
    own_unix: str = ""                           # our worker's frame socket (unix:/path), preferred
    pins: Mapping[str, bytes] = field(default_factory=dict)  # peer id -> TLS cert SHA-256 from its record
    insecure_loopback: bool = False
    relay_dialer: RelayDialer | None = None      # circuits to relayed peers (the daemon's)
    relayed_addrs: Callable[[str], Sequence[str]] = lambda peer_id: ()  # the peer's p2p-circuit addrs
    frames: Mapping[str, str] = field(default_factory=dict)  # peer id -> its framed TLS fast path (same pin)
    own_dialable: bool = False                   # peers can dial our worker's TLS port (a loop's head, push.py)

    def retry_same_peer(self, peer_id: str) -> bool:
        return self.relay_dialer is not None and self.relay_dialer.retry_same_peer(peer_id)

    def transport(self, hop: Hop) -> HopTransport:
        if hop.peer_id == self.self_peer_id and self.own_unix:
            return UnixFrameTransport(self.own_unix)   # our own worker, from this thread: no loopback gRPC
        if hop.peer_id == self.self_peer_id and self.own_endpoint:
            return GrpcTransport(loopback_channel(self.own_endpoint, GRPC_OPTIONS))
        if hop.relayed:
            if self.relay_dialer is None:
                raise HopFailure(0, hop.peer_id, "relayed hop but this connector has no relay dialer")
            return self.relay_dialer.transport(hop.peer_id, tuple(self.relayed_addrs(hop.peer_id)))
        if not hop.endpoint:
            raise HopFailure(0, hop.peer_id, "the peer advertises no gRPC endpoint")
        if self.insecure_loopback:
            return GrpcTransport(loopback_channel(hop.endpoint, GRPC_OPTIONS))
        pin = self.pins.get(hop.peer_id)
        if not pin:
            raise HopFailure(0, hop.peer_id, "the peer's record carries no TLS certificate pin")
        frames = self.frames.get(hop.peer_id)
        def pinned() -> GrpcTransport:
            return GrpcTransport(pinned_channel(hop.endpoint, pin, GRPC_OPTIONS))
        if frames:   # the fast path; the pinned gRPC port carries the unary calls and is the fallback
            return TlsFrameTransport(frames, pin, pinned)
        return pinned()

    def push_dial(self, hop: Hop, *, head: bool = False) -> PushDial | None:
        """Our own worker is a push target only as a loop's head, and only when peers can dial this
        node (``own_dialable``); a relayed hop never (workers cannot dial relay circuits: the libp2p
        host lives in the daemon); a peer only with the pin its record carries."""
        own = hop.peer_id == self.self_peer_id
        if hop.relayed or not hop.endpoint or (own and not (head and self.own_dialable)):
            return None
        if self.insecure_loopback:
            return PushDial(hop.endpoint)
        pin = bytes(self.pins.get(hop.peer_id, b""))
        if not pin:
            return None
        return PushDial(hop.endpoint, pin, self.frames.get(hop.peer_id, ""))


class FactoryConnector:
    """A driver.HopConnector over ``factory(endpoint) -> HopTransport`` (see the module doc): every
    hop is a peer's, reached at its endpoint by the entry and by pushing workers alike (no pin)."""

    self_peer_id = ""

    def __init__(self, factory: Callable[[str], HopTransport]) -> None:
        self.factory = factory

    def transport(self, hop: Hop) -> HopTransport:
        return self.factory(hop.endpoint)

    def retry_same_peer(self, peer_id: str) -> bool:
        return False

    def push_dial(self, hop: Hop, *, head: bool = False) -> PushDial | None:
        return None if hop.relayed or not hop.endpoint else PushDial(hop.endpoint)
