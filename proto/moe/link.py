"""Sans-I/O state of one expert exchange connection, both ends (no sockets here).

``ClientLink`` is the shard holder's end, ``ServerLink`` the expert peer's.
Both consume whole frame bodies (the transport reads the 4-byte prefix, asks
``frame_length`` whether that length is acceptable, then reads exactly that
many bytes -- never more, so bytes behind the current frame stay unread) and
produce bodies for the transport to frame and send.

Client states (the rules; nothing else moves a link)::

    NEW --hello()--> HELLO_SENT --welcome--> READY --request()--> AWAITING --matching reply--> READY
    any state --fail() / refusal / any protocol error--> FAILED   (terminal)

A reply matches only when its version, act, request id, layer, hidden size,
expert ids and row counts are exactly those of the outstanding request.
Anything else -- a short read, EOF mid-reply, a FAILURE answer, a reply with
another id (a late answer to an earlier request), bytes when none is awaited
-- moves the link to FAILED. From FAILED every call raises ``LinkFailed`` at
once: nothing is built to send and nothing is read, so a leftover reply on
the wire is never taken as the answer to another request. A link comes back
only as a new ``ClientLink`` over a new connection (a new hello).

Server states::

    AWAIT_HELLO --hello we speak--> READY --request--> READY (the app answers each request in order)
    AWAIT_HELLO --hello we do not speak--> CLOSED (a REFUSE naming our versions and acts is sent)
    any --bad bytes / a second hello / a request before the hello--> CLOSED

Counters: ``bytes_sent`` / ``bytes_received`` include the 4-byte prefixes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto.errors import LimitExceeded, LocalError, MeshdError, ProtocolError, ProtocolViolation
from proto.frames import PREFIX_BYTES, encode_frame
from proto.moe import wire as W
from proto.moe.decode import decode

__all__ = ["ClientLink", "ServerLink", "LinkFailed", "PeerRefused", "PREFIX_BYTES"]

NEW, HELLO_SENT, READY, AWAITING, FAILED = "new", "hello_sent", "ready", "awaiting", "failed"
AWAIT_HELLO, CLOSED = "await_hello", "closed"
# Which client calls each state allows (anything else is our own bug: LocalError).
_CLIENT_ALLOWED = {
    NEW: {"hello"},
    HELLO_SENT: {"receive"},
    READY: {"request"},
    AWAITING: {"receive"},
}


class LinkFailed(MeshdError):
    """This link to an expert peer failed (transport or protocol); it is never read again.

    ``peer`` names the peer; reconnect (a new link) or fail over to another peer.
    """

    def __init__(self, peer: str, detail: str) -> None:
        super().__init__(f"expert link to {peer} failed: {detail}")
        self.peer, self.detail = peer, detail


class PeerRefused(LinkFailed):
    """The peer refused our hello (or closed on it): it speaks neither our version nor our act."""


@dataclass(frozen=True, slots=True)
class _Outstanding:
    request_id: int
    layer: int
    hidden: int
    items: tuple[tuple[int, int], ...]  # (expert, count)


class ClientLink:
    def __init__(self, peer: str, *, version: int, act: int, artifact: str, recipe: str) -> None:
        self.peer = peer
        self.version, self.act = version, act
        self.artifact, self.recipe = artifact, recipe
        self.state = NEW
        self.failure = ""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.exchanges = 0
        self._next_id = 1
        self._outstanding: _Outstanding | None = None

    # ------------------------------------------------------------------ state
    @property
    def failed(self) -> bool:
        return self.state == FAILED

    def fail(self, detail: str) -> LinkFailed:
        """Move to FAILED (keeps the first reason); returns the error to raise."""
        if self.state != FAILED:
            self.state, self.failure = FAILED, detail
            self._outstanding = None
        return LinkFailed(self.peer, self.failure)

    def _enter(self, call: str) -> None:
        if self.state == FAILED:
            raise LinkFailed(self.peer, f"already failed ({self.failure}); reconnect")
        if call not in _CLIENT_ALLOWED[self.state]:
            raise LocalError(f"ClientLink.{call}() in state {self.state}")

    def _framed(self, body: bytes) -> bytes:
        data = encode_frame(body, W.MAX_EXCHANGE_FRAME_BYTES)
        self.bytes_sent += len(data)
        return data

    # ------------------------------------------------------------------ calls
    def hello(self) -> bytes:
        self._enter("hello")
        data = self._framed(W.encode_hello(self.version, self.act, self.artifact, self.recipe))
        self.state = HELLO_SENT
        return data

    def request(self, layer: int, rows: np.ndarray, items: list[W.Item]) -> bytes:
        """The framed request; the link then awaits exactly its reply."""
        self._enter("request")
        req = W.Request(self.version, self.act, self._next_id, layer, rows, tuple(items))
        data = self._framed(W.encode_request(req))
        self._outstanding = _Outstanding(req.request_id, layer, req.hidden,
                                         tuple((i.expert, len(i.index)) for i in items))
        self._next_id = (self._next_id % 0xFFFF_FFFF) + 1
        self.state = AWAITING
        return data

    def frame_length(self, prefix: bytes) -> int:
        """The body length a 4-byte prefix announces, if acceptable here (else the link fails)."""
        if self.state == FAILED:
            raise LinkFailed(self.peer, f"already failed ({self.failure}); reconnect")
        if self.state not in (HELLO_SENT, AWAITING):
            raise self.fail("the peer sent bytes while no answer was awaited")
        self.bytes_received += len(prefix)
        length = int.from_bytes(prefix, "big") if len(prefix) == PREFIX_BYTES else 0
        if not 0 < length <= W.MAX_EXCHANGE_FRAME_BYTES:
            raise self.fail(f"frame length {length} outside 1..{W.MAX_EXCHANGE_FRAME_BYTES}")
        return length

    def receive(self, body: bytes):
        """Consume one body: the Welcome in HELLO_SENT, the matching Reply in AWAITING."""
        self._enter("receive")
        self.bytes_received += len(body)
        try:
            msg = decode(body)
        except ProtocolError as exc:
            if self.state == HELLO_SENT:
                raise self._refused(f"answered the hello with bytes we cannot read ({exc})") from exc
            raise self.fail(f"{type(exc).__name__}: {exc}") from exc
        if self.state == HELLO_SENT:
            return self._on_welcome(msg)
        return self._on_reply(msg)

    def _refused(self, detail: str) -> PeerRefused:
        self.fail(detail)
        return PeerRefused(self.peer, detail)

    def _on_welcome(self, msg) -> W.Welcome:
        if isinstance(msg, W.Refuse):
            versions = ", ".join(f"v{v}" for v in msg.versions) or "none"
            acts = ", ".join(W.act_name(a) for a in msg.acts) or "none"
            raise self._refused(f"refused our v{self.version} {W.act_name(self.act)} hello: it speaks "
                                f"{versions} with {acts} ({msg.reason[:200]})")
        if not isinstance(msg, W.Welcome) or (msg.version, msg.act) != (self.version, self.act):
            raise self._refused(f"answered our v{self.version} {W.act_name(self.act)} hello with {msg!r:.120}")
        self.state = READY
        return msg

    def _on_reply(self, msg) -> W.Reply:
        want = self._outstanding
        assert want is not None
        if isinstance(msg, W.Failure):
            raise self.fail(f"the peer failed request {msg.request_id} (code {msg.code}: {msg.reason[:200]})")
        if not isinstance(msg, W.Reply):
            raise self.fail(f"expected a reply, got {type(msg).__name__}")
        if (msg.version, msg.act) != (self.version, self.act):
            raise self.fail(f"reply in v{msg.version} {W.act_name(msg.act)}, we speak "
                            f"v{self.version} {W.act_name(self.act)}")
        if msg.request_id != want.request_id:
            raise self.fail(f"reply to request {msg.request_id} while {want.request_id} is outstanding")
        got = tuple((e, out.shape[0]) for e, out in msg.outputs)
        if (msg.layer, msg.hidden, got) != (want.layer, want.hidden, want.items):
            raise self.fail(f"reply for layer {msg.layer} hidden {msg.hidden} items {got[:4]} does not answer "
                            f"layer {want.layer} hidden {want.hidden} items {want.items[:4]}")
        self._outstanding = None
        self.exchanges += 1
        self.state = READY
        return msg


class ServerLink:
    """The expert peer's end: hello first, then requests answered in order."""

    def __init__(self, *, artifact: str, recipe: str, versions: tuple[int, ...] = W.SUPPORTED_VERSIONS,
                 acts: tuple[int, ...] = W.ACTS) -> None:
        self.artifact, self.recipe = artifact, recipe
        self.versions, self.acts = versions, acts
        self.state = AWAIT_HELLO
        self.version = 0
        self.act = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.close_reason = ""

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    def frame_length(self, prefix: bytes) -> int:
        if self.state == CLOSED:
            raise LocalError("ServerLink is closed")
        self.bytes_received += len(prefix)
        length = int.from_bytes(prefix, "big") if len(prefix) == PREFIX_BYTES else 0
        if not 0 < length <= W.MAX_EXCHANGE_FRAME_BYTES:
            self._close(f"frame length {length}")
            raise LimitExceeded(f"frame length {length} outside 1..{W.MAX_EXCHANGE_FRAME_BYTES}")
        return length

    def _close(self, reason: str) -> None:
        self.state, self.close_reason = CLOSED, reason

    def _framed(self, body: bytes) -> bytes:
        data = encode_frame(body, W.MAX_EXCHANGE_FRAME_BYTES)
        self.bytes_sent += len(data)
        return data

    def receive(self, body: bytes) -> tuple[bytes, W.Request | None]:
        """(bytes to send now, a request for the app to answer or None). Raises ProtocolError and
        closes on bad input; after a refusal the returned bytes are the REFUSE and the link is CLOSED."""
        if self.state == CLOSED:
            raise LocalError("ServerLink is closed")
        self.bytes_received += len(body)
        try:
            msg = decode(body)
        except ProtocolError as exc:
            self._close(str(exc))
            if self.version == 0:  # still awaiting the hello
                # e.g. a newer client's hello: say which versions and acts we speak, then close
                return self._framed(W.encode_refuse(self.versions, self.acts, f"cannot read the hello: {exc}")), None
            raise
        if self.state == AWAIT_HELLO:
            if not isinstance(msg, W.Hello):
                self._close("a request before the hello")
                raise ProtocolViolation(f"expected a hello first, got {type(msg).__name__}")
            return self._on_hello(msg), None
        if not isinstance(msg, W.Request) or (msg.version, msg.act) != (self.version, self.act):
            self._close("unexpected message")
            raise ProtocolViolation(f"expected a v{self.version} {W.act_name(self.act)} request, "
                                    f"got {type(msg).__name__}")
        return b"", msg

    def _on_hello(self, hello: W.Hello) -> bytes:
        refuse = None
        if hello.version not in self.versions or hello.act not in self.acts:
            refuse = f"this peer does not speak v{hello.version} with {W.act_name(hello.act)} rows"
        elif (hello.artifact, hello.recipe) != (self.artifact, self.recipe):
            refuse = (f"this peer serves artifact {self.artifact[:23]} recipe {self.recipe[:23]}, "
                      f"not {hello.artifact[:23]} / {hello.recipe[:23]}")
        if refuse is not None:
            self._close(refuse)
            return self._framed(W.encode_refuse(self.versions, self.acts, refuse))
        self.version, self.act = hello.version, hello.act
        self.state = READY
        return self._framed(W.encode_welcome(hello.version, hello.act))

    def reply(self, request: W.Request, outputs: list[np.ndarray]) -> bytes:
        return self._framed(W.encode_reply(request, outputs))

    def failure(self, request: W.Request, code: int, reason: str) -> bytes:
        return self._framed(W.encode_failure(request.version, request.request_id, code, reason))
