#!/usr/bin/env bash
# Install kvledger with its test extras on a fresh machine and run the whole test suite.
# torch is pinned to the CPU build that these machines carry locally (an unpinned torch
# would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
# The dashboard's browser tests drive Debian's Chromium (never `playwright install`); the
# llama2.c oracle test compiles run.c with the system C compiler.
APT=""
command -v chromium >/dev/null 2>&1 || APT="$APT chromium"
command -v cc >/dev/null 2>&1 || APT="$APT gcc libc6-dev"
if [ -n "$APT" ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $APT >/dev/null
fi
ruff check kvledger tests benchmarks
# Two workers, a test file each at a time (pytest-xdist, --dist loadfile: a module's shared
# servers and models stay in one process): most tests run one torch thread, so on 2 cores one
# core idled (one worker: 741 s of pytest; two: ~470 s, 2026-12-03).
# --durations: the slowest tests named in every run, to keep the suite under ten minutes on 2 cores
python -m pytest -p no:cacheprovider -n 2 --dist loadfile --durations=25 "$@"
