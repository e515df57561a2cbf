#!/usr/bin/env bash
# Install the [native] extra (llama-cpp-python compiled from source).
# The build takes minutes on 2 cores, so the wheel is cached per machine in
# ~/.cache/meshd/wheels/<key>/, where <key> digests the CMake flags: a wheel
# built with other flags is never reused. The flags come from
# native/cpu_build.py: GGML_NATIVE off, every instruction set named from what
# the CPU reports AND the OS enabled (AMX only with the kernel's XTILEDATA
# permission; a GGML_NATIVE build dies with SIGILL where it is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
CACHE_ROOT="${MESHD_WHEEL_CACHE:-$HOME/.cache/meshd/wheels}"
ARGS="$(python -m native.cpu_build)"
KEY="$(python -m native.cpu_build --key)"
CACHE="$CACHE_ROOT/$KEY"
MARK="$(python -c 'import site,sys; print(site.getsitepackages()[0])')/meshd_native_build_key.txt"
mkdir -p "$CACHE"
if python -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null \
        && [ "$(cat "$MARK" 2>/dev/null)" = "$KEY" ]; then
    echo "llama-cpp-python $VERSION already installed (build key $KEY)"; python -m native.cbuild; exit 0
fi
if ! ls "$CACHE"/llama_cpp_python-$VERSION-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION (several minutes on 2 cores), build key $KEY:"
    echo "  CMAKE_ARGS=$ARGS"
    CMAKE_ARGS="$ARGS" pip wheel --no-deps --no-cache-dir "llama-cpp-python==$VERSION" -w "$CACHE"
    echo "$ARGS" > "$CACHE/cmake-args.txt"
fi
pip install -q --force-reinstall --no-deps "$CACHE"/llama_cpp_python-$VERSION-*.whl
pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3"
echo "$KEY" > "$MARK"
echo "llama-cpp-python $VERSION installed (build key $KEY)"
# meshd's own C against it (residual capture, bare split floor); cached by source + runtime.
python -m native.cbuild
