"""Typed refusals a shard sends back, on top of the proto error tree.

    proto.errors.MeshdError
    ├── ProtocolError (proto)          the peer's bytes or order were wrong
    ├── ArtifactError                  the model artifact is unusable as it is (truncated,
    │                                  corrupt, unsupported); fix or replace the files
    └── ShardRefusal                   the shard declines this work; .code + details
        ├── CacheMiss                  expected_past_len != actual; carries actual_past_len
        ├── EpochStale                 a newer epoch of the route session exists
        ├── ResourceExhausted          KV budget full or out of memory; carries retry_after_ms
        ├── Cancelled                  the session was cancelled
        ├── PermissionDenied           the session belongs to another opener
        ├── FingerprintMismatch        artifact/recipe digests differ from ours
        ├── RangeMismatch              the requested range is not the one we serve
        ├── DeadlineExceeded           the work's deadline had passed
        └── InternalError              our own failure (never a raw exception text)

``to_shard_error(exc)`` maps any of these (and ProtocolError) to the wire
``pb.ShardError``; anything else becomes INTERNAL with a sanitized detail.
What to do next is in each docstring and ``retryable``.

Foreign exceptions (a backend's, torch's, llama.cpp's) become ours at the
edge that catches them, through ``map_failure``: our refusals and a peer's
protocol errors stay as they are; only a real lack of memory
(``is_out_of_memory``) becomes ResourceExhausted -- never a cache or load
failure of another kind --; anything else is InternalError. ``log_failure``
puts our own failures in the worker's log with their traceback (the wire
detail names the exception type only; the log has the rest).
"""
from __future__ import annotations

import logging

from proto import shard_runtime_pb2 as pb
from proto.errors import MeshdError, ProtocolError

# ShardError.detail is operator-facing text; bound it so a long message never
# bloats a frame.
MAX_DETAIL_CHARS = 300
# Retry hint after running out of memory: other sessions may finish and free theirs.
OOM_RETRY_AFTER_MS = 1000
# torch's CPU allocator reports ENOMEM as a RuntimeError with this text (c10 alloc_cpu.cpp).
_TORCH_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


class ArtifactError(MeshdError):
    """The model artifact cannot be used as it is (truncated, corrupt, unsupported); fix or replace it."""


class ShardRefusal(MeshdError):
    """The shard declines this unit of work. Subclasses set ``code`` / ``retryable``."""

    code: pb.ErrorCode = pb.ERROR_CODE_INTERNAL
    retryable: bool = False

    def __init__(self, detail: str, *, actual_past_len: int = 0, retry_after_ms: int = 0) -> None:
        super().__init__(detail)
        self.detail = detail
        self.actual_past_len = actual_past_len
        self.retry_after_ms = retry_after_ms


class CacheMiss(ShardRefusal):
    """Re-send from ``actual_past_len`` (or re-prefill); nothing was applied."""

    code = pb.ERROR_CODE_CACHE_MISS
    retryable = True


class EpochStale(ShardRefusal):
    """Ask the route owner for the current epoch; this one is superseded."""

    code = pb.ERROR_CODE_EPOCH_STALE


class ResourceExhausted(ShardRefusal):
    """Retry after ``retry_after_ms`` or pick another peer."""

    code = pb.ERROR_CODE_RESOURCE_EXHAUSTED
    retryable = True


class Cancelled(ShardRefusal):
    """The session was cancelled; open a new epoch to continue."""

    code = pb.ERROR_CODE_CANCELLED


class PermissionDenied(ShardRefusal):
    """The session was opened by someone else (another owner token or peer); use your own."""

    code = pb.ERROR_CODE_PERMISSION_DENIED


class FingerprintMismatch(ShardRefusal):
    """The peer runs a different artifact or recipe; route to a matching shard."""

    code = pb.ERROR_CODE_FINGERPRINT_MISMATCH


class RangeMismatch(ShardRefusal):
    """This shard serves another layer range; check its capability."""

    code = pb.ERROR_CODE_SHARD_RANGE_MISMATCH


class DeadlineExceeded(ShardRefusal):
    """The deadline passed before execution; nothing was applied."""

    code = pb.ERROR_CODE_DEADLINE_EXCEEDED
    retryable = True


class InternalError(ShardRefusal):
    """Our fault; the session's cache was dropped. Retry from past_len 0 or elsewhere."""

    code = pb.ERROR_CODE_INTERNAL
    retryable = True


def is_out_of_memory(exc: BaseException) -> bool:
    """A real lack of memory: MemoryError (Python, numpy) or torch's allocator failing (ENOMEM)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _TORCH_CPU_OOM)


def map_failure(exc: BaseException, doing: str) -> MeshdError:
    """``exc`` (raised while ``doing``, e.g. "creating a KV cache") as a typed error.

    Our refusals and protocol errors pass unchanged; a real lack of memory is
    ResourceExhausted; anything else is InternalError naming the exception type."""
    if isinstance(exc, (ShardRefusal, ProtocolError)):
        return exc
    if is_out_of_memory(exc):
        return ResourceExhausted(f"out of memory {doing}", retry_after_ms=OOM_RETRY_AFTER_MS)
    return InternalError(f"{doing} failed ({type(exc).__name__}); the traceback is in the worker's log")


def log_failure(logger: logging.Logger, exc: BaseException, doing: str) -> None:
    """A foreign exception (our own failure) goes to the worker's log with its traceback.

    Call it with the exception as caught, before ``map_failure``: a peer's protocol error
    or one of our deliberate refusals is answered on the wire and not logged."""
    if isinstance(exc, (ProtocolError, ShardRefusal)):
        return
    level = logging.WARNING if is_out_of_memory(exc) else logging.ERROR
    logger.log(level, "%s failed: %s: %s", doing, type(exc).__name__, _clip(str(exc)), exc_info=exc)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."


def to_shard_error(exc: BaseException) -> pb.ShardError:
    """The wire form of an error; never leaks a foreign exception's text."""
    if isinstance(exc, ShardRefusal):
        return pb.ShardError(code=exc.code, detail=_clip(exc.detail), retryable=exc.retryable,
                             actual_past_len=exc.actual_past_len, retry_after_ms=exc.retry_after_ms)
    if isinstance(exc, ProtocolError):
        return pb.ShardError(code=exc.code, detail=_clip(str(exc)), retryable=False)
    return pb.ShardError(code=pb.ERROR_CODE_INTERNAL, detail=f"internal error ({type(exc).__name__})",
                         retryable=True)
