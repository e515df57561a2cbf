"""The Kademlia core: what a DHT node decides, with no I/O (sans-I/O).

    table.py   pure k-bucket routing table following py-libp2p 0.8.1's rules
"""
