"""Where routes and channels come from, for the route driver.

``AdsRouteSource`` plans over a snapshot of live shard ads taken when asked
(``plan_route`` / ``replacement_route`` from routing.py, pinned to the
entry's runtime recipe). The snapshot function is the daemon's DHT read (or
a fixed list in tests); it runs on the driver's thread, so a daemon passes
one that hops back into trio.

``PeerConnector`` turns a planned hop into a gRPC channel:
    * our own peer id      -> our worker's private frame socket, driven in the
                               daemon's loop (relay/local_link.py; when the
                               connector has both), else loopback plaintext
                               gRPC to it (meshd/reach/tls.py)
    * a peer with a pin     -> TLS, trusting only the certificate whose
                               SHA-256 the peer's signed record carries
    * a relayed hop         -> a circuit through one of the peer's relays
                               (meshd/reach/relay_dial.py RelayDialer, on the
                               daemon's own host); without a dialer, or when
                               no relay reaches the peer: HopFailure, so the
                               driver routes around it
``retry_same_peer(peer)``: after a relayed hop failed because its RELAY died,
True tells the driver to rebuild the hop on the same peer via another relay.
    * ``insecure_loopback`` -> plaintext to any loopback endpoint (in-process
                               tests and benchmarks only; refuses anything else)
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import grpc

from meshd.plan.adverts import ShardAd
from meshd.errors import HopFailure
from meshd.plan.routing import Hop, Route, RouteCosts, plan_route, replacement_route
from meshd.reach.tls import loopback_channel, pinned_channel
from relay.local_link import open_unix_frame_channel
from relay.syncchannel import RelayedGrpcChannel
from shard.server import GRPC_OPTIONS

AdsSnapshot = Callable[[], Iterable[ShardAd]]


def wall_ms() -> int:
    return int(time.time() * 1000)


@dataclass(slots=True)
class AdsRouteSource:
    ads: AdsSnapshot
    model_digest: str
    num_layers: int
    entry_peer_id: str
    recipe_digest: str | None = None
    costs: RouteCosts = field(default_factory=RouteCosts)
    clock: Callable[[], int] = wall_ms

    def plan(self, needed_tokens: int) -> Route:
        return plan_route(tuple(self.ads()), model_digest=self.model_digest, num_layers=self.num_layers,
                          now_ms=self.clock(), entry_peer_id=self.entry_peer_id, needed_tokens=needed_tokens,
                          costs=self.costs, recipe_digest=self.recipe_digest)

    def replace(self, route: Route, failed_peer: str, avoid: frozenset[str], needed_tokens: int) -> Route:
        return replacement_route(route, failed_peer, tuple(self.ads()), now_ms=self.clock(),
                                 entry_peer_id=self.entry_peer_id, needed_tokens=needed_tokens,
                                 costs=self.costs, avoid=avoid)


@dataclass(frozen=True, slots=True)
class PeerConnector:
    self_peer_id: str = ""
    own_endpoint: str = ""                       # our worker's loopback plaintext endpoint
    own_unix: str = ""                           # our worker's frame socket (unix:/path), preferred
    portal: object | None = None                 # the daemon's loop (meshd.reach.relay_dial.LoopPortal)
    pins: Mapping[str, bytes] = field(default_factory=dict)  # peer id -> TLS cert SHA-256 from its record
    insecure_loopback: bool = False
    relay_dialer: object | None = None           # meshd.reach.relay_dial.RelayDialer
    relayed_addrs: Callable[[str], Sequence[str]] = lambda peer_id: ()  # the peer's p2p-circuit addrs

    def retry_same_peer(self, peer_id: str) -> bool:
        return self.relay_dialer is not None and self.relay_dialer.retry_same_peer(peer_id)

    def channel(self, hop: Hop) -> grpc.Channel:
        if hop.peer_id == self.self_peer_id and self.own_unix and self.portal is not None:
            # our own worker's frame socket, driven in the daemon's loop: no loopback gRPC
            return RelayedGrpcChannel(self.portal, functools.partial(open_unix_frame_channel, self.own_unix))
        if hop.peer_id == self.self_peer_id and self.own_endpoint:
            return loopback_channel(self.own_endpoint, GRPC_OPTIONS)
        if hop.relayed:
            if self.relay_dialer is None:
                raise HopFailure(0, hop.peer_id, "relayed hop but this connector has no relay dialer")
            return self.relay_dialer.channel(hop.peer_id, tuple(self.relayed_addrs(hop.peer_id)))
        if not hop.endpoint:
            raise HopFailure(0, hop.peer_id, "the peer advertises no gRPC endpoint")
        if self.insecure_loopback:
            return loopback_channel(hop.endpoint, GRPC_OPTIONS)
        pin = self.pins.get(hop.peer_id)
        if not pin:
            raise HopFailure(0, hop.peer_id, "the peer's record carries no TLS certificate pin")
        return pinned_channel(hop.endpoint, pin, GRPC_OPTIONS)
