"""Content-addressed manifests: a model artifact's identity as one Merkle root (sans-I/O).

A manifest lists what an artifact IS, independent of how one node stores it:

    descriptor   kind (GGUF, safetensors directory), chunk size, and per file of the
                 source its path, size and whole-file SHA-256 (the digest ``sha256sum``
                 prints, kept as a field: a user can check a file against it)
    entries      named byte runs, in the source's order: BLOBs (GGUF: the canonical
                 metadata; safetensors: config.json, tokenizer files, ...) and TENSORs
                 (name, dtype, shape, size, which file of the source holds it), each
                 cut into fixed ``chunk_bytes`` chunks from its own first byte, so a
                 layer range's fetch never pulls a byte of another tensor
    chunks       one leaf hash per chunk

and binds all of it under one root (RFC 6962's tree shape, SHA-256, a domain byte
per node kind so no leaf can pass for an inner node)::

    leaf(chunk)      = H(0x00 || chunk bytes)
    inner(l, r)      = H(0x01 || l || r)          merkle([]) = H(""), merkle([x]) = x
    entry_node(e)    = H(0x02 || header(e) || merkle(leaves of e))
    root             = H(0x03 || descriptor || merkle(entry nodes))

The root, as ``merkle:<64 hex>``, is the model's id on the wire. A slice (a part
of the model on one node's disk) carries its source's whole manifest, so it
proves its own chunks against the same root and can hand the manifest to a
node that has nothing yet.

Why SHA-256: hashlib's SHA-256 runs on the CPU's SHA extensions (OpenSSL);
measured here it hashes ~1.7x faster than hashlib's BLAKE2b, it needs no new
dependency, and it is the hash of the whole-file field, so one library serves
both. Why 1 MiB chunks: a bad chunk costs at most 1 MiB to detect and re-fetch,
a manifest costs 32 bytes per MiB (a 40 GB model: 1.3 MB), and a range's bytes
travel in runs of consecutive chunks anyway.

Everything here is pure: bytes in, values or typed errors out. ``decode`` is
bounded (every count checked against the bytes left before it is used) and a
peer's bad manifest is a ``PayloadCorrupt`` / ``LimitExceeded`` (proto.errors).
"""
from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from proto.errors import LimitExceeded, LocalError, PayloadCorrupt

__all__ = [
    "Manifest", "Entry", "FileInfo", "EntryHasher", "CHUNK_BYTES", "ROOT_PREFIX", "KIND_GGUF",
    "KIND_SAFETENSORS", "BLOB", "TENSOR", "MAX_MANIFEST_BYTES", "chunk_leaf", "merkle", "parse_root",
    "is_root", "n_chunks",
]

MAGIC = b"MSHM"
FORMAT_VERSION = 1
# The chunk every manifest this build writes uses (see the module docstring); the
# root binds it, so changing it changes every model's id.
CHUNK_BYTES = 1 << 20
# Chunk sizes a decoded manifest may declare (tests build small ones): powers of two.
MIN_CHUNK_BYTES = 1 << 10
MAX_CHUNK_BYTES = 1 << 26
# A manifest is 32 bytes per chunk plus names: 16 MiB describes ~500 GiB of weights
# in 1 MiB chunks, and a slice embeds it as one GGUF byte array (native/gguf_file.py
# caps arrays at 16M elements).
MAX_MANIFEST_BYTES = 1 << 24
# Files of a source artifact: a GGUF is one; a safetensors directory a few dozen.
MAX_FILES = 4096
# Entries: GGUF files hold up to ~20k tensors (MoE with split experts); bounded by
# the manifest size anyway, this caps the loop before any entry is read.
MAX_ENTRIES = 1 << 20
# A tensor name (GGUF: 63 bytes) or a relative file path.
MAX_NAME_BYTES = 1024
MAX_DTYPE_BYTES = 32
MAX_DIMS = 8
MAX_DIM = 1 << 40
# One entry's bytes: beyond any single tensor of a real model, exact in int64.
MAX_ENTRY_BYTES = 1 << 44
# The smallest encoded entry: kind, a 1-byte name, file, empty dtype, no dims, size.
MIN_ENTRY_BYTES = 1 + 3 + 2 + 2 + 1 + 8

KIND_GGUF = 1
KIND_SAFETENSORS = 2
KINDS = {KIND_GGUF: "gguf", KIND_SAFETENSORS: "safetensors"}
BLOB = 1
TENSOR = 2

ROOT_PREFIX = "merkle:"
_ROOT_RE = re.compile(r"^merkle:[0-9a-f]{64}$")
HASH_BYTES = 32
_LEAF, _INNER, _ENTRY, _ROOT = b"\x00", b"\x01", b"\x02", b"\x03"
_EMPTY = hashlib.sha256(b"").digest()


def n_chunks(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def chunk_leaf(data: bytes | bytearray | memoryview) -> bytes:
    """The leaf hash of one chunk's bytes."""
    h = hashlib.sha256(_LEAF)
    h.update(data)
    return h.digest()


def merkle(hashes: Sequence[bytes]) -> bytes:
    """RFC 6962's Merkle tree hash over ``hashes`` (already leaf hashes), iteratively."""
    if not hashes:
        return _EMPTY
    level = list(hashes)
    while len(level) > 1:
        # RFC 6962 splits at the largest power of two below n; pairing left to right and
        # carrying an odd last node up unchanged builds exactly that tree.
        nxt = [hashlib.sha256(_INNER + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def is_root(text: str) -> bool:
    return isinstance(text, str) and bool(_ROOT_RE.match(text))


def parse_root(text: str) -> bytes:
    """``merkle:<64 hex>`` -> 32 bytes; LocalError for anything else (a user's typo)."""
    if not is_root(text):
        raise LocalError(f"{str(text)[:90]!r} is not a model root (merkle:<64 hex digits>)")
    return bytes.fromhex(text[len(ROOT_PREFIX):])


def _str(value: str, limit: int, what: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > limit:
        raise LocalError(f"{what} of {len(raw)} bytes exceeds {limit}")
    return struct.pack("<H", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One file of the source artifact: relative path, size, whole-file SHA-256."""

    path: str
    size: int
    sha256: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path or len(self.path.encode()) > MAX_NAME_BYTES:
            raise LocalError(f"file path {self.path!r} must be 1..{MAX_NAME_BYTES} bytes")
        if self.path.startswith("/") or ".." in self.path.split("/") or "\\" in self.path or "\0" in self.path:
            raise LocalError(f"file path {self.path!r} must be relative, without '..'")
        if not 0 <= self.size <= MAX_ENTRY_BYTES or len(self.sha256) != HASH_BYTES:
            raise LocalError("file size out of range or sha256 not 32 bytes")

    def encode(self) -> bytes:
        return _str(self.path, MAX_NAME_BYTES, "path") + struct.pack("<Q", self.size) + self.sha256


@dataclass(frozen=True, slots=True)
class Entry:
    """A named byte run of the artifact and the leaf hash of each of its chunks."""

    kind: int
    name: str
    file: int
    dtype: str
    shape: tuple[int, ...]
    size: int
    chunks: tuple[bytes, ...] = field(repr=False)

    def __post_init__(self) -> None:
        if self.kind not in (BLOB, TENSOR):
            raise LocalError(f"entry kind {self.kind} is neither BLOB nor TENSOR")
        if not isinstance(self.name, str) or not self.name or len(self.name.encode()) > MAX_NAME_BYTES:
            raise LocalError(f"entry name {self.name!r} must be 1..{MAX_NAME_BYTES} bytes")
        if len(self.dtype.encode()) > MAX_DTYPE_BYTES or len(self.shape) > MAX_DIMS:
            raise LocalError(f"entry {self.name}: dtype or shape beyond the limits")
        if any(not 0 <= d <= MAX_DIM for d in self.shape) or not 0 <= self.size <= MAX_ENTRY_BYTES:
            raise LocalError(f"entry {self.name}: a dimension or its size is out of range")
        if not 0 <= self.file < MAX_FILES:
            raise LocalError(f"entry {self.name}: file index {self.file} out of range")
        if any(len(c) != HASH_BYTES for c in self.chunks):
            raise LocalError(f"entry {self.name}: chunk hashes must be 32 bytes")

    def header(self) -> bytes:
        return (struct.pack("<B", self.kind) + _str(self.name, MAX_NAME_BYTES, "name")
                + struct.pack("<H", self.file) + _str(self.dtype, MAX_DTYPE_BYTES, "dtype")
                + struct.pack("<B", len(self.shape)) + b"".join(struct.pack("<Q", d) for d in self.shape)
                + struct.pack("<Q", self.size))

    def node(self) -> bytes:
        return hashlib.sha256(_ENTRY + self.header() + merkle(self.chunks)).digest()


@dataclass(frozen=True, slots=True)
class Manifest:
    """A validated manifest (see the module docstring); ``root`` names it."""

    kind: int
    chunk_bytes: int
    files: tuple[FileInfo, ...]
    entries: tuple[Entry, ...]
    _index: dict = field(default_factory=dict, repr=False, compare=False, hash=False)
    _root: list = field(default_factory=list, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LocalError(f"manifest kind {self.kind} is unknown")
        c = self.chunk_bytes
        if not MIN_CHUNK_BYTES <= c <= MAX_CHUNK_BYTES or c & (c - 1):
            raise LocalError(f"chunk size {c} is not a power of two in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        if len(self.files) > MAX_FILES or len(self.entries) > MAX_ENTRIES:
            raise LocalError("too many files or entries")
        if len({f.path for f in self.files}) != len(self.files):
            raise LocalError("two files share a path")
        for i, e in enumerate(self.entries):
            if e.name in self._index:
                raise LocalError(f"two entries are named {e.name!r}")
            if self.files and e.file >= len(self.files):
                raise LocalError(f"entry {e.name} names file {e.file} of {len(self.files)}")
            if len(e.chunks) != n_chunks(e.size, c):
                raise LocalError(f"entry {e.name}: {len(e.chunks)} chunk hashes for {e.size} bytes")
            self._index[e.name] = i

    # ------------------------------------------------------------------ identity
    def descriptor(self) -> bytes:
        return (MAGIC + struct.pack("<BBIH", FORMAT_VERSION, self.kind, self.chunk_bytes, len(self.files))
                + b"".join(f.encode() for f in self.files))

    @property
    def root_bytes(self) -> bytes:
        if not self._root:
            nodes = [e.node() for e in self.entries]
            self._root.append(hashlib.sha256(_ROOT + self.descriptor() + merkle(nodes)).digest())
        return self._root[0]

    @property
    def root(self) -> str:
        return ROOT_PREFIX + self.root_bytes.hex()

    # ------------------------------------------------------------------ lookups
    def index(self, name: str) -> int:
        """The entry index of ``name``; KeyError when the artifact has no such entry."""
        return self._index[name]

    def has(self, name: str) -> bool:
        return name in self._index

    def chunk_span(self, entry: int, chunk: int) -> tuple[int, int]:
        """(offset inside the entry, length) of one chunk."""
        e = self.entries[entry]
        if not 0 <= chunk < len(e.chunks):
            raise LocalError(f"chunk {chunk} of entry {e.name} (which has {len(e.chunks)})")
        start = chunk * self.chunk_bytes
        return start, min(self.chunk_bytes, e.size - start)

    def chunk_ok(self, entry: int, chunk: int, data: bytes | bytearray | memoryview) -> bool:
        """Whether ``data`` is exactly chunk ``chunk`` of entry ``entry``."""
        _, length = self.chunk_span(entry, chunk)
        return len(data) == length and chunk_leaf(data) == self.entries[entry].chunks[chunk]

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    # ------------------------------------------------------------------ bytes
    def encode(self) -> bytes:
        parts = [self.descriptor(), struct.pack("<I", len(self.entries))]
        for e in self.entries:
            parts.append(e.header())
            parts.extend(e.chunks)
        data = b"".join(parts)
        if len(data) > MAX_MANIFEST_BYTES:
            raise LocalError(f"the manifest is {len(data)} bytes, above MAX_MANIFEST_BYTES={MAX_MANIFEST_BYTES}")
        return data

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, *, root: str | None = None) -> Manifest:
        """Parse (bounded) and, with ``root``, check the manifest hashes to it (PayloadCorrupt if not)."""
        data = bytes(data)
        if len(data) > MAX_MANIFEST_BYTES:
            raise LimitExceeded(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        cur = _Cursor(data)
        if cur.take(4, "magic") != MAGIC:
            raise PayloadCorrupt("not a meshd manifest (bad magic)")
        version, kind, chunk_bytes, n_files = cur.unpack("<BBIH", "descriptor")
        if version != FORMAT_VERSION:
            raise PayloadCorrupt(f"manifest format {version} is not {FORMAT_VERSION}")
        if n_files > MAX_FILES:
            raise LimitExceeded(f"{n_files} files exceed {MAX_FILES}")
        try:
            files = tuple(FileInfo(cur.string(MAX_NAME_BYTES, "path"), cur.unpack("<Q", "size")[0],
                                   cur.take(HASH_BYTES, "sha256")) for _ in range(n_files))
            (n_entries,) = cur.unpack("<I", "entry count")
            if n_entries > MAX_ENTRIES:
                raise LimitExceeded(f"{n_entries} entries exceed {MAX_ENTRIES}")
            cur.need(n_entries * MIN_ENTRY_BYTES, f"{n_entries} entries")   # each at least its fixed fields
            if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes & (chunk_bytes - 1):
                raise PayloadCorrupt(f"chunk size {chunk_bytes} is not an allowed power of two")
            entries = []
            for _ in range(n_entries):
                (kind_e,) = cur.unpack("<B", "entry kind")
                name = cur.string(MAX_NAME_BYTES, "entry name")
                (file_i,) = cur.unpack("<H", "file index")
                dtype = cur.string(MAX_DTYPE_BYTES, "dtype")
                (ndims,) = cur.unpack("<B", "dims")
                if ndims > MAX_DIMS:
                    raise PayloadCorrupt(f"entry {name} has {ndims} dims")
                shape = cur.unpack("<" + "Q" * ndims, "shape") if ndims else ()
                (size,) = cur.unpack("<Q", "size")
                if size > MAX_ENTRY_BYTES:
                    raise LimitExceeded(f"entry {name} claims {size} bytes")
                count = n_chunks(size, chunk_bytes)
                raw = cur.take(count * HASH_BYTES, f"chunk hashes of {name}")
                chunks = tuple(raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES))
                entries.append(Entry(kind_e, name, file_i, dtype, tuple(shape), size, chunks))
            if cur.pos != len(data):
                raise PayloadCorrupt(f"{len(data) - cur.pos} bytes after the manifest")
            manifest = cls(kind, chunk_bytes, files, tuple(entries))
        except LocalError as exc:   # a field our own constructors refuse: the sender's fault here
            raise PayloadCorrupt(f"manifest: {exc}") from None
        if root is not None and manifest.root != root:
            raise PayloadCorrupt(f"the manifest hashes to {manifest.root[:23]}..., not to {root[:23]}...")
        return manifest


class _Cursor:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.data):
            raise PayloadCorrupt(f"manifest truncated: {what} needs {n} bytes, {len(self.data) - self.pos} left")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def string(self, limit: int, what: str) -> str:
        (n,) = self.unpack("<H", what)
        if n > limit:
            raise LimitExceeded(f"{what} of {n} bytes exceeds {limit}")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadCorrupt(f"{what} is not UTF-8") from None


class EntryHasher:
    """Chunk leaf hashes of a byte stream fed in any pieces (the builders' helper)."""

    __slots__ = ("chunk_bytes", "_buf", "chunks", "size")

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._buf = bytearray()
        self.chunks: list[bytes] = []
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if self._buf:
            take = min(len(view), self.chunk_bytes - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.chunk_bytes:
                self.chunks.append(chunk_leaf(self._buf))
                self._buf.clear()
        while len(view) >= self.chunk_bytes:
            self.chunks.append(chunk_leaf(view[:self.chunk_bytes]))
            view = view[self.chunk_bytes:]
        if len(view):
            self._buf += view

    def finish(self) -> tuple[bytes, ...]:
        if self._buf:
            self.chunks.append(chunk_leaf(self._buf))
            self._buf.clear()
        return tuple(self.chunks)


def entry_of(kind: int, name: str, data: bytes | bytearray | memoryview, *, file: int = 0, dtype: str = "",
             shape: Iterable[int] = (), chunk_bytes: int = CHUNK_BYTES) -> Entry:
    """An entry over bytes held in memory (blobs, tests)."""
    hasher = EntryHasher(chunk_bytes)
    hasher.update(data)
    return Entry(kind, name, file, dtype, tuple(shape), hasher.size, hasher.finish())
