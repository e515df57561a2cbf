"""Reaching peers: who can dial us, how we dial them.

    relaying.py        reachability verdict, relay reservations, relayed addrs (daemon part)
    relay_dial.py      entry side of relayed hops: circuits through the peer's relays
    direct_upgrade.py  DCUtR: bounded background direct upgrades of relayed peers
    tls.py             per-node TLS material and certificate-pinned gRPC channels
"""
