"""The worker's Unix frame socket (shard/edges/unix_server.py) and the trio link a home node uses
(relay/local_link.py): the same Session core as gRPC, exact through a real worker process."""
from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest
import torch
import trio

from meshd.generate.routes import FactoryConnector, PeerConnector, discover_fingerprint
from meshd.generate.transports import GrpcTransport, UnixFrameTransport
from meshd.reach.tls import loopback_channel
from meshd.testing.procs import spawn_workers
from proto import shard_runtime_pb2 as pb
from proto.frames import FrameReader, parse_response
from proto.limits import MAX_FRAME_BYTES
from relay.errors import WorkerUnavailable
from relay.local_link import UnixWorkerLink, UnixWorkerSession
from shard.edges.grpc_server import GRPC_OPTIONS
from shard.model.reference import WholeModel
from tests._shard_helpers import PROMPT, drive_fixed, fixed_source

SPECS = ["0:3", "3:6"]
MODEL_SEED = 0   # the shared ``model`` fixture's seed (tests/conftest.py)
torch.set_num_threads(1)  # as the workers: same reduction order, exact logits


@pytest.fixture(scope="module")
def workers(model):
    socks = [Path(tempfile.mkdtemp(prefix="mwt-")) / "w.sock" for _ in SPECS]
    ws = [spawn_workers(model, [spec], threads=1, extra=["--unix-listen", str(sock)])[0]
          for spec, sock in zip(SPECS, socks)]
    yield ws
    for w in ws:
        assert w.stop() == 0
    for sock in socks:
        assert not sock.exists()        # the worker removes its socket on the way out
        sock.parent.rmdir()


def test_socket_is_private_and_announced(workers):
    for w in workers:
        assert w.unix_endpoint and w.unix_endpoint.startswith("unix:")
        mode = os.stat(w.unix_endpoint[5:]).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_tail_over_the_socket_equals_the_whole_model(model, workers):
    source = fixed_source(workers, SPECS, 6)

    def factory(endpoint):
        if endpoint == workers[1].endpoint:
            return UnixFrameTransport(workers[1].unix_endpoint)
        return GrpcTransport(loopback_channel(endpoint, GRPC_OPTIONS))

    ref = WholeModel(model).generate(PROMPT, 12, chunk_tokens=16)
    # capability over gRPC; sessions over the socket
    fingerprint = discover_fingerprint(PeerConnector(insecure_loopback=True), source.route)
    res = drive_fixed(source, PROMPT, 12, connector=FactoryConnector(factory), fingerprint=fingerprint,
                      return_logits=True)
    assert res.tokens == ref.tokens
    assert max(float(abs(a - b).max()) for a, b in zip(res.logits, ref.logits)) == 0.0


def test_bad_prefix_gets_a_typed_status_and_the_worker_keeps_serving(model, workers):
    path = workers[0].unix_endpoint[5:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        reader = FrameReader(MAX_FRAME_BYTES)
        while (body := reader.next_frame()) is None:
            data = s.recv(65536)
            assert data, "closed without a status"
            reader.feed(data)
        status = parse_response(body).status
        assert status.terminal and status.error.code == pb.ERROR_CODE_LIMIT_EXCEEDED
        assert s.recv(1) == b""            # then closed
    assert len(drive_fixed(fixed_source(workers, SPECS, 6), PROMPT, 3).tokens) == 3


def test_trio_link_round_trip_and_missing_worker(workers):
    async def main():
        link = UnixWorkerLink(workers[0].unix_endpoint)
        async with UnixWorkerSession.open(link) as session:
            await session.send(pb.SessionRequest(release=pb.ReleaseSignal()).SerializeToString())
            first = parse_response(await session.receive())
            # A release before open is a protocol violation: typed, terminal, then the stream ends.
            assert first.status.terminal and first.status.error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION
            assert await session.receive() is None
        with pytest.raises(WorkerUnavailable):
            async with UnixWorkerSession.open(UnixWorkerLink("unix:/nonexistent/meshd.sock")):
                pass
        with pytest.raises(ValueError):
            UnixWorkerLink("127.0.0.1:1")

    trio.run(main)
