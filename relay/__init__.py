"""Relay mode and relayed hops: opaque length-prefixed frames over libp2p circuits.

    framing.py       sans-I/O frame core of a relayed stream (bounded; counters; node byte budget)
    transport.py     RelayedFrameChannel (frames over a libp2p stream) + RelayedSessionServer
                     (serving side: each relayed session -> the node's worker over local gRPC)
    bridge.py        trio <-> grpc.aio bridge: one worker Session call as raw bytes, one thread hop per frame
    handoff.py       bounded cross-thread hand-offs that wake the other side only when it waits
    client.py        circuit v2 client: reserve, dial through a relay (end-to-end Noise), STOP side
    hop.py           HopService: the relay's hop with meshd admission limits, bounded forwarding, counters
    reachability.py  dial-back probe (public/private) and the reservation keeper (renewal, failover)
    syncchannel.py   grpc.Channel look-alike so the route driver drives relayed hops unchanged
    local_link.py    trio-native link to this node's own worker over its Unix frame socket
    announce.py      a relay announces itself in the DHT
    node.py          `python -m relay.node`: a home node serving its worker through a relay
    trace.py         opt-in cross-process timestamps along the relayed frame path (benchmark breakdown)
    errors.py        RelayError tree

`meshd relay` itself (host + hop + DHT server + control API) is meshd/daemon/relay_mode.py.

The libp2p host every node runs on (relay/ included) is built by dht/host/; its library
adjustments live in dht/compat/, behind one version gate.
"""
