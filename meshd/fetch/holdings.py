"""What this node can serve to peers that fetch: its model files, slices, and parts still being fetched.

A ``Source`` maps a model's manifest entries to bytes this node holds:

* a whole GGUF file or a GGUF slice: each tensor at its offset in the file's
  memory map, the metadata blob rebuilt from the file's metadata pairs
  (native/gguf_write.canonical_metadata) -- a slice serves the same blob as
  its source;
* a model directory, whole or partial: each file that is a BLOB, each tensor
  at its offset in its safetensors file;
* a part being fetched (store.Target): only chunks its bitmap marks verified.

Only checked bytes are served: a file or directory becomes a Source through
``file_manifest`` / ``dir_manifest``, which check a slice's or a partial
directory's bytes against its manifest (a whole file's manifest is computed
from its bytes); a part serves only chunks that passed their hash on arrival.

``Holdings`` is the set of Sources per root, shared by the chunk server's
threads (one lock around the map; reads of the memory maps need none).
"""
from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

from shard.model.manifest import BLOB, Manifest

__all__ = ["Source", "Holdings", "source_of_path", "part_source"]

Location = tuple[int, int]     # (map index, absolute offset of the entry's first byte)


class Source:
    """Entries of one manifest held here: ``locate`` gives where each entry's bytes start."""

    def __init__(self, manifest: Manifest, maps: list, locations: dict[int, Location],
                 blobs: dict[int, bytes] | None = None, *, verified: Callable[[int, int], bool] | None = None,
                 held: tuple[int, int] | None = None, label: str = "") -> None:
        self.manifest = manifest
        self.maps = maps
        self.locations = locations
        self.blobs = blobs or {}
        self.verified = verified
        self.held = held
        self.label = label

    def holds_entry(self, entry: int) -> bool:
        return entry in self.locations or entry in self.blobs

    def read(self, entry: int, first: int, count: int) -> list[memoryview] | None:
        """The bytes of chunks ``first .. first+count-1`` of ``entry``, or None when one is not held."""
        m = self.manifest
        if not 0 <= entry < len(m.entries) or not 0 <= first or first + count > len(m.entries[entry].chunks):
            return None
        if self.verified is not None and not all(self.verified(entry, c) for c in range(first, first + count)):
            return None
        out = []
        if entry in self.blobs:
            data = memoryview(self.blobs[entry])
            for c in range(first, first + count):
                off, length = m.chunk_span(entry, c)
                out.append(data[off:off + length])
            return out
        loc = self.locations.get(entry)
        if loc is None:
            return None
        view = memoryview(self.maps[loc[0]])
        for c in range(first, first + count):
            off, length = m.chunk_span(entry, c)
            out.append(view[loc[1] + off:loc[1] + off + length])
        return out

    def close(self) -> None:
        for mp in self.maps:
            try:
                mp.close()
            except (BufferError, ValueError):   # a view is still being sent; the map dies with it
                pass


def _map(path: Path) -> mmap.mmap | bytes:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""


def source_of_path(path: Path, progress=None) -> Source:
    """The Source of a GGUF file or slice, or a model directory (whole or partial), checked."""
    path = Path(path)
    if path.is_file():
        from native.gguf_manifest import METADATA_ENTRY, file_manifest
        from native.gguf_range import held_range, model_info, open_reader
        from native.gguf_write import canonical_metadata

        reader = open_reader(path)
        manifest = file_manifest(path, reader, progress)
        maps = [_map(path)]
        locations = {manifest.index(t.name): (0, t.offset) for t in reader.tensors if manifest.has(t.name)}
        blobs = {manifest.index(METADATA_ENTRY): canonical_metadata(reader.fields.values())}
        held = held_range(reader, model_info(reader))
        return Source(manifest, maps, locations, blobs, held=(held.start, held.end), label=path.name)
    from shard.model.st_manifest import dir_manifest, held_layers, read_header

    manifest = dir_manifest(path)
    index = {f.path: i for i, f in enumerate(manifest.files)}
    maps, locations = [], {}
    for f in manifest.files:
        file = path / f.path
        if not file.is_file():
            continue
        k = len(maps)
        maps.append(_map(file))
        if f.path.endswith(".safetensors"):
            for t in read_header(file)[0]:
                if manifest.has(t.name):
                    locations[manifest.index(t.name)] = (k, t.begin)
        elif manifest.has(f.path) and manifest.entries[manifest.index(f.path)].kind == BLOB:
            locations[manifest.index(f.path)] = (k, 0)
    del index
    partial = held_layers(path)
    if partial is None:    # a whole directory holds every layer
        from meshd.plan.modelinfo import model_num_layers

        partial = (0, model_num_layers(path), 0)
    return Source(manifest, maps, locations, held=(partial[0], partial[1]), label=path.name)


def part_source(target, meta: dict[int, bytes]) -> Source:
    """The verified chunks of a part being fetched (store.Target), plus the model's BLOBs."""
    maps = []
    for i in range(len(target.files)):
        maps.append(mmap.mmap(target.fds[i], 0, access=mmap.ACCESS_READ))
    locations = {entry: (d.file, d.offset) for entry, d in target.dests.items()}
    return Source(target.manifest, maps, locations, dict(meta), verified=lambda e, c: target.verified(e, c),
                  label=target.part.name)


class Holdings:
    """Sources by model root; what the chunk server serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_root: dict[bytes, list[Source]] = {}

    def add(self, source: Source) -> None:
        with self._lock:
            self._by_root.setdefault(source.manifest.root_bytes, []).append(source)

    def remove(self, source: Source) -> None:
        with self._lock:
            sources = self._by_root.get(source.manifest.root_bytes, [])
            if source in sources:
                sources.remove(source)
            if not sources:
                self._by_root.pop(source.manifest.root_bytes, None)
        source.close()

    def manifest(self, root: bytes) -> Manifest | None:
        with self._lock:
            sources = self._by_root.get(root)
            return sources[0].manifest if sources else None

    def read(self, root: bytes, entry: int, first: int, count: int) -> list[memoryview] | None:
        with self._lock:
            sources = list(self._by_root.get(root, ()))
        for source in sources:
            got = source.read(entry, first, count)
            if got is not None:
                return got
        return None

    def roots(self) -> list[bytes]:
        with self._lock:
            return list(self._by_root)

    def sources(self, root: bytes) -> list[Source]:
        with self._lock:
            return list(self._by_root.get(root, ()))

    def close(self) -> None:
        with self._lock:
            sources = [s for group in self._by_root.values() for s in group]
            self._by_root.clear()
        for s in sources:
            s.close()
