"""Sessions belong to their opener, over real hops: a worker's TLS port and a relayed circuit.

One ``meshd worker`` subprocess serves layers 0:3 of the seeded random Llama on
its TLS port and on its Unix frame socket (the path a relayed session takes
through the home node). Alice opens a session; Bob -- another TLS client, or
another libp2p peer with its own circuit -- tries to re-attach to it,
supersede it, release it, cancel it and push it out for a session of his own:
every attempt is refused and Alice's session goes on.
"""
from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
import trio

from meshd.reach.tls import channel_trusting, generate_self_signed
from meshd.testing import models as testmodels
from meshd.testing.procs import spawn_worker
from proto import shard_runtime_pb2 as pb
from proto.frames import parse_response
from proto.tensors import encode_tensor
from relay.client import dial_relayed
from relay.transport import RelayedSessionServer, open_session_channel
from shard.edges.grpc_server import GRPC_OPTIONS, SERVICE_NAME
from shard.session.request_queue import RequestQueue
from tests._relay_helpers import LOOPBACK, info, new_host, triangle

BUDGET = 512
ALICE_TOKEN, BOB_TOKEN = os.urandom(32), os.urandom(32)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    d = tmp_path_factory.mktemp("owner-worker")
    cert, key = generate_self_signed("worker")
    (d / "cert.pem").write_bytes(cert)
    (d / "key.pem").write_bytes(key)
    w = spawn_worker(testmodels.build_random_llama(), "0:3", threads=1, extra=[
        "--kv-budget-tokens", str(BUDGET), "--min-idle-evict", "0",
        "--tls-listen", "127.0.0.1:0", "--tls-cert", str(d / "cert.pem"), "--tls-key", str(d / "key.pem"),
        "--unix-listen", str(d / "worker.sock")])
    w.cert = cert
    yield w
    assert w.stop() == 0


def fingerprint(worker):
    channel = grpc.insecure_channel(worker.endpoint, options=GRPC_OPTIONS)
    try:
        body = channel.unary_unary(f"/{SERVICE_NAME}/GetCapability")(
            pb.CapabilityRequest(schema_version=1).SerializeToString(), timeout=30)
        return pb.CapabilityReport.FromString(body).fingerprint
    finally:
        channel.close()


def open_body(fp, session, *, epoch=0, token=b"", max_tokens=64):
    return pb.SessionRequest(open=pb.SessionOpen(
        schema_version=1, route_session_id=session, route_epoch=epoch, fingerprint=fp,
        shard_range=pb.ShardRange(start_layer=0, end_layer=3), max_tokens=max_tokens,
        owner_token=token)).SerializeToString()


def decode_body(step, pos):
    return pb.SessionRequest(decode=pb.DecodeStep(
        idempotency_step=step, position=pos, expected_past_len=pos,
        tensor=encode_tensor("token_ids", np.array([3], np.int64)))).SerializeToString()


def answer(body):
    """The first non-flow-control response of a list of bodies, parsed."""
    for b in body:
        resp = parse_response(b)
        if resp.WhichOneof("kind") != "flow_control":
            return resp
    raise AssertionError("only flow control came back")


def refused(resp) -> int:
    assert resp.WhichOneof("kind") == "status", resp
    return resp.status.error.code


# -- direct: the TLS port ---------------------------------------------------------------------------
class TlsStream:
    """A raw Session call over the worker's TLS port (trusting exactly its certificate)."""

    def __init__(self, worker) -> None:
        self.channel = channel_trusting(worker.tls_endpoint, worker.cert, GRPC_OPTIONS)
        self._queue = RequestQueue(16)
        self._responses = self.channel.stream_stream(
            f"/{SERVICE_NAME}/Session", request_serializer=None, response_deserializer=None)(self._queue, timeout=60)

    def ask(self, body: bytes):
        self._queue.put(body)
        while True:
            resp = parse_response(next(self._responses))
            if resp.WhichOneof("kind") != "flow_control":
                return resp

    def unary(self, name, request, response_cls):
        return response_cls.FromString(self.channel.unary_unary(f"/{SERVICE_NAME}/{name}")(
            request.SerializeToString(), timeout=30))

    def close(self) -> None:
        self._queue.finish()
        self._responses.cancel()
        self.channel.close()


def test_direct_a_second_peer_cannot_touch_the_openers_session(worker):
    fp = fingerprint(worker)
    alice = TlsStream(worker)
    bobs = []
    try:
        assert alice.ask(open_body(fp, "alice", token=ALICE_TOKEN, max_tokens=256)).WhichOneof("kind") == "accepted"
        assert alice.ask(decode_body(1, 0)).decode.past_len == 1

        def bob_opens(**kw):
            bob = TlsStream(worker)
            bobs.append(bob)
            return bob.ask(open_body(fp, **kw))

        denied = pb.ERROR_CODE_PERMISSION_DENIED
        assert refused(bob_opens(session="alice", token=BOB_TOKEN)) == denied               # re-attach
        assert refused(bob_opens(session="alice", epoch=1, token=BOB_TOKEN)) == denied      # supersede
        assert refused(bob_opens(session="alice", epoch=1)) == pb.ERROR_CODE_PROTOCOL_VIOLATION  # no token
        bob = bobs[0]
        release = bob.unary("Release", pb.ReleaseRequest(schema_version=1, route_session_id="alice",
                                                          owner_token=BOB_TOKEN), pb.ReleaseResponse)
        assert not release.released and release.error.code == denied
        cancel = bob.unary("Cancel", pb.CancelRequest(schema_version=1, route_session_id="alice",
                                                       owner_token=BOB_TOKEN), pb.CancelResponse)
        assert cancel.error.code == denied
        # Eviction: alice idles past the worker's own-owner idle time (0 s here), yet Bob's
        # session that needs her room is refused with a retry hint, not granted by evicting her.
        full = bob_opens(session="bob", token=BOB_TOKEN, max_tokens=BUDGET - 128)
        assert refused(full) == pb.ERROR_CODE_RESOURCE_EXHAUSTED and full.status.error.retry_after_ms > 0
        # Alice goes on where she was, then releases with her own token.
        assert alice.ask(decode_body(2, 1)).decode.past_len == 2
        mine = alice.unary("Release", pb.ReleaseRequest(schema_version=1, route_session_id="alice",
                                                         owner_token=ALICE_TOKEN), pb.ReleaseResponse)
        assert mine.released and not mine.HasField("error")
    finally:
        for s in (alice, *bobs):
            s.close()


# -- relayed: a circuit through a relay to the home node, then the worker's Unix socket ----------------
def test_relayed_a_second_peer_cannot_touch_the_openers_session_even_with_its_token(worker):
    fp = fingerprint(worker)

    async def ask(channel, body):
        await channel.send(body)
        while True:
            resp = parse_response(await channel.receive())
            if resp.WhichOneof("kind") != "flow_control":
                return resp

    async def main():
        with trio.fail_after(120):
            await scenario()

    async def scenario():
        async with triangle() as t:
            server = RelayedSessionServer(worker.unix_endpoint)
            server.attach(t.home)
            bob_host = new_host()
            try:
                async with bob_host.run(LOOPBACK):
                    await dial_relayed(bob_host, info(t.relay), t.home.get_id())
                    alice = await open_session_channel(t.dialer, t.home.get_id())
                    mine = pb.SessionRequest.FromString(open_body(fp, "relayed", token=ALICE_TOKEN, max_tokens=256))
                    mine.open.relayed_peer_id = str(t.dialer.get_id())    # (the home node sets it anyway)
                    opened = await ask(alice, mine.SerializeToString())
                    assert opened.WhichOneof("kind") == "accepted"
                    assert (await ask(alice, decode_body(1, 0))).decode.past_len == 1
                    # Bob knows the session id AND Alice's token, and forges her peer id in the
                    # open: the home node stamps his own circuit's peer id, so he is still not her.
                    for epoch, token in ((0, ALICE_TOKEN), (1, ALICE_TOKEN), (0, BOB_TOKEN)):
                        bob = await open_session_channel(bob_host, t.home.get_id())
                        forged = pb.SessionRequest.FromString(open_body(fp, "relayed", epoch=epoch, token=token))
                        forged.open.relayed_peer_id = str(t.dialer.get_id())
                        resp = await ask(bob, forged.SerializeToString())
                        assert refused(resp) == pb.ERROR_CODE_PERMISSION_DENIED, (epoch, token)
                        await bob.close()
                    bob = await open_session_channel(bob_host, t.home.get_id())
                    full = await ask(bob, open_body(fp, "bobs", token=BOB_TOKEN, max_tokens=BUDGET - 128))
                    assert refused(full) == pb.ERROR_CODE_RESOURCE_EXHAUSTED
                    await bob.close()
                    assert (await ask(alice, decode_body(2, 1))).decode.past_len == 2
                    release = pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="relayed"))
                    assert (await ask(alice, release.SerializeToString())).WhichOneof("kind") == "ack"
                    await alice.close()
            finally:
                server.close()

    trio.run(main)
