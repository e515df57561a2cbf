"""A bounded GGUF reader: every count, length and offset is checked before it is used.

Data flow: ``GGUFFile.open(path)`` memory-maps the file read-only and walks
the header once (``_Cursor`` over the map; nothing is read twice)::

    magic "GGUF" | version u32 (2, 3) | tensor_count u64 | kv_count u64
    kv_count x   key string | value type u32 | value (scalar, string, or
                 array: element type u32 | count u64 | elements)
    tensor_count x  name string | n_dims u32 | dims u64 x n_dims | type u32 | offset u64
    padding to general.alignment (default 32) | tensor data

Each step checks, *before* allocating or slicing: that the bytes it needs
are inside the file, that a count times the smallest element size fits in
what is left (a "2^60 tokens" header fails at once, not after a huge loop),
and the named limits below. Tensor infos are checked against the file as a
whole: known ggml type, 1..4 dims, a row a whole number of quant blocks,
offset aligned, data inside the file, no two tensors overlapping, names
unique. Any violation is one ``GGUFFormatError`` (an ``ArtifactError``)
naming the byte offset and what was wrong; nothing else escapes.

Numeric arrays are numpy views into the map (zero copy); strings are decoded
(strict UTF-8). Tensor ``data`` is a view built on first access, shaped as
``gguf.GGUFReader`` shapes it (typed for F32/F16/F64/I8..I64, raw bytes
``[..., row_bytes]`` for block types incl. BF16), so gguf's writer and
dequantizer take it as they take the library reader's. Arrays are read as
arrays, not element by element as gguf.GGUFReader does, so a header with a
large vocabulary parses in a fraction of a second instead of many seconds
(docs/measurements/2026-12-01.md).

State: the memory map, alive as long as the ``GGUFFile`` or a tensor view.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from native.errors import ArtifactError

__all__ = ["GGUFFile", "GGUFField", "GGUFTensor", "GGUFFormatError", "VType", "parse_fields", "SCALAR_FORMATS",
           "ARRAY_DTYPES"]

VType = gguf.GGUFValueType

# Header versions we parse: 1 used 32-bit counts and is long gone.
SUPPORTED_VERSIONS = (2, 3)
# Real models have a few hundred to a few thousand tensors (MoE files with
# split experts ~ 20k); 1M leaves room and still bounds a lying header.
MAX_TENSORS = 1 << 20
# Metadata pairs: real files have 20-60.
MAX_KV = 1 << 16
# A key or tensor name: llama.cpp's GGML_MAX_NAME is 64 bytes with its NUL.
MAX_KEY_BYTES = 1 << 16
MAX_TENSOR_NAME_BYTES = 63
# One string value (chat templates run to tens of KiB).
MAX_STRING_BYTES = 1 << 24
# Elements of one array (vocabularies: 262k tokens, ~500k merges).
MAX_ARRAY_LEN = 1 << 24
# ggml's GGML_MAX_DIMS.
MAX_DIMS = 4
# One dimension, and the elements of one tensor: beyond any real model, small
# enough that byte counts stay exact in int64.
MAX_DIM = 1 << 40
MAX_TENSOR_ELEMENTS = 1 << 44
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 16

# The scalar value types' struct formats and widths, and the arrays' numpy dtypes (shared with
# native/gguf_write.py, which writes what this reads).
SCALAR_FORMATS: dict[VType, tuple[str, int]] = {
    VType.UINT8: ("<B", 1), VType.INT8: ("<b", 1), VType.UINT16: ("<H", 2), VType.INT16: ("<h", 2),
    VType.UINT32: ("<I", 4), VType.INT32: ("<i", 4), VType.FLOAT32: ("<f", 4), VType.BOOL: ("<?", 1),
    VType.UINT64: ("<Q", 8), VType.INT64: ("<q", 8), VType.FLOAT64: ("<d", 8),
}
ARRAY_DTYPES = {VType.UINT8: np.uint8, VType.INT8: np.int8, VType.UINT16: np.uint16, VType.INT16: np.int16,
                VType.UINT32: np.uint32, VType.INT32: np.int32, VType.FLOAT32: np.float32, VType.BOOL: np.bool_,
                VType.UINT64: np.uint64, VType.INT64: np.int64, VType.FLOAT64: np.float64}
# Tensor types stored as typed arrays (everything else: raw blocks of bytes).
_TYPED = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ArtifactError):
    """The file is not a well-formed GGUF (truncated, corrupt, or lying about sizes)."""


@dataclass(frozen=True, slots=True)
class GGUFField:
    """One metadata pair. ``value``: a Python scalar, a str, a numpy array or a list of str."""

    name: str
    vtype: VType
    value: Any
    sub_type: VType | None = None  # element type of an ARRAY

    def contents(self) -> Any:
        """The value as plain Python (arrays as lists), like ``gguf.ReaderField.contents``."""
        if isinstance(self.value, np.ndarray):
            return self.value.tolist()
        return self.value

    @property
    def types(self) -> list[VType]:
        return [self.vtype] + ([self.sub_type] if self.sub_type is not None else [])


@dataclass(frozen=True, slots=True, eq=False)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]          # GGUF order: ne0 (the row length) first
    tensor_type: gguf.GGMLQuantizationType
    offset: int                     # absolute byte offset in the file
    n_bytes: int
    _map: Any = field(repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def data(self) -> np.ndarray:
        """A read-only numpy view of the stored data (see the module docstring for its shape)."""
        view = self._cache.get("data")
        if view is None:
            raw = np.frombuffer(self._map, dtype=np.uint8, count=self.n_bytes, offset=self.offset)
            dims = tuple(reversed(self.shape))
            typed = _TYPED.get(self.tensor_type)
            if typed is not None:
                view = raw.view(typed).reshape(dims)
            else:
                block, size = gguf.GGML_QUANT_SIZES[self.tensor_type]
                view = raw.reshape(*dims[:-1], dims[-1] // block * size)
            self._cache["data"] = view
        return view


class _Cursor:
    """Reads from the map at ``pos``; every read checks the bytes exist first."""

    __slots__ = ("buf", "pos", "size")

    def __init__(self, buf, size: int) -> None:
        self.buf, self.pos, self.size = buf, 0, size

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"malformed GGUF at byte {self.pos}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes, {self.size - self.pos} left (truncated?)")

    def scalar(self, fmt: str, n: int, what: str):
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        n = self.u64(f"{what} length")
        if n > limit:
            raise self.fail(f"{what} of {n} bytes exceeds the limit of {limit}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8") from exc

    def vtype(self, what: str) -> VType:
        raw = self.u32(what)
        try:
            return VType(raw)
        except ValueError:
            raise self.fail(f"{what} {raw} is not a GGUF value type") from None

    def value(self, vtype: VType, what: str) -> tuple[Any, VType | None]:
        if vtype in SCALAR_FORMATS:
            return self.scalar(*SCALAR_FORMATS[vtype], what), None
        if vtype == VType.STRING:
            return self.string(what), None
        sub = self.vtype(f"{what} element type")
        count = self.u64(f"{what} element count")
        if count > MAX_ARRAY_LEN:
            raise self.fail(f"{what} has {count} elements; the limit is {MAX_ARRAY_LEN}")
        if sub == VType.ARRAY:
            raise self.fail(f"{what} is an array of arrays (not used by GGUF models)")
        if sub == VType.STRING:
            self.need(count * 8, f"{what} ({count} strings)")  # each at least its length field
            return [self.string(f"{what}[{i}]") for i in range(count)], sub
        fmt, width = SCALAR_FORMATS[sub]
        self.need(count * width, f"{what} ({count} x {width} bytes)")
        arr = np.frombuffer(self.buf, dtype=np.dtype(ARRAY_DTYPES[sub]).newbyteorder("<"), count=count, offset=self.pos)
        self.pos += count * width
        return arr, sub


def _pairs(cur: _Cursor, n_kv: int) -> dict[str, GGUFField]:
    fields: dict[str, GGUFField] = {}
    for index in range(n_kv):
        key = cur.string(f"key {index}", MAX_KEY_BYTES)
        if key in fields:
            raise cur.fail(f"metadata key {key!r} appears twice")
        vtype = cur.vtype(f"type of {key!r}")
        value, sub = cur.value(vtype, repr(key))
        fields[key] = GGUFField(key, vtype, value, sub)
    return fields


def parse_fields(data: bytes) -> dict[str, GGUFField]:
    """Metadata pairs on their own (a u64 count, then the pairs, nothing after): a manifest's
    canonical metadata blob (native/gguf_write.py), with the same checks as a file's header."""
    cur = _Cursor(data, len(data))
    n_kv = cur.u64("metadata count")
    if n_kv > MAX_KV:
        raise cur.fail(f"{n_kv} metadata pairs exceed the limit of {MAX_KV}")
    fields = _pairs(cur, n_kv)
    if cur.pos != len(data):
        raise cur.fail(f"{len(data) - cur.pos} bytes after the metadata pairs")
    return fields


def _row_bytes(cur: _Cursor, name: str, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[0] % block:
        raise cur.fail(f"tensor {name}: row of {shape[0]} is not a multiple of {qtype.name}'s block of {block}")
    return shape[0] // block * size


class GGUFFile:
    """A parsed, validated GGUF file (see the module docstring)."""

    def __init__(self, path: Path, buf, size: int, version: int, fields: dict[str, GGUFField],
                 tensors: tuple[GGUFTensor, ...], data_offset: int, alignment: int) -> None:
        self.path, self._buf, self.size, self.version = path, buf, size, version
        self.fields, self.tensors = fields, tensors
        self.data_offset, self.alignment = data_offset, alignment

    def bytes_of(self, offset: int, n_bytes: int) -> memoryview:
        """``n_bytes`` of the file from ``offset`` (a view of the map, no copy)."""
        if self._buf is None or not 0 <= offset <= offset + n_bytes <= self.size:
            raise ArtifactError(f"{self.path.name}: bytes [{offset}, {offset + n_bytes}) are not in the file")
        return memoryview(self._buf)[offset:offset + n_bytes]

    def get_field(self, key: str) -> GGUFField | None:
        return self.fields.get(key)

    def value(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.contents()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"{path}: no such GGUF file")
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 24:
                raise GGUFFormatError(f"{path.name} has {size} bytes: too short for a GGUF header; the file "
                                      "is truncated or corrupt, re-create or re-download it")
            buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return cls.parse(path, buf, size)
        except GGUFFormatError as exc:
            raise GGUFFormatError(f"{path.name} ({size} bytes): {exc}; the file is truncated or corrupt, "
                                  "re-create or re-download it") from None

    @classmethod
    def parse(cls, path: Path, buf, size: int) -> GGUFFile:
        cur = _Cursor(buf, size)
        cur.need(4, "magic")
        if bytes(buf[0:4]) != b"GGUF":
            raise cur.fail(f"magic {bytes(buf[0:4])!r} is not b'GGUF' (not a GGUF file)")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            raise cur.fail(f"GGUF version {version} is not supported ({SUPPORTED_VERSIONS})")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise cur.fail(f"{n_tensors} tensors / {n_kv} metadata pairs exceed the limits "
                           f"({MAX_TENSORS} / {MAX_KV})")
        fields = _pairs(cur, n_kv)
        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in fields:
            a = fields["general.alignment"]
            alignment = a.value if a.vtype == VType.UINT32 else 0
            if not 1 <= alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
                raise cur.fail(f"general.alignment {a.value!r} is not a u32 power of two <= {MAX_ALIGNMENT}")
        infos = []
        names: set[str] = set()
        for index in range(n_tensors):
            name = cur.string(f"tensor {index} name", MAX_TENSOR_NAME_BYTES)
            if name in names:
                raise cur.fail(f"tensor {name!r} appears twice")
            names.add(name)
            n_dims = cur.u32(f"tensor {name} dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(f"tensor {name} has {n_dims} dims (1..{MAX_DIMS})")
            shape = tuple(cur.u64(f"tensor {name} dim") for _ in range(n_dims))
            if any(not 1 <= d <= MAX_DIM for d in shape):
                raise cur.fail(f"tensor {name} has a dimension outside 1..{MAX_DIM}: {shape}")
            elements = 1
            for d in shape:
                elements *= d
            if elements > MAX_TENSOR_ELEMENTS:
                raise cur.fail(f"tensor {name} has {elements} elements (limit {MAX_TENSOR_ELEMENTS})")
            raw_type = cur.u32(f"tensor {name} type")
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
                gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise cur.fail(f"tensor {name} has unknown ggml type {raw_type}") from None
            offset = cur.u64(f"tensor {name} offset")
            n_bytes = _row_bytes(cur, name, qtype, shape) * (elements // shape[0])
            infos.append((name, shape, qtype, offset, n_bytes))
        data_offset = -(-cur.pos // alignment) * alignment
        tensors = []
        spans = []
        for name, shape, qtype, offset, n_bytes in infos:
            if offset % alignment:
                raise cur.fail(f"tensor {name}: offset {offset} is not aligned to {alignment}")
            start = data_offset + offset
            if start + n_bytes > size:
                raise cur.fail(f"tensor {name}: data [{start}, {start + n_bytes}) lies beyond the end "
                               f"of the file ({size} bytes)")
            spans.append((start, start + n_bytes, name))
            tensors.append(GGUFTensor(name, shape, qtype, start, n_bytes, buf))
        spans.sort()
        for (_, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise cur.fail(f"tensors {an} and {bn} overlap")
        return cls(path, buf, size, version, fields, tuple(tensors), data_offset, alignment)
