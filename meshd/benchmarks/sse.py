"""Reading an OpenAI-style SSE stream on the client side (benchmarks that time the ``/v1`` API).

``choices(response)`` yields each ``data:`` event's first choice, in arrival
order, skipping ``[DONE]`` and the usage-only chunk (whose ``choices`` is
empty); the caller stamps arrival times itself.
"""
from __future__ import annotations

import json
from collections.abc import Iterator


def choices(response) -> Iterator[dict]:
    """The first choice of every event of an httpx streaming response (raises on an HTTP error)."""
    response.raise_for_status()
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices"):
            yield chunk["choices"][0]
