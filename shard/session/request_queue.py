"""Request bodies of one Session call, from the caller's thread to whatever sends them.

Used by the entry's hop links (meshd/generate) and by a pushed hop's successor stream
(shard/push/successor.py).

gRPC's synchronous stream takes an iterator and drains it on a thread of its
own: ``RequestQueue`` is that iterator (a bounded ``queue.Queue``, ended by
``finish()``). A transport that lives in another event loop (a relayed hop's
trio loop, relay/syncchannel.py) can instead ``attach(push, finish)``: from
then on ``put`` calls ``push(body)`` in the driver's own thread, which hands
the frame to that loop directly -- one thread hand-off per frame instead of
two (driver -> pump thread -> loop). The consumer then bounds what waits with
a credit of ``depth`` frames, the same bound the queue gives gRPC.

State: the queue, and the attached consumer (set once, from the driver's
thread, before the first ``put``; bodies queued before that are handed over
in order when it attaches).
"""
from __future__ import annotations

import queue
from collections.abc import Callable

__all__ = ["RequestQueue"]


class RequestQueue:
    """A bounded iterator of request bodies that a consumer may take over (see the module doc)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)   # None: the end
        self._push: Callable[[bytes], None] | None = None
        self._finish: Callable[[], None] | None = None

    def put(self, body: bytes, timeout: float | None = None) -> None:
        """Queue (blocking while ``depth`` bodies wait, at most ``timeout`` s: ``queue.Full``) or push
        to the attached consumer."""
        push = self._push
        if push is not None:
            push(body)
        else:
            self._queue.put(body, timeout=timeout)

    def finish(self) -> None:
        """No more bodies; never blocks (a full queue means the call is being torn down anyway)."""
        if self._finish is not None:
            self._finish()
            return
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass

    def attach(self, push: Callable[[bytes], None], finish: Callable[[], None]) -> None:
        """Hand every body to ``push`` from now on (and those already queued, in order)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                finish()
                self._push, self._finish = (lambda body: None), (lambda: None)
                return
            push(item)
        self._push, self._finish = push, finish

    def __iter__(self) -> RequestQueue:
        return self

    def __next__(self) -> bytes:
        item = self._queue.get()
        if item is None:
            raise StopIteration
        return item
