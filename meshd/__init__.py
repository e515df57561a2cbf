"""meshd: pool home machines to run language models, one layer range per node.

Rooms of this package, as layers (top first; a room imports only rooms below
it -- ``tests/test_layout_imports.py`` enforces it):

    cli/          the ``meshd`` entry point and one module per command
    benchmarks/   ``meshd bench NAME``: product-path benchmarks, local-swarm and relay harnesses
    daemon/       the node's composition root, control socket, advertiser, supervisor,
                  worker process and slot, the swarm part, the API part, relay mode
    api/          OpenAI-compatible HTTP, Ollama routes, Prometheus metrics, dashboard;
                  the entry every generation passes
    swarm/        tracker duty, the swarm view from the DHT, join/directive wire
    generate/     the one route driver, hop links, route source and connector,
                  tokenizer + chat template, the generate service
    plan/         pure planners: adverts, assignment, routing, tracker ranking,
                  directives, footprint, model facts
    reach/        reachability, relay dialing, DCUtR direct upgrade, pinned TLS
    config.py, errors.py, sizes.py   the ground floor every room may use

``testing/`` (seeded random models, worker subprocesses) is imported only by
tests and benchmarks.
"""

__version__ = "0.1.0"
