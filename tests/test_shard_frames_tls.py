"""The framed fast path (shard/edges/frame_server.py, meshd/generate/transports.py TlsFrameTransport):
Session frames over pinned TLS/TCP to real worker processes -- exact, pinned, bounded, gRPC fallback."""
from __future__ import annotations

import socket
import ssl
import tempfile
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.errors import CertificateMismatch
from meshd.generate.routes import FactoryConnector
from meshd.generate.transports import GrpcTransport, TlsFrameTransport
from meshd.reach.tls import pinned_channel
from meshd.testing.experts import tls_files
from meshd.testing.procs import spawn_workers
from proto import shard_runtime_pb2 as pb
from proto.frames import FrameReader, encode_frame, parse_response
from proto.hop_transport import TransportError, Unary
from proto.limits import MAX_FRAME_BYTES
from shard.edges.grpc_server import GRPC_OPTIONS
from shard.experts.transport import client_tls_context
from shard.model.reference import WholeModel
from tests._shard_helpers import PROMPT, drive_fixed, fixed_source

SPECS = ["0:3", "3:6"]
MODEL_SEED = 0   # the shared ``model`` fixture's seed (tests/conftest.py)
torch.set_num_threads(1)  # as the workers: same reduction order, exact logits


@pytest.fixture(scope="module")
def tls():
    return tls_files(Path(tempfile.mkdtemp(prefix="mft-")), "worker")


@pytest.fixture(scope="module")
def workers(model, tls):
    ws = spawn_workers(model, SPECS, threads=1, extra=[
        "--tls-listen", "127.0.0.1:0", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
        "--frames-listen", "127.0.0.1:0"])
    yield ws
    for w in ws:
        assert w.stop() == 0


class _Recording:
    """The product's PeerConnector, keeping the transports it made."""

    def __init__(self, connector) -> None:
        self.connector, self.channels = connector, []
        self.self_peer_id = connector.self_peer_id

    def transport(self, hop):
        ch = self.connector.transport(hop)
        self.channels.append(ch)
        return ch

    def retry_same_peer(self, peer_id: str) -> bool:
        return False

    def push_dial(self, hop, *, head: bool = False):
        return self.connector.push_dial(hop, head=head)


def _grpc(endpoint: str, tls) -> GrpcTransport:
    return GrpcTransport(pinned_channel(endpoint, tls.pin, GRPC_OPTIONS))


def test_route_over_frames_equals_the_whole_model(model, workers, tls):
    from meshd.generate.routes import PeerConnector, fixed_route

    assert all(w.frames_endpoint for w in workers)
    bounds = [(0, 3), (3, 6)]
    source = fixed_route([(w.tls_endpoint, a, b) for w, (a, b) in zip(workers, bounds)], 6)
    connector = _Recording(PeerConnector(pins={w.tls_endpoint: tls.pin for w in workers},
                                         frames={w.tls_endpoint: w.frames_endpoint for w in workers}))
    ref = WholeModel(model).generate(PROMPT, 12, chunk_tokens=16)
    # capability over the fallback (pinned gRPC); sessions over frames
    res = drive_fixed(source, PROMPT, 12, connector=connector, return_logits=True)
    assert res.tokens == ref.tokens
    assert max(float(abs(a - b).max()) for a, b in zip(res.logits, ref.logits)) == 0.0
    sessions = [c for c in connector.channels if c.kind]
    assert len(sessions) == 2 and all(isinstance(c, TlsFrameTransport) and c.kind == "frames" for c in sessions)
    # a record without a frames endpoint: plain pinned gRPC, same tokens
    grpc_only = _Recording(PeerConnector(pins={w.tls_endpoint: tls.pin for w in workers}))
    assert drive_fixed(source, PROMPT, 12, connector=grpc_only).tokens == ref.tokens
    assert not any(isinstance(c, TlsFrameTransport) for c in grpc_only.channels)


def test_unreachable_frames_port_falls_back_to_grpc(model, workers, tls):
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    channels = []

    def factory(endpoint):
        w = next(x for x in workers if x.endpoint == endpoint)
        ch = TlsFrameTransport(dead, tls.pin, lambda: _grpc(w.tls_endpoint, tls))
        channels.append(ch)
        return ch

    ref = WholeModel(model).generate(PROMPT, 4, chunk_tokens=16)
    res = drive_fixed(fixed_source(workers, SPECS, 6), PROMPT, 4, connector=FactoryConnector(factory))
    assert res.tokens == ref.tokens
    used = [c for c in channels if c.kind]
    assert used and all(c.kind == "grpc" and "cannot reach" in c.fallback_reason for c in used)
    # without a fallback the hop fails with a transport error the driver can route around
    with pytest.raises(TransportError):
        TlsFrameTransport(dead, tls.pin).open_session()


def test_wrong_pin_is_refused_and_never_falls_back(workers, tls):
    fell_back = []
    ch = TlsFrameTransport(workers[0].frames_endpoint, bytes(32), lambda: fell_back.append(1))

    with pytest.raises(CertificateMismatch):
        ch.open_session()
    assert not fell_back
    with pytest.raises(CertificateMismatch):
        TlsFrameTransport(workers[0].frames_endpoint, b"short")


def test_driver_maps_a_pin_mismatch_to_a_hop_failure(workers, tls):
    from meshd.generate.driver import GenerationRequest, RouteFailed, SwarmDriver
    from meshd.generate.routes import PeerConnector, discover_fingerprint

    def factory(endpoint):
        w = next(x for x in workers if x.endpoint == endpoint)
        return TlsFrameTransport(w.frames_endpoint, bytes(32) if w is workers[1] else tls.pin)

    source = fixed_source(workers, SPECS, 6)
    fingerprint = discover_fingerprint(PeerConnector(insecure_loopback=True), source.route)
    driver = SwarmDriver(source, FactoryConnector(factory), fingerprint=fingerprint)
    with pytest.raises(RouteFailed, match="does not match the pin"):
        list(driver.generate(GenerationRequest(tuple(PROMPT), 2, chunk_tokens=16)))


def _tls_connect(endpoint: str) -> ssl.SSLSocket:
    host, port = endpoint.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=30)
    return client_tls_context().wrap_socket(raw, server_hostname="meshd-peer")


def _read_one(sock) -> bytes:
    reader = FrameReader(MAX_FRAME_BYTES)
    while (body := reader.next_frame()) is None:
        data = sock.recv(65536)
        assert data, "closed without a status"
        reader.feed(data)
    return body


def test_bad_prefix_gets_a_typed_status_and_the_worker_keeps_serving(workers):
    with _tls_connect(workers[0].frames_endpoint) as s:
        s.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        status = parse_response(_read_one(s)).status
        assert status.terminal and status.error.code == pb.ERROR_CODE_LIMIT_EXCEEDED
        assert s.recv(1) == b""            # then closed
    with _tls_connect(workers[0].frames_endpoint) as s:   # a message not allowed before open
        s.sendall(encode_frame(pb.SessionRequest(release=pb.ReleaseSignal()).SerializeToString()))
        status = parse_response(_read_one(s)).status
        assert status.terminal and status.error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION
    assert len(drive_fixed(fixed_source(workers, SPECS, 6), PROMPT, 3).tokens) == 3


def test_plaintext_on_the_frames_port_gets_nothing(workers):
    host, port = workers[0].frames_endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(encode_frame(pb.SessionRequest(release=pb.ReleaseSignal()).SerializeToString()))
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            data = b""
        assert b"SessionResponse" not in data and not data.startswith(b"\x00\x00")   # a TLS alert at most


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(min_size=1, max_size=2048))
def test_fuzzed_bytes_end_one_connection_only(workers, junk):
    with _tls_connect(workers[1].frames_endpoint) as s:
        s.settimeout(30)
        s.sendall(junk)
        try:
            socket.socket.shutdown(s, socket.SHUT_WR)
        except OSError:
            pass
        got = b""
        try:
            while data := s.recv(65536):
                got += data
        except (OSError, ssl.SSLError):
            pass
    reader = FrameReader(MAX_FRAME_BYTES)
    reader.feed(got)
    while (body := reader.next_frame()) is not None:   # whatever came back is well-framed responses
        parse_response(body)


def test_worker_still_serves_after_the_fuzzing(workers, model):
    ref = WholeModel(model).generate(PROMPT, 3, chunk_tokens=16)
    assert drive_fixed(fixed_source(workers, SPECS, 6), PROMPT, 3).tokens == ref.tokens


def test_grpc_fallback_transport_carries_unary_calls(workers, tls):
    ch = TlsFrameTransport(workers[0].frames_endpoint, tls.pin, lambda: _grpc(workers[0].tls_endpoint, tls))
    report = pb.CapabilityReport.FromString(ch.unary(
        Unary.CAPABILITY, pb.CapabilityRequest(schema_version=pb.SCHEMA_VERSION_1).SerializeToString(), 30))
    assert report.validated
    ch.close()
    with pytest.raises(TransportError):   # no fallback: no unary calls
        TlsFrameTransport(workers[0].frames_endpoint, tls.pin).unary(Unary.RELEASE, b"", 30)


def test_the_frames_port_is_not_a_private_edge(workers):
    """A TLS frames caller is a public peer: an open without an owner token is refused, so it can
    neither act as the local daemon nor name a relayed peer (only the Unix socket may)."""
    from shard.edges.grpc_server import SERVICE_NAME

    with grpc.insecure_channel(workers[0].endpoint) as channel:   # the private loopback port
        report = pb.CapabilityReport.FromString(channel.unary_unary(f"/{SERVICE_NAME}/GetCapability")(
            pb.CapabilityRequest().SerializeToString()))
    body = pb.SessionRequest(open=pb.SessionOpen(
        schema_version=1, route_session_id=b"f" * 16, route_epoch=0, fingerprint=report.fingerprint,
        shard_range=pb.ShardRange(start_layer=0, end_layer=3), max_tokens=8,
        relayed_peer_id="12D3KooWForged")).SerializeToString()
    with _tls_connect(workers[0].frames_endpoint) as s:
        s.sendall(encode_frame(body))
        resp = parse_response(_read_one(s))
        assert resp.WhichOneof("kind") == "status", resp
        assert "owner_token" in resp.status.error.detail


def _health(worker, tls) -> pb.HealthReport:
    from proto.frames import SCHEMA_VERSION
    from shard.edges.grpc_server import SERVICE_NAME

    channel = pinned_channel(worker.tls_endpoint, tls.pin, GRPC_OPTIONS)
    try:
        return channel.unary_unary(f"/{SERVICE_NAME}/Health", request_serializer=pb.HealthRequest.SerializeToString,
                                   response_deserializer=pb.HealthReport.FromString)(
            pb.HealthRequest(schema_version=SCHEMA_VERSION), timeout=10)
    finally:
        channel.close()


@pytest.mark.parametrize("frames_to_successor", [True, False])
def test_a_pushed_hop_reaches_its_successor_over_frames(model, workers, tls, frames_to_successor):
    """Push topology between real workers: the head's successor stream dials the successor's framed port
    (the real ``meshd worker`` push dialer, pinned TLS) when the entry names it, gRPC when not;
    same tokens and logits as the whole model either way."""
    from meshd.generate.driver import GenerationRequest
    from meshd.generate.push import PushDriver
    from meshd.generate.routes import PeerConnector, discover_fingerprint, fixed_route

    head, tail = workers
    source = fixed_route([(w.tls_endpoint, a, b) for w, (a, b) in zip(workers, [(0, 3), (3, 6)])], 6)
    frames = {w.tls_endpoint: w.frames_endpoint for w in workers} if frames_to_successor else {}
    connector = PeerConnector(pins={w.tls_endpoint: tls.pin for w in workers}, frames=frames)
    before = _health(head, tls)
    driver = PushDriver(source, connector, fingerprint=discover_fingerprint(connector, source.route))
    tokens = [t.id for t in driver.generate(GenerationRequest(tuple(PROMPT), 12, chunk_tokens=16,
                                                              return_logits=True))]
    ref = WholeModel(model).generate(PROMPT, 12, chunk_tokens=16)
    assert tokens == ref.tokens
    assert max(float(abs(a - b).max()) for a, b in zip(driver.stats.logits, ref.logits)) == 0.0
    after = _health(head, tls)
    frames_opened = after.push_streams_frames - before.push_streams_frames
    grpc_opened = after.push_streams_grpc - before.push_streams_grpc
    assert (frames_opened, grpc_opened) == ((1, 0) if frames_to_successor else (0, 1))
