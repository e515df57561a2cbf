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
    adjustments.py   applies those two (+ the library's yamux env knob) per version; the registry for status
    trace.py         opt-in cross-process timestamps along the relayed frame path (benchmark breakdown)
    errors.py        RelayError and HostError trees

`meshd relay` itself (host + hop + DHT server + control API) is meshd/daemon/relay_mode.py.

Library adjustments: py-libp2p 0.8.1's yamux sends a WINDOW_UPDATE after
(almost) every read, and its TCP/Noise/yamux layers spend most of a relayed
round trip in Python overhead. ``adjustments.apply_libp2p_adjustments()``
batches the updates at half the window (``yamux_tuning``), sets the library's
own knob PY_YAMUX_RELEASE_ON_READ=0 unless the user chose otherwise, and
installs the leaner data path (``libp2p_fastpath``; ``MESHD_LIBP2P_FASTPATH=0``
leaves it off). ``host.build_host`` calls it, so every process that builds a
host gets them before its first connection; importing this package changes
nothing. Each is gated on the exact library version, and the registry
(``adjustments.snapshot()``, shown by ``meshd status``) says which are on and why.
"""
