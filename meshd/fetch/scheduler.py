"""Which provider fetches which chunks next: the fetch's decisions as a sans-I/O core.

Inputs are events, outputs are runs to ask for; no clock, no socket (the
caller passes ``now``, in seconds of any monotonic clock)::

    Scheduler(manifest, wanted, verified)     the chunks to fetch, the ones already on disk
    .add_provider(peer, entries)              a peer and the entries it holds (None: all)
    .next_run(peer, now) -> Run | None        the next run for that peer's connection
    .chunk_ok(peer, entry, chunk)             a chunk arrived and matched its leaf hash
    .chunk_bad(peer, entry, chunk)            it did not: the peer is blamed
    .run_failed(peer, run, now, why)          transport error / timeout: the rest goes back
    .not_held(peer, run)                      the peer says it lacks those chunks

Rules:

* a chunk is fetched from one provider at a time; a run is consecutive
  missing chunks of one entry, up to ``run_bytes`` (fewer requests, and a
  range's fetch never pulls bytes of an entry it does not need);
* every provider pulls its next run from the first chunk it holds that no
  one has and no one is fetching (first fit in the wanted order), so all
  providers work in parallel on disjoint runs and the file fills in order;
* a chunk that fails its hash blames its sender: the sender gets nothing
  more (``blamed``; the daemon keeps the set per model, so it is never
  asked again), its unfinished chunks go back to the pool, and the caller
  logs it. Blame needs proof, a transport failure does not blame: it backs
  the provider off (``RETRY_BASE_S`` doubling to ``RETRY_MAX_S``) and after
  ``MAX_FAILURES`` in a row drops it for this fetch;
* ``stuck`` says when the missing chunks can no longer come from anyone
  (every provider that holds them is blamed or dropped), so the fetch ends
  with a clear error instead of waiting.

State: per chunk missing / in flight / verified; per provider what it holds,
its runs in flight, its failures, its bytes. Owned by one fetch; the threaded
driver serialises calls with one lock.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shard.model.manifest import Manifest

__all__ = ["Run", "Scheduler", "RETRY_BASE_S", "RETRY_MAX_S", "MAX_FAILURES"]

# A provider whose connection failed is tried again after this, doubling per failure in a row.
RETRY_BASE_S = 1.0
RETRY_MAX_S = 30.0
# Failures in a row (connect, timeout, reset) after which a provider is dropped for this fetch.
MAX_FAILURES = 4

MISSING, IN_FLIGHT, VERIFIED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Run:
    """Chunks ``first .. first+count-1`` of entry ``entry``, ``nbytes`` in all."""

    entry: int
    first: int
    count: int
    nbytes: int


@dataclass(slots=True)
class _Provider:
    entries: frozenset[int] | None          # None: every entry
    inflight: list[Run] = field(default_factory=list)
    blamed: bool = False
    dropped: bool = False
    failures: int = 0
    retry_at: float = 0.0
    bytes: int = 0
    chunks: int = 0

    def holds(self, entry: int) -> bool:
        return self.entries is None or entry in self.entries

    @property
    def usable(self) -> bool:
        return not (self.blamed or self.dropped)


class Scheduler:
    def __init__(self, manifest: Manifest, wanted: Iterable[tuple[int, int]],
                 verified: Iterable[tuple[int, int]] = (), *, run_bytes: int) -> None:
        self.manifest = manifest
        self.run_bytes = max(run_bytes, manifest.chunk_bytes)
        self.order: list[tuple[int, int]] = list(wanted)
        self.state: dict[tuple[int, int], int] = dict.fromkeys(self.order, MISSING)
        for key in verified:
            if key in self.state:
                self.state[key] = VERIFIED
        self.providers: dict[str, _Provider] = {}
        self._cursor = 0      # every chunk before it is not MISSING
        self.total_bytes = sum(self._len(k) for k in self.order)
        self.verified_bytes = sum(self._len(k) for k, s in self.state.items() if s == VERIFIED)
        self.resumed_bytes = self.verified_bytes

    def _len(self, key: tuple[int, int]) -> int:
        return self.manifest.chunk_span(*key)[1]

    # ------------------------------------------------------------------ providers
    def add_provider(self, peer: str, entries: Iterable[int] | None = None) -> None:
        if peer not in self.providers:
            self.providers[peer] = _Provider(None if entries is None else frozenset(entries))

    @property
    def blamed(self) -> list[str]:
        return sorted(p for p, s in self.providers.items() if s.blamed)

    def usable(self, peer: str) -> bool:
        p = self.providers.get(peer)
        return p is not None and p.usable

    # ------------------------------------------------------------------ progress
    @property
    def done(self) -> bool:
        return self.verified_bytes == self.total_bytes and all(s == VERIFIED for s in self.state.values())

    def missing(self) -> list[tuple[int, int]]:
        return [k for k in self.order if self.state[k] != VERIFIED]

    def stuck(self) -> bool:
        """Nothing in flight, and some missing chunk is held by no usable provider."""
        if any(p.inflight for p in self.providers.values()):
            return False
        usable = [p for p in self.providers.values() if p.usable]
        return any(self.state[k] == MISSING and not any(p.holds(k[0]) for p in usable) for k in self.order)

    # ------------------------------------------------------------------ decisions
    def next_run(self, peer: str, now: float) -> Run | None:
        p = self.providers.get(peer)
        if p is None or not p.usable or now < p.retry_at:
            return None
        while self._cursor < len(self.order) and self.state[self.order[self._cursor]] != MISSING:
            self._cursor += 1
        i = self._cursor
        while i < len(self.order):
            key = self.order[i]
            if self.state[key] == MISSING and p.holds(key[0]):
                break
            i += 1
        else:
            return None
        entry, first = self.order[i]
        count, nbytes = 0, 0
        while i < len(self.order):
            key = self.order[i]
            if key[0] != entry or key[1] != first + count or self.state[key] != MISSING:
                break
            size = self._len(key)
            if count and nbytes + size > self.run_bytes:
                break
            self.state[key] = IN_FLIGHT
            count, nbytes, i = count + 1, nbytes + size, i + 1
        run = Run(entry, first, count, nbytes)
        p.inflight.append(run)
        return run

    def _finish_run_if_done(self, p: _Provider, entry: int, chunk: int) -> None:
        for run in p.inflight:
            if run.entry == entry and run.first <= chunk < run.first + run.count:
                if chunk == run.first + run.count - 1:
                    p.inflight.remove(run)
                return

    def chunk_ok(self, peer: str, entry: int, chunk: int) -> None:
        key = (entry, chunk)
        p = self.providers[peer]
        if self.state.get(key) != VERIFIED:
            self.state[key] = VERIFIED
            self.verified_bytes += self._len(key)
        p.bytes += self._len(key)
        p.chunks += 1
        p.failures = 0
        self._finish_run_if_done(p, entry, chunk)

    def _release(self, run: Run, from_chunk: int) -> None:
        for c in range(max(from_chunk, run.first), run.first + run.count):
            if self.state[(run.entry, c)] == IN_FLIGHT:
                self.state[(run.entry, c)] = MISSING
        self._cursor = 0

    def chunk_bad(self, peer: str, entry: int, chunk: int) -> None:
        """The chunk did not match its hash: blame ``peer`` and give back everything it had."""
        p = self.providers[peer]
        p.blamed = True
        for run in p.inflight:
            self._release(run, run.first)
        p.inflight.clear()

    def run_failed(self, peer: str, run: Run, now: float, why: str = "") -> None:
        """The run ended early (transport); its chunks not yet verified go back to the pool."""
        p = self.providers[peer]
        if run not in p.inflight:
            return          # already given back (its provider was blamed or dropped)
        p.inflight.remove(run)
        self._release(run, run.first)
        p.failures += 1
        p.retry_at = now + min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (p.failures - 1))
        if p.failures >= MAX_FAILURES:
            p.dropped = True

    def not_held(self, peer: str, run: Run) -> None:
        """The provider lacks the run's entry: never ask it for that entry again in this fetch."""
        p = self.providers[peer]
        if run in p.inflight:
            p.inflight.remove(run)
            self._release(run, run.first)
        held = p.entries if p.entries is not None else frozenset(
            e for e in range(len(self.manifest.entries)))
        p.entries = held - {run.entry}

    def drop(self, peer: str) -> None:
        """Stop using ``peer`` for this fetch (its connection is gone for good)."""
        p = self.providers.get(peer)
        if p is None:
            return
        for run in p.inflight:
            self._release(run, run.first)
        p.inflight.clear()
        p.dropped = True
