"""One hop's decode step over each transport the entry can use, same worker, same run.

Beside ``bench pipeline``'s floors: a real ``meshd worker`` process (a seeded
Llama with SmolLM2's hidden size, serving the middle layer of three: hidden
rows in, hidden rows out -- hop-to-hop traffic) with its TLS gRPC port, its
framed TLS port (shard/edges/frame_server.py) and its Unix frame socket; one
``HopLink`` (the product's) per transport, each over the transport the
product's ``PeerConnector`` would build (pinned gRPC, ``TlsFrameTransport``,
``UnixFrameTransport``). Decode steps alternate between the links step by step,
so load from other processes hurts all alike. Reported per transport: the
median of (step wall time - the worker's own execution time), in ms:

    hop_transport_overhead_ms: {"grpc_tls": .., "frames_tls": .., "unix": ..}
    frames_vs_grpc_overhead_ratio: frames_tls / grpc_tls
"""
from __future__ import annotations

import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proto.hop_transport import HopTransport

# SmolLM2's hidden size: the decode frame is the one bench pipeline's hops carry.
HIDDEN = 576
WARMUP_STEPS = 10


def _fixed(transport: HopTransport) -> Callable[[], HopTransport]:
    """A HopLink's ``connect``: the one transport this benchmark made for it."""
    return lambda: transport


def measure(steps: int = 200) -> dict:
    import numpy as np

    from meshd.generate.hop_link import HopLink, LinkSpec, StepCounter
    from meshd.generate.transports import GrpcTransport, TlsFrameTransport, UnixFrameTransport
    from meshd.reach.tls import pinned_channel
    from meshd.testing import models
    from meshd.testing.experts import tls_files
    from meshd.testing.procs import spawn_worker
    from proto import shard_runtime_pb2 as pb
    from proto.frames import SCHEMA_VERSION
    from proto.hop_transport import Unary
    from shard.edges.grpc_server import GRPC_OPTIONS

    path = models.build_random_llama(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=4)
    tmp = Path(tempfile.mkdtemp(prefix="meshd-hoptransport-"))
    tls = tls_files(tmp, "worker")
    worker = spawn_worker(path, "1:2", threads=1, extra=[
        "--tls-listen", "127.0.0.1:0", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
        "--frames-listen", "127.0.0.1:0", "--unix-listen", str(tmp / "w.sock")])
    links = {}
    try:
        # all three were asked for on the worker's command line above
        assert worker.tls_endpoint and worker.frames_endpoint and worker.unix_endpoint
        grpc_transport = GrpcTransport(pinned_channel(worker.tls_endpoint, tls.pin, GRPC_OPTIONS))
        fingerprint = pb.CapabilityReport.FromString(grpc_transport.unary(
            Unary.CAPABILITY, pb.CapabilityRequest(schema_version=SCHEMA_VERSION).SerializeToString(),
            60)).fingerprint
        transports: dict[str, HopTransport] = {"grpc_tls": grpc_transport,
                                               "frames_tls": TlsFrameTransport(worker.frames_endpoint, tls.pin),
                                               "unix": UnixFrameTransport(worker.unix_endpoint)}
        rng = np.random.default_rng(0)
        for name, transport in transports.items():
            spec = LinkSpec(peer_id=name, start=1, end=2, effective_start=1, num_layers=3,
                            session_id=f"hoptransport-{name}", epoch=1, fingerprint=fingerprint,
                            chunk_tokens=128, max_tokens=steps + WARMUP_STEPS + 16,
                            owner_token=secrets.token_bytes(32))   # the TLS ports want the opener's token
            link = HopLink(0, spec, _fixed(transport))
            link.open()
            counter = StepCounter()
            link.run(rng.standard_normal((4, HIDDEN)).astype(np.float32), counter)
            links[name] = (link, counter)
        row = rng.standard_normal((1, HIDDEN)).astype(np.float32)
        samples: dict[str, list[float]] = {name: [] for name in links}
        for i in range(WARMUP_STEPS + steps):
            for name, (link, counter) in links.items():
                t0 = time.perf_counter_ns()
                link.run(row, counter)
                if i >= WARMUP_STEPS:
                    samples[name].append((time.perf_counter_ns() - t0 - link.execution_ns) / 1e6)
    finally:
        for link, _ in links.values():
            link.close(release=True)
        worker.stop()
    overhead = {name: statistics.median(v) for name, v in samples.items()}
    return {"hop_transport_overhead_ms": overhead,
            "frames_vs_grpc_overhead_ratio": overhead["frames_tls"] / overhead["grpc_tls"],
            "hop_transport_steps": steps}
