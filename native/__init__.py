"""GGUF side: range-aware GGUF reading and llama.cpp execution of a layer range."""
