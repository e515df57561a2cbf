"""The relay role: relay mode, circuits, NAT traversal, and relayed hops (opaque frames over circuits).

Relay mode -- a public peer carries circuits for peers that cannot dial each other:

    hop.py           HopService: circuit relay v2's hop with meshd admission limits, bounded forwarding, counters
    announce.py      a relay announces itself in the DHT (sign, publish, republish)

Circuits and NAT -- every node, as a client of relays:

    client.py        circuit v2 client: reserve a slot, dial through a relay (end-to-end Noise), the STOP side
    reachability.py  dial-back probe (public/private) and the reservation keeper (renewal, failover)

Relayed hops -- one route session as length-prefixed frames on a stream through a circuit:

    framing.py       sans-I/O frame core of a relayed stream (bounded; counters; node byte budget)
    transport.py     RelayedFrameChannel (frames over a libp2p stream) + RelayedSessionServer
                     (serving side: each relayed session -> the node's own worker)
    local_link.py    to the own worker over its Unix frame socket (trio-native, no threads)
    syncchannel.py   a grpc.Channel look-alike so the route driver drives relayed hops unchanged
    portal.py        the one bridge between trio and plain threads (Portal, LoopThread) and the
                     bounded hand-offs both ways (Outbox, Inbox, Credits); the whole daemon uses it
    trace.py         opt-in cross-process timestamps along the relayed frame path (benchmark breakdown)

    errors.py        RelayError tree (RelayRefused, RelayUnreachable, WorkerUnavailable)

`meshd relay` itself (host + hop + DHT server + control API) is meshd/daemon/relay_mode.py; a
home node reached through relays is the daemon (meshd/reach/relaying.py). The libp2p host every
node runs on is built by dht/host/, and its library adjustments live in dht/compat/.
"""
