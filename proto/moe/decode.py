"""Decoding of expert exchange bodies (proto/moe/wire.py has the layout and the bounds).

Every read goes through a bounded cursor that checks the bytes are there
first; counts and sizes are checked against the named limits of wire.py
before any array is built; the payload must end exactly where the
declarations say. Bad bytes raise ProtocolError subclasses only.
"""
from __future__ import annotations

import struct

import numpy as np

from proto.errors import LimitExceeded, PayloadCorrupt, ProtocolViolation, VersionUnsupported
from proto.moe.wire import (
    ACT_F32,
    ACT_Q8,
    ACTS,
    FAILURE_HEAD,
    HEADER,
    KIND_FAILURE,
    KIND_HELLO,
    KIND_REFUSE,
    KIND_REPLY,
    KIND_REQUEST,
    KIND_WELCOME,
    KINDS,
    MAGIC,
    MAX_DIGEST_BYTES,
    MAX_EXCHANGE_FRAME_BYTES,
    MAX_EXPERTS_PER_LAYER,
    MAX_HIDDEN,
    MAX_ITEMS,
    MAX_REASON_BYTES,
    MAX_ROWS,
    PAIR,
    REPLY_HEAD,
    REQUEST_HEAD,
    SHARED,
    SUPPORTED_VERSIONS,
    U16,
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
)
from proto.q8 import decode_q8, q8_encoded_size

__all__ = ["decode", "peek_header"]

_U8 = struct.Struct(">B")


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
        (n,) = self.unpack(U16)
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
    if len(body) < HEADER.size:
        raise PayloadCorrupt(f"expert message of {len(body)} bytes is shorter than its header")
    magic, version, kind, act, reserved = HEADER.unpack_from(body, 0)
    if magic != MAGIC:
        raise PayloadCorrupt(f"not an expert exchange message (magic {bytes(magic)!r})")
    if kind not in KINDS or reserved:
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
    request_id, layer, hidden, rows, n_items = cur.unpack(REQUEST_HEAD)
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
        expert, count = cur.unpack(PAIR)
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
        items = tuple(Item(e, index) for e, _, index in heads if index is not None)   # each has one (above)
    return Request(version, act, request_id, layer, rows_array, items)


def _decode_reply(cur: _Cursor, version: int, act: int) -> Reply:
    request_id, layer, hidden, n_items = cur.unpack(REPLY_HEAD)
    if not 1 <= hidden <= MAX_HIDDEN or not 1 <= n_items <= MAX_ITEMS:
        raise LimitExceeded(f"reply of {n_items} items at hidden {hidden} is outside the bounds")
    heads = []
    for _ in range(n_items):
        expert, count = cur.unpack(PAIR)
        if not 1 <= count <= MAX_ROWS:
            raise LimitExceeded(f"reply item of {count} rows outside 1..{MAX_ROWS}")
        heads.append((expert, count))
    outputs = tuple((expert, _payload(cur, count, hidden, act)) for expert, count in heads)
    cur.end()
    return Reply(version, act, request_id, layer, hidden, outputs)


def decode(body):
    """One body -> Hello | Welcome | Refuse | Request | Reply | Failure (bounded; ProtocolError on bad bytes)."""
    version, kind, act = peek_header(body)
    cur = _Cursor(body, HEADER.size)
    if kind == KIND_HELLO:
        artifact, recipe = cur.text(MAX_DIGEST_BYTES), cur.text(MAX_DIGEST_BYTES)
        cur.end()
        return Hello(version, act, artifact, recipe)
    if kind == KIND_WELCOME:
        cur.end()
        return Welcome(version, act)
    if kind == KIND_REFUSE:
        (n,) = cur.unpack(_U8)
        versions = tuple(cur.take(n))
        (m,) = cur.unpack(_U8)
        acts = tuple(cur.take(m))
        reason = cur.text(MAX_REASON_BYTES)
        cur.end()
        return Refuse(versions, acts, reason)
    if kind == KIND_REQUEST:
        return _decode_request(cur, version, act)
    if kind == KIND_REPLY:
        return _decode_reply(cur, version, act)
    request_id, code = cur.unpack(FAILURE_HEAD)
    reason = cur.text(MAX_REASON_BYTES)
    cur.end()
    return Failure(version, request_id, code, reason)
