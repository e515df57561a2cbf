"""Relay mode and relayed hops: opaque length-prefixed frames over libp2p circuits.

    framing.py       sans-I/O frame core of a relayed stream (bounded; counters; node byte budget)
    transport.py     RelayedFrameChannel (frames over a libp2p stream) + RelayedSessionServer
                     (serving side: each relayed session -> the node's worker over local gRPC)
    bridge.py        trio <-> grpc bridge: one worker Session call as raw bytes, bounded queues
    client.py        circuit v2 client: reserve, dial through a relay (end-to-end Noise), STOP side
    hop.py           HopService: the relay's hop with meshd admission limits, bounded forwarding, counters
    service.py       `meshd relay`: host + hop + DHT server + control API; status view
    reachability.py  dial-back probe (public/private) and the reservation keeper (renewal, failover)
    syncchannel.py   grpc.Channel look-alike so shard's RouteDriver drives relayed hops unchanged
    node.py          `python -m relay.node`: a home node serving its worker through a relay
    harness.py       process orchestration for the relay benchmark and end-to-end tests
    errors.py        RelayError tree

Yamux tuning: py-libp2p's yamux sends a WINDOW_UPDATE after every read by
default (PY_YAMUX_RELEASE_ON_READ=1). On a relayed hop that is one extra
Noise message per frame per direction through two hosts; batching updates at
half the window (go-yamux's behaviour, the library's documented alternative)
cut the relayed round trip of a 300-byte frame from ~18 ms to ~12 ms on the
loaded reference machine. Set here for every process that relays frames,
unless the user chose otherwise.
"""
import os as _os

_os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
