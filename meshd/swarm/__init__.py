"""Swarm control between daemons.

    view.py          the swarm as the planner sees it: live shard ads of one model, from the DHT;
                     pool_status, what every node says about layers without a server
    tracker_duty.py  plan ranges for ``--layers auto`` joiners, close gaps, issue signed directives
    member.py        what a node decides each refresh and how it takes a directive (sans-I/O)
    wire.py          join ask/reply and directive request/ack over libp2p
"""
