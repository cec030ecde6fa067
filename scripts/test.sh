#!/usr/bin/env bash
# Install what is missing, then lint and run every test that can run on this machine (tests that need a GPU, Isaac Sim
# or a real arm are marked and skipped with their reason). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
export RAY_AUTH_MODE=disabled MUJOCO_GL=${MUJOCO_GL:-egl} PYTHONHASHSEED=0
export RAY_TMPDIR=${RAY_TMPDIR:-$(mktemp -d /tmp/rayXXXX)}
export DREAMZERO_CACHE_DIR=${DREAMZERO_CACHE_DIR:-$PWD/.cache/dreamzero}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q -rs --durations=30 "$@"
