"""The entry's own worker over its Unix frame socket (no loopback gRPC), from the driver's thread.

Real torch shards: the entry serves [0,3) itself, a peer serves [3,6) over gRPC. The own
worker's gRPC server is stopped before generating, so tokens equal to the whole model's
prove the own hop went through the frame socket; its session is released afterwards."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from meshd.generate.driver import GenerationRequest, SwarmDriver, collect
from meshd.generate.routes import AdsRouteSource, PeerConnector
from meshd.generate.transports import UnixFrameTransport
from meshd.plan.routing import Hop
from shard.edges.unix_server import UnixFrameServer
from shard.model.reference import WholeModel
from tests._swarm_helpers import start_shard

NUM_LAYERS = 6
PROMPT = tuple(range(7, 40))
NEW_TOKENS = 12
MODEL_SEED = 11   # the shared ``model`` fixture's seed (tests/conftest.py)


def test_the_own_hop_goes_over_the_frame_socket_with_the_whole_models_tokens(model):
    reference = WholeModel(model).generate(list(PROMPT), NEW_TOKENS, chunk_tokens=16).tokens
    own, peer = start_shard(model, "entry", 0, 3), start_shard(model, "peer-b", 3, 6)
    sock_dir = Path(tempfile.mkdtemp(prefix="own-"))
    unix = UnixFrameServer(own.service, sock_dir / "w.sock").start()
    try:
        own.kill()              # its gRPC port is gone: only the frame socket serves it now
        fp = peer.service.backend.fingerprint
        source = AdsRouteSource(lambda: [own.ad(NUM_LAYERS), peer.ad(NUM_LAYERS)], fp.model_artifact_digest,
                                NUM_LAYERS, entry_peer_id="entry", recipe_digest=fp.runtime_recipe_digest)
        connector = PeerConnector(self_peer_id="entry", own_endpoint=own.endpoint, own_unix=unix.endpoint,
                                  insecure_loopback=True)
        own_hop = Hop("entry", 0, 3, 0, relayed=False, endpoint=own.endpoint)
        assert isinstance(connector.transport(own_hop), UnixFrameTransport)
        driver = SwarmDriver(source, connector, fingerprint=fp, replan_wait_s=0.0)
        tokens = collect(driver, GenerationRequest(PROMPT, NEW_TOKENS, chunk_tokens=16))
        assert tokens == reference
        assert own.active_sessions() == 0 and peer.active_sessions() == 0   # released in-stream
    finally:
        unix.close()
        peer.kill()


def test_the_frame_socket_call_is_cut_from_another_thread_and_a_gone_worker_is_a_transport_error(model):
    import threading
    import time

    from proto import shard_runtime_pb2 as pb
    from proto.hop_transport import TransportError, TransportStatus, Unary

    own = start_shard(model, "entry", 0, 3)
    own.kill()
    sock_dir = Path(tempfile.mkdtemp(prefix="own-"))
    unix = UnixFrameServer(own.service, sock_dir / "w.sock").start()
    transport = UnixFrameTransport(unix.endpoint)
    try:
        call = transport.open_session()
        fp = own.service.backend.fingerprint
        call.send(pb.SessionRequest(open=pb.SessionOpen(
            schema_version=1, route_session_id="cut", fingerprint=fp, max_tokens=32,
            shard_range=pb.ShardRange(start_layer=0, end_layer=3))).SerializeToString())
        assert pb.SessionResponse.FromString(call.receive()).WhichOneof("kind") == "accepted"
        with own.service.lock:          # the worker is silent: nothing comes back
            cutter = threading.Timer(0.3, call.cancel)
            cutter.start()
            t0 = time.monotonic()
            with pytest.raises(TransportError) as err:
                call.receive()
            assert err.value.status == TransportStatus.CANCELLED and time.monotonic() - t0 < 5
            cutter.join()
        with pytest.raises(TransportError):
            transport.unary(Unary.RELEASE, b"", 5)
    finally:
        unix.close()
    with pytest.raises(TransportError) as err:      # the socket is gone: a transport failure, at once
        transport.open_session()
    assert err.value.status == TransportStatus.UNAVAILABLE
