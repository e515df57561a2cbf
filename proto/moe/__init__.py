"""The expert exchange: how a MoE shard holder and its expert peers speak (sans-I/O).

Files and roles:

    wire.py     the format: header, hello / welcome / refuse, requests (rows once + per-expert
                indices, f32 or q8) and replies, every bound as a named constant; the encoders
    decode.py   its bounded decoder (every declaration checked before allocation)
    link.py     the link states of one connection (a client link fails for good; the server
                speaks hello first)

Public surface: the whole codec in one namespace (the format's constants,
messages and encoders from wire.py, ``decode`` / ``peek_header`` from
decode.py) and the link states; callers write ``from proto import moe as W``
and ``W.encode_request(...)`` / ``W.decode(body)``. Inside this room the
modules import each other by path: wire.py (the format) is the floor,
decode.py reads it, link.py uses both.
"""
from proto.moe.decode import decode, peek_header
from proto.moe.link import ClientLink, LinkFailed, PeerRefused, ServerLink
from proto.moe.wire import (
                            ACT_F32,
                            ACT_Q8,
                            ACTS,
                            FAILURE_BAD_REQUEST,
                            FAILURE_INTERNAL,
                            FAILURE_NOT_SERVED,
                            MAGIC,
                            MAX_DIGEST_BYTES,
                            MAX_EXCHANGE_FRAME_BYTES,
                            MAX_EXPERTS_PER_LAYER,
                            MAX_HIDDEN,
                            MAX_ITEMS,
                            MAX_REASON_BYTES,
                            MAX_ROWS,
                            SHARED,
                            SUPPORTED_VERSIONS,
                            VERSION_COPIES,
                            VERSION_ROWS_ONCE,
                            Failure,
                            Hello,
                            Item,
                            Refuse,
                            Reply,
                            Request,
                            Welcome,
                            act_name,
                            encode_failure,
                            encode_hello,
                            encode_refuse,
                            encode_reply,
                            encode_request,
                            encode_welcome,
)

__all__ = [
    "MAGIC", "VERSION_COPIES", "VERSION_ROWS_ONCE", "SUPPORTED_VERSIONS", "ACT_F32", "ACT_Q8", "ACTS",
    "SHARED", "MAX_ROWS", "MAX_HIDDEN", "MAX_ITEMS", "MAX_EXPERTS_PER_LAYER", "MAX_EXCHANGE_FRAME_BYTES",
    "MAX_REASON_BYTES", "MAX_DIGEST_BYTES", "FAILURE_NOT_SERVED", "FAILURE_BAD_REQUEST", "FAILURE_INTERNAL",
    "Hello", "Welcome", "Refuse", "Item", "Request", "Reply", "Failure", "act_name",
    "encode_hello", "encode_welcome", "encode_refuse", "encode_request", "encode_reply", "encode_failure",
    "decode", "peek_header", "ClientLink", "ServerLink", "LinkFailed", "PeerRefused",
]
