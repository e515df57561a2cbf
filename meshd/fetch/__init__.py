"""Weights from peers: a node fetches just its range's chunks of a model named by its root.

Files and roles (data flows top to bottom):

    facts.py      layers, context, footprint and a range's entries from a manifest (no weights)
    scheduler.py  sans-I/O: which provider fetches which run of chunks; blame, back-off, resume
    fetcher.py    one fetch: a thread per provider, each chunk hashed on arrival and written in place
    links.py      a peer's fetch port over pinned TLS, or this node's own holdings, as a provider
    wire.py       sans-I/O: the chunk protocol's requests and replies (bounded)
    server.py     the fetch port: holdings served over TLS, rate-limited, at the lowest CPU priority
    holdings.py   what this node can serve: model files, slices, parts being fetched (checked bytes only)
    store.py      what a node keeps per root: manifest, metadata, finished slices, parts + bitmaps
    flow.py       the steps: the manifest, the metadata (BLOBs), a range's slice checked at the end

The model's identity and its checks are shard/model/manifest.py (the Merkle
root), native/gguf_manifest.py and shard/model/st_manifest.py; the daemon's
side (providers from the DHT, ``ensure(range)``, status) is
meshd/daemon/fetch_part.py.
"""
