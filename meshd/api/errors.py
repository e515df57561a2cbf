"""HTTP errors in OpenAI's JSON shape, and the one mapping from the core's errors to them.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

Whose fault, which status (the client libraries pick their exception by it):

    400 invalid_request_error   a bad field, an unsupported feature (n > 1, tools), bad JSON
    401 authentication_error    missing or wrong bearer key
    404 not_found_error         unknown route or model
    413 invalid_request_error   body over the bound
    429 rate_limit_error        this entry runs and queues all it may, or every peer that
                                serves a hop is full (SwarmFull: their retry hint as Retry-After)
    503 service_unavailable     the swarm has no coverage / no route right now (Retry-After)
    504 timeout_error           the generation outlived its deadline
    415 invalid_request_error   a body that is not application/json
    501 not_implemented         embeddings on a swarm whose recipe cannot return hidden states
    500 server_error            anything else (a bug: logged, never a crash)

An error never echoes more of the client's input than a bounded, escaped
excerpt (``excerpt``: JSON-quoted, ASCII, at most MAX_ECHO_CHARS), and every
message and param is made encodable and bounded when the error is built: an
error that cannot be written would itself become a 500.
"""
from __future__ import annotations

import json

from meshd.api.jsonbody import BadJson, BadText
from meshd.generate.driver import RouteFailed, SwarmFull
from meshd.generate.service import EmbeddingsUnsupported, NotReady
from proto.errors import LocalError

# Characters of a client's string quoted back in an error message.
MAX_ECHO_CHARS = 64
# A message and a param are cut here (a param is a field path; a message may carry an exception's text).
MAX_MESSAGE_CHARS = 1024
MAX_PARAM_CHARS = 128


def excerpt(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """A client's value as a bounded, escaped excerpt: JSON-quoted ASCII, cut at ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > limit
    return json.dumps(text[:limit]) + ("..." if cut else "")


def safe_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, any lone surrogate written as its escape (encodable UTF-8)."""
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        message = safe_text(str(message), MAX_MESSAGE_CHARS)
        param = safe_text(param, MAX_PARAM_CHARS) if isinstance(param, str) else None
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def bad_field(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


class Busy(Exception):
    """The entry is running and queueing as many generations as it may."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GenerationDeadline(Exception):
    """The generation did not finish within the entry's deadline (it was cancelled, KV released)."""


def api_error(exc: BaseException) -> ApiError:
    """Map one of the core's errors (or ours) to the HTTP error the client sees."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Busy):
        return ApiError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                        retry_after_s=exc.retry_after_s)
    if isinstance(exc, NotReady):
        return ApiError(503, str(exc), type="service_unavailable", code="no_coverage",
                        retry_after_s=exc.retry_after_s)
    if isinstance(exc, SwarmFull):
        return ApiError(429, str(exc), type="rate_limit_error", code="swarm_full",
                        retry_after_s=max(1, -(-exc.retry_after_ms // 1000)))
    if isinstance(exc, RouteFailed):
        return ApiError(503, str(exc), type="service_unavailable", code="no_route", retry_after_s=5)
    if isinstance(exc, EmbeddingsUnsupported):
        return ApiError(501, str(exc), type="not_implemented", code="embeddings_unsupported")
    if isinstance(exc, GenerationDeadline):
        return ApiError(504, str(exc), type="timeout_error", code="generation_deadline")
    if isinstance(exc, BadText):
        return ApiError(400, str(exc), param=exc.path or None, code="invalid_string")
    if isinstance(exc, BadJson):
        return ApiError(400, str(exc), code="invalid_json")
    if isinstance(exc, LocalError):
        return ApiError(400, str(exc))
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def first_leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside nested exception groups (nurseries wrap errors)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
