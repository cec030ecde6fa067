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
# Two pytest-xdist workers by default (DREAMZERO_TEST_WORKERS=0: serial): much of the suite waits on Ray, servers and
# subprocesses, which the other worker's tests fill. Each test has a group meant to run whole on one worker, longest
# first (tests/support/parallel.py; docs/testing.md, "CI time")
workers=${DREAMZERO_TEST_WORKERS:-2}
parallel=()
[ "$workers" = "0" ] || parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
.venv/bin/python -m pytest -q -rs --durations=30 "${parallel[@]}" "$@"
