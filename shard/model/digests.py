"""Artifact digests computed once per file: an on-disk cache keyed by what identifies a file's bytes.

Why: a model's digest is SHA-256 over gigabytes (seconds to minutes), and it
is needed by every worker start, every daemon start (tracker duty), every
LOAD directive and every llama.cpp slice. Without a cache each of those
rehashed an unchanged model.

Key: the digest scheme (how the bytes are framed, e.g. ``dir-v1``) and, for
every file of the artifact in order, its (absolute path, size, mtime_ns,
inode, device) as ``os.stat`` reports them after following symlinks. A file
rewritten, touched or replaced (a new inode, as ``os.replace`` or a fresh
download gives) has another key and is hashed again; so is an artifact that
gained or lost a file. (Like make and rsync, a rewrite that restores size
and mtime and keeps the inode is not noticed.)

Store: one small JSON file per key in ``$MESHD_DIGEST_CACHE`` or else
``~/.cache/meshd/digests`` (mode 0700, per user), named by the SHA-256 of the
key. Writes are atomic (a temp file, then ``os.replace``); the directory
keeps at most ``MAX_ENTRIES`` entries (the least recently written go). An
entry that cannot be read, does not parse, is for another key or holds no
well-formed digest is ignored, and the digest is computed and written again.
A file that changes while it is hashed gives a digest that is returned but
never cached. An unwritable cache directory only costs the rehash.

State: the directory above; an in-process memo (same key, bounded); and
``hash_runs`` / ``hashed_bytes``, counters of the real hashing done in this
process (what tests and benchmarks read to see a cache hit).

Progress: hashing at least ``PROGRESS_MIN_BYTES`` reports "hashing NAME: X of
Y MB (P%)" at most once per ``PROGRESS_INTERVAL_S``, and a last line with the
time taken, to a text stream (stderr) or a callable.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import TextIO

from shard.model.memory import drop_page_cache

__all__ = ["FileKey", "file_key", "cached_digest", "cached_blob", "hash_files", "cache_dir", "CACHE_ENV",
           "hash_runs", "hashed_bytes", "MAX_ENTRIES", "emit", "Progress"]

CACHE_ENV = "MESHD_DIGEST_CACHE"
# Entries kept: one per model (directory or file) this user ever ran; a few
# hundred bytes each. Past this the least recently written are removed.
MAX_ENTRIES = 256
# A cached blob (a model's manifest, shard/model/manifest.py: 32 bytes per MiB of weights) is
# at most this; a larger file in the cache is not ours and is not read.
MAX_BLOB_BYTES = 1 << 25
# An entry is a few hundred bytes (more for a directory of many files); a file
# above this is not ours and is not parsed.
MAX_ENTRY_BYTES = 1 << 20
# Read size for hashing: large enough that Python overhead vanishes next to
# SHA-256 (~1 GB/s), small enough to keep the worker's memory flat.
HASH_CHUNK_BYTES = 8 << 20
# Below this an artifact hashes in well under a second: no progress lines.
PROGRESS_MIN_BYTES = 64 << 20
# At most one progress line per this many seconds: the lines reach the user's
# terminal through the daemon, so a minute of hashing is about 60 lines.
PROGRESS_INTERVAL_S = 1.0
# Temp files older than this were left by a process that died mid-write.
STALE_TMP_S = 3600.0
ENTRY_FORMAT = 1
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_MEMO_MAX = 64

Progress = TextIO | Callable[[str], None] | None

# Counters of real hashing in this process (never reset by the module).
hash_runs = 0
hashed_bytes = 0
_memo: dict[tuple, str] = {}


@dataclass(frozen=True, slots=True)
class FileKey:
    """What identifies one file's bytes without reading them."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    device: int


def file_key(path: str | os.PathLike) -> FileKey:
    p = Path(path).absolute()
    st = p.stat()
    return FileKey(str(p), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "meshd" / "digests"


def emit(progress: Progress, line: str) -> None:
    """One progress line to a stream or a callback (None: nowhere)."""
    if progress is None:
        return
    if callable(progress):
        progress(line)
    else:
        print(line, file=progress, flush=True)


def hash_files(parts: Sequence[tuple[bytes, Path]], *, label: str, progress: Progress = None,
               clock: Callable[[], float] = time.monotonic) -> str:
    """``sha256:`` over, for each part, its header bytes then the file's bytes (streamed, at most
    the size each file had when hashing began)."""
    global hash_runs, hashed_bytes
    hash_runs += 1
    sizes = [Path(p).stat().st_size for _, p in parts]
    total = sum(sizes)
    report = progress is not None and total >= PROGRESS_MIN_BYTES
    h = hashlib.sha256()
    done = 0
    started = last = clock()
    for (header, path), size in zip(parts, sizes):
        h.update(header)
        with open(path, "rb") as fh:
            # at most the size it had when we started: a file still being written cannot keep us
            # reading (its digest is then not cached: its key changed)
            offset = 0
            while size > 0 and (chunk := fh.read(min(HASH_CHUNK_BYTES, size))):
                size -= len(chunk)
                h.update(chunk)
                done += len(chunk)
                # read once: hand the pages back (a 2 GB model hashed inside a 1 GB promise)
                drop_page_cache(fh.fileno(), offset, len(chunk))
                offset += len(chunk)
                now = clock()
                if report and now - last >= PROGRESS_INTERVAL_S:
                    last = now
                    emit(progress, f"[meshd] hashing {label}: {done / 1e6:.0f} of {total / 1e6:.0f} MB "
                                    f"({done * 100 // max(total, 1)}%)")
    hashed_bytes += done
    if report:
        emit(progress, f"[meshd] hashed {label}: {done / 1e6:.0f} MB in {clock() - started:.1f} s "
                        "(cached; not hashed again until a file changes)")
    return "sha256:" + h.hexdigest()


def _entry_path(root: Path, scheme: str, keys: Sequence[FileKey]) -> tuple[Path, list]:
    files = [list(astuple(k)) for k in keys]
    name = hashlib.sha256(json.dumps([scheme, files]).encode()).hexdigest()
    return root / f"{name}.json", files


def _read(entry: Path, scheme: str, files: list) -> str | None:
    """The cached digest, or None for a missing, foreign or damaged entry."""
    try:
        with open(entry, "rb") as fh:
            raw = fh.read(MAX_ENTRY_BYTES + 1)
        if len(raw) > MAX_ENTRY_BYTES:
            return None
        data = json.loads(raw)
        if (not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT or data.get("scheme") != scheme
                or data.get("files") != files):
            return None
        digest = data.get("digest")
        return digest if isinstance(digest, str) and _DIGEST_RE.match(digest) else None
    except (OSError, ValueError):   # unreadable or not JSON: recompute (and rewrite)
        return None


def _write(root: Path, entry: Path, scheme: str, files: list, digest: str) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=entry.name + ".", suffix=".tmp", dir=root)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"format": ENTRY_FORMAT, "scheme": scheme, "files": files, "digest": digest}, fh)
            os.replace(tmp, entry)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _prune(root)
    except OSError:   # a read-only or full cache directory costs a rehash next time, nothing else
        pass


def _prune(root: Path) -> None:
    now = time.time()
    entries = []
    for child in root.iterdir():
        try:
            st = child.stat()
        except OSError:
            continue
        if child.name.endswith(".tmp"):
            if now - st.st_mtime > STALE_TMP_S:
                child.unlink(missing_ok=True)
        elif child.suffix in (".json", ".bin"):
            entries.append((st.st_mtime_ns, child))
    entries.sort()
    for _, child in entries[:max(0, len(entries) - MAX_ENTRIES)]:
        child.unlink(missing_ok=True)


def cached_digest(scheme: str, files: Sequence[Path], header: Callable[[int, FileKey], bytes], *,
                  label: str, progress: Progress = None) -> str:
    """The digest of ``files`` under ``scheme``: from the memo or the disk cache, else hashed
    (``header(i, key)`` framed before file i's bytes) and cached if no file changed meanwhile."""
    keys = [file_key(p) for p in files]
    memo_key = (scheme, tuple(keys))
    if memo_key in _memo:
        return _memo[memo_key]
    root = cache_dir()
    entry, rows = _entry_path(root, scheme, keys)
    digest = _read(entry, scheme, rows)
    if digest is None:
        digest = hash_files([(header(i, k), Path(k.path)) for i, k in enumerate(keys)], label=label,
                            progress=progress)
        if [file_key(p) for p in files] != keys:
            return digest            # changed while we read it: right for those bytes, not for the cache
        _write(root, entry, scheme, rows, digest)
    if len(_memo) >= _MEMO_MAX:
        _memo.pop(next(iter(_memo)))
    _memo[memo_key] = digest
    return digest


def _blob_read(entry: Path, header: bytes) -> bytes | None:
    try:
        with open(entry, "rb") as fh:
            raw = fh.read(MAX_BLOB_BYTES + len(header) + 1)
    except OSError:
        return None
    if len(raw) > MAX_BLOB_BYTES + len(header) or not raw.startswith(header):
        return None
    return raw[len(header):]


def _blob_write(root: Path, entry: Path, header: bytes, payload: bytes) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=entry.name + ".", suffix=".tmp", dir=root)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(header + payload)
            os.replace(tmp, entry)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _prune(root)
    except OSError:   # an unwritable cache costs the recomputation, nothing else
        pass


def cached_blob(scheme: str, files: Sequence[Path], compute: Callable[[], bytes]) -> bytes:
    """Bytes derived from ``files`` (a manifest), from the disk cache when no file changed, else
    ``compute()`` -- cached unless a file changed while it ran. The caller checks what it reads
    back (a manifest is decoded and its root compared), so a damaged entry costs a recompute.

    Entry: ``<sha256 of the key>.bin`` holding a one-line JSON key, then the payload; the key is
    the scheme and every file's (path, size, mtime_ns, inode, device), as for digests."""
    keys = [file_key(p) for p in files]
    root = cache_dir()
    entry, rows = _entry_path(root, "blob:" + scheme, keys)
    entry = entry.with_suffix(".bin")
    header = json.dumps({"format": ENTRY_FORMAT, "scheme": scheme, "files": rows}).encode() + b"\n"
    payload = _blob_read(entry, header)
    if payload is not None:
        return payload
    payload = compute()
    if [file_key(p) for p in files] == keys and len(payload) <= MAX_BLOB_BYTES:
        _blob_write(root, entry, header, payload)
    return payload
