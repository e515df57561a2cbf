"""The entry's front door: every generation, from HTTP or the control socket, passes here.

    edge (HTTP route / control socket)
      -> Entry.generate(params, send, edge=...)
           admission   at most ``max_running`` generations run; up to
                       ``max_deferred`` wait (FIFO) for at most ADMISSION_WAIT_S;
                       beyond that: Busy (HTTP 429 + Retry-After)
           deadline    the whole generation within ``deadline_s``, else it is
                       cancelled (KV released) and GenerationDeadline (HTTP 504)
           record      the core's events are watched on their way to ``send``:
                       metrics (meshd/api/metrics.py), the routes in use and the
                       last few generations (the dashboard's status JSON)
      -> core(params, send, observer=metrics)   (meshd/generate/service.py ``generate``)

State: the slot semaphore, the counts of running/deferred generations, the
live generations and a short history. Only trio touches it.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from meshd.api.errors import Busy, GenerationDeadline, first_leaf
from meshd.api.metrics import ApiMetrics
from meshd.generate.params import GenerateParams
from meshd.generate.service import Embeddings, EmbeddingsUnsupported, NotReady
from proto.errors import LocalError

Send = Callable[[dict], Awaitable[None]]
Core = Callable[..., Awaitable[None]]     # core(params, send, *, observer)
EmbedCore = Callable[..., Awaitable["Embeddings"]]   # embed_core(texts, *, truncate, observer)

# A CPU entry runs a handful of generations at once (each hop serialises
# its forwards); more would only slow every one of them down.
DEFAULT_MAX_RUNNING = 4
# Waiting room before "try later" (429).
DEFAULT_MAX_DEFERRED = 16
# How long a deferred request waits for a slot before it is told to retry.
ADMISSION_WAIT_S = 30.0
# The longest one generation may take once admitted, prefill included (4096
# tokens at ~10 tok/s fit); the wait for a slot has its own bound above.
DEFAULT_DEADLINE_S = 600.0
# What a refused client is told to wait.
BUSY_RETRY_AFTER_S = 2
# Finished generations shown on the dashboard.
RECENT_GENERATIONS = 16


@dataclass(frozen=True, slots=True)
class EntryLimits:
    max_running: int = DEFAULT_MAX_RUNNING
    max_deferred: int = DEFAULT_MAX_DEFERRED
    deadline_s: float = DEFAULT_DEADLINE_S
    admission_wait_s: float = ADMISSION_WAIT_S

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_deferred < 0 or self.deadline_s <= 0 or self.admission_wait_s < 0:
            raise LocalError("entry limits: need max_running >= 1, max_deferred >= 0, deadline_s > 0")


class _Record:
    """One generation as the entry watches it (times on the monotonic clock)."""

    def __init__(self, edge: str) -> None:
        self.edge = edge
        self.started = time.monotonic()
        self.first = self.last = 0.0
        self.prompt_tokens = self.tokens = self.failovers = 0
        self.drafted = self.accepted = 0      # speculative decoding's drafted and accepted tokens
        self.route: list[str] = []
        self.finish_reason = ""

    def see(self, event: dict) -> None:
        if event.get("event") == "start":
            self.prompt_tokens = int(event.get("prompt_tokens", 0))
        elif "token" in event:
            now = time.monotonic()
            if not self.tokens:
                self.first = now
            self.last = now
            self.tokens += 1
            if "route" in event:
                self.route = list(event["route"])
        elif event.get("done"):
            self.failovers = len(event.get("failovers") or ())
            self.drafted = int(event.get("drafted_tokens", 0))
            self.accepted = int(event.get("accepted_tokens", 0))
            self.finish_reason = str(event.get("finish_reason", ""))

    def summary(self) -> dict:
        decode_s = self.last - self.first
        return {"edge": self.edge, "route": self.route, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
                "age_s": round(time.monotonic() - self.started, 1), "failovers": self.failovers,
                "finish_reason": self.finish_reason,
                "ttft_s": round(self.first - self.started, 3) if self.tokens else None,
                "decode_tokens_per_s": round((self.tokens - 1) / decode_s, 2) if decode_s > 0 else None}


def _outcome(exc: BaseException) -> str:
    for kind, name in ((Busy, "busy"), (NotReady, "not_ready"), (GenerationDeadline, "deadline"),
                       (LocalError, "client_error"), (trio.Cancelled, "cancelled")):
        if isinstance(exc, kind):
            return name
    return "error"


class Entry:
    def __init__(self, core: Core, limits: EntryLimits = EntryLimits(), metrics: ApiMetrics | None = None,
                 embed_core: EmbedCore | None = None) -> None:
        self.core, self.limits, self.embed_core = core, limits, embed_core
        self.metrics = metrics or ApiMetrics()
        self._slots = trio.Semaphore(limits.max_running)
        self.running = 0
        self.deferred = 0
        self._live: dict[int, _Record] = {}
        self.recent: collections.deque[dict] = collections.deque(maxlen=RECENT_GENERATIONS)

    def snapshot(self) -> dict:
        """Generations now and lately (the dashboard's routes in use)."""
        return {"running": self.running, "deferred": self.deferred, "max_running": self.limits.max_running,
                "live": [r.summary() for r in self._live.values()], "recent": list(self.recent)}

    async def _admit(self) -> None:
        if self._slots.value == 0:
            if self.deferred >= self.limits.max_deferred:
                raise Busy(f"this entry runs {self.limits.max_running} generations and has "
                           f"{self.deferred} waiting; retry in a moment", BUSY_RETRY_AFTER_S)
            self.deferred += 1
            self.metrics.deferred.set(self.deferred)
            try:
                with trio.move_on_after(self.limits.admission_wait_s):
                    await self._slots.acquire()
                    return
            finally:
                self.deferred -= 1
                self.metrics.deferred.set(self.deferred)
            raise Busy(f"no generation slot freed within {self.limits.admission_wait_s:g} s; retry later",
                       BUSY_RETRY_AFTER_S)
        await self._slots.acquire()

    async def generate(self, params: GenerateParams, send: Send, *, edge: str = "http") -> None:
        """Run one generation through the core with admission, deadline and records (see module doc)."""
        outcome = "error"
        try:
            await self._admit()
            record = _Record(edge)
            self.running += 1
            self.metrics.processing.set(self.running)
            self._live[id(record)] = record

            async def watched(event: dict) -> None:
                record.see(event)
                if "token" in event and record.tokens == 1:
                    self.metrics.ttft.observe(record.first - record.started)
                await send(event)

            try:
                with trio.fail_after(self.limits.deadline_s):
                    await self.core(params, watched, observer=self.metrics)
                outcome = "ok"
            except trio.TooSlowError as exc:
                raise GenerationDeadline(f"the generation did not finish within {self.limits.deadline_s:g} s "
                                         "(it was cancelled and its KV released)") from exc
            finally:
                self._slots.release()
                self.running -= 1
                self.metrics.processing.set(self.running)
                del self._live[id(record)]
                self.recent.appendleft(record.summary())
                prompt_s = (record.first - record.started) if record.tokens else 0.0
                self.metrics.generation(prompt_tokens=record.prompt_tokens if record.tokens else 0,
                                        prompt_s=prompt_s, predicted=record.tokens,
                                        predicted_s=max(record.last - record.first, 0.0),
                                        failovers=record.failovers, drafted=record.drafted,
                                        accepted=record.accepted)
        except BaseException as exc:
            outcome = _outcome(first_leaf(exc))
            raise
        finally:
            self.metrics.requests.labels(edge, outcome).inc()

    async def embed(self, texts: list[str], *, truncate: bool = True, normalize: bool = True,
                    edge: str = "http") -> Embeddings:
        """Mean-pooled last hidden states of ``texts`` through the swarm, with the same admission and
        deadline as a generation (each text is one prefill of the whole route)."""
        outcome = "error"
        try:
            if self.embed_core is None:
                raise EmbeddingsUnsupported("this node cannot compute embeddings")
            await self._admit()
            self.running += 1
            self.metrics.processing.set(self.running)
            try:
                with trio.fail_after(self.limits.deadline_s):
                    result = await self.embed_core(texts, truncate=truncate, normalize=normalize,
                                                    observer=self.metrics)
                outcome = "ok"
                return result
            except trio.TooSlowError as exc:
                raise GenerationDeadline(f"the embeddings did not finish within {self.limits.deadline_s:g} s") from exc
            finally:
                self._slots.release()
                self.running -= 1
                self.metrics.processing.set(self.running)
        except BaseException as exc:
            outcome = _outcome(first_leaf(exc))
            raise
        finally:
            self.metrics.requests.labels(edge, outcome).inc()

    async def control_request(self, request: dict, send: Send) -> None:
        """The control socket's ``generate`` op (meshd/daemon/control.py streams the events)."""
        await self.generate(GenerateParams.from_request(request), send, edge="control")
