"""The Kademlia core: what a DHT node decides, with no I/O (sans-I/O).

    table.py   pure k-bucket routing table following py-libp2p 0.8.1's rules
    book.py    a node's RPC bookkeeping: deadlines (RpcTimer), peer health, counts
    values.py  what a node stores, serves and reads: validate, select, merge, prune
    ops.py     lookup, publish, fetch, join, refresh as step generators that yield effects
               (GET, PUT, pause, concurrent sub-steps) for an edge to carry out

The product's edge is dht/node.py (py-libp2p streams under trio); the
iterative lookup's state is dht/lookup.py and per-peer health dht/peer_health.py,
both pure and used here.
"""
