#!/usr/bin/env bash
# Lint, then every test that can run on this machine (GPU / Isaac Sim / real-arm tests are marked and skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=disabled MUJOCO_GL=${MUJOCO_GL:-egl} PYTHONHASHSEED=0
export RAY_TMPDIR=${RAY_TMPDIR:-$(mktemp -d /tmp/rayXXXX)}
export DREAMZERO_CACHE_DIR=${DREAMZERO_CACHE_DIR:-$PWD/.cache/dreamzero}
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -rs "$@"
