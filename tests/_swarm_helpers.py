"""In-process shard servers for the swarm tests (real gRPC on loopback, real torch)."""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from meshd.plan.adverts import ShardAd
from shard.edges.grpc_server import build_server
from shard.model.torch_backend import TorchRangeBackend
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy

FAR_FUTURE_MS = 2**62


@dataclass
class LocalShard:
    peer_id: str
    start: int
    end: int
    service: ShardService
    server: grpc.Server
    endpoint: str

    def ad(self, num_layers: int, decode_ms_per_layer: float = 1.0) -> ShardAd:
        fp = self.service.backend.fingerprint
        return ShardAd(peer_id=self.peer_id, model_digest=fp.model_artifact_digest, start=self.start, end=self.end,
                       num_layers=num_layers, decode_ms_per_layer=decode_ms_per_layer, prefill_tokens_per_s=100.0,
                       free_kv_tokens=4096, memory_budget_bytes=1 << 30, relayed=False,
                       expires_at_ms=FAR_FUTURE_MS, grpc_endpoint=self.endpoint,
                       recipe_digest=fp.runtime_recipe_digest)

    def kill(self) -> None:
        """Stop serving at once: open streams end with an error (a dead peer)."""
        self.server.stop(None)

    def active_sessions(self) -> int:
        return self.service.health().active_sessions


def start_shard(model, peer_id: str, start: int, end: int) -> LocalShard:
    backend = TorchRangeBackend.load(model, start, end)
    service = ShardService(backend, SessionPolicy(kv_budget_tokens=4096))
    server, port, _ = build_server(service, "127.0.0.1:0")
    server.start()
    return LocalShard(peer_id, start, end, service, server, f"127.0.0.1:{port}")
