"""Benchmarks run by ``meshd bench NAME [--quick] [--json]`` (each ``run(quick, progress, options) -> dict``).

    swarm.py          the product path: real ``meshd join`` daemons vs the whole model in one process
    swarm_llama.py    ``swarm --backend llama.cpp``: llama.cpp daemons vs whole llama.cpp vs the bare
                      split floor (native/llama_floor.py), same run; the capture before/after
    llama_cpu.py      CPU per decode token of a swarm's processes, and of the llama.cpp engines alone
    pipeline.py       fixed splits through daemons vs the whole model, hop overhead and round-trip floors
    daemon_runs.py    what swarm and pipeline share: options, fixed-split daemons, the reference
    relay.py          the same route with its last hop direct and relayed
    api.py            the streaming HTTP API vs the control socket of one entry (decode rate, first token)
    serve.py          many users at once through the entry's /v1 API (c=1/4/8), both lanes; batching floor
    sse.py            the client side of the /v1 SSE stream (api.py, serve.py)
    codec.py          frame codec cost next to a memory copy
    recipes.py        safetensors vs GGUF recipes (recipe_plan/_routes/_runner/_diagnose.py)
    route_plan.py     route-planning micro-benchmark
    moe.py            MoE expert delegation: bytes per position (copies, rows once, q8), drift, decode
    hopfloor.py       the machine's gRPC / raw-socket round-trip floors
    hoptransport.py   one hop's decode step over TLS gRPC, framed TLS and the Unix socket, alternating
    torch_floor.py    the route's ranges in bare processes on a ring of pipes: what splitting alone costs
    relay_harness.py  process orchestration for the relay benchmark and relay end-to-end tests

Nothing in the product imports this room: the local swarm the demo runs
lives with the daemon (meshd/daemon/local_swarm.py).
"""
