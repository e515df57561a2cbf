"""The entry's own worker over its Unix frame socket (no loopback gRPC), driven through a trio portal.

Real torch shards: the entry serves [0,3) itself, a peer serves [3,6) over gRPC. The own
worker's gRPC server is stopped before generating, so tokens equal to the whole model's
prove the own hop went through the frame socket; its session is released afterwards."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import trio

from meshd.generate.driver import GenerationRequest, SwarmDriver, collect
from meshd.plan.routing import Hop
from meshd.generate.routes import AdsRouteSource, PeerConnector
from relay.syncchannel import RelayedGrpcChannel, TrioPortal
from shard.reference import WholeModel
from meshd.testing.models import build_random_llama
from shard.unix_server import UnixFrameServer
from tests._swarm_helpers import start_shard

NUM_LAYERS = 6
PROMPT = tuple(range(7, 40))
NEW_TOKENS = 12


async def _idle_loop(task_status=trio.TASK_STATUS_IGNORED):
    task_status.started(None)
    await trio.sleep_forever()


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_llama(seed=11)


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
        with TrioPortal(_idle_loop) as portal:
            connector = PeerConnector(self_peer_id="entry", own_endpoint=own.endpoint, own_unix=unix.endpoint,
                                      portal=portal, insecure_loopback=True)
            own_hop = Hop("entry", 0, 3, 0, relayed=False, endpoint=own.endpoint)
            assert isinstance(connector.channel(own_hop), RelayedGrpcChannel)
            driver = SwarmDriver(source, connector, fingerprint=fp, replan_wait_s=0.0)
            tokens = collect(driver, GenerationRequest(PROMPT, NEW_TOKENS, chunk_tokens=16))
        assert tokens == reference
        assert own.active_sessions() == 0 and peer.active_sessions() == 0   # released in-stream
    finally:
        unix.close()
        peer.kill()
