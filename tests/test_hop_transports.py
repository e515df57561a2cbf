"""One HopTransport interface (proto/hop_transport.py), every implementation: the same behaviour.

The same worker (a real ShardService over a torch range of the tiny Llama) is
reached in memory (shard/edges/memory.py), over loopback gRPC and over its
Unix frame socket (meshd/generate/transports.py); each stream opens a
session, runs a prefill chunk, is released, and ends after our half-close;
a cancel from another thread ends a blocked receive; unary calls answer or
say UNIMPLEMENTED. Then the in-memory twin's own faults: a worker killed,
frozen, refusing, sending a bad frame -- each a TransportError or a bad body,
never a hang.
"""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from meshd.generate.transports import GrpcTransport, UnixFrameTransport
from meshd.reach.tls import loopback_channel
from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.errors import ProtocolError
from proto.frames import SCHEMA_VERSION, parse_response
from proto.hop_transport import TransportError, TransportStatus, Unary
from shard.edges.grpc_server import GRPC_OPTIONS, build_server
from shard.edges.memory import MemoryNetwork
from shard.edges.unix_server import UnixFrameServer
from shard.model.torch_backend import TorchRangeBackend
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy
from tests._swarm_helpers import tiny_llama

KINDS = ["memory", "grpc", "unix"]


@pytest.fixture(scope="module")
def service():
    return ShardService(TorchRangeBackend.load(tiny_llama(), 0, 3), SessionPolicy(kv_budget_tokens=512))


@pytest.fixture(scope="module")
def transports(service):
    network = MemoryNetwork()
    network.add("mem:worker", service)
    server, port, _ = build_server(service, "127.0.0.1:0")
    server.start()
    unix = UnixFrameServer(service, Path(tempfile.mkdtemp(prefix="hopt-")) / "w.sock").start()
    made = {"memory": lambda: network.transport("mem:worker"),
            "grpc": lambda: GrpcTransport(loopback_channel(f"127.0.0.1:{port}", GRPC_OPTIONS)),
            "unix": lambda: UnixFrameTransport(unix.endpoint)}
    yield made
    unix.close()
    server.stop(None)


def _open(service, session_id: str) -> bytes:
    return pb.SessionRequest(open=pb.SessionOpen(
        schema_version=SCHEMA_VERSION, route_session_id=session_id, route_epoch=0,
        fingerprint=service.backend.fingerprint, max_tokens=32,
        shard_range=pb.ShardRange(start_layer=0, end_layer=3))).SerializeToString()


def _chunk(session_id: str, n: int) -> bytes:
    env = pb.Envelope(schema_version=SCHEMA_VERSION, route_session_id=session_id, route_epoch=0,
                      phase=pb.PHASE_PREFILL, position=pb.PositionSpan(first_position=0, token_count=n),
                      idempotency_step=1,
                      cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=0),
                      chunk=pb.ChunkInfo(chunk_index=0, chunk_count=1, final_chunk=True))
    return wire.request_chunk(env, {"token_ids": np.arange(5, 5 + n, dtype=np.int64)})


def _kind_of(body: bytes | None) -> str:
    assert body is not None
    return parse_response(body).WhichOneof("kind")


def _answer(stream) -> str:
    """The next answer that is not a credit grant."""
    while (kind := _kind_of(stream.receive())) == "flow_control":
        pass
    return kind


@pytest.mark.parametrize("kind", KINDS)
def test_a_session_runs_is_released_and_ends_after_the_half_close(service, transports, kind):
    transport = transports[kind]()
    stream = transport.open_session()
    sid = f"hopt-{kind}"
    stream.send(_open(service, sid))
    assert _answer(stream) == "accepted"
    stream.send(_chunk(sid, 4))
    assert _answer(stream) == "chunk"
    assert service.health().active_sessions == 1
    stream.send(pb.SessionRequest(release=pb.ReleaseSignal(route_session_id=sid)).SerializeToString())
    assert _answer(stream) == "ack"
    stream.close_send()
    assert stream.receive() is None            # the worker ends the stream after our half-close
    assert service.health().active_sessions == 0
    transport.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancel_from_another_thread_ends_a_blocked_receive(service, transports, kind):
    transport = transports[kind]()
    stream = transport.open_session()
    stream.send(_open(service, f"cut-{kind}"))
    assert _answer(stream) == "accepted"
    cutter = threading.Timer(0.2, stream.cancel)    # nothing more will come: only the cancel ends the wait
    cutter.start()
    with pytest.raises(TransportError) as err:
        stream.receive()
    cutter.join()
    assert err.value.status in (TransportStatus.CANCELLED, TransportStatus.UNAVAILABLE)
    stream.send(b"after the cancel")               # never raises: the stream is over
    transport.close()


@pytest.mark.parametrize("kind", KINDS)
def test_unary_calls_answer_or_say_they_are_not_carried(service, transports, kind):
    transport = transports[kind]()
    body = pb.HealthRequest(schema_version=SCHEMA_VERSION).SerializeToString()
    if kind == "unix":
        with pytest.raises(TransportError) as err:
            transport.unary(Unary.HEALTH, body, 5.0)
        assert err.value.status == TransportStatus.UNIMPLEMENTED
        return
    report = pb.HealthReport.FromString(transport.unary(Unary.HEALTH, body, 5.0))
    assert report.schema_version == SCHEMA_VERSION
    capability = pb.CapabilityReport.FromString(transport.unary(
        Unary.CAPABILITY, pb.CapabilityRequest(schema_version=SCHEMA_VERSION).SerializeToString(), 5.0))
    assert capability.shard_range.end_layer == 3 and capability.backend == "torch"
    transport.close()


# -- the in-memory twin's faults ---------------------------------------------------------------
@pytest.fixture
def fresh():
    """A worker of its own per fault test (its KV counts start at zero)."""
    return ShardService(TorchRangeBackend.load(tiny_llama(), 0, 3), SessionPolicy(kv_budget_tokens=512))


@pytest.fixture
def hop(fresh):
    network = MemoryNetwork()
    return network, network.add("mem:faulty", fresh)


def test_a_killed_worker_breaks_its_streams_and_refuses_new_ones(fresh, hop):
    service = fresh
    network, h = hop
    stream = network.transport("mem:faulty").open_session()
    stream.send(_open(service, "killed"))
    assert _answer(stream) == "accepted"
    h.kill()
    with pytest.raises(TransportError) as err:
        stream.receive()
    assert err.value.status == TransportStatus.UNAVAILABLE
    with pytest.raises(TransportError):
        network.transport("mem:faulty").open_session()
    with pytest.raises(TransportError):
        network.transport("mem:faulty").unary(Unary.HEALTH, b"", 1.0)
    with pytest.raises(TransportError, match="nothing listens"):
        network.transport("mem:nobody")
    service.manager.release(*_key_owner("killed"))      # the dead worker's KV: this test's to free


def _key_owner(session_id: str):
    from shard.session.sessions import LOCAL_OWNER, SessionKey

    return SessionKey(session_id, 0), LOCAL_OWNER


def test_a_frozen_worker_answers_nothing_until_thawed(fresh, hop):
    service = fresh
    network, h = hop
    transport = network.transport("mem:faulty")
    stream = transport.open_session()
    h.freeze()
    stream.send(_open(service, "frozen"))
    health = pb.HealthRequest(schema_version=SCHEMA_VERSION).SerializeToString()
    with pytest.raises(TransportError) as err:
        transport.unary(Unary.HEALTH, health, 0.05)
    assert err.value.status == TransportStatus.DEADLINE_EXCEEDED
    assert service.health().active_sessions == 0         # the open waits, unread
    thawing = threading.Timer(0.1, h.thaw)
    thawing.start()
    assert _answer(stream) == "accepted"                  # answered once thawed
    thawing.join()
    stream.send(pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="frozen")).SerializeToString())
    assert _answer(stream) == "ack"
    stream.cancel()


def test_a_refusing_worker_turns_new_streams_away_and_keeps_the_open_ones(fresh, hop):
    service = fresh
    network, h = hop
    stream = network.transport("mem:faulty").open_session()
    h.refuse()
    with pytest.raises(TransportError, match="connection refused"):
        network.transport("mem:faulty").open_session()
    stream.send(_open(service, "kept"))
    assert _answer(stream) == "accepted"
    h.refuse(False)
    stream.cancel()
    assert service.health().active_sessions == 1          # a cancelled stream leaves its KV to the TTL
    service.manager.release(*_key_owner("kept"))


def test_a_corrupted_answer_is_a_body_no_parser_accepts(fresh, hop):
    service = fresh
    network, h = hop
    stream = network.transport("mem:faulty").open_session()
    h.corrupt()
    stream.send(_open(service, "garbled"))
    with pytest.raises(ProtocolError):
        parse_response(stream.receive())
    stream.cancel()
    service.manager.release(*_key_owner("garbled"))
