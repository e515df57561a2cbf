"""Expert exchange link states (proto/moe/link.py) and the one exchange function over socket pairs.

The rule under test: a transport or protocol failure marks the link failed,
and every later exchange on it fails at once without sending or reading -- so
bytes a peer sends after a failed exchange (the rest of a reply, or a
well-formed reply queued behind a bad one) are never taken as the answer to
another request.
"""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import moe as W
from proto.errors import LocalError, ProtocolViolation
from proto.errors import ProtocolError as ProtocolError_
from proto.frames import encode_frame
from proto.moe.link import ClientLink, LinkFailed, PeerRefused, ServerLink
from shard.experts.server import serve_connection
from shard.experts.transport import ExpertConnection, recv_exactly

ART, REC = "sha256:" + "a" * 64, "sha256:" + "b" * 64
ROWS = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)


def _client(version=W.VERSION_ROWS_ONCE, act=W.ACT_F32) -> ClientLink:
    return ClientLink("peerA", version=version, act=act, artifact=ART, recipe=REC)


def _ready_pair(**kw) -> tuple[ClientLink, ServerLink]:
    client, server = _client(**kw), ServerLink(artifact=ART, recipe=REC)
    out, _ = server.receive(client.hello()[4:])
    client.receive(out[4:])
    return client, server


# --------------------------------------------------------------------------- sans-I/O states


def test_hello_request_reply_in_order():
    client, server = _ready_pair()
    data = client.request(0, ROWS, [W.Item(3, np.array([1]))])
    _, req = server.receive(data[4:])
    assert req.items[0].expert == 3 and req.item_rows(req.items[0]).tolist() == [[3.0, 4.0]]
    reply = client.receive(server.reply(req, [np.array([[5.0, 6.0]], np.float32)])[4:])
    assert reply.outputs[0][1].tolist() == [[5.0, 6.0]] and client.state == "ready"
    second = client.request(0, ROWS, [W.Item(3, np.array([0]))])
    assert W.decode(second[4:]).request_id == req.request_id + 1
    hello_len = len(W.encode_hello(2, 1, ART, REC)) + 4
    assert client.bytes_sent == hello_len + len(data) + len(second)


@pytest.mark.parametrize("answer", [
    lambda req: W.encode_reply(W.Request(2, 1, req.request_id + 1, req.layer, req.rows, req.items),
                               [np.zeros((1, 2), np.float32)]),                 # an answer to another request
    lambda req: W.encode_reply(W.Request(2, 1, req.request_id, req.layer + 1, req.rows, req.items),
                               [np.zeros((1, 2), np.float32)]),                 # another layer
    lambda req: W.encode_reply(W.Request(2, 1, req.request_id, req.layer, req.rows,
                                         (W.Item(4, np.array([1])),)), [np.zeros((1, 2), np.float32)]),
    lambda req: W.encode_reply(W.Request(2, 1, req.request_id, req.layer, req.rows,
                                         (W.Item(3, np.array([0, 1])),)), [np.zeros((2, 2), np.float32)]),
    lambda req: W.encode_failure(2, req.request_id, W.FAILURE_NOT_SERVED, "not here"),
    lambda req: W.encode_welcome(2, 1),
    lambda req: b"garbage!",
])
def test_any_reply_that_is_not_the_answer_fails_the_link(answer):
    client, server = _ready_pair()
    _, req = server.receive(client.request(0, ROWS, [W.Item(3, np.array([1]))])[4:])
    with pytest.raises(LinkFailed):
        client.receive(answer(req))
    assert client.failed
    for call in (lambda: client.request(0, ROWS, [W.Item(3, np.array([1]))]),
                 lambda: client.receive(W.encode_reply(req, [np.zeros((1, 2), np.float32)])),
                 lambda: client.frame_length(b"\x00\x00\x00\x08")):
        with pytest.raises(LinkFailed, match="already failed"):
            call()


def test_calls_out_of_order_are_local_errors():
    client = _client()
    with pytest.raises(LocalError):
        client.request(0, ROWS, [W.Item(0, np.array([0]))])   # before the hello
    client, _ = _ready_pair()
    with pytest.raises(LinkFailed, match="no answer was awaited"):
        client.frame_length(b"\x00\x00\x00\x08")               # bytes nobody asked for


def test_bad_frame_length_fails_the_link():
    client, _ = _ready_pair()
    client.request(0, ROWS, [W.Item(0, np.array([0]))])
    with pytest.raises(LinkFailed, match="frame length"):
        client.frame_length((W.MAX_EXCHANGE_FRAME_BYTES + 1).to_bytes(4, "big"))
    assert client.failed


def test_server_refuses_versions_and_acts_it_does_not_speak_by_name():
    server = ServerLink(artifact=ART, recipe=REC, versions=(1,), acts=(W.ACT_F32,))
    out, _ = server.receive(W.encode_hello(2, W.ACT_Q8, ART, REC))
    assert server.closed
    client = _client(act=W.ACT_Q8)
    client.hello()
    with pytest.raises(PeerRefused, match=r"refused our v2 q8 hello: it speaks v1 with f32"):
        client.receive(out[4:])


def test_server_refuses_a_newer_hello_it_cannot_parse():
    server = ServerLink(artifact=ART, recipe=REC)
    newer = bytearray(W.encode_hello(2, 1, ART, REC))
    newer[4] = 9
    out, _ = server.receive(bytes(newer))
    refuse = W.decode(out[4:])
    assert isinstance(refuse, W.Refuse) and refuse.versions == W.SUPPORTED_VERSIONS and server.closed


def test_server_refuses_another_model_or_recipe():
    server = ServerLink(artifact=ART, recipe=REC)
    out, _ = server.receive(W.encode_hello(2, 1, ART, "sha256:" + "c" * 64))
    assert "recipe" in W.decode(out[4:]).reason and server.closed


def test_server_closes_on_a_request_before_the_hello_or_a_second_hello():
    server = ServerLink(artifact=ART, recipe=REC)
    with pytest.raises(ProtocolViolation, match="hello first"):
        server.receive(W.encode_request(W.Request(2, 1, 1, 0, ROWS, (W.Item(0, np.array([0])),))))
    assert server.closed
    _, server = _ready_pair()
    with pytest.raises(ProtocolViolation):
        server.receive(W.encode_hello(2, 1, ART, REC))


# --------------------------------------------------------------------------- over a socket pair


class ScriptedPeer(threading.Thread):
    """Welcomes the hello, reads one request, then sends ``script(request)`` bytes and maybe shuts writing."""

    def __init__(self, sock, script, shut_write: bool = False) -> None:
        super().__init__(daemon=True)
        self.sock, self.script, self.shut_write = sock, script, shut_write
        self.requests = 0
        self.later = b""

    def run(self) -> None:
        link = ServerLink(artifact=ART, recipe=REC)
        out, _ = link.receive(recv_exactly(self.sock, link.frame_length(recv_exactly(self.sock, 4))))
        self.sock.sendall(out)
        _, req = link.receive(recv_exactly(self.sock, link.frame_length(recv_exactly(self.sock, 4))))
        self.requests += 1
        self.sock.sendall(self.script(req))
        if self.shut_write:
            self.sock.shutdown(socket.SHUT_WR)
        self.sock.settimeout(1.0)
        try:
            self.later = self.sock.recv(1 << 16)   # a second request would arrive here
        except (TimeoutError, OSError):
            pass


def _pending(sock) -> bytes:
    try:
        return sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def test_a_reply_for_two_items_with_a_good_reply_queued_behind_is_never_read_as_the_next_answer():
    ours, theirs = socket.socketpair()
    good = {}

    def script(req):
        wrong = W.Request(2, 1, req.request_id, req.layer, req.rows,
                          (W.Item(3, np.array([1])), W.Item(4, np.array([0]))))
        bad = encode_frame(W.encode_reply(wrong, [np.zeros((1, 2), np.float32)] * 2))
        # a well-formed reply to the *next* request (id + 1) right behind it
        nxt = W.Request(2, 1, req.request_id + 1, req.layer, req.rows, req.items)
        good["bytes"] = encode_frame(W.encode_reply(nxt, [np.ones((1, 2), np.float32)]))
        return bad + good["bytes"]

    peer = ScriptedPeer(theirs, script)
    peer.start()
    conn = ExpertConnection.over(ours, "peerA", version=2, act=1, artifact=ART, recipe=REC, timeout_s=5.0)
    with pytest.raises(LinkFailed, match="does not answer"):
        conn.exchange(0, ROWS, [W.Item(3, np.array([1]))])
    peer.join(5.0)
    with pytest.raises(LinkFailed, match="already failed"):
        conn.exchange(0, ROWS, [W.Item(3, np.array([1]))])
    assert _pending(ours) == good["bytes"]          # still on the link, unread
    assert peer.requests == 1 and peer.later == b""  # and the peer saw no second request
    # The hazard is real: a link that forgot its failure would take those bytes as its next answer.
    naive = ExpertConnection(ours, ClientLink("peerA", version=2, act=1, artifact=ART, recipe=REC))
    naive.link.state, naive.link._next_id = "ready", 2
    stale = naive.exchange(0, ROWS, [W.Item(3, np.array([1]))])
    assert stale.outputs[0][1].tolist() == [[1.0, 1.0]]   # the queued reply, not an answer to this request
    conn.close()
    theirs.close()


def test_a_reply_cut_mid_rows_fails_and_nothing_is_read_afterwards():
    ours, theirs = socket.socketpair()

    def script(req):
        full = encode_frame(W.encode_reply(req, [np.full((2, 2), 7.0, np.float32)]))
        return full[:-8]   # stops after the first of two rows

    peer = ScriptedPeer(theirs, script, shut_write=True)
    peer.start()
    conn = ExpertConnection.over(ours, "peerA", version=2, act=1, artifact=ART, recipe=REC, timeout_s=5.0)
    with pytest.raises(LinkFailed, match="closed the connection"):
        conn.exchange(0, ROWS, [W.Item(3, np.array([0, 1]))])
    with pytest.raises(LinkFailed, match="already failed"):
        conn.exchange(0, ROWS, [W.Item(3, np.array([0, 1]))])
    peer.join(5.0)
    assert peer.requests == 1 and peer.later == b""
    conn.close()
    theirs.close()


def test_a_silent_peer_times_out_and_the_link_stays_failed():
    ours, theirs = socket.socketpair()
    peer = ScriptedPeer(theirs, lambda req: b"")
    peer.start()
    conn = ExpertConnection.over(ours, "peerA", version=2, act=1, artifact=ART, recipe=REC, timeout_s=0.3)
    with pytest.raises(LinkFailed, match="timed out|TimeoutError"):
        conn.exchange(0, ROWS, [W.Item(3, np.array([0]))])
    theirs.sendall(encode_frame(b"late reply bytes"))    # arrives after we gave up: never read
    with pytest.raises(LinkFailed, match="already failed"):
        conn.exchange(0, ROWS, [W.Item(3, np.array([0]))])
    conn.close()
    theirs.close()
    peer.join(5.0)


class _Doubler:
    hidden_size = 2

    def serves(self, layer, expert):
        return expert < 8

    def compute(self, layer, expert, rows):
        return rows * (expert + 1)


def _serve_in_thread(sock, **kw):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("why", serve_connection(
        sock, _Doubler(), artifact=ART, recipe=REC, **kw)), daemon=True)
    t.start()
    return t, result


def test_real_server_over_a_socket_pair_rows_once_and_failure_for_unserved_experts():
    ours, theirs = socket.socketpair()
    thread, result = _serve_in_thread(theirs)
    conn = ExpertConnection.over(ours, "peerA", version=2, act=1, artifact=ART, recipe=REC)
    reply = conn.exchange(5, ROWS, [W.Item(0, np.array([1, 0])), W.Item(2, np.array([1]))])
    assert [y.tolist() for _, y in reply.outputs] == [[[3, 4], [1, 2]], [[9, 12]]]
    with pytest.raises(LinkFailed, match="not served here"):
        conn.exchange(5, ROWS, [W.Item(9, np.array([0]))])
    conn.close()
    thread.join(5.0)
    assert result["why"] == "transport: the peer closed the connection after 0 of 4 bytes" or \
        "closed" in result["why"]


def test_hello_to_a_v1_only_server_is_refused_by_name_and_version():
    ours, theirs = socket.socketpair()
    thread, result = _serve_in_thread(theirs, versions=(W.VERSION_COPIES,), acts=(W.ACT_F32,))
    with pytest.raises(PeerRefused, match=r"peerA.*refused our v2 q8 hello: it speaks v1 with f32"):
        ExpertConnection.over(ours, "peerA", version=2, act=W.ACT_Q8, artifact=ART, recipe=REC)
    thread.join(5.0)
    assert result["why"].startswith("refused")
    ours.close()


def test_hello_to_a_peer_that_closes_on_it_names_the_version():
    ours, theirs = socket.socketpair()

    def older():   # an engine that does not know this hello: reads it and hangs up
        recv_exactly(theirs, 4)
        theirs.close()

    t = threading.Thread(target=older, daemon=True)
    t.start()
    with pytest.raises(PeerRefused, match="closed the connection on our v2 f32 hello"):
        ExpertConnection.over(ours, "peerA", version=2, act=1, artifact=ART, recipe=REC)
    t.join(5.0)
    ours.close()


# --------------------------------------------------------------------------- fuzz of both ends


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_fuzz_server_link_refuses_or_accepts_never_crashes(body, after_hello):
    server = ServerLink(artifact=ART, recipe=REC)
    if after_hello:
        server.receive(W.encode_hello(2, 1, ART, REC))
    try:
        out, req = server.receive(body)
    except ProtocolError_:
        assert server.closed
        return
    assert isinstance(out, bytes) and (req is None or isinstance(req, W.Request))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_client_link_fails_cleanly_on_any_reply(body):
    client, server = _ready_pair()
    client.request(0, ROWS, [W.Item(3, np.array([1]))])
    try:
        reply = client.receive(body)
    except LinkFailed:
        assert client.failed
        return
    assert isinstance(reply, W.Reply) and client.state == "ready"


def test_the_router_probes_peers_before_any_token_and_sets_refusers_aside():
    from shard.experts.pool import ExpertRouter, Placement
    from shard.experts.spec import ExpertSpec

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def old_peer():   # speaks v1 only
        conn, _ = listener.accept()
        serve_connection(conn, _Doubler(), artifact=ART, recipe=REC, versions=(W.VERSION_COPIES,))
        conn.close()

    t = threading.Thread(target=old_peer, daemon=True)
    t.start()
    router = ExpertRouter(artifact=ART, recipe=REC)
    spec = ExpertSpec.parse("0:E0-E3")
    router.set_placements([Placement("old-peer", "127.0.0.1", port, None, spec)])
    assert not len(router.uncovered(spec))
    refused = router.probe()
    assert "refused our v2 f32 hello: it speaks v1 with f32" in refused["old-peer"]
    assert router.uncovered(spec) == spec            # its experts count as not served
    out, unserved = router.run(0, ROWS, [(0, np.array([0]))])
    assert out == {} and unserved == [0]             # and it is never tried again
    t.join(5.0)
    listener.close()
