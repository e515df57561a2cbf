"""Shared pieces of the fetch swarm tests: a memory that splits a model in two fetched ranges, the
bytes a range's tensors take, a daemon's last fetch, greedy generation."""
from __future__ import annotations

from pathlib import Path

from meshd.daemon.local_swarm import LocalDaemon, wait_for

KV_TOKENS = 256
RECORD_TTL_S = 8.0
START_TIMEOUT_S = 100
PROMPT = "the swarm answers"


def split_memory(fp, kv: int, first: tuple[int, int], second: tuple[int, int]) -> int:
    """A --memory with which a joiner facing the gap first+second takes exactly ``first`` (the
    longest window from the left that fits) and the next joiner takes ``second``."""
    memory = max(fp.range_bytes(*first, kv), fp.range_bytes(*second, kv))
    assert memory < fp.range_bytes(first[0], first[1] + 1, kv), "the first joiner would take more"
    return memory


def range_tensor_bytes(path: Path, root: str, layers: tuple[int, int]) -> int:
    """The bytes of the tensors layers [A, B) need, from the model's manifest."""
    from meshd.fetch.facts import model_facts, range_entries
    from shard.model.backend import LayerRange
    from shard.model.manifest import BLOB

    if path.is_file():
        from native.gguf_manifest import file_manifest

        manifest = file_manifest(path)
        from native.gguf_range import open_reader
        from native.gguf_write import canonical_metadata

        meta = {manifest.index("gguf:metadata"): canonical_metadata(open_reader(path).fields.values())}
    else:
        from shard.model.st_manifest import dir_manifest

        manifest = dir_manifest(path)
        meta = {i: (path / e.name).read_bytes() for i, e in enumerate(manifest.entries) if e.kind == BLOB}
    assert manifest.root == root
    facts = model_facts(manifest, meta)
    entries = range_entries(manifest, facts, LayerRange(*layers, facts.num_layers))
    return sum(manifest.entries[i].size for i in entries)


def meta_bytes(path: Path) -> int:
    """What a joiner fetches besides its range: the manifest and every BLOB (the "header")."""
    from shard.model.manifest import BLOB

    if path.is_file():
        from native.gguf_manifest import file_manifest

        manifest = file_manifest(path)
    else:
        from shard.model.st_manifest import dir_manifest

        manifest = dir_manifest(path)
    return len(manifest.encode()) + sum(e.size for e in manifest.entries if e.kind == BLOB)


def last_fetch(daemon: LocalDaemon, timeout_s: float = START_TIMEOUT_S) -> dict:
    def done():
        st = daemon.query("status") or {}
        return (st.get("fetch") or {}).get("last_fetch")
    return wait_for(done, f"{daemon.name}'s fetch done", timeout_s, daemon)


def fetch_port(daemon: LocalDaemon) -> dict:
    return ((daemon.query("status") or {}).get("fetch") or {}).get("server") or {}


def generate(daemon: LocalDaemon, prompt: str, n: int) -> dict:
    done = None
    for event in daemon.generate(prompt, max_tokens=n, raw=True):
        if event.get("done"):
            done = event
    assert done is not None and done.get("ok"), done
    return done
