"""The generate core: validated params -> tokens -> route driver -> text events.

One core for every edge: the control socket (``run_generate``: one JSON line
in, JSON lines out) and the HTTP API (meshd/api/: OpenAI and Ollama routes
call ``generate`` with params they validated themselves). Data flow::

    GenerateParams (meshd/generate/params.py; a bad field is the client's LocalError)
      -> readiness: our worker serves (a client-only node, --layers none: the model's
         digest is known), the swarm covers every layer (else NotReady: the edge says
         "retry later", HTTP 503 + Retry-After, with the layers nobody serves and, when
         the pool is short, the memory that closes the gap: the swarm's ``pool_status``)
      -> token ids (the artifact's tokenizer, meshd/generate/tokenizer.py: chat
         template for messages, or for a prompt unless "raw")
      -> SwarmDriver (meshd/generate/driver.py) in one worker thread,
         routes from the DHT (AdsRouteSource over Swarm.fresh_snapshot),
         channels pinned to each peer's certificate (PeerConnector), or
         circuits through a relay for peers behind NAT (meshd/reach/relay_dial.py),
         each metered when an observer is given (meshd/generate/hop_meter.py)
      -> token ids through a bounded Outbox (relay/portal.py) -> TextStream (stop strings held
         back and cut, meshd/generate/textstream.py) -> events:
      <- {"event": "start", "prompt_tokens": n, "session": id}
         {"text": "...", "token": id[, "logprob", "piece", "top_logprobs"][, "route"]} per token
             ("route" on the first token and after a failover: the hops now in use)
         {"text": "..."}   (held-back text released at the end, if any)
         {"done": true, "finish_reason": "stop"|"length", "tokens": [...], ...}

With ``"logprobs": true`` each token event also carries ``"logprob"`` (log-
softmax of the raw logits), ``"piece"`` and, with ``"top_logprobs": N``
(0..20), that many ``{"token", "piece", "logprob"}`` alternatives. The done
event carries the route, failovers and timings: ``prefill_s``, ``decode_s``,
``decode_tokens_per_s``, ``tail_bytes_per_decode_step`` (response bytes from
the tail per decode step: the token alone is ~20), and per decode step its
wall time, the hops' own compute and the hop count (``step_wall_ms``,
``step_execution_ms``, ``step_hops``).

The node is seen through ``EntryView`` (entry_view.py), which the daemon's
swarm part implements: its identity, the model, the latest swarm snapshot,
its own worker.

Routes are planned here, at the entry, from its own DHT view, with the same
pure planner (routing.py) and the same signed records the tracker would use
rather than asking the tracker: one round trip less, and a
generation never depends on the tracker being reachable mid-way, e.g. while
duty moves after the tracker died.

Threads: the driver runs in one ``trio.to_thread`` thread that the calling
task waits for (so its nursery does), and the driver joins every thread it
started (its ThreadGroup: watchdog, push readers) before that thread returns.
The thread reaches the loop only through the daemon's Portal (DHT snapshots,
tokens).

Cancellation: the caller cancelling (client gone, deadline, daemon stopping)
cancels the driver; it finishes the step in flight and releases the KV on
every hop before the thread returns. A completed stop string ends the
generation the same way. The daemon never abandons the thread.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trio

from meshd.generate.audit import VerifyPolicy
from meshd.generate.draft import Drafter, DrafterPool, PromptLookup
from meshd.generate.driver import GenerationCancelled, GenerationRequest, PromptTooLarge, SampledToken, SwarmDriver
from meshd.generate.entry_view import EntryView
from meshd.generate.hop_meter import HopObserver, MeteredConnector
from meshd.generate.params import DEFAULT_MAX_TOKENS, MAX_NEW_TOKENS, MAX_PROMPT_CHARS, GenerateParams  # noqa: F401 - re-exported
from meshd.generate.push import PushDriver
from meshd.generate.routes import AdsRouteSource, PeerConnector
from meshd.generate.speculative import SpeculativeDriver
from meshd.generate.textstream import TextStream
from meshd.plan.adverts import CoverageMap
from meshd.plan.errors import MissingLayersError
from meshd.plan.routing import plan_route
from proto import shard_runtime_pb2 as pb
from proto.errors import MeshdError
from relay.portal import Outbox, Portal

# Tokens buffered between the driver thread and the socket writer.
TOKEN_QUEUE_DEPTH = 32
# What a client is told to wait before retrying when the swarm cannot serve
# yet: about one swarm refresh (records propagate, a worker finishes loading).
RETRY_AFTER_S = 5
# How often a driver thread waiting for room in that buffer checks for a cancel.
ROOM_POLL_S = 0.25

Send = Callable[[dict], Awaitable[None]]


def wall_ms() -> int:
    return int(time.time() * 1000)


class NotReady(MeshdError):
    """The swarm cannot serve a generation right now (nothing is the client's fault): retry later."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EmbeddingsUnsupported(MeshdError):
    """The swarm's runtime recipe cannot return hidden states (a llama.cpp tail): HTTP 501."""


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]     # one per text, mean-pooled (L2-normalized when asked)
    prompt_tokens: int


def _relayed_of(swarm: EntryView, peer_id: str) -> tuple[str, ...]:
    snap = swarm.snapshot   # the latest snapshot (replaced whole, so safe to read from the driver thread)
    return tuple(snap.relayed.get(peer_id, ())) if snap is not None else ()


def load_tokenizer(model_path):
    from meshd.generate.tokenizer import EntryTokenizer

    return EntryTokenizer(model_path)


async def run_generate(swarm: EntryView, request: dict, send: Send) -> None:
    """Serve one control-socket generate request; raises LocalError for a request we cannot serve."""
    await generate(swarm, GenerateParams.from_request(request), send)


async def check_ready(swarm: EntryView) -> None:
    """Raise NotReady unless our worker serves (a client-only node has none: it only needs the model's
    digest) and the swarm (fresh view) covers every layer."""
    if swarm.digest is None:
        raise NotReady("this node is still reading the model's digest; try again in a moment")
    if not _client_only(swarm) and swarm.own_worker() is None:
        raise NotReady("this node serves no layers yet (its worker is loading or it waits for the tracker); "
                       "try again in a moment")
    snap = swarm.snapshot
    for attempt in range(2):  # the latest view first; a fresh DHT read before saying no
        if snap is not None:
            cmap = CoverageMap.build(snap.ads, model_digest=swarm.digest, num_layers=swarm.num_layers)
            if cmap.fully_covered:
                return
        if attempt == 0:
            snap = await swarm.fresh_snapshot()
    gaps = ", ".join(f"{g.start}:{g.end}" for g in cmap.gaps())
    pool = swarm.pool_status() if hasattr(swarm, "pool_status") else None
    why = f": {pool['message']}" if pool and pool.get("short") else (
        "; the tracker is moving ranges to cover them" if pool and pool.get("short") is False else "")
    raise NotReady(f"no peer serves layers {gaps} of the model right now{why}; retry once a node covers them")


async def entry_tokenizer(swarm: EntryView):
    if swarm.tokenizer is None:
        path = getattr(swarm, "tokenizer_path", None) or swarm.config.model
        if path is None:   # --model ROOT before its first slice arrived
            raise NotReady("this node has not fetched the model's tokenizer yet; retry in a moment")
        swarm.tokenizer = await trio.to_thread.run_sync(load_tokenizer, path)
    return swarm.tokenizer


def _client_only(swarm: EntryView) -> bool:
    return bool(swarm.config.client_only)


def swarm_recipe(swarm, ads, me: str) -> str:
    """The runtime recipe a client-only entry pins its generation to: that of the cheapest route the
    swarm's signed records offer for our model (the planner searches each recipe alone), so every hop of
    it -- and of any replacement -- runs one numeric path. NotReady when no single recipe covers it."""
    try:
        route = plan_route(ads, model_digest=swarm.digest, num_layers=swarm.num_layers, now_ms=wall_ms(),
                           entry_peer_id=me)
    except MissingLayersError as exc:
        raise NotReady(f"no single runtime recipe covers the model right now ({exc}); retry once one does") from exc
    return route.recipe_digest


def swarm_driver(swarm: EntryView, observer: HopObserver | None = None,
                 topology: str = "", speculative: bool = False,
                 drafter: Drafter | None = None) -> tuple[SwarmDriver, list[dict]]:
    """A route driver over the swarm as this node sees it, and the list its failovers are noted in.

    A serving node pins the fingerprint its own worker validated and reaches its own hop over its
    worker's frame socket. A client-only node (``--layers none``) has no worker: the artifact digest is
    the one it computed from its local model files (no weights loaded), the recipe is the swarm's
    (``swarm_recipe``: this node computes nothing, so it has no recipe of its own, and computing one
    would import torch into the daemon), and every hop of its routes is a remote peer."""
    me = swarm.peer_id
    digest = swarm.digest
    if digest is None:          # check_ready came first; the digest is never unset again
        raise NotReady("this node is still reading the model's digest; try again in a moment")
    own = None if _client_only(swarm) else swarm.own_worker()
    if own is None:
        snap = swarm.snapshot
        recipe = swarm_recipe(swarm, snap.ads if snap is not None else (), me)
        fingerprint = pb.Fingerprint(model_artifact_digest=digest, runtime_recipe_digest=recipe)
    else:
        fingerprint = own.fingerprint

    portal = Portal.current()

    def ads():
        return portal.run(swarm.fresh_snapshot).ads

    def cached_ads():
        snap = swarm.snapshot   # replaced whole by the refresh loop: safe to read from the driver thread
        return snap.ads if snap is not None else ()

    source = AdsRouteSource(ads, digest, swarm.num_layers, entry_peer_id=me,
                            recipe_digest=fingerprint.runtime_recipe_digest, cached=cached_ads, load=swarm.load)
    # Our worker can head a loop (its tail dials it) when our record offers its direct endpoint, which
    # peers dial anyway: not a private node (a first node's probe may be "unknown" for minutes). A tail
    # that cannot reach it after all turns the loop off for that generation (push.py).
    own_endpoint, own_unix = (own.endpoint, own.unix) if own is not None else ("", "")
    connector = PeerConnector(self_peer_id=me, own_endpoint=own_endpoint, own_unix=own_unix, pins=swarm.pins,
                              frames=swarm.frames, own_dialable=swarm.own_dialable and bool(own_unix or own_endpoint),
                              relay_dialer=swarm.relay_dialer, relayed_addrs=lambda peer: _relayed_of(swarm, peer))
    failovers: list[dict] = []

    def on_failover(e) -> None:
        failovers.append({"failed_peer": e.failed_peer, "position": e.position, "detail": e.detail[:300],
                          "failed_at": e.failed_at, "reprefilled": list(e.reprefilled),
                          "route": [f"{h.peer_id}:{h.effective_start}:{h.end}" for h in e.route.hops]})

    hops = MeteredConnector(connector, observer, me) if observer else connector
    # the node's audit book: exclusions outlive a generation, whichever driver runs it
    book = getattr(swarm, "audit_book", None)
    driver: SwarmDriver
    if speculative:   # a star route: verify chunks are not pushed (speculative.py); not audited yet
        driver = SpeculativeDriver(source, hops, drafter=drafter or PromptLookup(), fingerprint=fingerprint,
                                   context_tokens=swarm.context_tokens, replan_wait_s=swarm.config.refill_wait,
                                   audit_book=book, on_failover=on_failover)
    else:
        driver = PushDriver(source, hops, topology=topology or swarm.config.route_topology,
                            fingerprint=fingerprint, context_tokens=swarm.context_tokens,
                            replan_wait_s=swarm.config.refill_wait,
                            verify=VerifyPolicy.for_lane(swarm.config.verify_rate, swarm.config.worker.backend),
                            audit_book=book, on_failover=on_failover)
    return driver, failovers


async def generate(swarm: EntryView, params: GenerateParams, send: Send, *,
                   observer: HopObserver | None = None) -> None:
    """The core on the daemon's swarm: check readiness, then ``drive`` (raises NotReady, LocalError)."""
    await check_ready(swarm)
    tokenizer = await entry_tokenizer(swarm)
    mode = swarm.config.speculative
    speculative = params.speculative if params.speculative is not None else mode != "off"
    draft_path = swarm.config.draft_model if mode == "draft-model" else None
    with _drafters(draft_path).lease() if speculative and draft_path is not None \
            else contextlib.nullcontext(None) as drafter:
        driver, failovers = swarm_driver(swarm, observer, params.topology, speculative, drafter)
        await drive(driver, tokenizer, params, send, failovers=failovers)


@functools.cache
def _drafters(path: Path) -> DrafterPool:
    """The entry's draft models for ``path`` (one pool per file, for the daemon's life)."""
    return DrafterPool(path)


# Marks the worker's refusal of TailOptions.return_hidden (shard/sessions.py) in a route failure.
_NO_HIDDEN = "cannot return hidden states"


async def embed_rows(driver: SwarmDriver, ids: list[int]) -> np.ndarray:
    """``driver.embed`` in a worker thread; cancelling the caller cancels the driver (KV released)."""
    async with trio.open_nursery() as nursery:
        async def cancel_when_done() -> None:
            try:
                await trio.sleep_forever()
            finally:
                driver.cancel()

        nursery.start_soon(cancel_when_done)
        rows = await trio.to_thread.run_sync(driver.embed, ids)
        nursery.cancel_scope.cancel()
    return rows


async def embed(swarm: EntryView, texts: list[str], *, truncate: bool = True, normalize: bool = True,
                observer: HopObserver | None = None) -> Embeddings:
    """Each text's mean-pooled last hidden state (the tail's final norm over every position), one
    prefill through the swarm per text (star topology: the rows come back here). A text past the
    model's context is cut to it when ``truncate``, else refused (LocalError)."""
    if swarm.config.worker.backend == "llama.cpp" and not _client_only(swarm):
        raise EmbeddingsUnsupported("embeddings need the torch recipe: this swarm runs llama.cpp, whose tail "
                                    "returns logits only (start the nodes with --backend torch)")
    await check_ready(swarm)
    tokenizer = await entry_tokenizer(swarm)
    context = swarm.context_tokens
    vectors, total = [], 0
    for text in texts:
        ids = tokenizer.encode_prompt(text, raw=True)
        if context and len(ids) > context:
            if not truncate:
                raise PromptTooLarge(f"the input has {len(ids)} tokens, past the model's {context}-token context")
            ids = ids[:context]
        driver, _ = swarm_driver(swarm, observer, "star")
        try:
            rows = await embed_rows(driver, ids)
        except MeshdError as exc:
            if _NO_HIDDEN in str(exc):
                raise EmbeddingsUnsupported(f"the swarm's tail cannot return hidden states: {exc}") from exc
            raise
        vector = rows.astype(np.float64).mean(axis=0)
        if normalize:
            norm = float(np.linalg.norm(vector))
            vector = vector / norm if norm > 0 else vector
        vectors.append([float(v) for v in vector])
        total += len(ids)
    return Embeddings(vectors, total)


def _speculation(driver: SwarmDriver) -> dict:
    """The done event's speculative-decoding figures: drafted tokens, accepted ones, tokens per round trip."""
    spec = driver.spec if isinstance(driver, SpeculativeDriver) else None
    if spec is None:
        return {"drafted_tokens": 0, "accepted_tokens": 0}
    return {"drafted_tokens": spec.drafted, "accepted_tokens": spec.accepted,
            "tokens_per_round_trip": round(spec.tokens_per_round_trip, 3)}


def _token_event(tokenizer, params: GenerateParams, delta: str, item: SampledToken) -> dict:
    event = {"text": delta, "token": item.id}
    if params.logprobs:
        event["logprob"] = item.logprob
        event["piece"] = tokenizer.piece(item.id)
        event["top_logprobs"] = [{"token": t, "piece": tokenizer.piece(t), "logprob": lp}
                                 for t, lp in item.top[:params.top_logprobs]]
    return event


async def drive(driver: SwarmDriver, tokenizer, params: GenerateParams, send: Send, *,
                failovers: list[dict] | None = None) -> None:
    """Run one generation on ``driver`` and send its events (see the module doc)."""
    if params.messages is not None:
        prompt_ids = tokenizer.encode_chat(params.messages)
    else:
        prompt_ids = tokenizer.encode_prompt(params.prompt, params.raw)
    gen = GenerationRequest(tuple(prompt_ids), params.max_tokens, sampling=params.sampling(),
                            stop_ids=tokenizer.stop_ids, logprobs=params.logprobs,
                            top_logprobs=params.top_logprobs)
    failovers = failovers if failovers is not None else []
    # Tokens cross into trio without the driver thread waiting for the loop (relay/portal.py
    # Outbox): at most TOKEN_QUEUE_DEPTH wait, the reader gives each slot back, order is kept.
    tokens_out: Outbox[SampledToken] = Outbox(Portal.current(), TOKEN_QUEUE_DEPTH, poll_s=ROOM_POLL_S)
    halt = False  # set by the trio side: a stop string completed, stop the driver

    def run_driver() -> None:
        stream = driver.generate(gen)
        try:
            for item in stream:
                if not tokens_out.put(item, gone=lambda: driver.cancelled):
                    return
                if halt:
                    break
        except GenerationCancelled:
            # Only this function cancels the driver (a stop string, or the trio side cancelled:
            # client gone, deadline): that side carries the reason, the thread just ends.
            if not (halt or driver.cancelled):
                raise
        finally:
            stream.close()
            tokens_out.close()

    await send({"event": "start", "prompt_tokens": len(prompt_ids), "session": driver.session_id})
    text = TextStream(tokenizer.decode, params.stop)
    tokens: list[int] = []
    routes_seen = 0
    async with trio.open_nursery() as nursery:
        async def cancel_when_done() -> None:
            try:
                await trio.sleep_forever()
            finally:
                driver.cancel()

        nursery.start_soon(cancel_when_done)

        async def run_thread() -> None:
            await trio.to_thread.run_sync(run_driver)

        nursery.start_soon(run_thread)
        async with tokens_out:
            async for item in tokens_out:
                tokens_out.give_back()
                if halt:
                    continue  # drain what the thread still sends while it stops
                tokens.append(item.id)
                event = _token_event(tokenizer, params, text.push(tokens[-1]), item)
                routes = driver.stats.routes
                if len(routes) != routes_seen:  # the first token, and after each failover: the route in use
                    routes_seen = len(routes)
                    event["route"] = [f"{h.peer_id}:{h.effective_start}:{h.end}" for h in routes[-1].hops]
                await send(event)
                if text.stopped:
                    halt = True
                    driver.cancel()
        nursery.cancel_scope.cancel()
    rest = text.finish()
    if rest:  # held-back text (a possible stop string that was not), or a last partial character
        await send({"text": rest})
    stats = driver.stats
    times = stats.token_times
    for event in failovers:  # monotonic clock: comparable across processes on this host
        event["next_token_at"] = next((t for t in times if t > event["failed_at"]), None)
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    route = stats.routes[-1] if stats.routes else None
    stopped = text.stopped or bool(tokens and tokens[-1] in tokenizer.stop_ids)
    tail_bytes = stats.tail_bytes_per_decode_step
    await send({"done": True, "tokens": tokens, "failovers": failovers,
                "finish_reason": "stop" if stopped else "length",
                "prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens),
                "prefill_s": round(stats.prefill_s, 6), "decode_s": round(decode_s, 6),
                "decode_tokens_per_s": round((len(times) - 1) / decode_s, 3) if decode_s > 0 else None,
                "tail_bytes_per_decode_step": round(tail_bytes, 2) if tail_bytes is not None else None,
                "step_wall_ms": [round(n / 1e6, 4) for n in stats.step_wall_ns],
                "step_execution_ms": [round(n / 1e6, 4) for n in stats.step_execution_ns],
                "step_hops": list(stats.step_hops),
                "step_legs": list(stats.step_legs),
                "topology": "push" if isinstance(driver, PushDriver) and driver.pushing else "star",
                "looped": isinstance(driver, PushDriver) and driver.looped,   # push: the tail feeds the head itself
                **_speculation(driver),
                "route": [f"{h.peer_id}:{h.effective_start}:{h.end}" for h in route.hops] if route else []})
