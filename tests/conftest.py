"""Shared pytest fixtures for meshd."""
from __future__ import annotations

import os
import tempfile

from shard.model.digests import CACHE_ENV

# The artifact digest cache (shard/model/digests.py) of a test run is its own: the many
# throwaway artifacts tests build must not push a user's real entries out of
# ~/.cache/meshd/digests. Set here, at collection, so every child process a test
# starts (workers, daemons) inherits it.
if CACHE_ENV not in os.environ:
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="meshd-test-digests-")
