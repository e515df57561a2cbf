"""The Kademlia core: what a DHT node decides, with no I/O (sans-I/O), and its simulation.

    table.py   pure k-bucket routing table following py-libp2p 0.8.1's rules
    book.py    a node's RPC bookkeeping: deadlines (RpcTimer), peer health, peers of
               another swarm (ForeignPeers), counts
    values.py  what a node stores, serves and reads: validate, select, merge, prune
    ops.py     lookup, publish, fetch, refresh as step generators that yield effects
               (GET, PUT, pause, concurrent sub-steps) for an edge to carry out
    sim.py     the in-memory twin of the network: thousands of nodes running ops.py
               on trio's MockClock, seeded latencies, NAT'd and slow peers, churn
    scenario.py  the churn scenario ``meshd bench dht --sim`` and the tests run

The product's edge is dht/node.py (py-libp2p streams under trio); the
iterative lookup's state is dht/lookup.py and per-peer health dht/peer_health.py,
both pure and used here.
"""
