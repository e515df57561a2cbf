"""Sans-I/O session manager: per-(route session, epoch) KV over one RangeBackend.

State (owned here, nowhere else): a table SessionKey -> _Session holding the
backend cache of the owned layers, the KV reservation (``max_tokens``), the
last idempotency step and its result, and the last-use time from the injected
clock. Plus two bounded memories: the highest epoch seen per route session id
(to refuse stale epochs) and cancelled keys (to refuse work after a cancel).

Rules, checked in this order on every ``step``:
  1. expired sessions (idle > ttl) are dropped first;
  2. an epoch below the highest seen for the id -> EpochStale;
     a cancelled key -> Cancelled; an unknown key -> CacheMiss(actual 0);
  3. idempotency_step <= last step -> acknowledged as a duplicate, not
     re-applied (the last step's result is replayed, older ones are not kept);
  4. position != expected_past_len -> ProtocolViolation;
     expected_past_len below the cache's real length, right after a verify
     step and not below its first position + 1 -> the drafted positions past
     it are dropped (speculative decoding: the next step carries how many the
     tail accepted); otherwise expected_past_len != the cache's real length
     -> CacheMiss(actual);
  5. inputs are validated against the backend (dtype, shape, room in the
     reservation) before the backend is called; a backend failure drops the
     cache (the session restarts at past_len 0) and raises a typed error
     (``shard.errors.map_failure``: the backend's own refusal or the peer's
     protocol error as it is, ResourceExhausted only for a real lack of
     memory, else InternalError), logged with its traceback.
Ownership: every session is bound to the ``Owner`` that opened it -- the
authenticated peer the edge saw (the Noise peer id of a relayed circuit, as
the node's own daemon reports it; the client address on the TLS port; "local"
on the worker's private edges) and the SHA-256 of the opener's
``owner_token`` (a per-hop secret the driver derives; it travels only inside
the pinned TLS or end-to-end Noise channel). Re-attaching, superseding with a
higher epoch, releasing or cancelling a session with another owner is
PermissionDenied; the session is untouched. Work on a session happens on the
stream that opened (or re-attached to) it, so it is owned too.

Admission (``open``): reservations are counted in tokens against
``kv_budget_tokens``; a peer holds at most ``max_sessions_per_peer`` sessions;
no new session while ``max_queued_steps`` steps wait for the next batched
forward (queue depth; weights and the forward's scratch are bounded where the
plan counts them: meshd/plan/footprint.py, shard/session/batching.py).
Eviction happens only under pressure (the budget or the table is full), oldest
(least recently used) first, and only of sessions that are idle: the opener's
same owner's after ``min_idle_before_evict_s``, anyone else's only after
``foreign_idle_evict_s`` (abandoned: a live generation steps far more often).
If that is not enough the new session gets ResourceExhausted with
``retry_after_ms``. The backend's own
cache may refuse too: its ResourceExhausted (llama.cpp's sequences or cells)
and a real MemoryError are "no room"; any other failure to create a cache is
InternalError (logged), never reported as lack of room. A higher epoch of an
id supersedes (and frees) the lower ones of the same owner. ``release`` frees
at once. Sessions idle past ``ttl_s`` are dropped whatever the pressure (a
crashed driver never releases).

No I/O, no threads: the gRPC/relay edges serialize calls (one lock). The only
side effect is the worker log line of a failure that is ours.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from proto.errors import LimitExceeded, ProtocolViolation
from shard.errors import CacheMiss, Cancelled, EpochStale, PermissionDenied, ResourceExhausted, log_failure, map_failure
from shard.model.backend import RangeBackend, ids_in_range
from shard.session.session_ids import (  # noqa: F401 - re-exported
    LOCAL_OWNER,
    MAX_OWNER_TOKEN_BYTES,
    MAX_PEER_CHARS,
    MAX_SESSION_ID_CHARS,
    MIN_OWNER_TOKEN_BYTES,
    Owner,
    SessionKey,
)
from shard.session.step_meter import StepMeter

log = logging.getLogger(__name__)

# SessionOpen.max_tokens == 0 means "unspecified": reserve this many.
DEFAULT_SESSION_TOKENS = 2048
# Sessions live this long without any use (a crashed driver never releases).
DEFAULT_TTL_S = 300.0
# step() looks for sessions idle past the TTL at most this often (the worker also sweeps on its own).
EXPIRE_CHECK_S = 1.0
# A session used this recently is never evicted for a newcomer of the same
# peer (prevents two of its routes from thrashing each other mid-generation).
DEFAULT_MIN_IDLE_BEFORE_EVICT_S = 2.0
# Another peer's session is evicted for a newcomer only after this long idle:
# a live generation steps every few ms to a few s (a long prefill upstream),
# so a session idle this long is abandoned (its driver crashed or lost us).
DEFAULT_FOREIGN_IDLE_EVICT_S = 60.0
# Bounded session table regardless of the token budget.
DEFAULT_MAX_SESSIONS = 256
# Sessions one peer may hold: a quarter of the table, so no single peer can
# take every slot (an entry runs one session per generation per hop).
DEFAULT_MAX_SESSIONS_PER_PEER = 64
# Remembered ids for stale-epoch and cancel checks; oldest forgotten first.
EPOCH_MEMORY = 4096
# Smallest retry hint: below this a retry storm costs more than it saves.
MIN_RETRY_AFTER_MS = 100
# New sessions are refused while this many steps wait for the worker's next
# batched forward (shard/session/batching.py): each waiting step already pays one batch
# of latency, and a newcomer's prefill chunks would add to every one of them.
# 32 waiting steps is four full c=8 rounds of decode rows.
DEFAULT_MAX_QUEUED_STEPS = 32


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    kv_budget_tokens: int
    ttl_s: float = DEFAULT_TTL_S
    min_idle_before_evict_s: float = DEFAULT_MIN_IDLE_BEFORE_EVICT_S
    max_sessions: int = DEFAULT_MAX_SESSIONS
    foreign_idle_evict_s: float = DEFAULT_FOREIGN_IDLE_EVICT_S
    max_sessions_per_peer: int = DEFAULT_MAX_SESSIONS_PER_PEER
    max_queued_steps: int = DEFAULT_MAX_QUEUED_STEPS

    def __post_init__(self) -> None:
        if min(self.kv_budget_tokens, self.max_sessions, self.max_sessions_per_peer, self.max_queued_steps) <= 0:
            raise ValueError("kv_budget_tokens, max_sessions, max_sessions_per_peer and max_queued_steps "
                             "must be positive")
        if self.ttl_s <= 0 or self.min_idle_before_evict_s < 0 or self.foreign_idle_evict_s < 0:
            raise ValueError("ttl_s must be positive and the eviction idle times non-negative")


@dataclass(frozen=True, slots=True)
class StepResult:
    """``payload`` is the (post-processed) backend output; None for an old duplicate."""

    payload: object
    past_len: int
    duplicate: bool
    execution_nanos: int


@dataclass(frozen=True, slots=True)
class ManagerStats:
    active_sessions: int
    kv_reserved_tokens: int
    kv_cached_tokens: int
    kv_budget_tokens: int

    @property
    def kv_pressure(self) -> float:
        return min(1.0, self.kv_reserved_tokens / self.kv_budget_tokens)


class _Session:
    __slots__ = ("key", "owner", "cache", "max_tokens", "last_step", "last_payload", "last_used", "hidden_out",
                 "rollback_floor")

    def __init__(self, key: SessionKey, owner: Owner, cache, max_tokens: int, now: float,
                 hidden_out: bool = False) -> None:
        self.hidden_out = hidden_out
        self.key = key
        self.owner = owner
        self.cache = cache
        self.max_tokens = max_tokens
        self.last_step: int | None = None
        self.last_payload: object = None
        self.last_used = now
        # After a verify step: the shortest length the next step may roll the cache back to (the
        # verify's first position + 1: its input token was real, the rest were drafts). None otherwise.
        self.rollback_floor: int | None = None


class SessionManager:
    def __init__(self, backend: RangeBackend, policy: SessionPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.policy = policy
        self.clock = clock
        self.meter = StepMeter()   # recent real steps' speed, for Health (shard/session/step_meter.py)
        self._sessions: OrderedDict[SessionKey, _Session] = OrderedDict()  # LRU order
        self._next_expiry_check = float("-inf")   # step() sweeps idle sessions at most every EXPIRE_CHECK_S
        self._epochs: OrderedDict[str, int] = OrderedDict()
        self._cancelled: OrderedDict[SessionKey, None] = OrderedDict()

    # -- bookkeeping ------------------------------------------------------------
    def _remember_epoch(self, key: SessionKey) -> None:
        seen = self._epochs.pop(key.session_id, -1)
        self._epochs[key.session_id] = max(seen, key.epoch)
        while len(self._epochs) > EPOCH_MEMORY:
            self._epochs.popitem(last=False)

    def _check_current(self, key: SessionKey) -> None:
        newest = self._epochs.get(key.session_id, -1)
        if key.epoch < newest:
            raise EpochStale(f"epoch {key.epoch} is stale; the current epoch is {newest}")
        if key in self._cancelled:
            raise Cancelled("the session was cancelled; open a new epoch")

    def _drop(self, key: SessionKey) -> bool:
        session = self._sessions.pop(key, None)
        if session is None:
            return False
        session.cache.release()
        return True

    def _touch(self, session: _Session) -> None:
        session.last_used = self.clock()
        self._sessions.move_to_end(session.key)

    def expire(self) -> list[SessionKey]:
        """Drop sessions idle longer than the TTL; returns their keys."""
        deadline = self.clock() - self.policy.ttl_s
        expired = [k for k, s in self._sessions.items() if s.last_used < deadline]
        for key in expired:
            self._drop(key)
        return expired

    def stats(self) -> ManagerStats:
        sessions = self._sessions.values()
        return ManagerStats(
            active_sessions=len(self._sessions),
            kv_reserved_tokens=sum(s.max_tokens for s in sessions),
            kv_cached_tokens=sum(s.cache.past_len for s in sessions),
            kv_budget_tokens=self.policy.kv_budget_tokens,
        )

    def past_len(self, key: SessionKey) -> int | None:
        session = self._sessions.get(key)
        return None if session is None else session.cache.past_len

    # -- admission ---------------------------------------------------------------
    def _check_owner(self, session: _Session, owner: Owner, doing: str) -> None:
        if session.owner != owner:
            raise PermissionDenied(f"cannot {doing} session {session.key.session_id[:32]}: "
                                   "another peer opened it (owner token or peer differs)")

    def _evictable(self, session: _Session, owner: Owner, now: float) -> bool:
        idle = now - session.last_used
        if session.owner == owner:
            return idle >= self.policy.min_idle_before_evict_s
        return idle >= self.policy.foreign_idle_evict_s

    def _check_queue(self) -> None:
        """Refuse a newcomer while the batch queue is deep (the backend is a BatchingBackend)."""
        depth = getattr(self.backend, "queue_depth", 0)
        if depth >= self.policy.max_queued_steps:
            wait_ms = getattr(self.backend, "last_batch_ms", 0.0) * depth
            raise ResourceExhausted(
                f"{depth} steps already wait for this worker's next forward (at most "
                f"{self.policy.max_queued_steps} before new sessions are refused); try another replica",
                retry_after_ms=max(MIN_RETRY_AFTER_MS, math.ceil(wait_ms)))

    def _make_room(self, tokens: int, owner: Owner) -> None:
        policy, now = self.policy, self.clock()
        held = sum(1 for s in self._sessions.values() if s.owner.peer == owner.peer)
        if held >= policy.max_sessions_per_peer:
            raise ResourceExhausted(
                f"this peer already holds {held} sessions here (at most {policy.max_sessions_per_peer} "
                "per peer); release some first", retry_after_ms=max(MIN_RETRY_AFTER_MS, 1000))
        reserved = sum(s.max_tokens for s in self._sessions.values())
        count = len(self._sessions)
        victims: list[SessionKey] = []
        for key, session in self._sessions.items():  # least recently used (oldest) first
            if reserved + tokens <= policy.kv_budget_tokens and count < policy.max_sessions:
                break
            if not self._evictable(session, owner, now):
                continue
            victims.append(key)
            reserved -= session.max_tokens
            count -= 1
        if reserved + tokens > policy.kv_budget_tokens or count >= policy.max_sessions:
            waits = [(policy.min_idle_before_evict_s if s.owner == owner else policy.foreign_idle_evict_s)
                     - (now - s.last_used) for s in self._sessions.values()]
            wait_s = min(waits) if waits else 0.0
            retry_ms = max(MIN_RETRY_AFTER_MS, math.ceil(wait_s * 1000))
            raise ResourceExhausted(
                f"KV budget full ({reserved} of {policy.kv_budget_tokens} tokens reserved, "
                f"{count} sessions); {tokens} more do not fit",
                retry_after_ms=retry_ms)
        for key in victims:
            self._drop(key)

    def _new_cache(self, tokens: int, hidden_out: bool):
        """A backend cache; ``hidden_out``: a tail's embeddings session (the backend's cache must offer it)."""
        cache = self.backend.new_cache(tokens)
        if hidden_out:
            inner = getattr(cache, "inner", cache)     # under the batching wrapper
            if not hasattr(inner, "hidden_out"):
                cache.release()
                raise ProtocolViolation(f"this {self.backend.backend_name} tail cannot return hidden states "
                                        "(embeddings need a torch tail)")
            inner.hidden_out = True
        return cache

    def open(self, key: SessionKey, max_tokens: int = 0, owner: Owner = LOCAL_OWNER, *,
             hidden_out: bool = False) -> int:
        """Admit (or re-attach to) a session; returns the tokens already cached."""
        self.expire()
        self._check_current(key)
        existing = self._sessions.get(key)
        if existing is not None:
            self._check_owner(existing, owner, "re-attach to")
            self._touch(existing)
            return existing.cache.past_len
        tokens = max_tokens or DEFAULT_SESSION_TOKENS
        if tokens > self.policy.kv_budget_tokens:
            refusal = ResourceExhausted(
                f"a session of {tokens} tokens exceeds this shard's whole KV budget "
                f"({self.policy.kv_budget_tokens}); use a shard with more memory")
            refusal.retryable = False
            raise refusal
        self._check_queue()
        older = [s for k, s in self._sessions.items() if k.session_id == key.session_id and k.epoch < key.epoch]
        for session in older:
            self._check_owner(session, owner, "supersede")
        for session in older:
            self._drop(session.key)  # superseded by the new epoch
        self._make_room(tokens, owner)
        try:
            cache = self._new_cache(tokens, hidden_out)
        except ProtocolViolation:
            raise
        except Exception as exc:  # llama.cpp's pool may be full (its ResourceExhausted); else ours
            log_failure(log, exc, f"creating a KV cache of {tokens} tokens")
            raise map_failure(exc, f"creating a KV cache of {tokens} tokens") from exc
        self._remember_epoch(key)
        self._sessions[key] = _Session(key, owner, cache, tokens, self.clock(), hidden_out)
        return 0

    # -- work ----------------------------------------------------------------------
    def _validate(self, session: _Session, inputs: np.ndarray, effective_start: int) -> None:
        backend = self.backend
        if not isinstance(inputs, np.ndarray):
            raise ProtocolViolation("inputs must be an array")
        if effective_start == 0:
            if inputs.dtype != np.int64 or inputs.ndim != 1:
                raise ProtocolViolation(f"the head takes int64 token ids [T], got {inputs.dtype} {inputs.shape}")
            if not ids_in_range(inputs, backend.vocab_size):
                raise ProtocolViolation(f"token ids must be in 0..{backend.vocab_size - 1}")
        elif (inputs.dtype != backend.boundary_dtype or inputs.ndim != 2
              or inputs.shape[1] != backend.hidden_size):
            raise ProtocolViolation(
                f"hidden states must be {backend.boundary_dtype} [T, {backend.hidden_size}], "
                f"got {inputs.dtype} {inputs.shape}")
        count = inputs.shape[0]
        if count == 0:
            raise ProtocolViolation("a step must carry at least one position")
        if session.cache.past_len + count > session.max_tokens:
            raise LimitExceeded(f"{count} more tokens exceed the session's reservation of "
                                f"{session.max_tokens} (at {session.cache.past_len})")

    def step(self, key: SessionKey, *, step: int, position: int, expected_past_len: int,
             inputs: np.ndarray, effective_start: int,
             post: Callable[[np.ndarray], object] | None = None, lend: bool = False,
             verify: bool = False) -> StepResult:
        """Apply one prefill chunk or decode step (rules in the module docstring). ``lend``: ``post``
        keeps nothing of the output, so the backend may lend it (shard/session/batching.py).
        ``verify``: a verify step (speculative decoding) -- a tail returns every position's logits
        [T, vocab], and the next step may drop the positions after the first."""
        now = self.clock()
        if now >= self._next_expiry_check:     # idle TTLs are minutes: no need to sweep every token
            self._next_expiry_check = now + min(EXPIRE_CHECK_S, self.policy.ttl_s / 4)
            self.expire()
        self._check_current(key)
        session = self._sessions.get(key)
        if session is None:
            raise CacheMiss("no such session here (never opened, released, expired or evicted)",
                            actual_past_len=0)
        self._touch(session)
        if session.last_step is not None and step <= session.last_step:
            payload = session.last_payload if step == session.last_step else None
            return StepResult(payload, session.cache.past_len, True, 0)
        if position != expected_past_len:
            raise ProtocolViolation(f"position {position} differs from expected_past_len {expected_past_len}")
        actual = session.cache.past_len
        floor = session.rollback_floor
        if floor is not None and floor <= expected_past_len < actual:
            self._roll_back(session, expected_past_len)
            actual = expected_past_len
        if expected_past_len != actual:
            raise CacheMiss(f"expected past length {expected_past_len}, cache holds {actual}",
                            actual_past_len=actual)
        self._validate(session, inputs, effective_start)
        inner = getattr(session.cache, "inner", session.cache)   # under the batching wrapper
        if verify and not (hasattr(inner, "truncate") and hasattr(inner, "logits_rows")):
            raise ProtocolViolation(f"this {self.backend.backend_name} shard cannot roll its KV back: "
                                    "no speculative decoding through it")
        session.rollback_floor = None
        t0 = time.perf_counter_ns()
        try:
            if verify:
                inner.logits_rows = True
            try:
                output = self.backend.forward(session.cache, inputs, effective_start=effective_start,
                                              **({"lend": True} if lend and post is not None
                                                 and getattr(self.backend, "lends_outputs", False) else {}))
            finally:
                if verify:
                    inner.logits_rows = False
            payload = post(output) if post is not None else output
        except Exception as exc:
            doing = f"running {inputs.shape[0]} positions at {actual} (session cache reset to 0)"
            log_failure(log, exc, doing)
            session.cache.release()
            if self._sessions.get(key) is not session:   # dropped while its forward ran (batching)
                raise map_failure(exc, doing) from exc
            try:
                session.cache = self._new_cache(session.max_tokens, session.hidden_out)
                session.last_step, session.last_payload = None, None
            except Exception as again:  # noqa: BLE001 - no fresh cache: the next request is a CACHE_MISS at 0
                log_failure(log, again, "creating a fresh KV cache after a failure")
                self._sessions.pop(key, None)
            raise map_failure(exc, doing) from exc
        elapsed = time.perf_counter_ns() - t0
        self.meter.observe(int(inputs.shape[0]), self.backend.layer_range.end - effective_start, elapsed / 1e9)
        session.last_step, session.last_payload = step, payload
        if verify:
            session.rollback_floor = position + 1
        return StepResult(payload, session.cache.past_len, False, elapsed)

    def _roll_back(self, session: _Session, length: int) -> None:
        """Drop the cache's positions from ``length`` on (a verify step's rejected drafts)."""
        session.rollback_floor = None
        getattr(session.cache, "inner", session.cache).truncate(length)

    def release(self, key: SessionKey, owner: Owner = LOCAL_OWNER) -> bool:
        """Free the session at once; idempotent (False when nothing was there); its owner only."""
        session = self._sessions.get(key)
        if session is not None:
            self._check_owner(session, owner, "release")
        return self._drop(key)

    def release_all(self) -> int:
        """Free every session (the worker is stopping); how many there were."""
        keys = list(self._sessions)
        for key in keys:
            self._drop(key)
        return len(keys)

    def cancel(self, key: SessionKey, owner: Owner = LOCAL_OWNER) -> int:
        """Drop the session and refuse further work on this (id, epoch); its owner only.

        Cancelling a key that is not here is allowed and remembered unless
        another owner holds a session of the same id (a higher epoch would make
        theirs stale): then PermissionDenied."""
        for session in [s for k, s in self._sessions.items() if k.session_id == key.session_id]:
            self._check_owner(session, owner, "cancel")   # nor mark another's epochs stale
        self._cancelled[key] = None
        while len(self._cancelled) > EPOCH_MEMORY:
            self._cancelled.popitem(last=False)
        self._remember_epoch(key)
        return int(self._drop(key))
