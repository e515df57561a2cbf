"""RequestQueue: an iterator for gRPC's sending thread, or pushed straight to an attached consumer."""
from __future__ import annotations

import threading

from shard.session.request_queue import RequestQueue


def test_as_an_iterator_it_yields_in_order_and_ends_at_finish():
    q = RequestQueue(4)
    for body in (b"a", b"b", b"c"):
        q.put(body)
    q.finish()
    assert list(q) == [b"a", b"b", b"c"]


def test_finish_never_blocks_even_when_the_queue_is_full():
    q = RequestQueue(2)
    q.put(b"1")
    q.put(b"2")
    done = threading.Event()
    threading.Thread(target=lambda: (q.finish(), done.set()), daemon=True).start()
    assert done.wait(5)


def test_attaching_hands_over_what_waits_in_order_then_pushes_directly():
    q = RequestQueue(4)
    q.put(b"early-1")
    q.put(b"early-2")
    got, ended = [], []
    q.attach(got.append, lambda: ended.append(True))
    q.put(b"late")
    assert got == [b"early-1", b"early-2", b"late"] and not ended
    q.finish()
    assert ended == [True]


def test_an_end_queued_before_attaching_ends_the_consumer_once_and_later_puts_go_nowhere():
    q = RequestQueue(4)
    q.put(b"only")
    q.finish()
    got, ended = [], []
    q.attach(got.append, lambda: ended.append(True))
    q.put(b"too late")
    q.finish()
    assert got == [b"only"] and ended == [True]
