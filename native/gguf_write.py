"""GGUF bytes written by us: metadata pairs, the canonical metadata blob, a file's layout.

Why not ``gguf.GGUFWriter``: a slice fetched from peers is written piece by
piece -- its header first, then each verified chunk at its final offset, in
any order and across restarts -- so the header and every tensor's offset
must be known before any tensor byte exists. ``plan_layout`` computes both
from the metadata pairs and the tensor table alone; ``meshd slice`` uses the
same layout (copying from the source's memory map), so a slice is the same
file however it was made.

The canonical metadata blob is what a model manifest hashes as the GGUF's
metadata (shard/model/manifest.py): the metadata pairs, sorted by key,
without the ``meshd.slice.*`` keys a slice adds, in GGUF's own encoding
behind a u64 count. A whole file and every slice of it give the same bytes
(a slice copies every pair with its type), and ``gguf_file.parse_fields``
reads them back with the bounded reader's checks.

Layout (GGUF v3, little-endian)::

    "GGUF" | u32 3 | u64 n_tensors | u64 n_kv | pairs | tensor infos | pad to alignment
    tensor data, each tensor at an aligned offset, padded to the alignment
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import gguf
import numpy as np

from native.errors import ArtifactError
from native.gguf_file import ARRAY_DTYPES, DEFAULT_ALIGNMENT, SCALAR_FORMATS, GGUFField, VType

__all__ = ["TensorSpec", "Layout", "encode_pairs", "canonical_metadata", "plan_layout", "RESERVED_PREFIX",
           "GGUF_VERSION"]

GGUF_VERSION = 3
# Keys a slice adds to its source's metadata; never part of the model's canonical metadata.
RESERVED_PREFIX = "meshd.slice."


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: VType, value, sub_type: VType | None) -> bytes:
    if vtype in SCALAR_FORMATS:
        return struct.pack(SCALAR_FORMATS[vtype][0], value)
    if vtype == VType.STRING:
        return _string(value)
    if vtype != VType.ARRAY or sub_type is None or sub_type == VType.ARRAY:
        raise ArtifactError(f"cannot encode a GGUF value of type {vtype!r}/{sub_type!r}")
    head = struct.pack("<IQ", int(sub_type), len(value))
    if sub_type == VType.STRING:
        return head + b"".join(_string(v) for v in value)
    return head + np.asarray(value, dtype=np.dtype(ARRAY_DTYPES[sub_type]).newbyteorder("<")).tobytes()


def encode_pairs(fields: Iterable[GGUFField]) -> bytes:
    """GGUF's encoding of metadata pairs, in the given order (no count)."""
    return b"".join(_string(f.name) + struct.pack("<I", int(f.vtype)) + _value(f.vtype, f.value, f.sub_type)
                    for f in fields)


def canonical_metadata(fields: Iterable[GGUFField]) -> bytes:
    """u64 count + the pairs sorted by key, the ``meshd.slice.*`` keys left out."""
    kept = sorted((f for f in fields if not f.name.startswith(RESERVED_PREFIX)), key=lambda f: f.name)
    return struct.pack("<Q", len(kept)) + encode_pairs(kept)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]                 # GGUF order: ne0 first
    qtype: gguf.GGMLQuantizationType
    n_bytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where everything of a GGUF file goes: its header bytes and each tensor's absolute offset."""

    header: bytes
    data_offset: int
    offsets: dict[str, int]
    size: int


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_layout(fields: Sequence[GGUFField], tensors: Sequence[TensorSpec]) -> Layout:
    """The header of a file with these pairs and tensors (in this order), and the offsets.

    The alignment is the pairs' ``general.alignment`` when present (GGUF's rule), else 32."""
    alignment = DEFAULT_ALIGNMENT
    for f in fields:
        if f.name == "general.alignment":
            alignment = int(f.value)
    infos, relative, cursor = [], {}, 0
    for t in tensors:
        infos.append(_string(t.name) + struct.pack("<I", len(t.shape))
                     + b"".join(struct.pack("<Q", d) for d in t.shape)
                     + struct.pack("<IQ", int(t.qtype), cursor))
        relative[t.name] = cursor
        cursor += _pad(t.n_bytes, alignment)
    header = (b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(fields)) + encode_pairs(fields)
              + b"".join(infos))
    data_offset = _pad(len(header), alignment)
    header += b"\0" * (data_offset - len(header))
    return Layout(header, data_offset, {n: data_offset + o for n, o in relative.items()}, data_offset + cursor)
