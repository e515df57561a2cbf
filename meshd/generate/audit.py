"""Audits at the entry: re-run a seeded share of each hop's steps on another replica, exclude liars.

Why it works: a split reproduces the whole model bit for bit on one runtime
and recipe when the hops see the same inputs in the same batches (the route
driver's ``_replay``), so an honest replica's recomputation of a step is a
proof of what the step should have been.

Data flow (star routes, where the entry holds every boundary's rows; the
driver calls ``StepAuditor.check`` right after a hop answered a step, before
the next hop consumes the answer):

    pick        ``AuditSampler``: for each hop (peer and range), one step in every window of
                ceil(1/rate) of its steps, at a seeded random offset inside the window: a
                share ``rate`` of the steps, unpredictable to the hop, and a hop that lies on
                every step is caught within two windows (2/rate of its steps) -- never later.
                ``rate`` 1 (``--verify all``): every step.
    auditor     another peer whose ads serve the same model, recipe and [effective start, end)
                (``auditor_hops``; peers already failed or excluded are not asked). Its audit
                session (own session id, ``<session>.audit<n>``) is kept across audits and fed
                the audited hop's input history -- the boundary rows at its effective start,
                token ids at the head -- in the very batches the hop saw, so it only catches
                up on the positions since the last audit.
    compare     the auditor's answer for the step against the hop's: rows exactly (or within
                ``VerifyPolicy.tolerance``, for lanes whose batching drifts: torch with
                batching on, docs/measurements), a tail's token (and logits when both
                returned them).
    mismatch    the peer is excluded at once (``AuditBook``: this entry's routes avoid it
                from now on) and ``AuditMismatch``, a HopFailure, goes to the driver's
                failover: a replacement re-runs the span from the kept boundary rows, and
                every hop after it is re-prefilled too (their KV may hold rows a lie fed).
                An auditor that fails is not an accusation: the step stays unaudited.

With ``--verify all`` every hop's step is checked before the next hop sees it,
so no lie reaches a streamed token: greedy and seeded outputs equal an honest
run's. At lower rates, tokens streamed before the detection may carry a lie.

State: the sampler's per-hop windows, the audit links (closed on every
failover: a replacement rewrote the rows they were fed), and the shared
``AuditBook`` (counters and excluded peers, one per entry node, thread-safe).
The audits run synchronously in the driver's thread: on these 2-core hosts an
audited step costs one more hop step; spare-capacity scheduling is for later.
"""
from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from meshd.config import DEFAULT_VERIFY_RATE, parse_verify_rate
from meshd.errors import ConfigError, HopFailure
from meshd.generate.evidence import Accusation
from meshd.generate.hop_link import HopLink, StepCounter, TailOut
from meshd.plan.routing import Hop
from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError

VERIFY_ALL = "all"
# The torch lane's batched forwards differ from single-row ones by rounding: measured on the
# test Llama, a decode row computed in a batch of 8 sessions differs from the same row alone by at
# most ~1e-6 of the rows' largest magnitude per hop (tests/test_audit.py measures it each run and
# requires 10x headroom below this bound). 1e-4 leaves that margin for longer KV histories, while a
# lie -- noise at 1 % of the rows' spread, a skipped layer, another dtype -- lands orders above it.
TORCH_BATCH_TOLERANCE = 1e-4
# Audit links kept open at once (one per audited hop range, normally a handful).
MAX_AUDIT_LINKS = 16
# Accusations an entry keeps for evidence records (a liar is excluded after its first).
MAX_ACCUSATIONS = 64


# (token ids of positions 0.., prompt length, chunk tokens, a tail's sampling): what evidence needs
EvidenceRecipe = tuple[Sequence[int], int, int, pb.SamplingParams]


class AuditMismatch(HopFailure):
    """An auditor's recomputation of the hop's step differs from the hop's answer: the hop lied."""


@dataclass(frozen=True, slots=True)
class VerifyPolicy:
    """``rate`` in [0, 1] (1: every step); ``seed`` fixes which steps (None: fresh randomness);
    ``tolerance``: 0 compares exactly, else the largest |difference| allowed relative to the
    rows' own largest magnitude (batch drift)."""

    rate: float = DEFAULT_VERIFY_RATE
    seed: int | None = None
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.rate, (int, float)) and 0.0 <= self.rate <= 1.0):
            raise LocalError(f"the verify rate must be in [0, 1] or {VERIFY_ALL!r}, got {self.rate!r}")
        if not (math.isfinite(self.tolerance) and 0.0 <= self.tolerance < 1.0):
            raise LocalError("the audit tolerance must be in [0, 1)")

    @classmethod
    def parse(cls, text: str, **kw) -> VerifyPolicy:
        """``--verify RATE|all``: a fraction (0.03), a percentage (3%), or all (meshd.config)."""
        try:
            return cls(parse_verify_rate(text), **kw)
        except ConfigError as exc:
            raise LocalError(str(exc)) from None

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    @classmethod
    def for_lane(cls, rate: float, backend: str, **kw) -> VerifyPolicy:
        """Exact on the llama.cpp lane (per-session KV streams); the torch lane's batch drift bound
        otherwise (peers may batch even when this node does not)."""
        return cls(rate, tolerance=0.0 if backend == "llama.cpp" else TORCH_BATCH_TOLERANCE, **kw)


class AuditSampler:
    """Which steps of each hop to audit: one per window of ceil(1/rate), seeded (module doc)."""

    def __init__(self, rate: float, seed: int | None) -> None:
        self.window = 0 if rate <= 0 else max(1, math.ceil(1.0 / rate - 1e-9))
        self._rng = random.Random(seed)
        self._state: dict[str, tuple[int, int]] = {}     # hop key -> (steps seen, chosen index in window)

    def pick(self, key: str) -> bool:
        """Count one step of hop ``key``; True when this step is audited."""
        if self.window == 0:
            return False
        seen, chosen = self._state.get(key, (0, -1))
        offset = seen % self.window
        if offset == 0:
            chosen = self._rng.randrange(self.window)
        self._state[key] = (seen + 1, chosen)
        return offset == chosen


@dataclass
class AuditBook:
    """One entry's audit figures and excluded peers (shared by its generations; thread-safe)."""

    audits: int = 0          # steps re-run on an auditor and compared
    mismatches: int = 0
    unaudited: int = 0       # steps picked but not audited (no replica, or the auditor failed)
    excluded: dict[str, str] = field(default_factory=dict)    # peer -> why
    # mismatches both peers signed receipts for (evidence.py), newest last, at most MAX_ACCUSATIONS
    accusations: list[Accusation] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, *, audits: int = 0, unaudited: int = 0) -> None:
        with self._lock:
            self.audits += audits
            self.unaudited += unaudited

    def exclude(self, peer_id: str, detail: str, accusation: Accusation | None = None) -> None:
        with self._lock:
            self.mismatches += 1
            self.excluded.setdefault(peer_id, detail)
            if accusation is not None:
                self.accusations = [*self.accusations[-(MAX_ACCUSATIONS - 1):], accusation]

    def excluded_peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self.excluded)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"audits": self.audits, "mismatches": self.mismatches, "unaudited": self.unaudited,
                    "excluded": sorted(self.excluded)}


def auditor_hops(ads: Iterable, hop: Hop, *, model_digest: str, recipe_digest: str | None,
                 now_ms: int, avoid: frozenset[str]) -> tuple[Hop, ...]:
    """Hops of other live peers that can run exactly ``hop``'s [effective start, end), cheapest first."""
    found = []
    for ad in ads:
        if (ad.peer_id == hop.peer_id or ad.peer_id in avoid or ad.model_digest != model_digest
                or (recipe_digest is not None and ad.recipe_digest != recipe_digest)
                or ad.expires_at_ms <= now_ms or not ad.start <= hop.effective_start < ad.end
                or ad.end != hop.end):
            continue
        found.append((ad.decode_ms_per_layer, ad.peer_id,
                      Hop(ad.peer_id, ad.start, ad.end, hop.effective_start, ad.relayed, ad.grpc_endpoint)))
    return tuple(h for _, _, h in sorted(found, key=lambda f: (f[0], f[1])))


def answers_agree(expected: np.ndarray | TailOut, got: np.ndarray | TailOut, tolerance: float) -> str:
    """'' when the auditor's answer ``got`` agrees with the hop's ``expected``; else what differs."""
    if isinstance(expected, TailOut) or isinstance(got, TailOut):
        if not (isinstance(expected, TailOut) and isinstance(got, TailOut)):
            return "the answers are of different kinds"
        if int(expected.sample.token_id) != int(got.sample.token_id):
            return f"token {expected.sample.token_id} where the auditor drew {got.sample.token_id}"
        if expected.logits is None or got.logits is None:
            return ""
        return answers_agree(np.asarray(expected.logits), np.asarray(got.logits), tolerance)
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return f"rows {expected.dtype}{expected.shape} where the auditor got {got.dtype}{got.shape}"
    if tolerance == 0.0:
        if np.array_equal(expected, got):
            return ""
        return "rows differ from the auditor's (exact lane)"
    a, b = expected.astype(np.float64), got.astype(np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return "" if np.array_equal(expected, got, equal_nan=True) else "non-finite rows differ"
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-30)
    diff = float(np.abs(a - b).max(initial=0.0)) / scale
    return "" if diff <= tolerance else f"rows differ from the auditor's by {diff:.3g} of their scale"


class StepAuditor:
    """The audits of one generation (see the module doc); the driver owns it."""

    def __init__(self, policy: VerifyPolicy, book: AuditBook, *, session_id: str) -> None:
        self.policy, self.book, self.session_id = policy, book, session_id
        self.sampler = AuditSampler(policy.rate, policy.seed)
        self._links: dict[tuple[str, int, int], HopLink] = {}
        self._steps = StepCounter()
        self._opened = 0
        self.audited_steps = 0
        self.picked_steps = 0

    def check(self, link: HopLink, hop: Hop, first: int, end: int, answer: np.ndarray | TailOut, *,
              candidates: Callable[[Hop], tuple[Hop, ...]], open_link: Callable[[Hop, str], HopLink],
              inputs: Callable[[int, int], np.ndarray], replay: Callable[[int, int], list[tuple[int, int]]],
              history: Callable[[], EvidenceRecipe] | None = None) -> None:
        """Audit the step [first, end) ``link`` just answered with ``answer`` when the sampler
        picks it; AuditMismatch (after excluding the peer) when an auditor disagrees."""
        spec = link.spec
        if not self.sampler.pick(f"{spec.peer_id}|{spec.effective_start}|{spec.end}"):
            return
        self.picked_steps += 1
        for auditor in candidates(hop):
            done = self._recompute(auditor, first, end, open_link=open_link, inputs=inputs, replay=replay)
            if done is None:
                continue                  # that auditor failed: try the next one
            got, audit_link = done
            self.audited_steps += 1
            self.book.count(audits=1)
            differs = answers_agree(answer, got, self.policy.tolerance)
            if differs:
                detail = (f"audit of positions [{first}, {end}) of layers [{spec.effective_start}, {spec.end}) "
                          f"on {auditor.peer_id[:16]}: {differs}")
                accusation = None
                if history is not None:
                    tokens, prompt, chunk, sampling = history()
                    accusation = Accusation.of(link, audit_link, token_ids=tokens, prompt_tokens=prompt,
                                               chunk_tokens=chunk, sampling=sampling)
                self.book.exclude(spec.peer_id, detail, accusation)
                raise AuditMismatch(link.index, spec.peer_id, detail, pb.ERROR_CODE_PAYLOAD_CORRUPT)
            return
        self.book.count(unaudited=1)

    def _recompute(self, auditor: Hop, first: int, end: int, *, open_link: Callable[[Hop, str], HopLink],
                   inputs: Callable[[int, int], np.ndarray],
                   replay: Callable[[int, int], list[tuple[int, int]]]
                   ) -> tuple[np.ndarray | TailOut, HopLink] | None:
        key = (auditor.peer_id, auditor.effective_start, auditor.end)
        link = self._links.get(key)
        if link is not None and link.past_len > first:
            link.close(release=True)          # it ran past this step (cannot happen in order): start over
            link = None
        if link is None:
            if len(self._links) >= MAX_AUDIT_LINKS:
                self.close()
            self._opened += 1
            link = self._links[key] = open_link(auditor, f"{self.session_id}.audit{self._opened}")
        try:
            if not link.is_open:
                link.open()
            got: np.ndarray | TailOut | None = None
            for a, b in replay(link.past_len, end):
                got = link.run(inputs(a, b), self._steps)
            return (got, link) if got is not None else None
        except HopFailure:
            self._links.pop(key, None)
            link.close(release=False)
            return None

    def reset(self) -> None:
        """A failover rewrote boundary rows: audit sessions start over from the history."""
        self.close()

    def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.close(release=True)
