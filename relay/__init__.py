"""Relay mode and relayed hops: opaque length-prefixed frames over libp2p circuits.

    framing.py       sans-I/O frame core of a relayed stream (bounded; counters; node byte budget)
    transport.py     RelayedFrameChannel (frames over a libp2p stream) + RelayedSessionServer
                     (serving side: each relayed session -> the node's worker over local gRPC)
    bridge.py        trio <-> grpc.aio bridge: one worker Session call as raw bytes, one thread hop per frame
    handoff.py       bounded cross-thread hand-offs that wake the other side only when it waits
    client.py        circuit v2 client: reserve, dial through a relay (end-to-end Noise), STOP side
    hop.py           HopService: the relay's hop with meshd admission limits, bounded forwarding, counters
    host.py          the libp2p host: Noise-only security, yamux, bootstrap dialing
    reachability.py  dial-back probe (public/private) and the reservation keeper (renewal, failover)
    syncchannel.py   grpc.Channel look-alike so the route driver drives relayed hops unchanged
    local_link.py    trio-native link to this node's own worker over its Unix frame socket
    announce.py      a relay announces itself in the DHT
    node.py          `python -m relay.node`: a home node serving its worker through a relay
    yamux_tuning.py  yamux WINDOW_UPDATEs batched at half the window (py-libp2p 0.8.1 sends ~one per read)
    libp2p_fastpath.py  a leaner TCP/Noise/yamux data path for py-libp2p 0.8.1 (same bytes on the wire)
    trace.py         opt-in cross-process timestamps along the relayed frame path (benchmark breakdown)
    errors.py        RelayError and HostError trees

`meshd relay` itself (host + hop + DHT server + control API) is meshd/daemon/relay_mode.py.

Yamux tuning: py-libp2p's yamux sends a WINDOW_UPDATE after (almost) every
read. On a relayed hop each frame is read at three yamux layers, so that is
~5 extra Noise messages, TCP sends and wakeups per frame per direction.
Importing this package makes every process that relays frames batch updates
at half the window (go-yamux's rule): ``yamux_tuning.apply()`` (see there
for the numbers), plus the library's own knob PY_YAMUX_RELEASE_ON_READ=0 for
the code paths the patch does not replace, unless the user chose otherwise.

Fast path: ``libp2p_fastpath.apply()`` removes most of py-libp2p's per-frame
Python overhead (scheduler passes on uncontended locks, two recvs per Noise
message, debug f-strings): about half the CPU of a relayed round trip.
"""
import os as _os

from relay import libp2p_fastpath as _libp2p_fastpath
from relay import yamux_tuning as _yamux_tuning

_os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
_yamux_tuning.apply()
_libp2p_fastpath.apply()
