"""The expert exchange wire format (sans-I/O): hello, requests, replies of MoE expert rows.

A shard holder whose MoE layer has experts on other nodes ("expert peers")
sends, per layer step and per peer, ONE request naming the rows each expert
must run, and reads ONE reply holding every expert's output rows. Each
message is one frame of proto/frames.py (u32 big-endian length, body) no
larger than ``MAX_EXCHANGE_FRAME_BYTES``. Integers are big-endian; row
payloads are little-endian float32 or q8 blocks (proto/q8.py).

Every body starts with the same 8-byte header::

    magic "MEXP" | version u8 | kind u8 | act u8 | reserved u8 (0)

Versions:
  1  rows per item: each item carries its own copies of its rows (float32
     only, no shared expert). A row routed to k experts crosses k times.
  2  rows once: the request carries the S rows once, then each item names its
     rows by index into them. ``act`` may be q8; the shared expert may ride
     as one more item (expert id ``SHARED``).
Acts (the activation format of the rows and of the reply's rows):
  1 ``ACT_F32``  raw little-endian float32
  2 ``ACT_Q8``   the q8 encoding of the row-major [n, hidden] matrix (32
                 values behind one float16 scale; blocks straddle rows when
                 hidden % 32 != 0)

Kinds and bodies after the header:
  HELLO    (client, first frame)  u16 n + artifact digest, u16 n + recipe digest
  WELCOME  (server)               nothing: the header echoes version and act
  REFUSE   (server, then closes)  u8 n + versions, u8 n + acts, u16 n + reason (utf-8)
  REQUEST  request_id u32, layer u32, hidden u32, rows u32, items u16, then
           v2: per item (expert u32, count u32, count x index u32), then the rows;
           v1: per item (expert u32, count u32), then each item's rows in order
               (rows == the sum of the counts)
  REPLY    request_id u32, layer u32, hidden u32, items u16,
           per item (expert u32, count u32), then each item's output rows in order
  FAILURE  request_id u32, code u16, u16 n + reason (utf-8)

Bounds, checked before anything is allocated: rows <= ``MAX_ROWS``, hidden <=
``MAX_HIDDEN``, items <= ``MAX_ITEMS`` with distinct expert ids below
``MAX_EXPERTS_PER_LAYER`` (or ``SHARED``), each count in 1..rows, every index
< rows, the payload exactly as long as declared (no trailing bytes), and the
reply a request asks for fits in one frame. Bad bytes raise ``ProtocolError``
subclasses (never another exception); bad local arguments ``LocalError``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from proto.errors import LocalError
from proto.limits import MIB
from proto.q8 import encode_q8

__all__ = [
    "MAGIC", "VERSION_COPIES", "VERSION_ROWS_ONCE", "SUPPORTED_VERSIONS", "ACT_F32", "ACT_Q8", "ACTS",
    "SHARED", "MAX_ROWS", "MAX_HIDDEN", "MAX_ITEMS", "MAX_EXPERTS_PER_LAYER", "MAX_EXCHANGE_FRAME_BYTES",
    "Hello", "Welcome", "Refuse", "Item", "Request", "Reply", "Failure",
    "encode_hello", "encode_welcome", "encode_refuse", "encode_request", "encode_reply", "encode_failure",
    "act_name",
]

MAGIC = b"MEXP"
VERSION_COPIES = 1
VERSION_ROWS_ONCE = 2
SUPPORTED_VERSIONS = (VERSION_COPIES, VERSION_ROWS_ONCE)
ACT_F32 = 1
ACT_Q8 = 2
ACTS = (ACT_F32, ACT_Q8)
_ACT_NAMES = {ACT_F32: "f32", ACT_Q8: "q8"}
KIND_HELLO, KIND_WELCOME, KIND_REFUSE, KIND_REQUEST, KIND_REPLY, KIND_FAILURE = 1, 2, 3, 4, 5, 6
KINDS = {KIND_HELLO, KIND_WELCOME, KIND_REFUSE, KIND_REQUEST, KIND_REPLY, KIND_FAILURE}

# The shared expert's id: no routed expert id comes near it.
SHARED = 0xFFFF_FFFF
# One request carries one batch of a layer step: a 128-token prefill chunk is
# 128 rows; 65,536 is the seed protocol's bound and far above any chunk.
MAX_ROWS = 65_536
# Hidden sizes of real MoE models are 2-8 Ki; 32 Ki leaves room.
MAX_HIDDEN = 32_768
# Routed experts per MoE layer: today's largest have 256; 512 leaves room.
MAX_EXPERTS_PER_LAYER = 512
# Every routed expert of a layer on one peer, plus its shared expert.
MAX_ITEMS = MAX_EXPERTS_PER_LAYER + 1
# One frame: a 128-row chunk at hidden 8192 in float32 is 4 MiB per copy; top-8
# copies (v1) 32 MiB. 64 MiB bounds what one peer makes us buffer.
MAX_EXCHANGE_FRAME_BYTES = 64 * MIB
# Free text in REFUSE / FAILURE, and digests in HELLO.
MAX_REASON_BYTES = 512
MAX_DIGEST_BYTES = 80

FAILURE_NOT_SERVED = 1   # the peer does not hold an expert the request names
FAILURE_BAD_REQUEST = 2  # well-formed but unusable here (hidden size, layer)
FAILURE_INTERNAL = 3

# The fixed layouts every body is built from (and read back by decode.py).
HEADER = struct.Struct(">4sBBBB")
U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
REQUEST_HEAD = struct.Struct(">IIIIH")
REPLY_HEAD = struct.Struct(">IIIH")
PAIR = struct.Struct(">II")
FAILURE_HEAD = struct.Struct(">IH")


def act_name(act: int) -> str:
    return _ACT_NAMES.get(act, f"act#{act}")


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    act: int
    artifact: str
    recipe: str


@dataclass(frozen=True, slots=True)
class Welcome:
    version: int
    act: int


@dataclass(frozen=True, slots=True)
class Refuse:
    versions: tuple[int, ...]
    acts: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Item:
    """One expert's share of a request: its id and the request rows it runs (indices, in order)."""

    expert: int
    index: np.ndarray  # uint32 [count]

    def __post_init__(self) -> None:
        if not (0 <= self.expert < MAX_EXPERTS_PER_LAYER or self.expert == SHARED):
            raise LocalError(f"expert id {self.expert} outside 0..{MAX_EXPERTS_PER_LAYER - 1} (or SHARED)")


@dataclass(frozen=True, slots=True)
class Request:
    version: int
    act: int
    request_id: int
    layer: int
    rows: np.ndarray  # float32 [S, hidden]
    items: tuple[Item, ...]

    @property
    def hidden(self) -> int:
        return int(self.rows.shape[1])

    def item_rows(self, item: Item) -> np.ndarray:
        return self.rows[item.index]


@dataclass(frozen=True, slots=True)
class Reply:
    version: int
    act: int
    request_id: int
    layer: int
    hidden: int
    outputs: tuple[tuple[int, np.ndarray], ...]  # (expert, float32 [count, hidden]) in item order


@dataclass(frozen=True, slots=True)
class Failure:
    version: int
    request_id: int
    code: int
    reason: str


# --------------------------------------------------------------------------- encoding


def _header(version: int, kind: int, act: int) -> bytes:
    return HEADER.pack(MAGIC, version, kind, act, 0)


def _check_version_act(version: int, act: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise LocalError(f"expert exchange version {version} is not one of {SUPPORTED_VERSIONS}")
    if act not in ACTS or (version == VERSION_COPIES and act != ACT_F32):
        raise LocalError(f"version {version} cannot carry {act_name(act)} rows")


def _text(value: str, bound: int) -> bytes:
    data = value.encode("utf-8")[:bound]
    return U16.pack(len(data)) + data


def _rows_payload(rows: np.ndarray, act: int) -> bytes:
    if act == ACT_Q8:
        return encode_q8(rows)
    return np.ascontiguousarray(rows, dtype="<f4").tobytes()


def encode_hello(version: int, act: int, artifact: str, recipe: str) -> bytes:
    _check_version_act(version, act)
    for digest in (artifact, recipe):
        if len(digest.encode()) > MAX_DIGEST_BYTES:
            raise LocalError(f"digest over {MAX_DIGEST_BYTES} bytes")
    return _header(version, KIND_HELLO, act) + _text(artifact, MAX_DIGEST_BYTES) + _text(recipe, MAX_DIGEST_BYTES)


def encode_welcome(version: int, act: int) -> bytes:
    _check_version_act(version, act)
    return _header(version, KIND_WELCOME, act)


def encode_refuse(versions: tuple[int, ...], acts: tuple[int, ...], reason: str) -> bytes:
    head = _header(max(SUPPORTED_VERSIONS), KIND_REFUSE, ACT_F32)
    return (head + bytes([len(versions)]) + bytes(versions) + bytes([len(acts)]) + bytes(acts)
            + _text(reason, MAX_REASON_BYTES))


def _check_rows(rows: np.ndarray) -> None:
    if rows.ndim != 2 or rows.dtype != np.float32:
        raise LocalError(f"rows must be float32 [S, hidden], got {rows.dtype} {rows.shape}")
    if not 1 <= rows.shape[0] <= MAX_ROWS or not 1 <= rows.shape[1] <= MAX_HIDDEN:
        raise LocalError(f"rows shape {rows.shape} outside [1..{MAX_ROWS}, 1..{MAX_HIDDEN}]")


def encode_request(req: Request) -> bytes:
    """The body of ``req`` (frame it with proto.frames.encode_frame)."""
    _check_version_act(req.version, req.act)
    _check_rows(req.rows)
    rows, hidden = req.rows.shape
    if not 1 <= len(req.items) <= MAX_ITEMS or len({i.expert for i in req.items}) != len(req.items):
        raise LocalError(f"a request carries 1..{MAX_ITEMS} items with distinct experts")
    parts = [_header(req.version, KIND_REQUEST, req.act)]
    if req.version == VERSION_COPIES:
        total = sum(len(i.index) for i in req.items)
        if any(i.expert == SHARED for i in req.items):
            raise LocalError("version 1 has no shared-expert item")
        parts.append(REQUEST_HEAD.pack(req.request_id, req.layer, hidden, total, len(req.items)))
        parts += [PAIR.pack(i.expert, len(i.index)) for i in req.items]
        parts += [_rows_payload(req.item_rows(i), ACT_F32) for i in req.items]
    else:
        parts.append(REQUEST_HEAD.pack(req.request_id, req.layer, hidden, rows, len(req.items)))
        for item in req.items:
            index = np.asarray(item.index)
            if not 1 <= index.size <= rows or int(index.max()) >= rows or int(index.min()) < 0:
                raise LocalError(f"item of expert {item.expert}: 1..{rows} indices below {rows}")
            parts += [PAIR.pack(item.expert, index.size), index.astype(">u4").tobytes()]
        parts.append(_rows_payload(req.rows, req.act))
    body = b"".join(parts)
    if len(body) > MAX_EXCHANGE_FRAME_BYTES:
        raise LocalError(f"request of {len(body)} bytes > MAX_EXCHANGE_FRAME_BYTES; send fewer rows")
    return body


def encode_reply(req: Request, outputs: list[np.ndarray]) -> bytes:
    """The reply body to ``req``: ``outputs[i]`` are item i's rows (float32 [count_i, hidden])."""
    if len(outputs) != len(req.items):
        raise LocalError("one output per item")
    parts = [_header(req.version, KIND_REPLY, req.act), REPLY_HEAD.pack(req.request_id, req.layer, req.hidden,
                                                                  len(req.items))]
    payloads = []
    for item, out in zip(req.items, outputs):
        if out.shape != (len(item.index), req.hidden) or out.dtype != np.float32:
            raise LocalError(f"output of expert {item.expert} must be float32 [{len(item.index)}, {req.hidden}]")
        parts.append(PAIR.pack(item.expert, len(item.index)))
        payloads.append(_rows_payload(out, req.act))
    return b"".join(parts + payloads)


def encode_failure(version: int, request_id: int, code: int, reason: str) -> bytes:
    return (_header(version, KIND_FAILURE, ACT_F32) + FAILURE_HEAD.pack(request_id, code)
            + _text(reason, MAX_REASON_BYTES))

