"""Speculative decoding on a star route: several tokens per round trip, the same tokens.

The entry drafts (draft.py), then sends the last token plus k drafted tokens
through every hop as one verify chunk (hop_link.HopLink.verify). Every hop
computes the k + 1 positions; the tail draws its own token at each position
with the draw of plain decoding (shard/session/stream.py) and answers with how
many drafts it accepted (a) and the token after them. The route keeps
L = start + 1 + a positions: each link notes L (``roll_back``) and its next
step carries it as the expected past length, so every hop drops the rejected
positions before that step runs -- no round trip of its own.

State on top of the plain driver's (driver.py):

    history         the prompt and every emitted token (what the drafter reads)
    boundary rows   as in the plain driver, for the kept positions only: after
                    a verdict every boundary is cut back to L
    verify log      start -> (fed end, kept L, drafts, every boundary's input
                    rows of the rejected positions): with the kept rows above,
                    the chunk exactly as the route first ran it. It holds one
                    row per boundary for each rejected draft, so it stays
                    within k_max times the boundary rows (the policy shortens
                    k when drafts are rejected)
    replay          a fresh hop after a failover is fed its history in the
                    route's original shapes: the prompt as one prefill, then
                    per step either one position or the whole verify chunk
                    from the log (then rolled back to L), because a position
                    computed inside a (k+1)-row batch need not equal the same
                    position computed alone (driver.py's _replay). A hop killed
                    mid-verify is replaced like any failed hop: kept hops that
                    already ran the chunk are skipped, fresh ones catch up and
                    run it, and the tail's verdict is the one the first tail
                    would have given (its draws are a pure function of the
                    position and the prefix).

Tokens only: a request that asks for logprobs or logits runs the plain driver
loop (the verify answer carries tokens). Admission: every hop's session
reserves k_max positions more than prompt + max new tokens, since a verify
chunk holds its drafts until the next step drops them. Measurements
(``spec``): drafted, accepted, verify and plain steps, each verify step's
accepted count.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from meshd.errors import HopFailure
from meshd.generate.draft import Drafter, DraftPolicy
from meshd.generate.driver import BoundaryRows, GenerationRequest, SampledToken, SwarmDriver
from meshd.generate.hop_link import HopLink, TailOut
from proto.errors import LocalError
from proto.limits import MAX_DRAFT_TOKENS

log = logging.getLogger(__name__)


class LengthPolicy(Protocol):
    """How many drafts the next step carries (draft.DraftPolicy, draft.FixedDraftLength)."""

    def next_k(self) -> int: ...

    def observe_plain(self, wall_s: float, compute_s: float = 0.0) -> None: ...

    def observe_verify(self, drafted: int, accepted: int, wall_s: float) -> None: ...


@dataclass(frozen=True, slots=True)
class _Verify:
    """One verify chunk as the route ran it: positions [start, fed), L = ``kept`` of them kept."""

    start: int
    fed: int
    kept: int
    drafts: tuple[int, ...]
    rejected: dict[int, np.ndarray]   # boundary layer -> the input rows of positions [kept, fed) there


@dataclass(slots=True)
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round_trip(self) -> float:
        steps = self.verify_steps + self.plain_steps
        return (self.accepted + steps) / steps if steps else 0.0


class SpeculativeDriver(SwarmDriver):
    """The star route driver with speculative decoding (module doc); ``drafter`` guesses,
    ``policy`` picks k (default: the adaptive draft.DraftPolicy)."""

    def __init__(self, *args, drafter: Drafter, policy: LengthPolicy | None = None, k_max: int = 0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafter = drafter
        self.policy: LengthPolicy = policy if policy is not None else DraftPolicy()
        self.k_max = k_max or int(getattr(self.policy, "k_max", getattr(self.policy, "k", MAX_DRAFT_TOKENS)))
        if not 0 <= self.k_max <= MAX_DRAFT_TOKENS:
            raise LocalError(f"k_max must be in 0..{MAX_DRAFT_TOKENS}")
        self.spec = SpecStats()
        self._log: dict[int, _Verify] = {}

    def generate(self, request: GenerationRequest) -> Generator[SampledToken, None, None]:
        if request.logprobs or request.top_logprobs or request.return_logits or not self.k_max:
            yield from super().generate(request)     # the verify answer carries tokens only
            return
        self._max_tokens = len(request.prompt_ids) + request.max_new_tokens + self.k_max
        if self.context_tokens and self._max_tokens - self.k_max > self.context_tokens:
            yield from super().generate(request)     # raises PromptTooLarge with its message
            return
        self._max_tokens = min(self._max_tokens, self.context_tokens or self._max_tokens)
        self._chunk_tokens = request.chunk_tokens
        self._stop_ids = request.stop_ids
        self._tail = request.tail_options()
        self._return_logits = self._want_logprobs = False
        self.stats.started_at = time.monotonic()
        self._done = done = threading.Event()
        self._start_threads()
        try:
            self._set_route(self._plan_first())
            self._rows[0] = BoundaryRows(np.asarray(request.prompt_ids, dtype=np.int64))
            self._prompt_len = len(request.prompt_ids)
            warm = self._warm_drafter(request.prompt_ids)
            out = self._advance_with_failover(self._prompt_len)   # the prefill: no verify history yet
            if warm is not None:
                warm.join()
            if not isinstance(out, TailOut):
                raise LocalError("the tail returned rows, not a token (a route built for embeddings)")
            history = list(request.prompt_ids)
            pending = [int(out.sample.token_id)]
            budget = request.max_new_tokens
            while True:
                for token in pending:
                    self.stats.token_times.append(time.monotonic())
                    yield SampledToken(token)
                    history.append(token)
                    budget -= 1
                    if token in request.stop_ids or budget == 0:
                        return
                n = len(history)              # the last token sits at n - 1, not fed yet
                k = min(self.policy.next_k(), self.k_max, budget - 1, self._max_tokens - n)
                t0 = time.perf_counter()
                drafts = self.drafter.draft(history, k)[:k] if k > 0 else ()
                self._rows[0].write(n - 1, np.array([history[-1], *drafts], dtype=np.int64))
                pending = self._step_with_failover(n - 1, drafts, time.perf_counter() - t0)
        finally:
            done.set()
            self._close_all()
            self._end_threads()

    def _warm_drafter(self, prompt: tuple[int, ...]) -> threading.Thread | None:
        """Let a draft model read the prompt while the route runs it (its ``prepare``), in this
        generation's ThreadGroup; the caller joins it before the first draft. A failure here is
        logged: the first draft meets it again, in the driver's thread."""
        prepare = getattr(self.drafter, "prepare", None)
        if prepare is None:
            return None

        def run() -> None:
            try:
                prepare(prompt)
            except Exception:
                log.warning("the draft model could not read the prompt", exc_info=True)
        return self.threads.start(run, name="draft-prepare")

    # ------------------------------------------------------------------ one step
    def _step_with_failover(self, start: int, drafts: tuple[int, ...], draft_s: float = 0.0) -> list[int]:
        """Run position ``start`` (plain) or ``start`` plus drafts (verify); the tokens it yields.
        ``draft_s``: what drafting them took, counted in the step's cost for the policy (a draft
        model's k sequential forwards are part of what a verify step costs)."""
        fed = start + 1 + len(drafts)
        while True:
            self._check_cancel()
            try:
                t0 = time.perf_counter()
                out = self._step(start, fed, drafts)
                wall = time.perf_counter() - t0 + draft_s
                break
            except HopFailure as failure:
                self._check_cancel()
                self._failover(failure, fed)
        token = int(out.sample.token_id)
        if not drafts:
            self.spec.plain_steps += 1
            self.policy.observe_plain(wall, sum(link.execution_ns for link in self._links) / 1e9)
            return [token]
        accepted = out.accepted or 0
        kept = start + 1 + accepted
        self._log[start] = _Verify(start, fed, kept, drafts,
                                   {b: rows.read(kept, fed).copy() for b, rows in self._rows.items() if rows.n >= fed})
        for rows in self._rows.values():
            rows.n = min(rows.n, kept)
        for link in self._links:
            if link.past_len > kept:
                link.roll_back(kept)
        self.spec.verify_steps += 1
        self.spec.drafted += len(drafts)
        self.spec.accepted += accepted
        self.spec.accepted_per_step.append(accepted)
        self.policy.observe_verify(len(drafts), accepted, wall)
        return [*drafts[:accepted], token]

    def _step(self, start: int, fed: int, drafts: tuple[int, ...]) -> TailOut:
        answer: TailOut | None = None
        for link in self._links:
            spec = link.spec
            if link.past_len >= fed:
                continue     # this hop already ran the step before a later hop failed
            if not link.is_open:
                link.open()
            self._catch_up(link, start)
            rows = self._rows.get(spec.effective_start)
            if rows is None or rows.n < fed:
                raise LocalError(f"no boundary rows at layer {spec.effective_start} up to {fed}")
            inputs = rows.read(start, fed)
            out = link.verify(inputs, drafts, self._steps) if drafts else link.run(inputs, self._steps)
            if spec.is_tail:
                if not isinstance(out, TailOut):
                    raise LocalError("the tail returned rows, not a token")
                answer = out
            else:
                self._write(spec.end, start, out)
        if answer is None:
            raise LocalError("the tail already ran this step: nothing to sample from")
        return answer

    def _write(self, boundary: int, at: int, out: object) -> None:
        if not isinstance(out, np.ndarray):
            raise LocalError("a hop before the tail returned a token, not rows")
        if boundary in self._rows:
            self._rows[boundary].write(at, out)
        elif at == 0:
            self._rows[boundary] = BoundaryRows(out)
        else:
            raise LocalError(f"boundary {boundary} first written at position {at}")

    def _catch_up(self, link: HopLink, start: int) -> None:
        """Feed a hop that is behind everything before ``start`` in the route's original shapes."""
        spec = link.spec
        while link.past_len < start:
            past = link.past_len
            if past < self._prompt_len:      # the prompt: one prefill (the link chunks it)
                out = link.run(self._rows[spec.effective_start].read(past, self._prompt_len), self._steps)
                self._replayed(link, past, out)
                continue
            entry = self._log.get(past)
            if entry is None:          # a plain step
                out = link.run(self._rows[spec.effective_start].read(past, past + 1), self._steps)
                self._replayed(link, past, out)
                continue
            rejected = entry.rejected.get(spec.effective_start)
            if rejected is None:
                raise LocalError(f"the verify step at {past} kept no rows at layer {spec.effective_start}")
            kept_rows = self._rows[spec.effective_start].read(past, entry.kept)
            out = link.verify(np.concatenate([kept_rows, rejected]), entry.drafts, self._steps)
            if not spec.is_tail:
                if not isinstance(out, np.ndarray):
                    raise LocalError("a hop before the tail returned a token, not rows")
                split = entry.kept - past
                entry.rejected[spec.end] = out[split:].copy()   # a fresh hop further on may start there
                self._write(spec.end, past, out[:split])
            link.roll_back(entry.kept)

    def _replayed(self, link: HopLink, at: int, out: object) -> None:
        if not link.spec.is_tail:
            self._write(link.spec.end, at, out)
