"""The worker's log on stderr: one line per record, traceback lines marked.

A worker's stderr is its log: the daemon's supervisor writes every line to
``worker.log`` (meshd/daemon/worker_process.py) and shows the others on the
user's terminal and in ``meshd status``. Tracebacks belong in the log, not on
the terminal, so every line of one starts with ``TRACE_MARK``; the daemon
keeps marked lines in the file only.

``install()`` (called once by ``meshd worker``) sends the root logger to
stderr in this format and routes uncaught exceptions -- in the main thread
(``sys.excepthook``) and in any other (``threading.excepthook``: gRPC and
Unix-socket stream threads) -- through it, so no traceback reaches stderr
unmarked and none is lost.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import TextIO

__all__ = ["TRACE_MARK", "WorkerLogFormatter", "install", "is_trace_line", "LOG_PREFIX", "LOG_ONLY"]

# Starts every line of a traceback in the worker's stderr.
TRACE_MARK = "  | "
# Starts every log record's first line (the worker's other output has its own prefixes).
LOG_PREFIX = "[worker]"
# ``logger.info(..., extra=LOG_ONLY)``: every line of the record marked, so it reaches worker.log only.
LOG_ONLY = {"log_only": True}


class WorkerLogFormatter(logging.Formatter):
    """``[worker] LEVEL logger: message``; exception text on following lines, each marked."""

    def __init__(self) -> None:
        super().__init__(f"{LOG_PREFIX} %(levelname)s %(name)s: %(message)s")

    def formatException(self, ei) -> str:
        return "\n".join(TRACE_MARK + line for line in super().formatException(ei).splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join(TRACE_MARK + line for line in stack_info.splitlines())

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if getattr(record, "log_only", False):      # the whole record stays in the log file
            return "\n".join(TRACE_MARK + line for line in text.split("\n"))
        first, *rest = text.split("\n")
        # a multi-line message gets marked too: only the first line is the record's summary
        return "\n".join([first] + [line if line.startswith(TRACE_MARK) else TRACE_MARK + line for line in rest])


def is_trace_line(line: str) -> bool:
    return line.startswith(TRACE_MARK)


def install(stream: TextIO | None = None, level: int = logging.INFO) -> logging.Handler:
    """Root logger -> ``stream`` (stderr) in the worker format; uncaught exceptions logged there."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(WorkerLogFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    crash = logging.getLogger("meshd.worker")

    def excepthook(exc_type, exc, tb) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            sys.__excepthook__(exc_type, exc, tb)
            return
        crash.critical("uncaught %s: %s", exc_type.__name__, " ".join(str(exc).split())[:300],
                       exc_info=(exc_type, exc, tb))

    def thread_excepthook(args) -> None:
        if args.exc_type is SystemExit:
            return
        crash.error("uncaught %s in thread %s: %s", args.exc_type.__name__,
                    args.thread.name if args.thread else "?", " ".join(str(args.exc_value).split())[:300],
                    exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    return handler
