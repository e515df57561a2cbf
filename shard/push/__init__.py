"""Push: a hop sends its output rows straight to the next hop, and recovers when that hop fails.

Files and roles:

    hub.py         the worker's pushed sessions (PushHub, PushSession): who may attach, the
                   entry's control stream answered from other threads (ControlSink), and the
                   carrying-out of the stream core's push actions for the edges
    successor.py   a pushed hop's own stream to its successor (framed TLS fast path or gRPC) and
                   the rows it keeps, so that a replacement successor can be re-fed (recovery)

Who owns what: the PushHub (one per ShardService) owns the registered
PushSessions; each PushSession owns its ControlSink and its SuccessorStream,
and the SuccessorStream owns its reader thread and its call to the successor.
"""
from shard.push.hub import ControlSink, PushHub, PushSession, check_target, hub_of, serve_control
from shard.push.successor import PushError, SuccessorStream

__all__ = ["PushHub", "PushSession", "ControlSink", "serve_control", "check_target", "hub_of",
           "SuccessorStream", "PushError"]
