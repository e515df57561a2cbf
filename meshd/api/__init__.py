"""The entry node's user-facing HTTP: OpenAI-compatible API, Ollama routes, metrics, dashboard.

    jsonbody.py   untrusted JSON with bounds (size, nesting depth, no NaN): HTTP and control socket
"""
