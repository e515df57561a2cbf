"""The artifact digest is computed once per file and cached on disk (shard/model/digests.py).

Real files: hashed once, found again after the in-process memo is gone (a worker
respawn) and in a fresh process (a restart); touched, rewritten or replaced files
are hashed again; damaged entries are ignored and rewritten. ``digests.hash_runs``
counts the real hashing in this process."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from native.gguf_range import artifact_digest as gguf_digest
from shard.model import digests
from shard.model.artifact import artifact_digest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "digest-cache"
    monkeypatch.setenv(digests.CACHE_ENV, str(root))
    digests._memo.clear()
    yield root
    digests._memo.clear()


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def _by_hand(root: Path) -> str:
    """The artifact digest's definition, written out: (len, path, size, bytes) per sorted file."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix().encode()
        h.update(len(rel).to_bytes(4, "big") + rel + p.stat().st_size.to_bytes(8, "big") + p.read_bytes())
    return "sha256:" + h.hexdigest()


def runs_for(fn, *args) -> tuple[str, int]:
    """(the digest, how many real hashing runs it took), starting from an empty memo (a new worker)."""
    digests._memo.clear()
    before = digests.hash_runs
    value = fn(*args)
    return value, digests.hash_runs - before


def test_digests_are_unchanged_by_the_cache(cache, tmp_path):
    root = _tree(tmp_path / "m", {"config.json": b"{}", "w/model.safetensors": os.urandom(3000)})
    assert runs_for(artifact_digest, root) == (_by_hand(root), 1)
    assert runs_for(artifact_digest, root) == (_by_hand(root), 0)       # from disk
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(os.urandom(5000))
    assert runs_for(gguf_digest, gguf) == ("sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest(), 1)
    assert runs_for(gguf_digest, gguf)[1] == 0
    # the same bytes under the two schemes are two entries, never confused
    assert runs_for(artifact_digest, gguf)[0] != gguf_digest(gguf)
    assert len(list(cache.glob("*.json"))) == 3


def test_touched_rewritten_and_replaced_files_are_hashed_again(cache, tmp_path):
    root = _tree(tmp_path / "m", {"config.json": b"{}", "model.safetensors": b"a" * 4096})
    first, runs = runs_for(artifact_digest, root)
    assert runs == 1
    weights = root / "model.safetensors"
    st = weights.stat()

    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))           # touched
    assert runs_for(artifact_digest, root) == (first, 1)
    assert runs_for(artifact_digest, root) == (first, 0)

    weights.write_bytes(b"b" * 4096)                                              # rewritten, same size
    changed, runs = runs_for(artifact_digest, root)
    assert runs == 1 and changed != first == _by_hand(_tree(tmp_path / "ref", {"config.json": b"{}",
                                                                                "model.safetensors": b"a" * 4096}))
    st = weights.stat()
    fresh = root / "fresh.tmp"                                                    # replaced: same bytes, size
    fresh.write_bytes(b"b" * 4096)                                                # and mtime, a new inode
    os.utime(fresh, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(fresh, weights)
    assert weights.stat().st_ino != st.st_ino and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert runs_for(artifact_digest, root) == (changed, 1)

    (root / "tokenizer.json").write_bytes(b"{}")                                  # a file more
    assert runs_for(artifact_digest, root)[1] == 1


def test_a_damaged_entry_is_ignored_recomputed_and_rewritten(cache, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(os.urandom(2048))
    good, _ = runs_for(gguf_digest, f)
    [entry] = cache.glob("*.json")
    valid = json.loads(entry.read_text())
    damages = [b"", b"\x00garbage{", json.dumps({**valid, "digest": "sha256:xyz"}).encode(),
               json.dumps({**valid, "digest": "sha256:" + "0" * 64, "files": [["/elsewhere", 1, 1, 1, 1]]}).encode(),
               json.dumps({**valid, "format": 99}).encode(), b" " * (digests.MAX_ENTRY_BYTES + 10)]
    for damage in damages:
        entry.write_bytes(damage)
        assert runs_for(gguf_digest, f) == (good, 1), damage[:40]
        assert json.loads(entry.read_text()) == valid                   # rewritten whole
    entry.unlink()
    entry.mkdir()                                                        # unwritable: still the right digest
    assert runs_for(gguf_digest, f) == (good, 1)


def test_the_cache_stays_bounded(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(digests, "MAX_ENTRIES", 3)
    for i in range(6):
        f = tmp_path / f"m{i}.gguf"
        f.write_bytes(bytes([i]) * 100)
        gguf_digest(f)
    assert len(list(cache.glob("*.json"))) == 3 and not list(cache.glob("*.tmp"))


def test_a_file_changing_while_it_is_hashed_is_not_cached(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(digests, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(digests, "HASH_CHUNK_BYTES", 1024)
    monkeypatch.setattr(digests, "PROGRESS_INTERVAL_S", 0.0)
    f = tmp_path / "growing.gguf"
    f.write_bytes(b"x" * 8192)

    def append(line: str) -> None:          # a download still running: grows at each of 8 + 1 lines
        with open(f, "ab") as fh:
            fh.write(b"y" * 100)

    digests._memo.clear()
    first = digests.cached_digest("file-sha256", [f.resolve()], lambda i, k: b"", label="growing", progress=append)
    assert first == "sha256:" + hashlib.sha256(b"x" * 8192).hexdigest()      # the bytes it had at the start
    assert f.stat().st_size == 8192 + 9 * 100 and list(cache.glob("*.json")) == []
    assert runs_for(gguf_digest, f)[1] == 1 and len(list(cache.glob("*.json"))) == 1


def test_hashing_a_large_file_reports_progress_a_few_times_per_second(tmp_path, monkeypatch):
    monkeypatch.setattr(digests, "HASH_CHUNK_BYTES", 1 << 20)
    big = tmp_path / "big.gguf"
    with open(big, "wb") as fh:                     # sparse: 80 MiB of zeros without writing them
        fh.truncate(80 << 20)
    ticks = iter(i * 0.1 for i in range(10_000))    # each chunk takes 0.1 s on this clock
    out = io.StringIO()
    value = digests.hash_files([(b"", big)], label="big.gguf", progress=out, clock=lambda: next(ticks))
    assert value == "sha256:" + hashlib.sha256(b"\0" * (80 << 20)).hexdigest()
    lines = out.getvalue().splitlines()
    # 80 chunks over 8 s of clock: one line per second at most, then the closing line
    assert 6 <= len(lines) - 1 <= 8, lines
    assert lines[0].startswith("[meshd] hashing big.gguf: ") and " of 84 MB (" in lines[0]
    assert lines[-1].startswith("[meshd] hashed big.gguf: 84 MB in 8.")
    small = tmp_path / "small.gguf"
    small.write_bytes(b"s" * 1000)
    quiet = io.StringIO()
    digests.hash_files([(b"", small)], label="small", progress=quiet)
    assert quiet.getvalue() == ""                   # below PROGRESS_MIN_BYTES: no lines


PROBE = ("import sys; from shard.model import digests; from shard.model.artifact import artifact_digest; "
         "from native.gguf_range import artifact_digest as g; "
         "d = artifact_digest(sys.argv[1]); e = g(sys.argv[2]); print(d, e, digests.hash_runs)")


def test_a_restart_finds_the_digests_on_disk(cache, tmp_path):
    root = _tree(tmp_path / "m", {"config.json": b"{}", "model.safetensors": os.urandom(4096)})
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(os.urandom(4096))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))

    def process() -> list[str]:
        out = subprocess.run([sys.executable, "-c", PROBE, str(root), str(gguf)], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        return out.stdout.split()

    first, second = process(), process()
    assert first[:2] == second[:2] == [_by_hand(root), "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()]
    assert (first[2], second[2]) == ("2", "0")
