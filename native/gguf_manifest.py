"""GGUF manifests: a file's or a slice's Merkle root, verified; what a layer range needs; slice plans.

Data flow::

    whole file  --build_manifest (one read: whole-file SHA-256 + chunk leaves)--> Manifest
    slice       --its meshd.slice.manifest pair, checked against its own bytes--> Manifest
    Manifest + metadata blob --virtual_reader--> GGUFFile with no bytes (model facts, sizes)
    (native/slice.py plans a range's slice from the manifest and the metadata pairs)

The manifest of a GGUF (shard/model/manifest.py) has one BLOB, ``gguf:metadata``
(the canonical metadata pairs: native/gguf_write.py), then one TENSOR per
tensor in the file's order (name, ggml type, GGUF shape, bytes). Padding and
the header's layout are not content: a slice of the model has another layout
and the same root.

A slice (``meshd slice`` or a fetch) carries its source's manifest in the
``meshd.slice.manifest`` pair. ``file_manifest`` trusts it only after checking
the slice's own bytes against it: its metadata pairs give the manifest's
metadata blob, and every tensor it holds has the entry's type, shape and
chunk hashes. A slice that fails is an ArtifactError; nothing of it is loaded.

State: none of its own; both checks cost one read of the file and are cached on
disk per file (shard/model/digests.py ``cached_blob``: keyed by path, size,
mtime_ns, inode), so a restart or a worker respawn never rereads an unchanged
file; an in-process memo spares repeated decoding.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np

from native.errors import ArtifactError
from native.gguf_file import GGUFField, GGUFFile, GGUFTensor, VType, parse_fields
from native.gguf_write import canonical_metadata
from proto.errors import ProtocolError
from shard.model import digests
from shard.model.backend import LayerRange
from shard.model.manifest import BLOB, CHUNK_BYTES, KIND_GGUF, TENSOR, Entry, EntryHasher, FileInfo, Manifest

__all__ = ["METADATA_ENTRY", "MANIFEST_KEY", "file_manifest", "build_manifest", "virtual_reader", "range_names",
           "metadata_of", "check_slice", "embedded_manifest"]

METADATA_ENTRY = "gguf:metadata"
MANIFEST_KEY = "meshd.slice.manifest"
# The manifest names a GGUF's one file by this, not by its file name: renaming a file
# must not change the model's id.
FILE_NAME = "model.gguf"
# Cache schemes (bump when what is cached changes meaning).
WHOLE_SCHEME = "gguf-manifest-v1"
SLICE_SCHEME = "gguf-slice-checked-v1"
# One read of the file feeds both hashes; 8 MiB keeps Python's overhead invisible.
READ_BYTES = 8 << 20
# Progress lines for files above this size, at most one per interval.
PROGRESS_MIN_BYTES = 64 << 20
PROGRESS_INTERVAL_S = 1.0
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_MEMO_MAX = 32
_memo: dict[tuple, Manifest] = {}

Progress = digests.Progress


def _spans(reader: GGUFFile) -> list[tuple[int, int, int]]:
    """(start, end, tensor index) of every tensor's bytes, in file order."""
    return sorted((t.offset, t.offset + t.n_bytes, i) for i, t in enumerate(reader.tensors))


def _hash_pass(reader: GGUFFile, chunk_bytes: int, progress: Progress) -> tuple[bytes, list[tuple[bytes, ...]]]:
    """One sequential read of the file: its SHA-256 and every tensor's chunk leaves."""
    whole = hashlib.sha256()
    hashers = [EntryHasher(chunk_bytes) for _ in reader.tensors]
    spans = _spans(reader)
    view = reader.bytes_of(0, reader.size)
    size, pos, k = reader.size, 0, 0
    report = size >= PROGRESS_MIN_BYTES
    started = last = time.monotonic()
    while pos < size:
        end = min(size, pos + READ_BYTES)
        block = view[pos:end]
        whole.update(block)
        while k < len(spans) and spans[k][1] <= pos:
            k += 1
        j = k
        while j < len(spans) and spans[j][0] < end:
            s, e, index = spans[j]
            lo, hi = max(s, pos), min(e, end)
            if lo < hi:
                hashers[index].update(view[lo:hi])
            j += 1
        pos = end
        if report and time.monotonic() - last >= PROGRESS_INTERVAL_S:
            last = time.monotonic()
            digests.emit(progress, f"[meshd] hashing {reader.path.name}: {pos / 1e6:.0f} of {size / 1e6:.0f} MB "
                         f"({pos * 100 // size}%)")
    if report:
        digests.emit(progress, f"[meshd] hashed {reader.path.name}: {size / 1e6:.0f} MB in "
                     f"{time.monotonic() - started:.1f} s (its model root; cached until the file changes)")
    return whole.digest(), [h.finish() for h in hashers]


def _tensor_entry(t: GGUFTensor, chunks: tuple[bytes, ...]) -> Entry:
    return Entry(TENSOR, t.name, 0, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.n_bytes), chunks)


def build_manifest(reader: GGUFFile, *, chunk_bytes: int = CHUNK_BYTES, progress: Progress = None) -> Manifest:
    """The manifest of a whole GGUF file (reads every byte once)."""
    if reader.get_field(MANIFEST_KEY) is not None:
        raise ArtifactError(f"{reader.path.name} is a slice: its manifest is the one it carries")
    sha, leaves = _hash_pass(reader, chunk_bytes, progress)
    meta = EntryHasher(chunk_bytes)
    meta.update(canonical_metadata(reader.fields.values()))
    entries = [Entry(BLOB, METADATA_ENTRY, 0, "", (), meta.size, meta.finish())]
    entries += [_tensor_entry(t, leaves[i]) for i, t in enumerate(reader.tensors)]
    return Manifest(KIND_GGUF, chunk_bytes, (FileInfo(FILE_NAME, reader.size, sha),), tuple(entries))


def embedded_manifest(reader: GGUFFile) -> Manifest:
    """The manifest a slice carries, parsed but not yet checked against the slice's bytes."""
    field = reader.get_field(MANIFEST_KEY)
    if field is None:
        raise ArtifactError(f"{reader.path.name} is a slice written before model roots (it carries no "
                            f"{MANIFEST_KEY}); re-create it with meshd slice from the whole file")
    if field.vtype != VType.ARRAY or field.sub_type != VType.UINT8:
        raise ArtifactError(f"{reader.path.name}: {MANIFEST_KEY} is not a byte array; the slice is corrupt")
    try:
        manifest = Manifest.decode(np.asarray(field.value, dtype=np.uint8).tobytes())
    except ProtocolError as exc:
        raise ArtifactError(f"{reader.path.name}: its manifest does not parse ({exc}); the slice is corrupt") from None
    if manifest.kind != KIND_GGUF:
        raise ArtifactError(f"{reader.path.name} carries a manifest of another kind of artifact")
    return manifest


def check_slice(reader: GGUFFile, manifest: Manifest, progress: Progress = None) -> None:
    """ArtifactError unless every byte the slice holds is what ``manifest`` says (see the docstring)."""
    name = reader.path.name
    meta = canonical_metadata(reader.fields.values())
    if not manifest.has(METADATA_ENTRY):
        raise ArtifactError(f"{name}: its manifest has no {METADATA_ENTRY} entry")
    m = manifest.index(METADATA_ENTRY)
    hasher = EntryHasher(manifest.chunk_bytes)
    hasher.update(meta)
    if hasher.size != manifest.entries[m].size or hasher.finish() != manifest.entries[m].chunks:
        raise ArtifactError(f"{name}: its metadata is not the metadata of the model its manifest names; "
                            "the slice is corrupt or was edited")
    total = sum(t.n_bytes for t in reader.tensors)
    done, last = 0, time.monotonic()
    view = reader.bytes_of(0, reader.size)
    for t in reader.tensors:
        if not manifest.has(t.name):
            raise ArtifactError(f"{name}: tensor {t.name} is not part of the model its manifest names")
        i = manifest.index(t.name)
        e = manifest.entries[i]
        if (e.kind, e.dtype, e.shape, e.size) != (TENSOR, t.tensor_type.name, tuple(t.shape), t.n_bytes):
            raise ArtifactError(f"{name}: tensor {t.name} is {t.tensor_type.name} {t.shape}, its manifest says "
                                f"{e.dtype} {e.shape}; the slice is corrupt")
        for c in range(len(e.chunks)):
            off, length = manifest.chunk_span(i, c)
            if not manifest.chunk_ok(i, c, view[t.offset + off:t.offset + off + length]):
                raise ArtifactError(f"{name}: chunk {c} of tensor {t.name} does not match the model's root "
                                    f"{manifest.root[:23]}...; the slice is corrupt, fetch or re-create it")
        done += t.n_bytes
        if total >= PROGRESS_MIN_BYTES and time.monotonic() - last >= PROGRESS_INTERVAL_S:
            last = time.monotonic()
            digests.emit(progress, f"[meshd] checking {name} against its root: {done * 100 // total}%")


def file_manifest(path: str | os.PathLike[str], reader: GGUFFile | None = None, progress: Progress = None) -> Manifest:
    """The manifest of a GGUF file (whole: built; slice: its own, checked), cached per file."""
    path = Path(path).resolve()
    key = digests.file_key(path)
    memo = _memo.get((str(path), key))
    if memo is not None:
        return memo
    reader = reader or GGUFFile.open(path)
    if reader.get_field(MANIFEST_KEY) is None:
        raw = digests.cached_blob(WHOLE_SCHEME, [path], lambda: build_manifest(reader, progress=progress).encode())
        try:
            manifest = Manifest.decode(raw)
        except ProtocolError:   # a damaged cache entry: build it again (and let the cache keep the new one)
            manifest = build_manifest(reader, progress=progress)
    else:
        manifest = embedded_manifest(reader)

        def checked() -> bytes:
            check_slice(reader, manifest, progress)
            return manifest.root.encode()

        if digests.cached_blob(SLICE_SCHEME, [path], checked) != manifest.root.encode():
            check_slice(reader, manifest, progress)   # a cache entry for other bytes: check these
    if len(_memo) >= _MEMO_MAX:
        _memo.pop(next(iter(_memo)))
    _memo[(str(path), key)] = manifest
    return manifest


def metadata_of(manifest: Manifest, blob: bytes) -> dict[str, GGUFField]:
    """The metadata pairs of the model, from its metadata blob checked against the manifest."""
    i = manifest.index(METADATA_ENTRY)
    hasher = EntryHasher(manifest.chunk_bytes)
    hasher.update(blob)
    if hasher.size != manifest.entries[i].size or hasher.finish() != manifest.entries[i].chunks:
        raise ArtifactError("the metadata blob does not match the manifest")
    return parse_fields(blob)


def virtual_reader(manifest: Manifest, fields: dict[str, GGUFField], name: str = "(manifest)") -> GGUFFile:
    """A GGUFFile of the whole model with no bytes behind it: ``model_info``, ``size_table`` and the
    footprint read it as they read a file; ``tensor.data`` is not available."""
    tensors = []
    for e in manifest.entries:
        if e.kind != TENSOR:
            continue
        try:
            qtype = gguf.GGMLQuantizationType[e.dtype]
        except KeyError:
            raise ArtifactError(f"tensor {e.name} has unknown ggml type {e.dtype!r}") from None
        tensors.append(GGUFTensor(e.name, tuple(e.shape), qtype, 0, e.size, None))
    alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else 32
    return GGUFFile(Path(name), None, 0, 3, dict(fields), tuple(tensors), 0, alignment)


def range_names(names: Iterable[str], layer_range: LayerRange) -> list[str]:
    """The tensors of the model (``names``, in file order) that ``layer_range`` needs: its blocks,
    ``token_embd`` at the head, ``output_norm`` and ``output`` -- or, tied, ``token_embd`` -- at
    the tail (the rule gguf_range.read_range applies to a file)."""
    names = list(names)
    present = set(names)
    want: set[str] = set()
    if layer_range.is_head:
        want.add("token_embd.weight")
    if layer_range.is_tail:
        want.add("output_norm.weight")
        want.add("output.weight" if "output.weight" in present else "token_embd.weight")
    out = []
    for n in names:
        m = _BLOCK.match(n)
        if (m is not None and layer_range.start <= int(m.group(1)) < layer_range.end) or n in want:
            out.append(n)
    return out
