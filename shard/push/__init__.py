"""Push: a hop sends its output rows straight to the next hop, and recovers when that hop fails.

Files and roles:

    actions.py     what every edge runs between its socket and the stream core: the core's push
                   actions carried out in order (register, attach a feeder, push rows on, answer
                   the entry, repoint, release), the gRPC control stream's loop
    hub.py         the worker's pushed sessions (PushHub, PushSession): the registry by key, who
                   may attach, the entry's control stream answered from other threads (ControlSink)
    successor.py   a pushed hop's own stream to its successor (framed TLS fast path or gRPC) and
                   the rows it keeps, so that a replacement successor can be re-fed (recovery);
                   it sees its session through a small protocol (Upstream)

Who owns what: the PushHub (one per ShardService) owns the registered
PushSessions; each PushSession owns its ControlSink and its SuccessorStream,
and the SuccessorStream owns its reader thread and its call to the successor.
The stream core (shard/session/stream.py) imports none of this: it returns
actions, the edges hand them to ``actions.receive``.
"""
from shard.push.actions import carry, receive, serve_control, sink_of, stream_ended
from shard.push.hub import ControlSink, PushHub, PushSession, check_target, hub_of
from shard.push.successor import PushError, SuccessorStream, Upstream

__all__ = ["receive", "carry", "sink_of", "stream_ended", "serve_control",
           "PushHub", "PushSession", "ControlSink", "check_target", "hub_of",
           "SuccessorStream", "Upstream", "PushError"]
