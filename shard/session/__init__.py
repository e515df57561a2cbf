"""Sessions: per-(route session, epoch) KV, batching and admission, and the sans-I/O stream core.

Files and roles (data flows top to bottom):

    stream.py         sans-I/O Session stream core: request bytes in, response bytes and push
                      actions out (the edge carries the actions out, shard/push/)
    service.py        ShardService: backend + sessions + lock + batcher; capability (validated), health
    batching.py       continuous batching: streams' ready steps share one forward (leader, outside the lock)
    sessions.py       sans-I/O SessionManager: epochs, idempotency, cache miss, TTL, budget,
                      owners (token + peer), per-peer quota, eviction only under pressure
    session_ids.py    SessionKey (route session id + epoch) and Owner (peer + owner-token digest)
    request_queue.py  request bodies of one Session call, from the caller's thread to the transport
    worklog.py        the worker's stderr log: one line per record, traceback lines marked

Who owns what: ``ShardService`` owns the backend, the SessionManager and the
one lock every manager call holds; a ``SessionStream`` owns one stream's
state (its key, credits, tail options) and nothing that outlives the stream.
Nothing here opens a socket or starts a thread.
"""
from shard.session.request_queue import RequestQueue
from shard.session.service import ShardService
from shard.session.session_ids import LOCAL_OWNER, Owner, SessionKey
from shard.session.sessions import SessionManager, SessionPolicy, StepResult
from shard.session.stream import HIDDEN, LOGITS, TOKEN_IDS, SessionStream

__all__ = [
    "SessionStream", "HIDDEN", "LOGITS", "TOKEN_IDS",
    "ShardService", "SessionManager", "SessionPolicy", "StepResult",
    "SessionKey", "Owner", "LOCAL_OWNER", "RequestQueue",
]
