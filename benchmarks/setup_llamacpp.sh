#!/usr/bin/env bash
# Build llama.cpp's command-line tools for the CPU comparisons (benchmarks/spec_decode.py, and
# quantised-weight comparisons): llama-server, llama-cli, llama-bench, llama-quantize,
# llama-speculative-simple, llama-lookup and friends.
#
# llama.cpp is never a kvledger dependency. Its source comes from the vendored copy in PyPI's
# llama-cpp-python sdist (pip, an ordinary registry client; no git clone), built with cmake,
# Release, -DGGML_NATIVE=ON (this machine's avx512 etc.). Idempotent: a second run only checks.
#
#   LLAMACPP_DIR      install dir  (default <kvledger cache dir>/bench_envs/llama.cpp, the cache
#                     dir rule of kvledger/envs.py: $KVLEDGER_CACHE_DIR, else
#                     $XDG_CACHE_HOME/kvledger, else ~/.cache/kvledger)
#   LLAMACPP_SDIST    llama-cpp-python version whose vendor/llama.cpp is built (default 0.3.36)
#   JOBS              parallel compile jobs (default 2)
#   --print-dir       print the install dir and exit
#
# Layout: $LLAMACPP_DIR/src (the vendored llama.cpp source, incl. convert_hf_to_gguf.py, which
# needs the `gguf`, `transformers` and `sentencepiece` packages), $LLAMACPP_DIR/build,
# $LLAMACPP_DIR/bin (tools).
set -euo pipefail

CACHE_DIR="${KVLEDGER_CACHE_DIR:-${KVLEDGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvledger}}"
DIR="${LLAMACPP_DIR:-$CACHE_DIR/bench_envs/llama.cpp}"
if [ "${1:-}" = "--print-dir" ]; then
    echo "$DIR"
    exit 0
fi
VERSION="${LLAMACPP_SDIST:-0.3.36}"
JOBS="${JOBS:-2}"
TOOLS=(llama-server llama-cli llama-bench llama-quantize llama-speculative-simple
       llama-speculative llama-lookup llama-lookup-stats llama-simple)

mkdir -p "$DIR"
if [ ! -f "$DIR/src/CMakeLists.txt" ]; then
    echo "[setup_llamacpp] pip download llama-cpp-python==$VERSION (sdist)"
    tmp="$(mktemp -d)"
    python3 -m pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$tmp"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    rm -rf "$DIR/src"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DIR/src"
    rm -rf "$tmp"
fi

missing=()
for t in "${TOOLS[@]}"; do
    [ -x "$DIR/bin/$t" ] || missing+=("$t")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "[setup_llamacpp] building ${missing[*]} with $JOBS jobs (tens of minutes on 2 cores)"
    gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    cmake -S "$DIR/src" -B "$DIR/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
    # A tool that does not exist in this llama.cpp version is skipped with a message, not fatal.
    mkdir -p "$DIR/bin"
    for t in "${missing[@]}"; do
        if cmake --build "$DIR/build" --config Release -j "$JOBS" --target "$t"; then
            cp "$DIR/build/bin/$t" "$DIR/bin/"
        else
            echo "[setup_llamacpp] FAILED to build $t (see the cmake output above)" >&2
        fi
    done
fi

# convert_hf_to_gguf.py imports sentencepiece before it looks for a tokenizer.model (a folder
# with only tokenizer.json, as stories260k, fails without it): one of llama.cpp's own
# convert requirements.
python3 -c "import sentencepiece" 2>/dev/null || python3 -m pip install --quiet sentencepiece

python3 - "$DIR" <<'EOF'
import importlib.util
import sys

ok = all(importlib.util.find_spec(m) for m in ("gguf", "transformers", "sentencepiece"))
print(f"[setup_llamacpp] convert_hf_to_gguf.py: {sys.argv[1]}/src/convert_hf_to_gguf.py "
      f"({'gguf, transformers, sentencepiece importable' if ok else 'MISSING gguf, transformers or sentencepiece'})")
EOF
ls "$DIR/bin"
"$DIR/bin/llama-cli" --version 2>&1 | head -2 || true
