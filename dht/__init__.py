"""Kademlia DHT records for meshd: signed capability records and their validator.

    records.py    pure rules: build/sign, validate (signature, peer id, schema,
                  expiry, skew, bounds), replace-by-sequence, record sets, merge
    keys.py       pure key names: /meshd/peer/<id>, /meshd/model/<digest>,
                  /meshd/span/<digest>/<A>-<B>
    validator.py  py-libp2p glue: strict NamespacedValidator for "meshd", and a
                  ValueStore that merges index values instead of replacing them
    kademlia/     the sans-I/O Kademlia core (lookup, publish, fetch, join and refresh as
                  steps; deadlines and peer health; the value rules; a k-bucket table that
                  follows py-libp2p's) and its simulation on a virtual clock
    node.py       DhtNode: runs the core over py-libp2p (KadDHT's table and server)
    lookup.py     pure iterative Kademlia lookup (alpha asks per round, final round, bounded)
    rpc.py        cancel-safe GET_VALUE / PUT_VALUE, stream sessions
    peer_health.py  pure per-peer bookkeeping: runs of misses, congestion, unreachable peers
    relay_records.py  signed relay records (a public relay announces itself)
    expert_records.py signed expert placement records (experts a peer serves without their layers)
    evidence.py       signed evidence that a peer answered a step otherwise than a replica (model-free rules)
    identity.py   the node's persistent Ed25519 identity and peer ids
    errors.py     RecordRejected, IdentityError

Two rooms below the records and Kademlia code (they import only each other,
downwards, and identity/errors; tests/test_layout_imports.py):

    host/         a node's libp2p host: build (Noise, yamux), bootstrap, connection watch
    compat/       every py-libp2p patch, behind one version gate, and their registry

Public surface: ``DhtNode``, ``CapabilityClaim``, ``CapabilityRecord``,
``validate_capability``, ``sign_capability``, ``sign_withdrawal``.
"""
