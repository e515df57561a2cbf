"""The entry node's route driver: one generation through the swarm, surviving hop failures.

This is the only route driver: the daemon's generate op, ``meshd bench``,
and the tests all run it (tests and benchmarks without a swarm give it a
fixed route: ``routes.FixedRouteSource``).

Topology is a star: the entry opens one Session per hop and carries each
hop's output to the next hop itself, so it sees every boundary. The tail
draws the next token and sends back only its id (and logprobs or its
logits row when the caller asked): about 20 bytes per decode step. That
makes recovery exact and local:

    boundary rows   for every layer boundary b the route crosses, the rows
                    fed into b for positions 0..P-1 (layer 0: the token
                    history itself). Kept until the generation ends; bounded
                    by the session's max tokens.
    advance(P)      for each hop in order: feed it positions [past_len, P)
                    from its effective start's rows (chunked prefill for many
                    positions, the decode fast path for one), write its
                    output rows at its end boundary; the tail returns the
                    token it drew for position P.
    failure         any HopFailure (refusal, closed stream, transport error,
                    step deadline) -> ask the RouteSource for a replacement
                    route that avoids every failed peer (planner's
                    replacement_route: the prefix before the failed hop is
                    kept); hops that are not kept (hops_to_reprefill) get a
                    fresh session at a bumped epoch and past_len 0; then
                    advance(P) again -- new hops are re-prefilled from the
                    boundary rows, kept hops continue where they were, a hop
                    that already finished position P-1 is skipped.
    coverage gap    when the replacement finds no live peer for some layers
                    (every server of them died at once), the driver waits for
                    the swarm to refill them -- the tracker moves a redundant
                    node there once the dead records expire (tracker_duty.py)
                    -- re-asking the RouteSource (cached view, then a fresh
                    DHT read) every REPLAN_POLL_S, backing off to
                    REPLAN_POLL_MAX_S, for at most ``replan_wait_s`` (the
                    daemon's ``refill_wait_s``); the hops after the kept prefix
                    are then re-prefilled as on any failover. Past the bound:
                    CoverageGap (a RouteFailed) names the layers and the wait.
    full peer       a hop refusing with RESOURCE_EXHAUSTED and a retry hint is
                    full, not broken: a replica is tried at once; with none,
                    SwarmFull carries the smallest hint (the API's 429 and
                    Retry-After) without the replan wait.

Greedy output is therefore identical with and without failures (same
inputs, same recipe on every route: the source pins the recipe). Seeded
sampling too: the tail's draw for position P is a pure function of (seed,
P) (shard/model/sampling.py), so a replacement tail that re-runs position P-1
draws the same token.

Silent hops: each link derives its step deadlines from its own measured
step times (deadlines.py); the watchdog thread cuts a call past its
deadline and the hop fails with DEADLINE_EXCEEDED, within a couple of
seconds of a frozen decode step. A cut peer is replaced like a dead one when
the swarm has a replacement; when it has none, the same peer is retried
(fresh session, re-prefilled) with doubled patience, at most
SLOW_PEER_RETRIES times -- a peer that was merely slow once keeps serving.

Threads: ``generate`` is blocking and runs in a worker thread; ``cancel`` is
safe from any thread (the current step finishes, then every hop's KV is
released). The watchdog thread only cuts calls. Every thread a generation
starts (the watchdog, a pushed route's readers and probes) is in its
ThreadGroup (``threads``), joined before ``generate`` returns.

Ownership: each driver holds a random secret; every hop's SessionOpen (and
unary Release) carries ``owner_token(peer, range)`` = HMAC-SHA256(secret,
peer id and range), so a hop knows only its own token: no hop of the route
(and no one who learns the session id) can release, cancel, re-attach or
supersede the session on another hop (shard/session/sessions.py).

Hop transport: the ``HopConnector`` turns a planned hop into a
proto.hop_transport.HopTransport; the daemon's connector pins the peer's TLS
certificate (meshd/reach/tls.py) or uses its own worker's frame socket;
relayed hops (``hop.relayed``) get a circuit through one of the peer's relays
(meshd/reach/relay_dial.py); tests connect to workers in memory
(shard/edges/memory.py). When a relayed hop fails only because its relay died,
the connector's ``retry_same_peer(peer)`` says so: the route is kept, the
failed hop alone gets a fresh session (through another relay) and is
re-prefilled from the boundary rows -- the peer is not avoided, the output is
unchanged.

Measurements (``stats``): the routes and failovers, each token's time, the
prefill time, and per plain decode step (every hop ran one position) its
wall time, the hops' own execution time and the bytes the tail sent back.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from meshd.errors import HopFailure
from meshd.generate.audit import AuditBook, AuditMismatch, StepAuditor, VerifyPolicy
from meshd.generate.hop_link import HopLink, LinkSpec, StepCounter, TailOut
from meshd.generate.receipt_check import ReceiptCheck
from meshd.plan.errors import MissingLayersError
from meshd.plan.routing import Hop, Route, hops_to_reprefill
from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, LocalError, MeshdError
from proto.hop_transport import HopTransport
from proto.limits import DEFAULT_PREFILL_CHUNK_TOKENS, MAX_STOP_TOKENS
from proto.threads import ThreadGroup
from shard.model.sampling import SamplingSpec, check_top_logprobs

log = logging.getLogger(__name__)

# Failovers one generation may go through before giving up (each needs a
# distinct failed peer or a bounded retry, so this also bounds the peers we try).
MAX_FAILOVERS = 8
# A peer cut by its step deadline with no replacement in sight is retried
# (fresh session, doubled patience) at most this often, then treated as failed.
SLOW_PEER_RETRIES = 2
# When no replacement route exists yet (a gap the tracker must refill, records of a new server
# still propagating), re-plan every REPLAN_POLL_S (doubling up to REPLAN_POLL_MAX_S: each try may
# read the DHT) for at most the driver's replan_wait_s; REPLAN_WAIT_S is the default of drivers
# built without one (the daemon passes its refill_wait_s: meshd/config.py).
REPLAN_WAIT_S = 30.0
REPLAN_POLL_S = 0.5
REPLAN_POLL_MAX_S = 2.0
# Watchdog resolution for step deadlines.
WATCHDOG_TICK_S = 0.25
# Longest generation (prompt + new tokens) one driver accepts: the boundary
# rows kept for recovery grow with it.
MAX_SESSION_TOKENS = 32768


class GenerationCancelled(MeshdError):
    """The caller cancelled (client gone, Ctrl-C); every hop's KV was released."""


class RouteFailed(MeshdError):
    """No route could finish the generation; the message says what to do."""


class CoverageGap(RouteFailed):
    """Some layers had no live server for the whole refill wait (``spans``; ``waited_s``): the
    swarm lost every peer serving them and no node was moved or started there in time."""

    def __init__(self, message: str, spans: tuple = (), waited_s: float = 0.0) -> None:
        super().__init__(message)
        self.spans = tuple(spans)
        self.waited_s = waited_s


class PromptTooLarge(LocalError):
    """The prompt plus max new tokens exceed the model's context or every serving peer's
    whole KV budget: no retry helps; shorten the prompt or max_tokens (the API's 400)."""


class SwarmFull(RouteFailed):
    """Every peer that could serve a hop refused for lack of room (RESOURCE_EXHAUSTED) and
    retryably so; ``retry_after_ms`` is the smallest hint they gave. Try again then."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class RouteSource(Protocol):
    def plan(self, needed_tokens: int) -> Route: ...

    def replace(self, route: Route, failed_peer: str, avoid: frozenset[str], needed_tokens: int) -> Route: ...


@dataclass(frozen=True, slots=True)
class PushDial:
    """How a worker reaches a hop to push to it: its gRPC endpoint, the certificate pin from its
    signed record (empty: loopback plaintext, tests), its framed fast path (same pin) if offered."""

    endpoint: str
    pin: bytes = b""
    frames: str = ""


class HopConnector(Protocol):
    """How the driver reaches the hops of its routes (routes.PeerConnector; tests' connectors)."""

    @property
    def self_peer_id(self) -> str:
        """This node's peer id: its own worker is a hop like any other, but never asked for Health."""
        ...

    def transport(self, hop: Hop) -> HopTransport:
        """The hop's transport (connecting lazily is allowed); a MeshdError when it cannot be had."""
        ...

    def retry_same_peer(self, peer_id: str) -> bool:
        """The hop to ``peer_id`` failed: True when another way to the same peer is left (a relayed
        hop whose relay died); the route is then kept and only that hop restarts."""
        ...

    def push_dial(self, hop: Hop, *, head: bool = False) -> PushDial | None:
        """How another worker would reach ``hop`` to push to it (``head``: as the head of a loop);
        None when it cannot (a relayed hop, no pin, our own worker unless peers can dial it)."""
        ...


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation. ``logprobs``: each token's log-probability; ``top_logprobs`` (0..20): the
    most likely alternatives too; ``return_logits``: keep each step's logits row in
    ``stats.logits`` (tests comparing logits; vocab x 4 bytes per step on the wire). Invalid
    values raise LocalError."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingSpec = SamplingSpec()
    stop_ids: frozenset[int] = frozenset()
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    top_logprobs: int = 0
    return_logits: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids or any(not isinstance(t, int) or t < 0 for t in self.prompt_ids):
            raise LocalError("the prompt must be a non-empty sequence of token ids")
        if not 1 <= self.max_new_tokens or len(self.prompt_ids) + self.max_new_tokens > MAX_SESSION_TOKENS:
            raise LocalError(f"need 1 <= max_new_tokens and prompt + new tokens <= {MAX_SESSION_TOKENS}")
        if self.chunk_tokens < 1:
            raise LocalError("chunk_tokens must be >= 1")
        try:
            check_top_logprobs(self.top_logprobs)
        except LimitExceeded as exc:
            raise LocalError(str(exc)) from None
        if not isinstance(self.return_logits, bool) or not isinstance(self.logprobs, bool):
            raise LocalError("return_logits and logprobs must be booleans")

    def tail_options(self) -> pb.TailOptions:
        stops = sorted(self.stop_ids) if len(self.stop_ids) <= MAX_STOP_TOKENS else []   # for a looped tail
        return pb.TailOptions(sample=True, sampling=self.sampling.to_pb(), return_logits=self.return_logits,
                              logprobs=self.logprobs or self.top_logprobs > 0, top_logprobs=self.top_logprobs,
                              stop_token_ids=stops)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One generated token: its id; with ``logprobs``/``top_logprobs`` its log-probability
    (log-softmax of the raw logits) and the most likely (id, logprob) pairs, best first."""

    id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class FailoverEvent:
    failed_peer: str
    position: int
    detail: str
    route: Route
    reprefilled: tuple[int, ...]
    failed_at: float  # time.monotonic() when the failure surfaced


@dataclass(slots=True)
class DriverStats:
    routes: list[Route] = field(default_factory=list)
    failovers: list[FailoverEvent] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # monotonic time of each emitted token
    started_at: float = 0.0                                  # monotonic time generate() began
    # per plain decode step (every hop ran one position through the fast path):
    step_wall_ns: list[int] = field(default_factory=list)
    step_execution_ns: list[int] = field(default_factory=list)   # the hops' own compute, summed
    step_tail_bytes: list[int] = field(default_factory=list)     # response bytes from the tail
    step_hops: list[int] = field(default_factory=list)
    hop_execution_ns: list[int] = field(default_factory=list)    # per hop index, summed over those steps
    step_legs: list[int] = field(default_factory=list)           # network legs each step took, counted (push.py)
    continued_steps: int = 0     # decode inputs the tail's reader sent to the head itself (push.py's continuation)
    looped_steps: int = 0        # decode inputs a looped route's tail sent to the head (push.py)
    logits: list[np.ndarray] = field(default_factory=list)       # with return_logits only

    @property
    def prefill_s(self) -> float:
        return self.token_times[0] - self.started_at if self.token_times else 0.0

    @property
    def tail_bytes_per_decode_step(self) -> float | None:
        steps = self.step_tail_bytes
        return sum(steps) / len(steps) if steps else None


class _Rows:
    """A growable [positions, ...] buffer (amortised appends, no O(n^2) copies)."""

    __slots__ = ("data", "n")

    def __init__(self, first: np.ndarray) -> None:
        self.data = np.empty((max(16, first.shape[0] * 2), *first.shape[1:]), dtype=first.dtype)
        self.n = 0
        self.write(0, first)

    def write(self, at: int, rows: np.ndarray) -> None:
        if at > self.n:
            raise LocalError(f"boundary rows written at {at} but only {self.n} exist")
        end = at + rows.shape[0]
        if end > self.data.shape[0]:
            grown = np.empty((max(end, self.data.shape[0] * 2), *self.data.shape[1:]), dtype=self.data.dtype)
            grown[:self.n] = self.data[:self.n]
            self.data = grown
        self.data[at:end] = rows
        self.n = end

    def read(self, start: int, end: int) -> np.ndarray:
        if end > self.n:
            raise LocalError(f"boundary rows {start}..{end} requested, {self.n} held")
        return self.data[start:end]


BoundaryRows = _Rows   # the public name: the speculative driver (speculative.py) keeps these too


class SwarmDriver:
    def __init__(self, source: RouteSource, connector: HopConnector, *, fingerprint: pb.Fingerprint,
                 replan_wait_s: float = REPLAN_WAIT_S, session_id: str | None = None,
                 on_failover: Callable[[FailoverEvent], None] | None = None, context_tokens: int = 0,
                 verify: VerifyPolicy | None = None, audit_book: AuditBook | None = None,
                 receipts: ReceiptCheck | None = None) -> None:
        self.source, self.connector, self.fingerprint = source, connector, fingerprint
        self.context_tokens = context_tokens   # the model's trained context (0: unknown, unchecked)
        self.replan_wait_s = replan_wait_s
        self.session_id = session_id or uuid.uuid4().hex
        self._owner_secret = os.urandom(32)
        self._full_hint_ms = 0    # smallest retry hint of the peers that refused for lack of room
        self._held: tuple[str, ...] = ()   # peers counted in the source's LoadBook for this generation
        self.on_failover = on_failover
        self.stats = DriverStats()
        self._cancel = threading.Event()
        self._links: list[HopLink] = []
        self._route: Route | None = None
        self._epoch = 0
        self._steps = StepCounter()
        self._rows: dict[int, _Rows] = {}
        self._failed: set[str] = set()
        self._patience: dict[str, float] = {}   # peer -> deadline multiplier after a cut without replacement
        self._slow_retries: dict[str, int] = {}
        self._lock = threading.Lock()  # guards _links against the watchdog / cancel threads
        # Audits (audit.py): a seeded share of each hop's steps re-run on another replica; the
        # book (the entry's, shared by its generations) keeps the excluded peers.
        self.audit_book = audit_book if audit_book is not None else AuditBook()
        self.auditor = (StepAuditor(verify, self.audit_book, session_id=self.session_id)
                        if verify is not None and verify.enabled else None)
        # Each hop's step receipts are checked as they arrive (receipt_check.py; unsigned hops pass).
        self.receipt_check = receipts if receipts is not None else ReceiptCheck()

    # ------------------------------------------------------------------ public
    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def generate(self, request: GenerationRequest) -> Generator[SampledToken, None, None]:
        """Yield the generated tokens one by one (a generator; close() it to stop early)."""
        self._max_tokens = len(request.prompt_ids) + request.max_new_tokens
        if self.context_tokens and self._max_tokens > self.context_tokens:
            raise PromptTooLarge(
                f"the prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_new_tokens}) "
                f"is {self._max_tokens} tokens, past the model's {self.context_tokens}-token context; "
                "shorten the prompt or lower max_tokens")
        self._chunk_tokens = request.chunk_tokens
        self._stop_ids = request.stop_ids
        self._tail = request.tail_options()
        self._return_logits = request.return_logits
        self._want_logprobs = request.logprobs or request.top_logprobs > 0
        self.stats.started_at = time.monotonic()
        done = threading.Event()
        self._done = done
        self._start_threads()
        try:
            self._set_route(self._plan_first())
            self._rows[0] = _Rows(np.asarray(request.prompt_ids, dtype=np.int64))
            target = self._prompt_len = len(request.prompt_ids)
            for produced in range(request.max_new_tokens):
                out = self._advance_with_failover(target)
                if not isinstance(out, TailOut):
                    raise LocalError("the tail returned rows, not a token (a route built for embeddings)")
                token = self._token_of(out)
                self.stats.token_times.append(time.monotonic())
                yield token
                if token.id in request.stop_ids or produced + 1 == request.max_new_tokens:
                    return
                self._rows[0].write(target, np.array([token.id], dtype=np.int64))
                target += 1
        finally:
            done.set()
            self._close_all()
            self._end_threads()

    def embed(self, prompt_ids: Sequence[int], chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS) -> np.ndarray:
        """The final-normed hidden state of every prompt position, [T, hidden] float32: one prefill
        through the route whose tail returns rows (``TailOptions.return_hidden``), not a token. The
        same failover and replay as a generation; star topology (the rows come back to us)."""
        if not prompt_ids or any(not isinstance(t, int) or t < 0 for t in prompt_ids):
            raise LocalError("the text must tokenize to at least one token")
        self._max_tokens = self._prompt_len = len(prompt_ids)
        if self.context_tokens and self._max_tokens > self.context_tokens:
            raise PromptTooLarge(f"the text ({self._max_tokens} tokens) is past the model's "
                                 f"{self.context_tokens}-token context; shorten it")
        self._chunk_tokens, self._stop_ids = chunk_tokens, frozenset()
        self._tail = pb.TailOptions(return_hidden=True)
        self._return_logits = self._want_logprobs = False
        self.stats.started_at = time.monotonic()
        self._done = done = threading.Event()
        self._start_threads()
        try:
            self._set_route(self._plan_first())
            self._rows[0] = _Rows(np.asarray(prompt_ids, dtype=np.int64))
            rows = self._advance_with_failover(self._max_tokens)
            if not isinstance(rows, np.ndarray) or rows.shape[0] != self._max_tokens:
                raise LocalError(f"the tail returned {getattr(rows, 'shape', None)} for {self._max_tokens} positions")
            return rows
        finally:
            done.set()
            self._close_all()
            self._end_threads()

    def _token_of(self, out: TailOut) -> SampledToken:
        if self._return_logits:
            self.stats.logits.append(np.array(out.logits, dtype=np.float32))
        sample = out.sample
        if not self._want_logprobs:
            return SampledToken(int(sample.token_id))
        return SampledToken(int(sample.token_id), float(sample.logprob),
                            tuple((int(t.token_id), float(t.logprob)) for t in sample.top))

    # ------------------------------------------------------------------ routing
    def _plan_first(self) -> Route:
        route = self._replan(lambda: self.source.plan(self._max_tokens))
        excluded = self.audit_book.excluded_peers()
        self._failed |= excluded          # peers an audit caught lying: never in this entry's routes
        for _ in range(len(excluded)):
            liar = next((h.peer_id for h in route.hops if h.peer_id in excluded), None)
            if liar is None:
                break
            route = self._replan(functools.partial(self.source.replace, route, liar, frozenset(self._failed),
                                                   self._max_tokens))
        return route

    def _replan(self, attempt: Callable[[], Route], after: HopFailure | None = None) -> Route:
        wait = 0.0 if getattr(self.source, "static", False) else self.replan_wait_s  # a fixed route never grows
        started = time.monotonic()
        deadline, poll = started + wait, REPLAN_POLL_S
        while True:
            self._check_cancel()
            try:
                return attempt()
            except MissingLayersError as exc:
                now = time.monotonic()
                if now >= deadline:
                    cause = f" (after {after})" if after is not None else ""
                    waited = f"; waited {now - started:.0f} s for a peer to serve them" if wait > 0 else ""
                    raise CoverageGap(f"no route through the swarm{cause}: {exc}{waited}",
                                      exc.spans, now - started) from exc
            self._cancel.wait(min(poll, max(0.0, deadline - time.monotonic())))
            poll = min(poll * 2, REPLAN_POLL_MAX_S)

    def _set_route(self, route: Route, keep: dict[int, HopLink] | None = None) -> None:
        links = []
        for i, hop in enumerate(route.hops):
            link = (keep or {}).get(i)
            if link is None:
                link = self._new_link(i, hop, route.num_layers)
            link.index = i
            links.append(link)
        with self._lock:
            self._links = links
        self._route = route
        self.stats.routes.append(route)
        self._hold(tuple(h.peer_id for h in route.hops))

    def _hold(self, peers: tuple[str, ...]) -> None:
        book = getattr(self.source, "load", None)   # AdsRouteSource's LoadBook (spreads generations)
        if book is not None:
            book.drop(self._held)
            book.hold(peers)
        self._held = peers

    def _new_link(self, index: int, hop: Hop, num_layers: int) -> HopLink:
        spec = LinkSpec(peer_id=hop.peer_id, start=hop.start, end=hop.end, effective_start=hop.effective_start,
                        num_layers=num_layers, session_id=self.session_id, epoch=self._epoch,
                        fingerprint=self.fingerprint, chunk_tokens=self._chunk_tokens, max_tokens=self._max_tokens,
                        tail=self._tail if hop.end == num_layers else None,
                        owner_token=self.owner_token(hop.peer_id, hop.start, hop.end))
        link = HopLink(index, spec, functools.partial(self.connector.transport, hop),
                       patience=self._patience.get(hop.peer_id, 1.0))
        link.receipt_check = self.receipt_check
        return link

    def owner_token(self, peer_id: str, start: int, end: int) -> bytes:
        """This generation's secret for one hop (the same for every epoch of it)."""
        return hmac.new(self._owner_secret, f"{peer_id}|{start}|{end}".encode(), hashlib.sha256).digest()

    # ------------------------------------------------------------------ stepping
    def _advance_with_failover(self, target: int) -> TailOut | np.ndarray:
        while True:
            self._check_cancel()
            try:
                return self._advance(target)
            except HopFailure as failure:
                self._check_cancel()
                self._failover(failure, target)

    def _advance(self, target: int) -> TailOut | np.ndarray:
        """The tail's answer for ``target``: a token, or rows when the route was built for embeddings."""
        answer: TailOut | np.ndarray | None = None
        t0, plain, tail_bytes = time.perf_counter_ns(), True, 0
        for link in self._links:
            spec = link.spec
            if link.past_len >= target:
                plain = False
                continue  # this hop already ran position target-1 before a later hop failed
            if not link.is_open:
                link.open()
            rows = self._rows.get(spec.effective_start)
            if rows is None or rows.n < target:
                raise LocalError(f"no boundary rows at layer {spec.effective_start} up to {target}")
            plain = plain and link.past_len == target - 1 > 0
            before = link.received_bytes
            for a, b in self._replay(link.past_len, target):
                out = link.run(rows.read(a, b), self._steps)
                if self.auditor is not None:   # before the next hop sees the answer (audit.py)
                    self._audit(link, a, b, out)
                if spec.is_tail:
                    answer, tail_bytes = out, link.received_bytes - before
                    continue
                assert isinstance(out, np.ndarray)   # a hop before the tail returns its rows
                first = b - out.shape[0]
                if spec.end in self._rows:
                    self._rows[spec.end].write(first, out)
                elif first == 0:
                    self._rows[spec.end] = _Rows(out)
                else:
                    raise LocalError(f"boundary {spec.end} first written at position {first}")
        if answer is None:
            raise LocalError("the tail already ran this position: nothing to sample from")
        if plain:
            s = self.stats
            s.step_wall_ns.append(time.perf_counter_ns() - t0)
            executed = [link.execution_ns for link in self._links]
            s.step_execution_ns.append(sum(executed))
            s.step_tail_bytes.append(tail_bytes)
            s.step_hops.append(len(executed))
            s.hop_execution_ns.extend([0] * (len(executed) - len(s.hop_execution_ns)))
            for i, ns in enumerate(executed):
                s.hop_execution_ns[i] += ns
        return answer

    def _audit(self, link: HopLink, first: int, end: int, out: TailOut | np.ndarray) -> None:
        route = self._route
        assert self.auditor is not None and route is not None
        hop, rows = route.hops[link.index], self._rows[link.spec.effective_start]
        find = getattr(self.source, "auditors", None)   # a fixed route knows no replicas

        def candidates(h: Hop) -> tuple[Hop, ...]:
            return find(h, frozenset(self._failed)) if find is not None else ()

        def open_link(h: Hop, session_id: str) -> HopLink:
            spec = replace(self._new_link(link.index, h, route.num_layers).spec, session_id=session_id,
                           epoch=0, owner_token=self.owner_token(h.peer_id, h.start, h.end))
            audit = HopLink(link.index, spec, functools.partial(self.connector.transport, h))
            audit.receipt_check = self.receipt_check
            return audit

        def history() -> tuple[Sequence[int], int, int, pb.SamplingParams]:
            tokens = self._rows[0]
            return ([int(t) for t in tokens.read(0, tokens.n)], getattr(self, "_prompt_len", 0), self._chunk_tokens,
                    self._tail.sampling)

        self.auditor.check(link, hop, first, end, out, candidates=candidates, open_link=open_link,
                           inputs=rows.read, replay=self._replay, history=history)

    def _replay(self, past: int, target: int) -> list[tuple[int, int]]:
        """Position batches that repeat how the route first ran [past, target): the prompt as one
        prefill (chunked by the link), then one call per generated position.

        A fresh hop after a failover is fed its history in the very batches the failed hop saw,
        because some kernels are not batch-invariant (llama.cpp's tinyBLAS / repacked K-quant
        GEMMs accumulate differently than its single-row GEMV: a position computed inside a batch
        can differ from the same position decoded alone by far more than rounding,
        docs/measurements/2026-12-01.md). Without a failure this is exactly one batch per call.
        """
        prompt = getattr(self, "_prompt_len", 0)
        batches = [(past, min(prompt, target))] if past < prompt else []
        return batches + [(p, p + 1) for p in range(max(past, prompt), target)]

    def _failover(self, failure: HopFailure, target: int) -> None:
        old = self._route
        assert old is not None
        if len(self.stats.failovers) >= MAX_FAILOVERS:
            raise RouteFailed(f"gave up after {MAX_FAILOVERS} failovers; last: {failure}") from failure
        failed_at = time.monotonic()
        peer = failure.peer_id
        same_hop = 0 <= failure.index < len(old.hops) and old.hops[failure.index].peer_id == peer
        new = None
        if same_hop and self.connector.retry_same_peer(peer):
            new, fresh = old, {failure.index}   # same peer through another relay: only this hop restarts
        elif same_hop and failure.code == pb.ERROR_CODE_DEADLINE_EXCEEDED \
                and self._slow_retries.get(peer, 0) < SLOW_PEER_RETRIES:
            try:   # a silent peer: replace it now if the swarm can, else give it more room once more
                new = self.source.replace(old, peer, frozenset(self._failed | {peer}), self._max_tokens)
                fresh = set(hops_to_reprefill(old, new))
                self._failed.add(peer)
            except MissingLayersError:
                self._slow_retries[peer] = self._slow_retries.get(peer, 0) + 1
                self._patience[peer] = self._patience.get(peer, 1.0) * 2.0
                new, fresh = old, {failure.index}
        if new is None and failure.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and not failure.retry_after_ms:
            # No hint: the session exceeds the peer's WHOLE KV budget. A replica may be bigger;
            # without one, no wait or retry helps: say so at once.
            self._failed.add(peer)
            try:
                new = self.source.replace(old, peer, frozenset(self._failed), self._max_tokens)
            except MissingLayersError as exc:
                raise PromptTooLarge(
                    f"{self._max_tokens} tokens (prompt + max_tokens) do not fit the KV budget of any peer "
                    f"serving these layers ({failure.detail}); shorten the prompt or lower max_tokens") from exc
            fresh = set(hops_to_reprefill(old, new))
        if new is None and failure.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and failure.retry_after_ms:
            # Full, not broken: try a replica at once; with none, tell the caller when to come back
            # (no replan wait: the peer said when it expects room).
            self._full_hint_ms = min(self._full_hint_ms or failure.retry_after_ms, failure.retry_after_ms)
            self._failed.add(peer)
            try:
                new = self.source.replace(old, peer, frozenset(self._failed), self._max_tokens)
            except MissingLayersError as exc:
                raise SwarmFull(f"every peer that serves these layers is full ({failure.detail}); "
                                f"retry in {self._full_hint_ms} ms", self._full_hint_ms) from exc
            fresh = set(hops_to_reprefill(old, new))
        if new is None:
            self._failed.add(peer)
            avoid = frozenset(self._failed)
            try:
                new = self._replan(lambda: self.source.replace(old, peer, avoid, self._max_tokens), failure)
            except CoverageGap as exc:
                raise CoverageGap(f"{exc}; the hop failed with: {failure}", exc.spans, exc.waited_s) from failure
            fresh = set(hops_to_reprefill(old, new))
        if isinstance(failure, AuditMismatch):
            # The liar's earlier answers may sit in the KV of every hop after it: re-prefill them
            # from the rows its replacement recomputes.
            fresh |= {i for i, h in enumerate(new.hops) if h.effective_start >= old.hops[failure.index].end}
        by_hop = {(k.spec.peer_id, k.spec.start, k.spec.end, k.spec.effective_start): k for k in self._links}
        keep: dict[int, HopLink] = {}
        for i, hop in enumerate(new.hops):
            if i not in fresh:
                keep[i] = by_hop.pop((hop.peer_id, hop.start, hop.end, hop.effective_start))
        self._epoch += 1  # new sessions supersede anything a reused peer still holds for this id
        for link in by_hop.values():  # dropped hops: release what they hold (best effort; a liar is alive)
            link.close(release=link.spec.peer_id != peer or isinstance(failure, AuditMismatch))
        if self.auditor is not None:
            self.auditor.reset()   # boundary rows are rewritten: audit sessions start over
        self._set_route(new, keep)
        event = FailoverEvent(peer, target, str(failure), new, tuple(sorted(fresh)), failed_at)
        self.stats.failovers.append(event)
        if self.on_failover is not None:
            self.on_failover(event)

    # ------------------------------------------------------------------ housekeeping
    def _start_threads(self) -> None:
        """This generation's ThreadGroup (the watchdog now; links add their readers and probes)."""
        self.threads = ThreadGroup(f"route-{self.session_id[:8]}")
        self.threads.start(self._watch, name="watchdog")

    def _end_threads(self) -> None:
        """Join every thread of this generation (bounded; the links are closed, so each ends). A
        thread's error is raised, unless the generation already ends with one: then it is logged."""
        if sys.exc_info()[1] is None:
            self.threads.close()
            return
        try:
            self.threads.close()
        except Exception as exc:
            log.error("route %s: its threads did not end cleanly", self.session_id[:8], exc_info=exc)

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise GenerationCancelled("the generation was cancelled; its KV is released on every hop")

    def _watch(self) -> None:
        while not self._done.wait(WATCHDOG_TICK_S):
            now = time.monotonic()
            with self._lock:
                late = [link for link in self._links if link.deadline and now > link.deadline]
            for link in late:
                link.cut()

    def _close_all(self) -> None:
        with self._lock:
            links, self._links = self._links, []
        self._hold(())
        if self.auditor is not None:
            self.auditor.close()
        for link in links:
            link.close(release=True)


def collect(driver: SwarmDriver, request: GenerationRequest) -> list[int]:
    """Run a whole generation and return its token ids (tests, benchmarks)."""
    return [token.id for token in driver.generate(request)]


def route_summary(route: Route) -> Sequence[str]:
    return [f"{h.peer_id[-8:]}[{h.effective_start}:{h.end})" for h in route.hops]
