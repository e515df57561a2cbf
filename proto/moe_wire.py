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

from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolViolation, VersionUnsupported
from proto.limits import MIB
from proto.q8 import decode_q8, encode_q8, q8_encoded_size

__all__ = [
    "MAGIC", "VERSION_COPIES", "VERSION_ROWS_ONCE", "SUPPORTED_VERSIONS", "ACT_F32", "ACT_Q8", "ACTS",
    "SHARED", "MAX_ROWS", "MAX_HIDDEN", "MAX_ITEMS", "MAX_EXPERTS_PER_LAYER", "MAX_EXCHANGE_FRAME_BYTES",
    "Hello", "Welcome", "Refuse", "Item", "Request", "Reply", "Failure",
    "encode_hello", "encode_welcome", "encode_refuse", "encode_request", "encode_reply", "encode_failure",
    "decode", "peek_header", "act_name",
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
_KINDS = {KIND_HELLO, KIND_WELCOME, KIND_REFUSE, KIND_REQUEST, KIND_REPLY, KIND_FAILURE}

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

_HEADER = struct.Struct(">4sBBBB")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_REQ = struct.Struct(">IIIIH")
_REP = struct.Struct(">IIIH")
_PAIR = struct.Struct(">II")
_FAIL = struct.Struct(">IH")


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
    return _HEADER.pack(MAGIC, version, kind, act, 0)


def _check_version_act(version: int, act: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise LocalError(f"expert exchange version {version} is not one of {SUPPORTED_VERSIONS}")
    if act not in ACTS or (version == VERSION_COPIES and act != ACT_F32):
        raise LocalError(f"version {version} cannot carry {act_name(act)} rows")


def _text(value: str, bound: int) -> bytes:
    data = value.encode("utf-8")[:bound]
    return _U16.pack(len(data)) + data


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
        parts.append(_REQ.pack(req.request_id, req.layer, hidden, total, len(req.items)))
        parts += [_PAIR.pack(i.expert, len(i.index)) for i in req.items]
        parts += [_rows_payload(req.item_rows(i), ACT_F32) for i in req.items]
    else:
        parts.append(_REQ.pack(req.request_id, req.layer, hidden, rows, len(req.items)))
        for item in req.items:
            index = np.asarray(item.index)
            if not 1 <= index.size <= rows or int(index.max()) >= rows or int(index.min()) < 0:
                raise LocalError(f"item of expert {item.expert}: 1..{rows} indices below {rows}")
            parts += [_PAIR.pack(item.expert, index.size), index.astype(">u4").tobytes()]
        parts.append(_rows_payload(req.rows, req.act))
    body = b"".join(parts)
    if len(body) > MAX_EXCHANGE_FRAME_BYTES:
        raise LocalError(f"request of {len(body)} bytes > MAX_EXCHANGE_FRAME_BYTES; send fewer rows")
    return body


def encode_reply(req: Request, outputs: list[np.ndarray]) -> bytes:
    """The reply body to ``req``: ``outputs[i]`` are item i's rows (float32 [count_i, hidden])."""
    if len(outputs) != len(req.items):
        raise LocalError("one output per item")
    parts = [_header(req.version, KIND_REPLY, req.act), _REP.pack(req.request_id, req.layer, req.hidden,
                                                                  len(req.items))]
    payloads = []
    for item, out in zip(req.items, outputs):
        if out.shape != (len(item.index), req.hidden) or out.dtype != np.float32:
            raise LocalError(f"output of expert {item.expert} must be float32 [{len(item.index)}, {req.hidden}]")
        parts.append(_PAIR.pack(item.expert, len(item.index)))
        payloads.append(_rows_payload(out, req.act))
    return b"".join(parts + payloads)


def encode_failure(version: int, request_id: int, code: int, reason: str) -> bytes:
    return _header(version, KIND_FAILURE, ACT_F32) + _FAIL.pack(request_id, code) + _text(reason, MAX_REASON_BYTES)


# --------------------------------------------------------------------------- decoding


class _Cursor:
    """Bounded reads over one body: every read checks the bytes are there first."""

    __slots__ = ("data", "at")

    def __init__(self, data, at: int) -> None:
        self.data, self.at = data, at

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.data):
            raise PayloadCorrupt(f"truncated expert message: need {n} bytes at offset {self.at}, "
                                 f"have {len(self.data) - self.at}")
        view = memoryview(self.data)[self.at:self.at + n]
        self.at += n
        return view

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack(self.take(fmt.size))

    def text(self, bound: int) -> str:
        (n,) = self.unpack(_U16)
        if n > bound:
            raise LimitExceeded(f"text field of {n} bytes > {bound}")
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PayloadCorrupt("text field is not utf-8") from exc

    def end(self) -> None:
        if self.at != len(self.data):
            raise PayloadCorrupt(f"{len(self.data) - self.at} trailing bytes after the expert message")


def peek_header(body) -> tuple[int, int, int]:
    """(version, kind, act) of a body; refuses a wrong magic, an unknown kind or version."""
    if len(body) > MAX_EXCHANGE_FRAME_BYTES:
        raise LimitExceeded(f"expert message of {len(body)} bytes > {MAX_EXCHANGE_FRAME_BYTES}")
    if len(body) < _HEADER.size:
        raise PayloadCorrupt(f"expert message of {len(body)} bytes is shorter than its header")
    magic, version, kind, act, reserved = _HEADER.unpack_from(body, 0)
    if magic != MAGIC:
        raise PayloadCorrupt(f"not an expert exchange message (magic {bytes(magic)!r})")
    if kind not in _KINDS or reserved:
        raise ProtocolViolation(f"unknown expert message kind {kind} (reserved byte {reserved})")
    if kind != KIND_REFUSE:  # a refusal comes from a peer that may speak newer versions
        if version not in SUPPORTED_VERSIONS:
            raise VersionUnsupported(f"expert exchange version {version}; this node speaks {SUPPORTED_VERSIONS}")
        if kind not in (KIND_FAILURE,) and (act not in ACTS or (version == VERSION_COPIES and act != ACT_F32)):
            raise VersionUnsupported(f"activation format {act_name(act)} over version {version}")
    return version, kind, act


def _payload(cur: _Cursor, count: int, hidden: int, act: int) -> np.ndarray:
    n = count * hidden
    size = q8_encoded_size(n) if act == ACT_Q8 else 4 * n
    raw = cur.take(size)
    if act == ACT_Q8:
        return decode_q8(raw, n, np.dtype(np.float32)).reshape(count, hidden)
    return np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=False).reshape(count, hidden)


def _row_bytes(hidden: int, act: int, count: int) -> int:
    return q8_encoded_size(count * hidden) if act == ACT_Q8 else 4 * count * hidden


def _decode_request(cur: _Cursor, version: int, act: int) -> Request:
    request_id, layer, hidden, rows, n_items = cur.unpack(_REQ)
    if not 1 <= hidden <= MAX_HIDDEN:
        raise LimitExceeded(f"hidden size {hidden} outside 1..{MAX_HIDDEN}")
    if not 1 <= rows <= MAX_ROWS:
        raise LimitExceeded(f"{rows} rows outside 1..{MAX_ROWS}")
    if not 1 <= n_items <= MAX_ITEMS:
        raise LimitExceeded(f"{n_items} items outside 1..{MAX_ITEMS}")
    heads: list[tuple[int, int, np.ndarray | None]] = []
    seen: set[int] = set()
    total = 0
    for _ in range(n_items):
        expert, count = cur.unpack(_PAIR)
        if not (expert < MAX_EXPERTS_PER_LAYER or (expert == SHARED and version == VERSION_ROWS_ONCE)):
            raise ProtocolViolation(f"expert id {expert} outside 0..{MAX_EXPERTS_PER_LAYER - 1}")
        if expert in seen:
            raise ProtocolViolation(f"expert {expert} named twice in one request")
        seen.add(expert)
        if not 1 <= count <= rows:
            raise LimitExceeded(f"item of expert {expert} names {count} rows; 1..{rows} allowed")
        index = None
        if version == VERSION_ROWS_ONCE:
            index = np.frombuffer(cur.take(4 * count), dtype=">u4")
            if int(index.max()) >= rows:
                raise ProtocolViolation(f"item of expert {expert} names row {int(index.max())} of {rows}")
            index = index.astype(np.int64)
        total += count
        heads.append((expert, count, index))
    if version == VERSION_COPIES and total != rows:
        raise ProtocolViolation(f"a version 1 request carries {total} item rows but declares {rows}")
    if 64 + 8 * n_items + _row_bytes(hidden, act, total) > MAX_EXCHANGE_FRAME_BYTES:
        raise LimitExceeded(f"the reply to {total} routed rows of hidden {hidden} would not fit one frame")
    if version == VERSION_COPIES:
        copies = [_payload(cur, count, hidden, ACT_F32) for _, count, _ in heads]
        cur.end()
        rows_array = np.concatenate(copies) if len(copies) > 1 else copies[0]
        offsets = np.cumsum([0] + [c for _, c, _ in heads])
        items = tuple(Item(e, np.arange(offsets[i], offsets[i + 1])) for i, (e, _, _) in enumerate(heads))
    else:
        rows_array = _payload(cur, rows, hidden, act)
        cur.end()
        items = tuple(Item(e, index) for e, _, index in heads)
    return Request(version, act, request_id, layer, rows_array, items)


def _decode_reply(cur: _Cursor, version: int, act: int) -> Reply:
    request_id, layer, hidden, n_items = cur.unpack(_REP)
    if not 1 <= hidden <= MAX_HIDDEN or not 1 <= n_items <= MAX_ITEMS:
        raise LimitExceeded(f"reply of {n_items} items at hidden {hidden} is outside the bounds")
    heads = []
    for _ in range(n_items):
        expert, count = cur.unpack(_PAIR)
        if not 1 <= count <= MAX_ROWS:
            raise LimitExceeded(f"reply item of {count} rows outside 1..{MAX_ROWS}")
        heads.append((expert, count))
    outputs = tuple((expert, _payload(cur, count, hidden, act)) for expert, count in heads)
    cur.end()
    return Reply(version, act, request_id, layer, hidden, outputs)


def decode(body):
    """One body -> Hello | Welcome | Refuse | Request | Reply | Failure (bounded; ProtocolError on bad bytes)."""
    version, kind, act = peek_header(body)
    cur = _Cursor(body, _HEADER.size)
    if kind == KIND_HELLO:
        artifact, recipe = cur.text(MAX_DIGEST_BYTES), cur.text(MAX_DIGEST_BYTES)
        cur.end()
        return Hello(version, act, artifact, recipe)
    if kind == KIND_WELCOME:
        cur.end()
        return Welcome(version, act)
    if kind == KIND_REFUSE:
        (n,) = cur.unpack(struct.Struct(">B"))
        versions = tuple(cur.take(n))
        (m,) = cur.unpack(struct.Struct(">B"))
        acts = tuple(cur.take(m))
        reason = cur.text(MAX_REASON_BYTES)
        cur.end()
        return Refuse(versions, acts, reason)
    if kind == KIND_REQUEST:
        return _decode_request(cur, version, act)
    if kind == KIND_REPLY:
        return _decode_reply(cur, version, act)
    request_id, code = cur.unpack(_FAIL)
    reason = cur.text(MAX_REASON_BYTES)
    cur.end()
    return Failure(version, request_id, code, reason)
