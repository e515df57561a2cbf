"""One generation through the swarm, from the entry node.

    service.py        the generate core: request -> tokens -> route driver -> text events
    driver.py         SwarmDriver: the one route driver (failover, exact recovery, token-only tails)
    hop_link.py       one hop's Session stream (blocking gRPC call, credits, past length)
    deadlines.py      each hop's step deadlines from its own measured step times (silent hops)
    request_queue.py  request bodies from the driver's thread to the transport
    unix_channel.py   the own worker's Unix frame socket, read and written by the driver's thread
    routes.py         route sources (DHT ads, a fixed route) and the peer connector
    tokenizer.py      the artifact's tokenizer and chat template, without transformers
"""
