#!/usr/bin/env bash
# Install the [native] extra (llama-cpp-python compiled from source).
# The build takes minutes on 2 cores, so the wheel is cached per machine in
# ~/.cache/meshd/wheels and reused by later runs. Flags: no llava, no
# examples/tests/server; GGML_NATIVE stays on (this machine's CPU features).
set -euo pipefail
VERSION=0.3.36
CACHE="${MESHD_WHEEL_CACHE:-$HOME/.cache/meshd/wheels}"
mkdir -p "$CACHE"
if python -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null; then
    echo "llama-cpp-python $VERSION already installed"; exit 0
fi
if ! ls "$CACHE"/llama_cpp_python-$VERSION-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION (several minutes on 2 cores)..."
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF" \
        pip wheel --no-deps "llama-cpp-python==$VERSION" -w "$CACHE"
fi
pip install -q --no-deps "$CACHE"/llama_cpp_python-$VERSION-*.whl
pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3"
