"""Drafters and the draft length: what the entry guesses before a verify step (speculative decoding).

Data flow: the speculative driver (speculative.py) asks its ``Drafter`` for
at most k tokens that may follow the text so far, sends the last token plus
those drafts through the route as one verify chunk, and tells the
``DraftPolicy`` what came back (how many the tail accepted, how long the step
took). The policy picks the next k. Both are pure: no I/O, no clock of their
own (the driver measures and passes wall times in), so the tests feed them
numbers.

    Drafter         ``draft(history, k)`` -> at most k token ids; an empty
                    tuple means "no guess": the driver runs a plain decode
                    step instead. A draft never changes the output (the tail
                    keeps only what it would have drawn itself); a good one
                    saves round trips. A drafter with a model may also offer
                    ``prepare(history)``: the driver calls it in a thread of
                    its own while the route runs the prompt.
    PromptLookup    no model: the longest n-gram (``max_ngram`` down to
                    ``min_ngram`` tokens) that ends the history and occurred
                    before in it (prompt + generated text); the tokens that
                    followed its latest earlier occurrence are the draft.
                    Code edits and quoting a given passage repeat long runs of
                    the prompt, so the draft is often right there. Bounded:
                    only the last ``window`` tokens are searched.
    DraftPolicy     k from the measured acceptance and costs: with per-token
                    acceptance a (accepted / (accepted + rejections), the
                    geometric estimate), a step of k drafts yields
                    E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs
                    t(k) = t1 + c * k (t1: a plain step's wall time -- round
                    trips plus one position's compute --, c: the measured cost
                    of one more position, drafting included). Before any
                    verify step it starts with k_start, or with 0 when the
                    hops' compute is most of a plain step (a LAN, loopback). It picks the k in 0..k_max with the
                    most tokens per second; k = 0 is plain decoding. Where
                    compute dominates (a LAN, loopback), c is close to t1 and
                    k = 0 wins: speculation turns itself off, and is probed
                    again after ``probe_every`` plain steps (the text may have
                    reached a passage the drafter knows), the gap doubling
                    after each probe that did not pay (up to MAX_PROBE_GAP),
                    so a route where it never pays loses a vanishing share.
    FixedDraftLength always k (tests, benchmarks that pin the shapes).
    DrafterPool     the entry's draft models (native/draft_model.py): each
                    generation leases one for its whole run (a drafter keeps
                    one sequence's KV), at most ``size`` exist, each loaded on
                    its first draft (in the driver's thread, never the
                    daemon's loop); with none free, prompt lookup drafts.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from proto.errors import LocalError
from proto.limits import MAX_DRAFT_TOKENS

# Longest n-gram the prompt lookup matches: longer matches are rarer and add
# little certainty over three tokens (a code line's indentation and a name).
DEFAULT_MAX_NGRAM = 3
# History tokens the prompt lookup searches: it runs before every step on the
# entry, so it stays a few vector comparisons over at most this many ids.
DEFAULT_LOOKUP_WINDOW = 8192
# First draft length before anything is measured, and the policy's ceiling.
DEFAULT_START_K = 4
DEFAULT_MAX_K = 8
# Plain steps between two probes while speculation is off.
DEFAULT_PROBE_EVERY = 16
# Longest gap between two probes while speculation stays off.
MAX_PROBE_GAP = 256
# Weight of a new measurement in the policy's moving averages.
EWMA_WEIGHT = 0.2
# Draft models one entry keeps (each a llama.cpp context with its own KV): generations that enter
# at once beyond this draft by prompt lookup; the entry's cores are shared with its worker anyway.
DEFAULT_DRAFT_MODELS = 2
# Share of a plain step spent in the hops' compute above which the first verify step waits for a
# probe: the route's round trips are then a small part of a token, and a wider step mostly adds compute.
COMPUTE_SHARE_OFF = 0.5
# Speculation must promise this much more throughput than plain decoding to
# run: below it the estimate's noise could make it a loss.
MIN_GAIN = 1.05


class Drafter(Protocol):
    """Guesses the tokens after ``history`` (see the module doc)."""

    @property
    def name(self) -> str: ...

    def draft(self, history: Sequence[int], k: int) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class PromptLookup:
    """Prompt-lookup drafting: the continuation of an earlier occurrence of the history's last n-gram."""

    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = 1
    window: int = DEFAULT_LOOKUP_WINDOW
    name: str = "prompt-lookup"

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram <= 64:
            raise LocalError("need 1 <= min_ngram <= max_ngram <= 64")
        if self.window < self.max_ngram + 1:
            raise LocalError("the lookup window must hold more than one n-gram")

    def draft(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        if not 0 <= k <= MAX_DRAFT_TOKENS:
            raise LocalError(f"k must be in 0..{MAX_DRAFT_TOKENS}")
        if k == 0 or len(history) < 2:
            return ()
        ids = np.asarray(history[-self.window:], dtype=np.int64)
        for n in range(min(self.max_ngram, ids.size - 1), self.min_ngram - 1, -1):
            # every earlier n-gram that has at least one token after it: starts 0 .. size-1-n
            grams = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((grams == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n          # the latest occurrence: the most local context
                return tuple(int(t) for t in ids[start:start + k])
        return ()


@dataclass(frozen=True, slots=True)
class FixedDraftLength:
    """Always ``k`` drafts (tests and benchmarks that pin the verify shapes)."""

    k: int

    def __post_init__(self) -> None:
        if not 0 <= self.k <= MAX_DRAFT_TOKENS:
            raise LocalError(f"k must be in 0..{MAX_DRAFT_TOKENS}")

    def next_k(self) -> int:
        return self.k

    def observe_plain(self, wall_s: float, compute_s: float = 0.0) -> None:
        pass

    def observe_verify(self, drafted: int, accepted: int, wall_s: float) -> None:
        pass


def _ewma(average: float, value: float) -> float:
    """The moving average after ``value`` (the first value when the average is still 0)."""
    return value if not average else (1 - EWMA_WEIGHT) * average + EWMA_WEIGHT * value


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify step of k drafts yields when each draft is accepted with ``acceptance``
    (independently, until the first rejection), the tail's own token included."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(slots=True)
class DraftPolicy:
    """The adaptive draft length (module doc). ``next_k`` -> 0 means a plain step."""

    k_max: int = DEFAULT_MAX_K
    k_start: int = DEFAULT_START_K
    probe_every: int = DEFAULT_PROBE_EVERY
    accepted: int = 0            # drafted tokens accepted, over the generation
    rejected: int = 0            # verify steps that stopped at a rejection
    plain_s: float = 0.0         # moving average of a plain step's wall time (0: none measured yet)
    compute_s: float = 0.0       # moving average of the hops' own compute in those steps
    extra_s: float | None = None  # moving average of one more position's cost in a verify step
    off_steps: int = 0           # plain steps since speculation last ran
    probe_gap: int = 0           # plain steps before the next probe (0: probe_every)
    _chosen: int = field(default=0)

    def __post_init__(self) -> None:
        if not 1 <= self.k_start <= self.k_max <= MAX_DRAFT_TOKENS or self.probe_every < 1:
            raise LocalError(f"need 1 <= k_start <= k_max <= {MAX_DRAFT_TOKENS} and probe_every >= 1")

    @property
    def acceptance(self) -> float:
        """Per-draft acceptance (the geometric estimate); 0.5 before any verify step."""
        total = self.accepted + self.rejected
        return self.accepted / total if total else 0.5

    def best_k(self) -> int:
        """The k in 0..k_max with the most expected tokens per second (0: plain is best)."""
        if not self.plain_s or self.extra_s is None:
            # Nothing measured of a verify step yet: try one, unless the plain step is mostly the
            # hops' compute (a LAN, loopback), where a wider step costs about what it could save.
            return 0 if self.compute_s > COMPUTE_SHARE_OFF * self.plain_s else self.k_start
        a, t1, c = self.acceptance, self.plain_s, max(self.extra_s, 0.0)
        rates = [expected_tokens(a, k) / (t1 + c * k) for k in range(self.k_max + 1)]
        best = int(np.argmax(rates))
        return best if rates[best] >= MIN_GAIN * rates[0] else 0

    def next_k(self) -> int:
        if not self.plain_s:
            self._chosen = 0                    # measure one plain step first
        else:
            best = self.best_k()
            if best:
                self.probe_gap = self.probe_every
            elif self.off_steps >= (self.probe_gap or self.probe_every):
                best = self.k_start             # probe: the text may have changed
                self.probe_gap = min(2 * (self.probe_gap or self.probe_every), MAX_PROBE_GAP)
            self._chosen = best
        return self._chosen

    def observe_plain(self, wall_s: float, compute_s: float = 0.0) -> None:
        """A plain step took ``wall_s``, of which the hops computed ``compute_s`` (0: unknown)."""
        self.plain_s = _ewma(self.plain_s, wall_s)
        self.compute_s = _ewma(self.compute_s, compute_s)
        self.off_steps += 1

    def observe_verify(self, drafted: int, accepted: int, wall_s: float) -> None:
        if not 0 <= accepted <= drafted:
            raise LocalError("accepted must be in 0..drafted")
        self.off_steps = 0
        self.accepted += accepted
        self.rejected += accepted < drafted
        if self.plain_s and drafted:
            extra = (wall_s - self.plain_s) / drafted
            self.extra_s = extra if self.extra_s is None else _ewma(self.extra_s, extra)


class _LazyDrafter:
    """A draft model loaded on its first draft (native/draft_model.py), in the caller's thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._drafter = None
        self.name = f"draft-model:{path.name}"

    def _loaded(self):
        if self._drafter is None:
            from native.draft_model import LlamaDrafter  # llama.cpp only where a draft model is asked for

            self._drafter = LlamaDrafter(self.path)
        return self._drafter

    def draft(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        return self._loaded().draft(history, k)

    def prepare(self, history: Sequence[int]) -> None:
        self._loaded().prepare(history)


class DrafterPool:
    """Draft models leased one per generation (module doc); ``make`` builds one (tests pass theirs)."""

    def __init__(self, path: Path, size: int = DEFAULT_DRAFT_MODELS,
                 make: Callable[[Path], Drafter] | None = None) -> None:
        if size < 1:
            raise LocalError("a drafter pool holds at least one draft model")
        self.path, self.size = path, size
        self._make = make or _LazyDrafter
        self._lock = threading.Lock()
        self._free: list[Drafter] = []
        self._made = 0

    @contextlib.contextmanager
    def lease(self) -> Iterator[Drafter]:
        with self._lock:
            drafter: Drafter | None = self._free.pop() if self._free else None
            if drafter is None and self._made < self.size:
                drafter = self._make(self.path)
                self._made += 1
        if drafter is None:
            yield PromptLookup()
            return
        try:
            yield drafter
        finally:
            with self._lock:
                self._free.append(drafter)
