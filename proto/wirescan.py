"""One bounded pass over a tensor-carrying message's wire bytes (pure Python).

Why: protobuf's parser allocates per element -- a 32 MiB frame of empty
fragments (2 bytes each) would become ~16 M message objects (~1 GB) before any
of our checks ran, and a packed shape of 32 M dims would be 256 MiB of int64.
So before protobuf sees a chunk or decode frame, ``scan`` walks the fields on
the paths that can repeat and refuses (LimitExceeded) more than MAX_WIRE_FIELDS
fields or an over-long shape. Control frames (no tensors) are simply bounded by
MAX_CONTROL_FRAME_BYTES in proto.frames.

The same pass serves proto.zerocopy: it returns the *skeleton* (the message
with fragment payloads removed, lengths recomputed), the payloads as
memoryviews of the input, and each tensor's declared values as a TensorHeader
when the tensor is canonically encoded (every field once, known fields only,
packed shape) -- so decoding needs no protobuf wrapper objects. A tensor that is
not canonical gets header None and is decoded from the protobuf message.

Paths walked (message kind: field -> child kind):
    request: chunk(2) -> CHUNK, decode(3) -> STEP      response: chunk(2), decode(6) -> RESULT
    CHUNK: bundle(2) -> BUNDLE   STEP: tensor(4) -> TENSOR   RESULT: bundle(5) -> BUNDLE
    BUNDLE: tensors(2) -> TENSOR   TENSOR: fields 1-7, 9 + fragments(8) -> FRAG
"""
from __future__ import annotations

from proto.decoding import TensorHeader
from proto.errors import LimitExceeded, PayloadCorrupt
from proto.limits import Limits
from proto.tensors import varint

__all__ = ["REQUEST", "RESPONSE", "MAX_WIRE_FIELDS", "scan", "top_level_field", "Scan"]

REQUEST, RESPONSE, _CHUNK, _STEP, _RESULT, _BUNDLE = range(6)
_DESCEND = {REQUEST: {2: _CHUNK, 3: _STEP}, RESPONSE: {2: _CHUNK, 6: _RESULT},
            _CHUNK: {2: _BUNDLE}, _STEP: {4: -1}, _RESULT: {5: _BUNDLE}, _BUNDLE: {2: -1}}
TENSOR_FIELDS = {REQUEST: frozenset({2, 3}), RESPONSE: frozenset({2, 6})}

# Fields a legitimate tensor frame has: 32 tensors x (64 fragments x 4 + 10) ~ 8.5 k.
MAX_WIRE_FIELDS = 16384
_MAX_VARINT_BYTES = 10
# NamedTensor field -> expected wire type (0 varint, 2 length-delimited)
_TENSOR_WIRE = {1: 2, 2: 2, 3: 0, 4: 0, 5: 0, 6: 0, 7: 2, 9: 0}
_INT32 = 1 << 31
_UINT32 = 1 << 32
_UINT64 = 1 << 64


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise PayloadCorrupt("truncated or overlong varint")


def top_level_field(data: bytes) -> tuple[int, int, int] | None:
    """(field number, wire type, end) of the first field, or None if data is empty."""
    if not data:
        return None
    key, pos = _varint(data, 0, len(data))
    if key & 7 == 2:
        length, body = _varint(data, pos, len(data))
        return key >> 3, 2, body + length
    return key >> 3, key & 7, -1


class Scan:
    """Result of one pass: skeleton pieces and, per tensor, (header or None, payload views)."""

    __slots__ = ("data", "view", "tensors", "fields", "max_rank_bytes", "skeleton")

    def __init__(self, data: bytes, limits: Limits) -> None:
        self.data = data
        self.view = memoryview(data)
        self.tensors: list[tuple[TensorHeader | None, list]] = []
        self.fields = 0
        self.max_rank_bytes = limits.max_rank * _MAX_VARINT_BYTES
        self.skeleton: list = []

    def _field(self, pos: int, end: int) -> tuple[int, int, int, int]:
        """(key, body start, field end, varint value or -1) of the field at pos.

        One- and two-byte varints (nearly all of them) are decoded inline.
        """
        self.fields += 1
        if self.fields > MAX_WIRE_FIELDS:
            raise LimitExceeded(f"more than {MAX_WIRE_FIELDS} fields in one frame")
        data = self.data
        key = data[pos]
        pos += 1
        if key >= 0x80:
            if pos < end and data[pos] < 0x80:
                key = (key & 0x7F) | (data[pos] << 7)
                pos += 1
            else:
                key, pos = _varint(data, pos - 1, end)
        if key < 8:
            raise PayloadCorrupt("field number 0")
        wire_type = key & 7
        if wire_type == 2:
            if pos >= end:
                raise PayloadCorrupt("truncated length")
            length = data[pos]
            pos += 1
            if length >= 0x80:
                if pos < end and data[pos] < 0x80:
                    length = (length & 0x7F) | (data[pos] << 7)
                    pos += 1
                else:
                    length, pos = _varint(data, pos - 1, end)
            stop = pos + length
            value = -1
        elif wire_type == 0:
            if pos >= end:
                raise PayloadCorrupt("truncated or overlong varint")
            value = data[pos]
            stop = pos + 1
            if value >= 0x80:
                value, stop = _varint(data, pos, end)
        elif wire_type == 1:
            stop, value = pos + 8, -1
        elif wire_type == 5:
            stop, value = pos + 4, -1
        else:
            raise PayloadCorrupt(f"unsupported wire type {wire_type}")
        if stop > end:
            raise PayloadCorrupt("field runs past the end of its message")
        return key, pos, stop, value

    def walk(self, kind: int, start: int, end: int) -> tuple[list[bytes | memoryview], int]:
        """Skeleton pieces of the message in data[start:end] and their total size."""
        view, size = self.view, 0
        pieces: list[bytes | memoryview] = []
        descend = _DESCEND[kind]
        seen_child = False
        run = pos = start
        while pos < end:
            field_start = pos
            key, body, pos, _ = self._field(pos, end)
            child = descend.get(key >> 3) if key & 7 == 2 else None
            if child is None:
                continue
            if kind == _STEP:
                if seen_child:
                    raise PayloadCorrupt("decode step carries its tensor twice")
                seen_child = True
            if run < field_start:
                pieces.append(view[run:field_start])
                size += field_start - run
            inner, inner_size = (self._tensor(body, pos) if child < 0
                                 else self.walk(child, body, pos))
            head = varint(key) + varint(inner_size)
            pieces.append(head)
            pieces.extend(inner)
            size += len(head) + inner_size
            run = pos
        if run < end:
            pieces.append(view[run:end])
            size += end - run
        return pieces, size

    def _tensor(self, start: int, end: int) -> tuple[list[bytes | memoryview], int]:
        """A NamedTensor: skeleton pieces; records (header or None, payload views)."""
        view, size = self.view, 0
        pieces: list[bytes | memoryview] = []
        values: dict[int, object] = {}
        canonical = True
        frags: list[tuple[int, int, int]] = []
        views: list = []
        run = pos = start
        while pos < end:
            field_start = pos
            key, body, pos, value = self._field(pos, end)
            field, wire_type = key >> 3, key & 7
            if field == 8 and wire_type == 2:
                if run < field_start:
                    pieces.append(view[run:field_start])
                    size += field_start - run
                frag, payload, ok = self._fragment(body, pos)
                canonical &= ok
                frags.append(frag)
                views.append(payload)
                head = b"\x42" + varint(len(frag[3]))
                pieces.append(head)
                pieces.append(frag[3])
                size += len(head) + len(frag[3])
                run = pos
                continue
            if field == 2 and wire_type == 2 and pos - body > self.max_rank_bytes:
                raise LimitExceeded("tensor shape longer than the rank limit allows")
            if field in values or _TENSOR_WIRE.get(field) != wire_type:
                canonical = False
            values[field] = value if wire_type == 0 else (body, pos)
        if run < end:
            pieces.append(view[run:end])
            size += end - run
        header = self._header(values, frags) if canonical else None
        self.tensors.append((header, views))
        return pieces, size

    def _fragment(self, start: int, end: int):
        """((index, count, offset, skeleton bytes), payload view, canonical)."""
        data, view = self.data, self.view
        index = count = offset = 0
        seen = 0
        payload = view[0:0]
        kept = []
        pos = start
        ok = True
        while pos < end:
            field_start = pos
            key, body, pos, value = self._field(pos, end)
            field, wire_type = key >> 3, key & 7
            bit = 1 << field if field < 8 else 0
            if not bit or seen & bit:
                ok = False
            seen |= bit
            if field == 4 and wire_type == 2:
                payload = view[body:pos]
                continue
            kept.append(data[field_start:pos])
            if wire_type != (2 if field == 4 else 0) or field > 4:
                ok = False
            elif field == 1:
                index = value
            elif field == 2:
                count = value
            elif field == 3:
                offset = value
        if index >= _UINT32 or count >= _UINT32 or offset >= _UINT64:
            ok = False
        return (index, count, offset, b"".join(kept)), payload, ok

    def _header(self, values: dict, frags: list) -> TensorHeader | None:
        """Declared values of a canonical tensor (None if a value needs protobuf's rules)."""
        data = self.data
        enums = [values.get(f, 0) for f in (3, 4, 6, 9)]
        total = values.get(5, 0)
        if any(v >= _INT32 for v in enums) or total >= _UINT64:
            return None
        name = b""
        if 1 in values:
            a, b = values[1]
            name = data[a:b]
        shape: list[int] = []
        if 2 in values:
            pos, end = values[2]
            while pos < end:
                d, pos = _varint(data, pos, end)
                if d >= _UINT64:
                    return None
                shape.append(d - _UINT64 if d >= 1 << 63 else d)
        algorithm, checksum = 0, b""
        if 7 in values:
            pos, end = values[7]
            seen = set()
            while pos < end:
                key, body, pos, value = self._field(pos, end)
                field = key >> 3
                if field in seen or key not in (0x08, 0x12):
                    return None
                seen.add(field)
                if field == 1:
                    if value >= _INT32:
                        return None
                    algorithm = value
                else:
                    checksum = data[body:pos]
        return TensorHeader(name.decode("utf-8", "replace"), tuple(shape), enums[0], enums[1],
                            total, enums[2], algorithm, checksum, enums[3],
                            [(i, c, o) for i, c, o, _ in frags])


def scan(data: bytes, top: int, limits: Limits) -> Scan:
    """Walk a tensor-carrying frame once (bounded); see the module docstring."""
    result = Scan(data, limits)
    result.skeleton, _ = result.walk(top, 0, len(data))
    return result
