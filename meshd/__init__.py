"""meshd: pool home machines to run language models, one layer range per node."""

__version__ = "0.1.0"
