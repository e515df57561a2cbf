"""The steps of fetching a range, blocking (the daemon runs them in a thread; the bench calls them):

    get_manifest(store, providers)            the store's, or the first provider's that hashes to the root
    get_meta(store, manifest, providers)      every BLOB entry (GGUF metadata, config and tokenizer files)
    RangeFetch(store, manifest, meta, range)  the range's slice: a Target, a Fetch, and at the end
       .run(providers, stop) -> Path          a finished slice checked as the worker will check it

A provider list is a callable returning the providers known now (the daemon
refreshes it from the DHT); a step with nobody to ask waits for it, until
``stop``. Nothing unverified is kept: the manifest must hash to the root,
every chunk to its leaf, and the finished slice as a whole to the root again.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from meshd.errors import ConfigError
from meshd.fetch.facts import meta_entries, model_facts
from meshd.fetch.fetcher import Fetch, MemorySink, Provider
from meshd.fetch.links import LinkError, NotHeld
from meshd.fetch.store import ModelStore, Target, make_target
from proto.errors import MeshdError, ProtocolError
from proto.threads import ThreadGroup
from shard.model.backend import LayerRange
from shard.model.manifest import Manifest

log = logging.getLogger(__name__)

__all__ = ["get_manifest", "get_meta", "RangeFetch", "check_slice_root"]

# Between two looks for providers when none can help yet.
PROVIDER_POLL_S = 1.0
# How soon a stop reaches a running fetch.
STOP_POLL_S = 0.1

Providers = Callable[[], list[Provider]]


def get_manifest(store: ModelStore, providers: Providers, stop: threading.Event,
                 say: Callable[[str], None] = log.info) -> Manifest:
    """The model's manifest: from the store, else from the first provider whose copy hashes to the root."""
    manifest = store.manifest()
    if manifest is not None:
        return manifest
    tried: dict[str, str] = {}
    while not stop.is_set():
        for p in providers():
            if p.peer in tried:
                continue
            link = p.connect()
            try:
                manifest = Manifest.decode(link.manifest(), root=store.root)
            except (LinkError, NotHeld, ProtocolError, MeshdError) as exc:
                tried[p.peer] = str(exc)
                say(f"fetch: no manifest from {p.peer[:16]}: {exc}")
                continue
            finally:
                link.close()
            store.save_manifest(manifest)
            say(f"fetch: manifest of {store.root[:23]}... from {p.peer[:16]} ({len(manifest.entries)} entries, "
                f"{manifest.total_bytes / 1e6:.0f} MB in all)")
            return manifest
        stop.wait(PROVIDER_POLL_S)
        if len(tried) > 64:
            tried.clear()     # peers may have come back with it
    raise ConfigError("stopped before the model's manifest arrived")


def get_meta(store: ModelStore, manifest: Manifest, providers: Providers, stop: threading.Event,
             on_blame: Callable[[str, str, int], None] | None = None) -> dict[int, bytes]:
    """Every BLOB entry, checked: from the store, the rest fetched (and then stored)."""
    entries = meta_entries(manifest)
    have = {i: d for i in entries if (d := store.blob(manifest, i)) is not None}
    missing = [i for i in entries if i not in have]
    if missing:
        sink = MemorySink(manifest, missing)
        wanted = [(i, c) for i in missing for c in range(len(manifest.entries[i].chunks))]
        fetch = Fetch(manifest, sink, wanted, label="metadata", on_blame=on_blame)
        if not _drive(fetch, providers, stop):
            raise ConfigError("stopped before the model's metadata arrived")
        for i, data in sink.result().items():
            store.save_blob(i, data)
            have[i] = data
    return have


def _drive(fetch: Fetch, providers: Providers, stop: threading.Event) -> bool:
    """Run ``fetch`` while feeding it the providers known now; one helper thread looks for new
    ones every PROVIDER_POLL_S and passes ``stop`` on (joined before returning)."""
    def feed() -> None:
        last = 0.0
        while not fetch.stop.is_set():
            if stop.is_set():
                fetch.stop.set()
                return
            if time.monotonic() - last >= PROVIDER_POLL_S:
                last = time.monotonic()
                blamed = set(fetch.blamed)
                for p in providers():
                    if p.peer not in blamed:
                        fetch.add_provider(p)
            fetch.stop.wait(STOP_POLL_S)

    for p in providers():
        fetch.add_provider(p)
    with ThreadGroup("fetch-feed") as feeder:   # closed on exit: the feeder ends within STOP_POLL_S
        feeder.on_stop(fetch.stop.set)
        feeder.start(feed)
        try:
            return fetch.run()
        finally:
            fetch.stop.set()


def check_slice_root(path: Path, root: str) -> None:
    """The finished slice read as the worker reads it: its root must be ``root`` (ArtifactError if not)."""
    from meshd.plan.modelinfo import model_digest

    got = model_digest(path)
    if got != root:
        raise ConfigError(f"{path} names model {got[:23]}..., not {root[:23]}...")


class RangeFetch:
    """The slice of one range: resumes a part left by an earlier run, fetches the rest."""

    def __init__(self, store: ModelStore, manifest: Manifest, meta: dict[int, bytes], layer_range: LayerRange, *,
                 on_blame: Callable[[str, str, int], None] | None = None) -> None:
        self.store, self.manifest, self.meta, self.range = store, manifest, meta, layer_range
        self.facts = model_facts(manifest, meta)
        self.target: Target = make_target(store, manifest, self.facts, meta, layer_range)
        self.fetch: Fetch | None = None
        self.on_blame = on_blame
        self.resumed_chunks = 0
        self.started = time.monotonic()

    def open(self) -> Fetch:
        verified = self.target.open()
        self.resumed_chunks = len(verified)
        self.fetch = Fetch(self.manifest, self.target, self.target.wanted, verified,
                           label=f"layers {self.range.start}:{self.range.end}", on_blame=self.on_blame)
        return self.fetch

    def run(self, providers: Providers, stop: threading.Event) -> Path:
        fetch = self.fetch or self.open()
        try:
            if not _drive(fetch, providers, stop):
                raise ConfigError("stopped before the range was fetched")
        finally:
            if not fetch.sched.done:
                self.target.close()     # keeps the part and its bitmap for the next run
        path = self.target.finish()
        check_slice_root(path, self.manifest.root)
        return path
