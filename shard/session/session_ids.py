"""Which session and whose: the keys and owners the session manager (shard/session/sessions.py) keys on.

``SessionKey`` is a route session id and its epoch, bounded so a peer cannot
make a worker keep large keys. ``Owner`` is the authenticated peer an edge saw
plus the SHA-256 of the opener's ``owner_token`` (the token itself is never
kept); ``LOCAL_OWNER`` is the worker's private edges. Pure values, no state.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from proto.errors import ProtocolViolation

# A route session id is an opaque token from the initiator; bound it so a peer
# cannot make us keep large keys.
MAX_SESSION_ID_CHARS = 128
# SessionOpen.owner_token: 128 bits at least (unguessable), 64 bytes at most.
MIN_OWNER_TOKEN_BYTES = 16
MAX_OWNER_TOKEN_BYTES = 64
# Peer identities are peer ids or addresses; bound what we keep per session.
MAX_PEER_CHARS = 128


@dataclass(frozen=True, slots=True)
class SessionKey:
    session_id: str
    epoch: int

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not 0 < len(self.session_id) <= MAX_SESSION_ID_CHARS:
            raise ProtocolViolation(f"route_session_id must be 1..{MAX_SESSION_ID_CHARS} characters")
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ProtocolViolation("route_epoch must be a non-negative integer")


@dataclass(frozen=True, slots=True)
class Owner:
    """Who opened a session: the authenticated peer the edge saw and the digest of its owner token."""

    peer: str
    token_digest: bytes = b""

    @classmethod
    def of(cls, peer: str, token: bytes = b"") -> Owner:
        """The owner of a request carrying ``token`` (ProtocolViolation for a token of a bad size)."""
        if token and not MIN_OWNER_TOKEN_BYTES <= len(token) <= MAX_OWNER_TOKEN_BYTES:
            raise ProtocolViolation(f"owner_token must be {MIN_OWNER_TOKEN_BYTES}..{MAX_OWNER_TOKEN_BYTES} bytes")
        return cls(peer[:MAX_PEER_CHARS], hashlib.sha256(token).digest() if token else b"")


# The worker's private edges without a token (its own daemon, tests in process).
LOCAL_OWNER = Owner("local")
