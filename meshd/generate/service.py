"""``generate`` over the control API: tokenize, drive the route, stream text back.

Data flow (one client connection)::

    {"op": "generate", "prompt": ..., "max_tokens": ..., ...}
      -> GenerateParams (validated here; a bad field is the client's error)
      -> token ids (the artifact's tokenizer, meshd/generate/tokenizer.py; chat template unless "raw")
      -> SwarmDriver (meshd/generate/driver.py) in one worker thread,
         routes from the DHT (AdsRouteSource over Swarm.fresh_snapshot),
         channels pinned to each peer's certificate (PeerConnector), or
         circuits through a relay for peers behind NAT (meshd/reach/relay_dial.py)
      -> token ids through a bounded channel -> text deltas, one JSON line each
      <- {"text": "...", "token": id} ... {"done": true, "tokens": [...], ...}

With ``"logprobs": true`` each token event also carries ``"logprob"`` (log-
softmax of the raw logits), with ``"top_logprobs": N`` (0..20) also
``"top_logprobs": [[id, logprob], ...]``; neither key appears otherwise.
The done event carries the route, failovers and timings: ``prefill_s``,
``decode_tokens_per_s``, ``tail_bytes_per_decode_step`` (response bytes
from the tail per decode step: the token alone is ~20), and per decode
step its wall time, the hops' own compute and the hop count
(``step_wall_ms``, ``step_execution_ms``, ``step_hops``).

Routes are planned here, at the entry, from its own DHT view, with the same
pure planner (routing.py) and the same signed records the tracker would use
(ARCHITECTURE has the entry ask the tracker): one round trip less, and a
generation never depends on the tracker being reachable mid-way, e.g. while
duty moves after the tracker died.

Cancellation: the client closing its socket (or the daemon stopping)
cancels the driver; it finishes the step in flight and releases the KV on
every hop before the thread returns. The daemon never abandons the thread.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from meshd.generate.driver import GenerationRequest, SwarmDriver
from meshd.generate.routes import AdsRouteSource, PeerConnector
from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError
from proto.limits import MAX_TOP_LOGPROBS
from shard.sampling import SamplingSpec

# Bounds on what a client may ask for (the control socket is local, but a
# request is still input): prompt size, new tokens per request.
MAX_PROMPT_CHARS = 32_000
MAX_NEW_TOKENS = 4096
DEFAULT_MAX_TOKENS = 128
# Tokens buffered between the driver thread and the socket writer.
TOKEN_QUEUE_DEPTH = 32
# How often a driver thread waiting for room in that buffer checks for a cancel.
ROOM_POLL_S = 0.25

Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class GenerateParams:
    prompt: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    raw: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not 0 < len(self.prompt) <= MAX_PROMPT_CHARS:
            raise LocalError(f"prompt must be a string of 1..{MAX_PROMPT_CHARS} characters")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 1 <= self.max_tokens <= MAX_NEW_TOKENS:
            raise LocalError(f"max_tokens must be an integer in 1..{MAX_NEW_TOKENS}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise LocalError(f"{name} must be a number")
        if not isinstance(self.top_k, int) or not isinstance(self.seed, int) or not isinstance(self.raw, bool):
            raise LocalError("top_k and seed must be integers, raw a boolean")
        if not isinstance(self.logprobs, bool) or isinstance(self.top_logprobs, bool) \
                or not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise LocalError(f"logprobs must be a boolean, top_logprobs an integer in 0..{MAX_TOP_LOGPROBS}")

    @classmethod
    def from_request(cls, request: dict) -> "GenerateParams":
        known = {"prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "raw", "logprobs", "top_logprobs"}
        try:
            return cls(**{k: v for k, v in request.items() if k in known})
        except TypeError as exc:
            raise LocalError(f"bad generate request: {exc}") from exc

    def sampling(self) -> SamplingSpec:
        return SamplingSpec(temperature=float(self.temperature), top_k=self.top_k, top_p=float(self.top_p),
                            seed=self.seed)


def _relayed_of(swarm, peer_id: str) -> tuple[str, ...]:
    snap = swarm.snapshot   # the latest snapshot (replaced whole, so safe to read from the driver thread)
    return snap.relayed.get(peer_id, ()) if snap is not None else ()


def load_tokenizer(model_path):
    from meshd.generate.tokenizer import EntryTokenizer

    return EntryTokenizer(model_path)


async def run_generate(swarm, request: dict, send: Send) -> None:
    """Serve one generate request; raises LocalError for a request we cannot serve."""
    params = GenerateParams.from_request(request)
    node = swarm.node
    claim = node.advertiser.claim
    if swarm.digest is None or claim is None or node.supervisor is None:
        raise LocalError("this node serves no layers yet (its worker is loading or it waits for the tracker); "
                         "try again in a moment")
    if swarm.tokenizer is None:
        swarm.tokenizer = await trio.to_thread.run_sync(load_tokenizer, swarm.config.model)
    tokenizer = swarm.tokenizer
    prompt_ids = tokenizer.encode_prompt(params.prompt, params.raw)
    gen = GenerationRequest(tuple(prompt_ids), params.max_tokens, sampling=params.sampling(),
                            stop_ids=tokenizer.stop_ids, logprobs=params.logprobs,
                            top_logprobs=params.top_logprobs)
    fingerprint = pb.Fingerprint(model_artifact_digest=claim.model_artifact_digest,
                                 runtime_recipe_digest=claim.runtime_recipe_digest)

    def ads():
        return trio.from_thread.run(swarm.fresh_snapshot).ads

    def cached_ads():
        snap = swarm.snapshot   # replaced whole by the refresh loop: safe to read from the driver thread
        return snap.ads if snap is not None else ()

    me = node.identity.peer_id
    source = AdsRouteSource(ads, swarm.digest, swarm.num_layers, entry_peer_id=me,
                            recipe_digest=claim.runtime_recipe_digest, cached=cached_ads)
    state = node.supervisor.state
    connector = PeerConnector(self_peer_id=me, own_endpoint=state.endpoint, own_unix=state.unix, pins=swarm.pins,
                              relay_dialer=node.relay_dialer, relayed_addrs=lambda peer: _relayed_of(swarm, peer))
    failovers: list[dict] = []
    driver = SwarmDriver(source, connector, fingerprint=fingerprint, on_failover=lambda e: failovers.append(
        {"failed_peer": e.failed_peer, "position": e.position, "detail": e.detail[:300],
         "failed_at": e.failed_at, "reprefilled": list(e.reprefilled),
         "route": [f"{h.peer_id}:{h.effective_start}:{h.end}" for h in e.route.hops]}))
    # Tokens cross into trio without the driver thread waiting for the loop: a slot of
    # ``room`` is taken per token (so at most TOKEN_QUEUE_DEPTH wait; the writer gives it
    # back) and the token is queued with run_sync_soon, which runs callbacks in order.
    send_chan, recv_chan = trio.open_memory_channel(TOKEN_QUEUE_DEPTH)
    room = threading.BoundedSemaphore(TOKEN_QUEUE_DEPTH)
    loop = trio.lowlevel.current_trio_token()

    def deliver(token) -> None:
        try:
            send_chan.send_nowait(token)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass                            # the writer is gone (client left): the driver is cancelled

    def drive() -> None:
        stream = driver.generate(gen)
        try:
            for token in stream:
                while not room.acquire(timeout=ROOM_POLL_S):
                    if driver.cancelled:
                        return
                loop.run_sync_soon(deliver, token)
        finally:
            stream.close()
            loop.run_sync_soon(send_chan.close)

    await send({"event": "start", "prompt_tokens": len(prompt_ids), "session": driver.session_id})
    tokens: list[int] = []
    text = ""
    async with trio.open_nursery() as nursery:
        async def cancel_when_done() -> None:
            try:
                await trio.sleep_forever()
            finally:
                driver.cancel()

        nursery.start_soon(cancel_when_done)

        async def run_thread() -> None:
            await trio.to_thread.run_sync(drive)

        nursery.start_soon(run_thread)
        async with recv_chan:
            async for sampled in recv_chan:
                room.release()
                tokens.append(sampled.id)
                full = tokenizer.decode(tokens)
                if full.endswith("\ufffd"):
                    delta = ""  # an incomplete multi-byte character: wait for the next token
                else:
                    delta, text = full[len(text):], full
                event = {"text": delta, "token": sampled.id}
                if params.logprobs or params.top_logprobs:
                    event["logprob"] = sampled.logprob
                if params.top_logprobs:
                    event["top_logprobs"] = [[i, lp] for i, lp in sampled.top]
                await send(event)
        nursery.cancel_scope.cancel()
    rest = tokenizer.decode(tokens)[len(text):] if tokens else ""
    if rest:  # the tail of a multi-byte character held back above
        await send({"text": rest})
    stats = driver.stats
    times = stats.token_times
    for event in failovers:  # monotonic clock: comparable across processes on this host
        event["next_token_at"] = next((t for t in times if t > event["failed_at"]), None)
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    route = stats.routes[-1] if stats.routes else None
    tail_bytes = stats.tail_bytes_per_decode_step
    await send({"done": True, "tokens": tokens, "failovers": failovers,
                "prefill_s": round(stats.prefill_s, 6), "decode_s": round(decode_s, 6),
                "decode_tokens_per_s": round((len(times) - 1) / decode_s, 3) if decode_s > 0 else None,
                "tail_bytes_per_decode_step": round(tail_bytes, 2) if tail_bytes is not None else None,
                "step_wall_ms": [round(n / 1e6, 4) for n in stats.step_wall_ns],
                "step_execution_ms": [round(n / 1e6, 4) for n in stats.step_execution_ns],
                "step_hops": list(stats.step_hops),
                "route": [f"{h.peer_id}:{h.effective_start}:{h.end}" for h in route.hops] if route else []})

