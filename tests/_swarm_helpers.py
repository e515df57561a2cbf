"""Shards of a tiny random Llama for the route-driver tests (not a test module).

``MemorySwarm``: workers in memory (shard/edges/memory.py), each a real
ShardService over a real torch range, reached by the driver and by each other
(push) through in-memory transports: no socket, no server thread. Faults are
the transport's: ``kill``, ``freeze``/``thaw``, ``refuse``, ``corrupt``.

``start_shard``: one worker behind a real gRPC server on loopback (tests of the
socket edges and of what runs over them).
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from meshd.generate.driver import GenerationRequest, SwarmDriver
from meshd.generate.push import PushDriver
from meshd.generate.routes import AdsRouteSource, FactoryConnector
from meshd.plan.adverts import ShardAd
from proto.errors import ProtocolError
from proto.frames import parse_request
from shard.edges.grpc_server import build_server
from shard.edges.memory import MemoryHop, MemoryNetwork
from shard.model.torch_backend import TorchRangeBackend
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy
from tests.conftest import seeded_model

FAR_FUTURE_MS = 2**62
NUM_LAYERS = 6
PROMPT = tuple(range(5, 45))   # 40 tokens: three prefill chunks of 16
CHUNK = 16
KV_BUDGET_TOKENS = 4096


@functools.cache
def tiny_llama() -> Path:
    """The seeded 6-layer random Llama every driver test splits: the ``model`` fixture's artifact
    (tests/conftest.py), for helpers and module-level caches that no fixture reaches."""
    return seeded_model()


@functools.cache
def whole_tokens(new_tokens: int, prompt: tuple[int, ...] = PROMPT) -> list[int]:
    """The whole model's greedy tokens: what every split must reproduce."""
    from shard.model.reference import WholeModel

    return WholeModel(tiny_llama()).generate(list(prompt), new_tokens, chunk_tokens=CHUNK).tokens


def request(new_tokens: int, prompt: tuple[int, ...] = PROMPT, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, new_tokens, chunk_tokens=CHUNK, **kw)


def decode_input_of(token: int, prompt: tuple[int, ...] = PROMPT) -> Callable[[bytes], bool]:
    """Matches the decode step that carries generated token number ``token`` (1-based) into a hop:
    the step at position len(prompt) + token - 1 (its rows, past the head). For ``MemoryHop.kill_on``:
    a hop dying the moment that step reaches it fails the driver at position len(prompt) + token."""
    position = len(prompt) + token - 1

    def match(body: bytes) -> bool:
        try:
            req = parse_request(body)
        except ProtocolError:
            return False
        return req.WhichOneof("kind") == "decode" and req.decode.position == position
    return match


def shard_ad(peer_id: str, service: ShardService, start: int, end: int, endpoint: str, num_layers: int,
             decode_ms_per_layer: float) -> ShardAd:
    fp = service.backend.fingerprint
    return ShardAd(peer_id=peer_id, model_digest=fp.model_artifact_digest, start=start, end=end,
                   num_layers=num_layers, decode_ms_per_layer=decode_ms_per_layer, prefill_tokens_per_s=100.0,
                   free_kv_tokens=KV_BUDGET_TOKENS, memory_budget_bytes=1 << 30, relayed=False,
                   expires_at_ms=FAR_FUTURE_MS, grpc_endpoint=endpoint, recipe_digest=fp.runtime_recipe_digest)


# -- in memory --------------------------------------------------------------------------------
@dataclass
class MemoryShard:
    """One worker in memory: its service and the transport's end of it (the faults)."""

    peer_id: str
    start: int
    end: int
    service: ShardService
    hop: MemoryHop
    endpoint: str

    def ad(self, num_layers: int = NUM_LAYERS, decode_ms_per_layer: float = 1.0) -> ShardAd:
        return shard_ad(self.peer_id, self.service, self.start, self.end, self.endpoint, num_layers,
                        decode_ms_per_layer)

    def kill(self) -> None:
        """The worker is gone: its streams break, nothing reaches it any more."""
        self.hop.kill()

    def freeze(self) -> None:
        self.hop.freeze()

    def thaw(self) -> None:
        self.hop.thaw()

    def active_sessions(self) -> int:
        return self.service.health().active_sessions


_ENDPOINTS = itertools.count()


@dataclass
class MemorySwarm:
    """Workers in memory by peer id, and route drivers over them (see the module doc)."""

    model: Path = field(default_factory=tiny_llama)
    network: MemoryNetwork = field(default_factory=MemoryNetwork)
    shards: dict[str, MemoryShard] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)     # decode ms per layer in each peer's ad

    def start(self, peer_id: str, start: int, end: int, *, cost: float = 1.0,
              kv_budget_tokens: int = KV_BUDGET_TOKENS, push: bool = True) -> MemoryShard:
        """A worker serving [start, end); ``push=False``: it has no push dialer."""
        service = ShardService(TorchRangeBackend.load(self.model, start, end),
                               SessionPolicy(kv_budget_tokens=kv_budget_tokens))
        endpoint = f"mem-{next(_ENDPOINTS)}:{peer_id}"
        hop = self.network.add(endpoint, service)
        if not push:
            service.push_dialer = None
        shard = self.shards[peer_id] = MemoryShard(peer_id, start, end, service, hop, endpoint)
        self.costs[peer_id] = cost
        return shard

    def __getitem__(self, peer_id: str) -> MemoryShard:
        return self.shards[peer_id]

    @property
    def fingerprint(self):
        return next(iter(self.shards.values())).service.backend.fingerprint

    def ads(self, peers=None) -> list[ShardAd]:
        """The live ads (``peers``: only those)."""
        return [s.ad(NUM_LAYERS, self.costs[p]) for p, s in self.shards.items() if peers is None or p in peers]

    def connector(self) -> FactoryConnector:
        return FactoryConnector(self.network.transport)

    def source(self, ads=None, **kw) -> AdsRouteSource:
        fp = self.fingerprint
        return AdsRouteSource(ads or self.ads, fp.model_artifact_digest, NUM_LAYERS, entry_peer_id="entry",
                              recipe_digest=fp.runtime_recipe_digest, **kw)

    def driver(self, topology: str = "star", *, source=None, connector=None, replan_wait_s: float = 0.0,
               **kw) -> SwarmDriver:
        """A route driver over this swarm's ads (``topology``: "star" -- the plain SwarmDriver --,
        or "push"/"star-push" for the PushDriver pushing or forced to a star)."""
        source = source or self.source()
        connector = connector or self.connector()
        if topology == "star":
            return SwarmDriver(source, connector, fingerprint=self.fingerprint, replan_wait_s=replan_wait_s, **kw)
        return PushDriver(source, connector, fingerprint=self.fingerprint, replan_wait_s=replan_wait_s,
                          topology="star" if topology == "star-push" else topology, **kw)

    def idle(self, *peers: str) -> bool:
        """No session left on these workers (all when none named): every hop's KV was released."""
        return all(self.shards[p].active_sessions() == 0 for p in (peers or self.shards))

    def no_pushed_sessions(self) -> bool:
        return all(not s.service.push_hub._sessions for s in self.shards.values() if s.service.push_hub)


# -- over real gRPC -----------------------------------------------------------------------------
@dataclass
class LocalShard:
    peer_id: str
    start: int
    end: int
    service: ShardService
    server: grpc.Server
    endpoint: str

    def ad(self, num_layers: int, decode_ms_per_layer: float = 1.0) -> ShardAd:
        return shard_ad(self.peer_id, self.service, self.start, self.end, self.endpoint, num_layers,
                        decode_ms_per_layer)

    def kill(self) -> None:
        """Stop serving at once: open streams end with an error (a dead peer)."""
        self.server.stop(None)

    def active_sessions(self) -> int:
        return self.service.health().active_sessions


def start_shard(model, peer_id: str, start: int, end: int) -> LocalShard:
    backend = TorchRangeBackend.load(model, start, end)
    service = ShardService(backend, SessionPolicy(kv_budget_tokens=KV_BUDGET_TOKENS))
    server, port, _ = build_server(service, "127.0.0.1:0")
    server.start()
    return LocalShard(peer_id, start, end, service, server, f"127.0.0.1:{port}")
