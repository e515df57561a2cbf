"""The entry node's user-facing HTTP: OpenAI-compatible API, Ollama routes, metrics, dashboard.

Every generation of the node -- HTTP or the control socket -- enters through
``Entry`` and runs the one generate core (meshd/generate/service.py).

    app.py        the Starlette app: routes, strict bounded bodies, streamed generation responses
    guard.py      who may use it: Host allow-list, Origin check, CORS when configured, bearer key
    server.py     Hypercorn's trio HTTP protocol on the daemon's loop; accept loop over the slot table
    connections.py  the connection slots: per-address cap, eviction of idle ones, deadlines (sans-I/O)
    hypercorn_compat.py  the one version-gated adjustment of Hypercorn (HTTP/2 preface-only idle)
    entry.py      Entry: admission (running / deferred), deadline, records; the door of every generation
    openai.py     OpenAI chat / completions bodies -> GenerateParams; events -> responses and SSE chunks
    ollama.py     Ollama /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/embed(dings)
    model_card.py what the model's files say (family, parameters, quantization, context, template)
    metrics.py    Prometheus metrics in a per-daemon registry (llama.cpp server's meanings + the mesh's)
    errors.py     OpenAI's error shape and the one mapping from the core's errors to HTTP statuses
    jsonbody.py   untrusted JSON with bounds (size, nesting depth, no NaN, Unicode scalar values only)
    static/       the dashboard page, script and style (package data; no CDN)
"""
