"""Safetensors directory manifests: a model directory's root, a range's tensors, partial directories.

Data flow::

    whole directory   --build_manifest (one read per file)--> Manifest
    partial directory --its meshd-manifest.bin, checked against its files--> Manifest
    Manifest + config.json + range --range_names--> the tensors a range needs
    Manifest + names --plan_partial--> per safetensors file: header bytes + tensor offsets

A directory's manifest (shard/model/manifest.py, kind SAFETENSORS) lists every
file of the directory (sorted relative paths, size, whole-file SHA-256), one
BLOB per file that is not a ``.safetensors`` (config.json, tokenizer files:
every node gets all of them) and one TENSOR per tensor of each safetensors
file, in data order (name, safetensors dtype, shape, bytes, its file). A
safetensors header is not content: a partial file holding some tensors has
another header and the same root.

A *partial directory* is what a node that fetched a layer range holds: the
blob files verbatim, each safetensors file of the source under its own name
holding only the range's tensors (so an index.json still names the right
files), and two markers: ``meshd-manifest.bin`` (the source's manifest) and
``meshd-slice.json`` (``{"start", "end", "num_layers"}``). ``dir_manifest``
trusts its manifest only after checking every file the directory holds
against it; the torch backend loads a partial directory like a whole one
(it reads only the keys of its range).

Which tensors a range needs (``range_names``) follows the footprint's rule
(meshd/plan/footprint.py): ``*.layers.<l>.*`` for the range's layers; the
other tensors at the head, except the final norm and ``lm_head`` (at the
tail); a tail with tied embeddings also needs the embedding.

State: none; checks and builds are cached on disk per file set
(``digests.cached_blob``) and memoised in this process.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from proto.errors import ProtocolError
from shard.errors import ArtifactError
from shard.model import digests
from shard.model.backend import LayerRange
from shard.model.manifest import BLOB, CHUNK_BYTES, KIND_SAFETENSORS, TENSOR, Entry, EntryHasher, FileInfo, Manifest

__all__ = ["MANIFEST_FILE", "SLICE_FILE", "build_manifest", "dir_manifest", "model_root", "held_layers",
           "range_names", "plan_partial", "PartialFile", "read_header", "is_partial", "MAX_HEADER_BYTES"]

MANIFEST_FILE = "meshd-manifest.bin"
SLICE_FILE = "meshd-slice.json"
MARKERS = (MANIFEST_FILE, SLICE_FILE)
WHOLE_SCHEME = "st-manifest-v1"
PARTIAL_SCHEME = "st-partial-checked-v1"
# A safetensors header is JSON listing tensors; real ones are well under a few MiB.
MAX_HEADER_BYTES = 64 << 20
# The marker is a few dozen bytes.
MAX_SLICE_FILE_BYTES = 4096
# Files one directory may hold (a sharded checkpoint has dozens).
MAX_DIR_FILES = 4096
# safetensors' header is padded with spaces to this multiple.
HEADER_ALIGN = 8
READ_BYTES = 8 << 20
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_memo: dict[tuple, Manifest] = {}
_MEMO_MAX = 32


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int          # absolute offset in the file
    size: int


def read_header(path: Path) -> tuple[list[TensorInfo], int]:
    """The tensors of a safetensors file (in data order) and its data start; ArtifactError when the
    header is malformed, out of bounds, or lies about sizes."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ArtifactError(f"{path.name}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ArtifactError(f"{path.name}: a header of {n} bytes is implausible for a {size}-byte file")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path.name}: the safetensors header is not JSON") from exc
    if not isinstance(header, dict):
        raise ArtifactError(f"{path.name}: the safetensors header is not an object")
    start, out = 8 + n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            ok = isinstance(dtype, str) and isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= size - start
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ArtifactError(f"{path.name}: tensor {name!r} has a malformed entry in the header")
        count = 1
        for d in shape:
            count *= d
        if dtype in DTYPE_BYTES and count * DTYPE_BYTES[dtype] != e - b:
            raise ArtifactError(f"{path.name}: tensor {name} of {dtype} {list(shape)} cannot be {e - b} bytes")
        out.append(TensorInfo(name, dtype, shape, start + b, e - b))
    out.sort(key=lambda t: t.begin)
    for a, b in zip(out, out[1:]):
        if b.begin < a.begin + a.size:
            raise ArtifactError(f"{path.name}: tensors {a.name} and {b.name} overlap")
    return out, start


def _files(root: Path) -> list[tuple[str, Path]]:
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a model directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel not in MARKERS:
                found.append((rel, path))
    if len(found) > MAX_DIR_FILES:
        raise ArtifactError(f"{root} holds {len(found)} files (limit {MAX_DIR_FILES})")
    return sorted(found)


def build_manifest(root: Path, *, chunk_bytes: int = CHUNK_BYTES) -> Manifest:
    """The manifest of a whole model directory (reads every byte once)."""
    files, entries = [], []
    for index, (rel, path) in enumerate(_files(root)):
        whole = hashlib.sha256()
        if rel.endswith(".safetensors"):
            tensors, _ = read_header(path)
            hashers = [EntryHasher(chunk_bytes) for _ in tensors]
            spans = [(t.begin, t.begin + t.size, k) for k, t in enumerate(tensors)]
        else:
            tensors, hashers, spans = [], [EntryHasher(chunk_bytes)], []
        pos = 0
        with open(path, "rb") as fh:
            while chunk := fh.read(READ_BYTES):
                view = memoryview(chunk)
                whole.update(view)
                end = pos + len(chunk)
                if not tensors:
                    hashers[0].update(view)
                for s, e, k in spans:
                    lo, hi = max(s, pos), min(e, end)
                    if lo < hi:
                        hashers[k].update(view[lo - pos:hi - pos])
                pos = end
        files.append(FileInfo(rel, pos, whole.digest()))
        if tensors:
            entries += [Entry(TENSOR, t.name, index, t.dtype, t.shape, t.size, h.finish())
                        for t, h in zip(tensors, hashers)]
        else:
            entries.append(Entry(BLOB, rel, index, "", (), pos, hashers[0].finish()))
    return Manifest(KIND_SAFETENSORS, chunk_bytes, tuple(files), tuple(entries))


def is_partial(root: Path) -> bool:
    return (root / MANIFEST_FILE).is_file()


def held_layers(root: Path) -> tuple[int, int, int] | None:
    """(start, end, num_layers) a partial directory holds; None for a whole one."""
    marker = root / SLICE_FILE
    if not marker.is_file():
        return None
    try:
        if marker.stat().st_size > MAX_SLICE_FILE_BYTES:
            raise ValueError("too large")
        data = json.loads(marker.read_text())
        start, end, n = int(data["start"]), int(data["end"]), int(data["num_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{marker} is not a readable slice marker; fetch the range again") from exc
    if not 0 <= start < end <= n:
        raise ArtifactError(f"{marker} says layers {start}:{end} of {n}; the partial directory is corrupt")
    return start, end, n


def check_partial(root: Path, manifest: Manifest) -> None:
    """ArtifactError unless every file of the partial directory is what ``manifest`` says."""
    names = {f.path: i for i, f in enumerate(manifest.files)}
    for rel, path in _files(root):
        if rel not in names:
            raise ArtifactError(f"{root.name}/{rel} is not a file of the model its manifest names")
        if rel.endswith(".safetensors"):
            tensors, _ = read_header(path)
        else:
            st = path.stat()
            tensors = [TensorInfo(rel, "", (), 0, st.st_size)]
        with open(path, "rb") as fh:
            for t in tensors:
                if not manifest.has(t.name):
                    raise ArtifactError(f"{root.name}/{rel}: {t.name} is not part of the model")
                i = manifest.index(t.name)
                e = manifest.entries[i]
                if e.file != names[rel] or e.size != t.size or (t.dtype and (e.dtype, e.shape) != (t.dtype, t.shape)):
                    raise ArtifactError(f"{root.name}/{rel}: {t.name} differs from the model's manifest")
                fh.seek(t.begin)
                for c in range(len(e.chunks)):
                    data = fh.read(manifest.chunk_span(i, c)[1])
                    if not manifest.chunk_ok(i, c, data):
                        raise ArtifactError(f"{root.name}/{rel}: chunk {c} of {t.name} does not match the model's "
                                            f"root {manifest.root[:23]}...; the directory is corrupt, fetch it again")


def dir_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of a model directory (whole: built; partial: its own, checked), cached per file set."""
    root = Path(path).resolve()
    files = [p for _, p in _files(root)]
    if is_partial(root):
        files.append(root / MANIFEST_FILE)
    key = (str(root), tuple(digests.file_key(p) for p in files))
    if key in _memo:
        return _memo[key]
    if is_partial(root):
        raw = (root / MANIFEST_FILE).read_bytes()
        try:
            manifest = Manifest.decode(raw)
        except ProtocolError as exc:
            raise ArtifactError(f"{root / MANIFEST_FILE} does not parse ({exc}); fetch the range again") from None
        if manifest.kind != KIND_SAFETENSORS:
            raise ArtifactError(f"{root / MANIFEST_FILE} is the manifest of another kind of artifact")

        def checked() -> bytes:
            check_partial(root, manifest)
            return manifest.root.encode()

        if digests.cached_blob(PARTIAL_SCHEME, files, checked) != manifest.root.encode():
            check_partial(root, manifest)
    else:
        raw = digests.cached_blob(WHOLE_SCHEME, files, lambda: build_manifest(root).encode())
        try:
            manifest = Manifest.decode(raw)
        except ProtocolError:   # a damaged cache entry
            manifest = build_manifest(root)
    if len(_memo) >= _MEMO_MAX:
        _memo.pop(next(iter(_memo)))
    _memo[key] = manifest
    return manifest


def model_root(path: str | os.PathLike[str]) -> str:
    """The model id of a directory: its manifest's Merkle root."""
    return dir_manifest(path).root


def range_names(manifest: Manifest, config: dict, layer_range: LayerRange) -> list[str]:
    """The tensors (manifest order) that ``layer_range`` needs (the rule in the module docstring)."""
    text = config.get("text_config") or config
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    out = []
    for e in manifest.entries:
        if e.kind != TENSOR:
            continue
        m = _LAYER.search(e.name)
        if m is not None:
            keep = layer_range.start <= int(m.group(1)) < layer_range.end
        elif e.name.startswith("lm_head") or e.name.endswith("norm.weight"):
            keep = layer_range.is_tail
        else:
            keep = layer_range.is_head or (layer_range.is_tail and tied and "embed" in e.name)
        if keep:
            out.append(e.name)
    return out


@dataclass(frozen=True, slots=True)
class PartialFile:
    """One safetensors file of a partial directory: its header and each tensor's absolute offset."""

    path: str
    header: bytes
    offsets: dict[str, int]
    size: int


def plan_partial(manifest: Manifest, names: Sequence[str]) -> list[PartialFile]:
    """Per source safetensors file with a tensor in ``names``: the partial file to write."""
    wanted = set(names)
    by_file: dict[int, list[Entry]] = {}
    for e in manifest.entries:
        if e.kind == TENSOR and e.name in wanted:
            by_file.setdefault(e.file, []).append(e)
    out = []
    for index, entries in sorted(by_file.items()):
        header, cursor = {}, 0
        for e in entries:
            header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [cursor, cursor + e.size]}
            cursor += e.size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
        start = 8 + len(raw)
        offsets, pos = {}, start
        for e in entries:
            offsets[e.name] = pos
            pos += e.size
        out.append(PartialFile(manifest.files[index].path, struct.pack("<Q", len(raw)) + raw, offsets, pos))
    return out
