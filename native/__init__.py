"""GGUF side of meshd: range-aware GGUF reading and llama.cpp / torch execution of a layer range.

Files and roles:
  errors.py         ArtifactError / RuntimeUnavailable / RangeUnavailable in the meshd error tree
  gguf_file.py      the bounded GGUF reader: every count, length and offset checked (GGUFFormatError)
  gguf_arch.py      one adapter per architecture (llama, qwen2, qwen3, gemma3): tensors, hparams,
                    layer-indexed metadata of slices, the torch lane's names and transforms
  gguf_range.py     model facts, one range's tensors (memory-mapped), held range of a slice,
                    size table, model digest (the Merkle root; a slice's = its source's), recipe
  gguf_manifest.py  a GGUF's manifest: built from a whole file, or carried by a slice and checked against
                    its bytes; a manifest's model facts without the file (virtual reader); a range's tensors
  gguf_write.py     GGUF bytes written by us: metadata pairs, the canonical metadata blob, a file's layout
  slice.py          per-range GGUF slices for llama.cpp (renumbered blocks, no_vocab, fake vocab
                    off the ends) and self-describing user slices (``meshd slice``, and what a node
                    fetches: the same file, carrying the source's manifest)
  llama_engine.py   one llama.cpp model + context; token/embedding batches; residual capture via cb_eval
                    (the C callback of csrc/capture.c; the Python one without a compiler)
  cbuild.py         compiles and caches meshd's C against the installed llama.cpp (csrc/)
  csrc/capture.c    the eval callback that copies a non-tail slice's residual and stops the graph
  csrc/llama_floor.c  bare llama.cpp split floor: one slice per process, raw rows over pipes
  llama_floor.py    runs that floor as a ring of processes; tokens + prefill/decode timings
  llama_backend.py  LlamaRangeBackend: shard's RangeBackend over llama.cpp sequences (sessions = seq_ids)
  torch_gguf.py     the exactness reference: dequantized GGUF range -> shard's TorchRangeBackend
  convert.py        safetensors artifact -> GGUF (F32, F16, BF16, Q8_0; Q4_K_M via llama.cpp's quantizer)
  moe_gguf.py       Qwen3-MoE safetensors artifact -> qwen3moe GGUF (experts stacked per block)
  factory.py        the worker's hook: FILE.gguf + --backend llama.cpp|torch -> a RangeBackend
  llama_reference.py  whole-model llama.cpp in one process: greedy tokens + prefill/decode timings
  packaged.py       models shipped in PyPI packages (SmolLM2 GGUF, Gemma-3 GGUF) prepared, cached
  cpu_build.py      llama.cpp build flags from CPU features and what the OS enabled (AMX)

llama-cpp-python is the optional ``[native]`` extra (compiled from source; see
scripts/install-native.sh); modules that need it import it lazily and raise
RuntimeUnavailable with the install hint when it is missing.
"""
