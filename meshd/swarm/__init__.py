"""Swarm control between daemons.

    view.py          the swarm as the planner sees it: live shard ads of one model, from the DHT
    tracker_duty.py  plan ranges for ``--layers auto`` joiners, issue signed directives
    wire.py          join ask/reply and directive request/ack over libp2p
"""
