"""The entry node's HTTP API as one Starlette app (served by meshd/api/server.py).

    GET  /                       dashboard page (static, no data; its script polls the status)
    GET  /static/{file}          the dashboard's script and style (package data, no CDN)
    GET  /meshd/status           the node's status JSON (feeds the dashboard)
    GET  /metrics                Prometheus text (meshd/api/metrics.py)
    GET  /v1/models              the swarm's model and its coverage
    POST /v1/chat/completions    OpenAI chat (SSE when "stream")       meshd/api/openai.py
    POST /v1/completions         OpenAI completions (prompt string)
    POST /api/chat               Ollama chat (NDJSON stream by default) meshd/api/ollama.py
    POST /api/generate           Ollama generate
    GET  /api/tags               Ollama model list (size, family, parameters, digest)
    POST /api/show               Ollama model card (meshd/api/model_card.py)
    GET  /api/ps                 the model loaded on the swarm
    POST /api/embed              mean-pooled last hidden states through the swarm (/api/embeddings:
    POST /v1/embeddings          the older Ollama route; /v1/embeddings: OpenAI's)

Every generation goes through ``Entry.generate`` (meshd/api/entry.py), the
same door as the control socket; embeddings through ``Entry.embed``. Bodies
are ``application/json`` only (415), bounded (MAX_BODY_BYTES, read within
BODY_READ_TIMEOUT_S) and parsed strictly (meshd/api/jsonbody.py: nesting
bound, no NaN, no lone surrogate). Host, Origin, CORS and the bearer key are
checked before any route (meshd/api/guard.py); with a key, every route but
the page and its static files needs ``Authorization: Bearer <key>`` (the page
asks for the key and sends it; the key never sits in a URL sent to us).

A generation's response is an ASGI callable (``GenerationResponse``): it
waits for the first generated token before sending the status line, so an
error before any output (no coverage, bad template, route failure,
deadline) gets its own HTTP status; an error after the first byte ends the
stream with an error event. The client disconnecting cancels the
generation: the driver releases the KV on every hop.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshd.api import ollama, openai
from meshd.api.entry import Entry
from meshd.api.errors import ApiError, api_error, excerpt, first_leaf
from meshd.api.guard import guarded
from meshd.api.jsonbody import loads_object
from meshd.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from meshd.generate.params import GenerateParams
from proto.errors import MeshdError

log = logging.getLogger(__name__)

# A chat of MAX_PROMPT_CHARS characters, JSON-escaped, fits with room to spare.
MAX_BODY_BYTES = 1 << 20
# A body over the bound is still read (and dropped) up to this many bytes, so
# the client gets its 413 instead of a connection reset mid-upload; larger
# ones are answered at once.
MAX_DRAIN_BYTES = 8 << 20
# The one body type the API takes (see read_json).
JSON_MEDIA_TYPE = "application/json"
# A client gets this long to send its whole body (slow senders hold a connection).
BODY_READ_TIMEOUT_S = 30.0
STATIC = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
DASHBOARD_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
                 "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson")]


@dataclass
class ApiContext:
    entry: Entry
    model: Callable[[], dict]                  # {"id", "digest", "num_layers", "coverage", "serving"}
    status: Callable[[], Awaitable[dict]]      # the node's status JSON
    api_key: str | None = None
    card: Callable[[], object] = lambda: None   # the model's ModelCard (meshd/api/model_card.py), None: no model
    loaded: Callable[[], dict] = lambda: {}     # {"size_bytes", "expires_at"} of the model on the swarm (/api/ps)
    allowed_hosts: tuple[str, ...] = ()     # names beyond IP literals and localhost (meshd/api/guard.py)
    cors_origins: tuple[str, ...] = ()      # web origins that may drive the API (CORS off when empty)


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


async def read_json(request: Request) -> dict:
    """The request's JSON object: ``application/json`` only (415), bounded (413, 408), strict (400).

    Any other type is refused before a byte is read: text/plain, form and XML bodies (and none at
    all) are what a browser sends cross-site without asking first (a CORS "simple" request)."""
    media = _media_type(request.headers.get("content-type"))
    if media != JSON_MEDIA_TYPE:
        raise ApiError(415, f"the body must be {JSON_MEDIA_TYPE} (Content-Type: {JSON_MEDIA_TYPE}), "
                            f"not {excerpt(media) if media else 'untyped'}", code="unsupported_media_type")
    too_large = ApiError(413, f"the body must be at most {MAX_BODY_BYTES} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_DRAIN_BYTES):
        raise too_large
    chunks, total = [], 0
    with trio.move_on_after(BODY_READ_TIMEOUT_S) as scope:
        async for chunk in request.stream():
            total += len(chunk)
            if total > MAX_DRAIN_BYTES:
                raise too_large
            if total <= MAX_BODY_BYTES:
                chunks.append(chunk)
    if scope.cancelled_caught:
        raise ApiError(408, f"the body did not arrive within {BODY_READ_TIMEOUT_S:g} s", code="request_timeout")
    if total > MAX_BODY_BYTES:
        raise too_large
    return loads_object(b"".join(chunks), max_bytes=MAX_BODY_BYTES)


class GenerationResponse:
    """Run one generation and answer it: SSE / NDJSON stream or one JSON body (see module doc)."""

    def __init__(self, entry: Entry, params: GenerateParams, fmt, *, stream: bool, framing: str) -> None:
        self.entry, self.params, self.fmt, self.stream, self.framing = entry, params, fmt, stream, framing

    def _frame(self, obj) -> bytes:
        if self.framing == "sse":
            return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        return json.dumps(obj).encode() + b"\n"

    async def __call__(self, scope, receive, send) -> None:
        started = gone = False
        error: ApiError | None = None

        async def body(data: bytes, more: bool = True) -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200,
                            "headers": SSE_HEADERS if self.framing == "sse" else NDJSON_HEADERS})
            await send({"type": "http.response.body", "body": data, "more_body": more})

        async def on_event(event: dict) -> None:
            chunks = self.fmt.on_event(event)
            if self.stream and chunks:
                await body(b"".join(self._frame(c) for c in chunks))

        async with trio.open_nursery() as nursery:
            async def watch_disconnect() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                    pass
                gone = True
                nursery.cancel_scope.cancel()   # cancels the generation: KV released on every hop

            nursery.start_soon(watch_disconnect)
            try:
                await self.entry.generate(self.params, on_event)
            except Exception as exc:  # every failure becomes an HTTP answer
                leaf = first_leaf(exc)
                error = api_error(leaf)
                if error.status >= 500 and error.status not in (503, 504):
                    log.error("generation failed", exc_info=leaf)
            nursery.cancel_scope.cancel()
        if gone:
            return
        if error is not None and not started:
            await _error_response(error)(scope, receive, send)
            return
        if error is not None:   # mid-stream: say so in the stream, then end it
            await body(self._frame(error.body() if self.framing == "sse" else {"error": error.message}), more=False)
            return
        if self.stream:
            tail = b"".join(self._frame(c) for c in self.fmt.finish())
            await body(tail + (self._frame(b"[DONE]") if self.framing == "sse" else b""), more=False)
            return
        await JSONResponse(self.fmt.whole())(scope, receive, send)


def build_app(ctx: ApiContext) -> Starlette:
    static = {name: (resources.files("meshd.api") / "static" / name).read_bytes() for name in (*STATIC, "index.html")}

    def served_model() -> str:
        info = ctx.model()
        if not info.get("id"):
            raise ApiError(503, "this node serves no model yet", type="service_unavailable", retry_after_s=5)
        return info["id"]

    async def dashboard(request: Request) -> Response:
        return Response(static["index.html"], media_type="text/html; charset=utf-8",
                        headers={"content-security-policy": DASHBOARD_CSP, "cache-control": "no-cache"})

    async def static_file(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            raise ApiError(404, f"no static file {excerpt(name)}", type="not_found_error")
        return Response(static[name], media_type=STATIC[name], headers={"cache-control": "no-cache"})

    async def status(request: Request) -> Response:
        return JSONResponse(await ctx.status())

    async def metrics(request: Request) -> Response:
        return Response(ctx.entry.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def models(request: Request) -> Response:
        info = ctx.model()
        data = [{"id": info["id"], "object": "model", "created": 0, "owned_by": "meshd",
                 "meshd": {k: info.get(k) for k in ("digest", "num_layers", "coverage", "serving")}}] \
            if info.get("id") else []
        return JSONResponse({"object": "list", "data": data})

    def openai_route(parse, format_class):
        async def endpoint(request: Request):
            params, answer = parse(await read_json(request), served_model())
            return GenerationResponse(ctx.entry, params, format_class(answer), stream=answer.stream, framing="sse")
        return endpoint

    def ollama_route(parse, is_chat: bool):
        async def endpoint(request: Request):
            model = served_model()
            params, stream = parse(await read_json(request), model)
            return GenerationResponse(ctx.entry, params, ollama.OllamaFormat(model, is_chat), stream=stream,
                                      framing="ndjson")
        return endpoint

    def card():
        served_model()
        card = ctx.card()
        if card is None:
            raise ApiError(503, "this node is still reading the model's files", type="service_unavailable",
                           retry_after_s=5)
        return card

    async def tags(request: Request) -> Response:
        return JSONResponse(ollama.tags_of(card()) if ctx.model().get("id") else {"models": []})

    async def show(request: Request) -> Response:
        return JSONResponse(ollama.show(await read_json(request), card()))

    async def ps(request: Request) -> Response:
        loaded = ctx.loaded()
        if not ctx.model().get("id") or not loaded:
            return JSONResponse({"models": []})
        return JSONResponse(ollama.ps(card(), expires_at=loaded["expires_at"], size_bytes=loaded["size_bytes"]))

    async def embed(request: Request) -> Response:
        texts, truncate = ollama.parse_embed(await read_json(request), served_model())
        t0 = time.perf_counter_ns()
        result = await ctx.entry.embed(texts, truncate=truncate)
        return JSONResponse({"model": served_model(), "embeddings": result.vectors,
                             "total_duration": time.perf_counter_ns() - t0, "load_duration": 0,
                             "prompt_eval_count": result.prompt_tokens})

    async def embeddings_legacy(request: Request) -> Response:
        prompt = ollama.parse_embeddings(await read_json(request), served_model())
        result = await ctx.entry.embed([prompt], normalize=False)
        return JSONResponse({"embedding": result.vectors[0]})

    async def embeddings_openai(request: Request) -> Response:
        texts, encoding = openai.parse_embeddings(await read_json(request), served_model())
        result = await ctx.entry.embed(texts)
        return JSONResponse(openai.embeddings_answer(served_model(), result.vectors, result.prompt_tokens, encoding))

    async def version(request: Request) -> Response:
        from meshd import __version__
        return JSONResponse({"version": __version__})

    # Starlette types every handler as taking an Exception; it calls each for its own class only.
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(exc.status_code, f"{request.method} {excerpt(request.url.path)}: {exc.detail}",
                                        type=kind))

    async def on_other_error(request: Request, exc: Exception) -> Response:
        err = api_error(first_leaf(exc))
        if err.status == 500:
            log.error("API request failed", exc_info=exc)
        return _error_response(err)

    routes = [
        Route("/", dashboard), Route("/static/{name}", static_file), Route("/meshd/status", status),
        Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/chat/completions", openai_route(openai.parse_chat, openai.ChatFormat), methods=["POST"]),
        Route("/v1/completions", openai_route(openai.parse_completion, openai.CompletionFormat), methods=["POST"]),
        Route("/api/chat", ollama_route(ollama.parse_chat, True), methods=["POST"]),
        Route("/api/generate", ollama_route(ollama.parse_generate, False), methods=["POST"]),
        Route("/api/tags", tags), Route("/api/version", version), Route("/api/ps", ps),
        Route("/api/show", show, methods=["POST"]), Route("/api/embed", embed, methods=["POST"]),
        Route("/api/embeddings", embeddings_legacy, methods=["POST"]),
        Route("/v1/embeddings", embeddings_openai, methods=["POST"]),
    ]
    # ApiError and our own errors are answered here; anything else is a bug: ServerErrorMiddleware
    # answers 500 in the same shape and re-raises it for the server's log.
    app = Starlette(routes=routes, exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                                                       MeshdError: on_other_error, Exception: on_other_error})
    return guarded(app, key=ctx.api_key, allowed_hosts=ctx.allowed_hosts, cors_origins=ctx.cors_origins)
