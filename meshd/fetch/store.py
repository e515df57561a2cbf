"""What a node keeps of models it fetched: per root, the manifest, the metadata, slices, partial files.

Layout under ``<data dir>/models/<first 32 hex of the root>/``::

    manifest.bin                 the model's manifest (checked against the root on every read)
    blob-<entry>.bin             each BLOB entry fetched (GGUF metadata, config.json, tokenizer files)
    blamed.json                  peers that sent a chunk failing its hash: never asked again
    layers-A-B.gguf              a finished GGUF slice (native/slice.py format)
    layers-A-B/                  a finished partial safetensors directory (shard/model/st_manifest.py)
    layers-A-B.gguf.part         ... while it is fetched: the final layout, header written,
    layers-A-B.part/             tensor bytes filled in chunk by chunk at their final offsets
    layers-A-B.bitmap            which chunks of the part are verified: a log (survives a restart)

A ``Target`` is one slice being written. Its layout is fixed before the first
chunk arrives (``native.slice.plan_slice`` / ``st_manifest.plan_partial``), so
each verified chunk is written once, straight to where it stays (the part is
sparse: only written chunks take disk). The bitmap is a log: a header line
naming the part (root, range, layout), then one u32 chunk index appended per
chunk once its bytes were written -- one small ``write`` per MiB, so a kill
at any moment loses no verified chunk (both writes are in the page cache
before the chunk counts). Neither file is fsynced while chunks arrive (a
flush per chunk would halve the fetch on a slow disk): after a power cut an
index may be ahead of its bytes, so on a restart every logged chunk is read
back and checked again before it counts -- a torn write costs a re-fetch,
never a bad byte. Every SETTLE_BYTES marked, though, the part's files are
synced and their pages handed back to the kernel (native/slice.py's rule:
a node fetching its range must not fill its memory cgroup with dirty or
written-once pages of a file its worker will read back once). The log is rewritten compactly on every open. Finishing
fsyncs, renames the part into place and writes the markers; the slice is then
checked once more as the worker will check it.

State: the files above. Owned by the daemon's fetch part; one target is
written by one fetch at a time.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshd.errors import ConfigError
from proto.errors import ProtocolError
from shard.model.backend import LayerRange
from shard.model.manifest import BLOB, KIND_GGUF, Manifest, parse_root
from shard.model.memory import drop_page_cache

__all__ = ["ModelStore", "Target", "Dest", "store_root"]

_INDEX = struct.Struct("<I")
# Bytes of verified chunks written between syncs that drop the part's pages from the page cache:
# native/slice.py's COPY_CHUNK_BYTES (not imported: the daemon keeps gguf out of its imports), the
# dirty page cache a slice write may hold: small beside any node's promise, large enough to stream.
SETTLE_BYTES = 16 << 20
# The blamed list: one line per peer; a few hundred peers at most matter.
MAX_BLAMED = 1024
MAX_BLAMED_BYTES = 1 << 20


def store_root(data_dir: Path, root: str) -> Path:
    return data_dir / "models" / parse_root(root).hex()[:32]


def _atomic_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _replace(path: Path, data: bytes) -> None:
    """Atomic against a kill (not fsynced: see the module docstring)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass(frozen=True, slots=True)
class Dest:
    """Where chunk bytes of one entry go: a file of the target and the entry's first byte in it."""

    file: int
    offset: int


class ModelStore:
    def __init__(self, data_dir: Path, root: str) -> None:
        self.root = root
        self.dir = store_root(data_dir, root)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    # ------------------------------------------------------------------ manifest and blobs
    def manifest(self) -> Manifest | None:
        path = self.dir / "manifest.bin"
        if not path.is_file():
            return None
        try:
            return Manifest.decode(path.read_bytes(), root=self.root)
        except (OSError, ProtocolError):
            path.unlink(missing_ok=True)    # damaged: fetch it again
            return None

    def save_manifest(self, manifest: Manifest) -> None:
        if manifest.root != self.root:
            raise ValueError("not this store's model")
        _atomic_bytes(self.dir / "manifest.bin", manifest.encode())

    def blob(self, manifest: Manifest, entry: int) -> bytes | None:
        """A stored BLOB entry, only if every chunk of it still matches the manifest."""
        path = self.dir / f"blob-{entry}.bin"
        try:
            data = path.read_bytes() if path.stat().st_size == manifest.entries[entry].size else None
        except OSError:
            return None
        if data is None or not all(manifest.chunk_ok(entry, c, data[o:o + n]) for c, (o, n) in
                                   enumerate(manifest.chunk_span(entry, c)
                                             for c in range(len(manifest.entries[entry].chunks)))):
            path.unlink(missing_ok=True)
            return None
        return data

    def save_blob(self, entry: int, data: bytes) -> None:
        _atomic_bytes(self.dir / f"blob-{entry}.bin", data)

    # ------------------------------------------------------------------ blame
    def blamed(self) -> set[str]:
        path = self.dir / "blamed.json"
        try:
            if path.stat().st_size > MAX_BLAMED_BYTES:
                return set()
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return set()
        return {p for p in data if isinstance(p, str)} if isinstance(data, list) else set()

    def blame(self, peer: str) -> None:
        peers = sorted(self.blamed() | {peer})[:MAX_BLAMED]
        _atomic_bytes(self.dir / "blamed.json", json.dumps(peers).encode())

    # ------------------------------------------------------------------ slices
    def name(self, manifest: Manifest, layer_range: LayerRange) -> str:
        base = f"layers-{layer_range.start}-{layer_range.end}"
        return base + ".gguf" if manifest.kind == KIND_GGUF else base

    def finished(self, manifest: Manifest) -> list[tuple[LayerRange, Path]]:
        """The slices fully fetched (and renamed into place), by range."""
        out = []
        for path in sorted(self.dir.glob("layers-*")):
            stem = path.name.removesuffix(".gguf")
            if path.name.endswith((".part", ".bitmap", ".tmp")) or stem.count("-") != 2:
                continue
            try:
                start, end = (int(x) for x in stem.split("-")[1:])
            except ValueError:
                continue
            out.append((start, end, path))
        n = self.num_layers(manifest)
        return [(LayerRange(s, e, n), p) for s, e, p in out if 0 <= s < e <= n]

    def num_layers(self, manifest: Manifest) -> int:
        from meshd.fetch.facts import model_facts

        return model_facts(manifest, self.meta(manifest)).num_layers

    def meta(self, manifest: Manifest) -> dict[int, bytes]:
        """Every BLOB entry this store holds (checked), by entry index."""
        out = {}
        for i, e in enumerate(manifest.entries):
            if e.kind == BLOB:
                data = self.blob(manifest, i)
                if data is None:
                    raise ConfigError(f"the store of {self.root[:23]}... lacks {e.name}; fetch it again")
                out[i] = data
        return out

    def holding(self, manifest: Manifest, layer_range: LayerRange) -> Path | None:
        """A finished slice that holds ``layer_range`` (the smallest), or None."""
        fits = [(r.count, p) for r, p in self.finished(manifest)
                if r.start <= layer_range.start and layer_range.end <= r.end]
        return min(fits)[1] if fits else None


class Target:
    """One slice being written: its files (in the store), the chunk destinations, the bitmap log.

    ``files``: (relative path, header bytes, final size) of every file of the part; GGUF has one,
    a safetensors part one per source safetensors file. ``dests``: entry index -> Dest.
    ``wanted``: every (entry, chunk) the slice holds, in file order (the log's indices)."""

    def __init__(self, store: ModelStore, manifest: Manifest, layer_range: LayerRange,
                 files: Sequence[tuple[str, bytes, int]], dests: dict[int, Dest], wanted: list[tuple[int, int]],
                 *, finish_extra=None) -> None:
        self.store, self.manifest, self.range = store, manifest, layer_range
        self.name = store.name(manifest, layer_range)
        self.final = store.dir / self.name
        self.single = manifest.kind == KIND_GGUF
        self.part = store.dir / (self.name + ".part")
        self.bitmap_path = store.dir / f"layers-{layer_range.start}-{layer_range.end}.bitmap"
        self.files, self.dests, self.wanted = list(files), dests, wanted
        self.finish_extra = finish_extra   # safetensors: writes the blobs and markers into the part dir
        self.fds: list[int] = []
        self.log_fd: int | None = None
        self.bits = bytearray((len(wanted) + 7) // 8)
        self.index = {key: i for i, key in enumerate(wanted)}
        self.rechecked_bad = 0
        self.unsettled = 0   # bytes marked since the part's pages were last synced and dropped

    def path_of(self, i: int) -> Path:
        return self.part if self.single else self.part / self.files[i][0]

    # ------------------------------------------------------------------ open / resume
    def _log_header(self) -> bytes:
        return json.dumps({"root": self.manifest.root, "start": self.range.start, "end": self.range.end,
                           "chunks": len(self.wanted), "files": [[f, len(h), s] for f, h, s in self.files]}
                          ).encode() + b"\n"

    def _read_log(self, header: bytes) -> bool:
        """Set the bits the log names; False when there is no log for exactly this part."""
        try:
            raw = self.bitmap_path.read_bytes()
        except OSError:
            return False
        if not raw.startswith(header):
            return False
        body = raw[len(header):]
        for (i,) in _INDEX.iter_unpack(body[:len(body) - len(body) % _INDEX.size]):   # a torn last index: ignored
            if i < len(self.wanted):
                self.bits[i // 8] |= 1 << (i % 8)
        return True

    def open(self) -> list[tuple[int, int]]:
        """Create the part (or reopen it) and return the chunks already verified on disk."""
        if not self.single:
            self.part.mkdir(parents=True, exist_ok=True)
        header = self._log_header()
        resumed = self._read_log(header)
        for i, (_, head, size) in enumerate(self.files):
            path = self.path_of(i)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            self.fds.append(fd)
            if not resumed or os.fstat(fd).st_size != size:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)     # sparse: only verified chunks ever take disk
                self.bits[:] = bytes(len(self.bits))
                resumed = False
            os.pwrite(fd, head, 0)
        good = self._recheck()
        for fd in self.fds:   # the recheck read them once: not kept in the page cache
            drop_page_cache(fd)
        # a compact log of what counts now, then appends
        _replace(self.bitmap_path, header + b"".join(_INDEX.pack(self.index[k]) for k in good))
        self.log_fd = os.open(self.bitmap_path, os.O_WRONLY | os.O_APPEND)
        return good

    def _recheck(self) -> list[tuple[int, int]]:
        """The chunks the log names whose bytes on disk still match (an index never vouches alone)."""
        good = []
        for i, key in enumerate(self.wanted):
            if not self.bits[i // 8] >> (i % 8) & 1:
                continue
            if self.manifest.chunk_ok(*key, self.read(*key)):
                good.append(key)
            else:
                self.bits[i // 8] &= ~(1 << (i % 8)) & 0xFF
                self.rechecked_bad += 1
        return good

    # ------------------------------------------------------------------ chunks
    def _where(self, entry: int, chunk: int) -> tuple[int, int, int]:
        d = self.dests[entry]
        off, length = self.manifest.chunk_span(entry, chunk)
        return self.fds[d.file], d.offset + off, length

    def read(self, entry: int, chunk: int) -> bytes:
        fd, at, length = self._where(entry, chunk)
        return os.pread(fd, length, at)

    def put(self, entry: int, chunk: int, data) -> None:
        """Write a VERIFIED chunk in place (the caller checked it); threads may put different chunks
        at once. ``mark`` it afterwards."""
        fd, at, length = self._where(entry, chunk)
        if len(data) != length:
            raise ValueError("chunk length differs from the manifest's")
        os.pwrite(fd, data, at)

    def mark(self, entry: int, chunk: int) -> None:
        """Count a chunk that was ``put``: its bit, and its index appended to the log (one caller at
        a time: the fetch's lock)."""
        i = self.index[(entry, chunk)]
        self.bits[i // 8] |= 1 << (i % 8)
        if self.log_fd is not None:
            os.write(self.log_fd, _INDEX.pack(i))
        self.unsettled += self.manifest.chunk_span(entry, chunk)[1]
        if self.unsettled >= SETTLE_BYTES:
            self.settle()

    def settle(self) -> None:
        """Sync the part's files and drop their pages from the page cache (the module docstring)."""
        for fd in self.fds:
            os.fdatasync(fd)
            drop_page_cache(fd)
        self.unsettled = 0

    def verified(self, entry: int, chunk: int) -> bool:
        i = self.index.get((entry, chunk))
        return i is not None and bool(self.bits[i // 8] >> (i % 8) & 1)

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Close the part's files, keeping the part and its log for the next run."""
        for fd in self.fds + ([self.log_fd] if self.log_fd is not None else []):
            os.close(fd)
        self.fds.clear()
        self.log_fd = None

    def finish(self) -> Path:
        """Flush, move the part into place, drop the log; returns the finished slice's path."""
        for fd in self.fds:
            os.fsync(fd)
        self.close()
        if self.finish_extra is not None:
            self.finish_extra(self.part)
        if self.final.exists():   # a leftover of an older run: replaced
            shutil.rmtree(self.final) if self.final.is_dir() else self.final.unlink()
        os.replace(self.part, self.final)
        self.bitmap_path.unlink(missing_ok=True)
        return self.final

    def discard(self) -> None:
        self.close()
        if self.part.is_dir():
            shutil.rmtree(self.part, ignore_errors=True)
        else:
            self.part.unlink(missing_ok=True)
        self.bitmap_path.unlink(missing_ok=True)


def make_target(store: ModelStore, manifest: Manifest, facts, meta: dict[int, bytes],
                layer_range: LayerRange) -> Target:
    """The Target of ``layer_range``'s slice: GGUF (native/slice.py format) or a partial directory."""
    from meshd.fetch.facts import range_entries

    entries = range_entries(manifest, facts, layer_range)
    wanted = [(i, c) for i in entries for c in range(len(manifest.entries[i].chunks))]
    if manifest.kind == KIND_GGUF:
        from native.gguf_manifest import METADATA_ENTRY, metadata_of
        from native.slice import plan_slice

        fields = metadata_of(manifest, meta[manifest.index(METADATA_ENTRY)])
        layout, indices = plan_slice(manifest, fields, layer_range)
        if indices != entries:   # pragma: no cover - one rule (gguf_manifest.range_names) decides both
            raise ConfigError("the slice plan and the range's entries disagree")
        dests = {i: Dest(0, layout.offsets[manifest.entries[i].name]) for i in entries}
        return Target(store, manifest, layer_range, [("", layout.header, layout.size)], dests, wanted)
    from shard.model.st_manifest import MANIFEST_FILE, SLICE_FILE, plan_partial

    partials = plan_partial(manifest, [manifest.entries[i].name for i in entries])
    dests = {}
    for k, pf in enumerate(partials):
        for name, offset in pf.offsets.items():
            dests[manifest.index(name)] = Dest(k, offset)

    def finish(part: Path) -> None:
        for i, data in meta.items():
            path = part / manifest.entries[i].name
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_bytes(path, data)
        _atomic_bytes(part / MANIFEST_FILE, manifest.encode())
        marker = {"start": layer_range.start, "end": layer_range.end, "num_layers": layer_range.num_layers}
        _atomic_bytes(part / SLICE_FILE, json.dumps(marker).encode())

    return Target(store, manifest, layer_range, [(pf.path, pf.header, pf.size) for pf in partials], dests, wanted,
                  finish_extra=finish)
