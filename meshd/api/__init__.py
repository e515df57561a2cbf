"""The entry node's user-facing HTTP: OpenAI-compatible API, Ollama routes, metrics, dashboard.

Every generation of the node -- HTTP or the control socket -- enters through
``Entry`` and runs the one generate core (meshd/generate/service.py).

    app.py        the Starlette app: routes, bounded bodies, bearer auth, streamed generation responses
    server.py     Hypercorn's trio HTTP protocol on the daemon's loop, bounded connections
    entry.py      Entry: admission (running / deferred), deadline, records; the door of every generation
    openai.py     OpenAI chat / completions bodies -> GenerateParams; events -> responses and SSE chunks
    ollama.py     Ollama /api/chat, /api/generate, /api/tags over the same core
    metrics.py    Prometheus metrics in a per-daemon registry (llama.cpp server's meanings + the mesh's)
    errors.py     OpenAI's error shape and the one mapping from the core's errors to HTTP statuses
    jsonbody.py   untrusted JSON with bounds (size, nesting depth, no NaN): HTTP and control socket
    static/       the dashboard page, script and style (package data; no CDN)
"""
