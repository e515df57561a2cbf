"""The daemon: one trio process per node, one tree of nurseries.

    node.py            ``run_daemon``: the composition root (host, DHT, parts below), status
    control.py         the local control socket (JSON lines; server and blocking client)
    api_part.py        the HTTP API's entry and server, wired to the node; the dashboard's status JSON
    peer_watch.py      the peers as they are now: Health each second, liveness (gone / unreachable), history
    advertiser.py      keeps our signed capability record alive in the DHT
    free_kv.py         when our record's free KV is republished (moved > 10% of the budget, rate-limited)
    supervisor.py      restarts the worker with backoff, withdraws meanwhile
    worker_process.py  the life of one ``meshd worker`` subprocess
    worker_slot.py     the worker of a ``--layers auto`` node (range assigned at run time; with
                       ``--model ROOT`` fetched first)
    fetch_part.py      the fetch port (the model bytes we hold, served to peers) and, for
                       ``--model ROOT``, fetching our range from every peer that holds it
    swarm_part.py      the daemon's swarm part: tracker duty, auto ranges, directives, generate
    experts_part.py    MoE: an expert peer's worker and signed expert record, a holder's directory
                       of expert peers (the placement file its worker reads)
    relay_mode.py      ``meshd relay``: circuit relay v2 hop + DHT server + control API
    local_swarm.py     LocalSwarm / LocalDaemon: real ``meshd join`` daemons on loopback, driven
                       through their control sockets (``meshd demo``, benchmarks, slow tests)
"""
