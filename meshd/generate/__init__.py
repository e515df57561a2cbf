"""One generation through the swarm, from the entry node.

    service.py        the generate core: request -> tokens -> route driver -> text events
    driver.py         SwarmDriver: the one route driver (failover, exact recovery)
    hop_link.py       one hop's Session stream (blocking gRPC call, credits, past length)
    request_queue.py  request bodies from the driver's thread to the transport
    routes.py         route sources (DHT ads, fixed routes) and the peer connector
    tokenizer.py      the artifact's tokenizer and chat template, without transformers
    gguf_tokenizer.py the same from a .gguf's metadata (transformers' ids, a tenth of its time)
"""
