"""One generation through the swarm, from the entry node.

    service.py        the generate core: params -> tokens -> route driver -> text events (every edge)
    params.py         GenerateParams: one validated request shape (prompt or chat messages, stops, logprobs)
    textstream.py     incremental detokenization; stop strings held back and cut
    hop_meter.py      per-hop bytes and decode-step latency, measured on each hop's transport
    driver.py         SwarmDriver: the one route driver (failover, exact recovery, token-only tails)
    push.py           PushDriver: the driver with the push topology (hops + 1 legs per token), star kept
    hop_link.py       one hop's Session stream (over any proto.hop_transport.HopTransport; credits, past length)
    deadlines.py      each hop's step deadlines from its own measured step times (silent hops)
    audit.py          audits: a seeded share of each hop's steps re-run on a replica; liars excluded
    receipt_check.py  each hop's signed step receipts checked as they arrive (digests chained)
    evidence.py       an audit mismatch as evidence, and a second entry's re-verification of it
    transports.py     the hop transports the entry dials: gRPC (pinned TLS, loopback), a peer's framed
                      TLS fast path (gRPC as fallback), the own worker's Unix socket
    routes.py         route sources (DHT ads, a fixed route) and the peer connector
    tokenizer.py      the artifact's tokenizer and chat template, without transformers
    gguf_tokenizer.py the same from a .gguf's metadata (transformers' ids, a tenth of its time)
"""
