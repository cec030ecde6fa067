#!/usr/bin/env bash
# One command on a machine with one NVIDIA GPU (sized for an H200, under 8 minutes): the GPU test tier (tests/gpu,
# marked `gpu`) and the DROID 14B latency benchmark (random weights: 8 steps, 16 steps, dynamic skipping, with
# `pipeline.compile` none and dit where this tree has that knob), whose table becomes the "GPU" section of
# docs/benchmarks.md. Fails at once, saying why, where there is no CUDA. Installs only what scripts/install.sh does
# (skip that with DREAMZERO_PYTHON=/path/to/python). Logs: $GPU_CHECK_LOGS (default .cache/gpu-check/).
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
start=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - start))); }
fail() { echo "gpu-check: $*" >&2; exit 2; }

# 1. fail fast: no driver, no GPU
command -v nvidia-smi >/dev/null 2>&1 || fail "no NVIDIA driver (nvidia-smi not found): run this on a GPU machine"
nvidia-smi -L >/dev/null 2>&1 || fail "nvidia-smi sees no GPU: $(nvidia-smi -L 2>&1 | head -1)"

# 2. the environment install.sh builds (nothing else is downloaded)
if [ -n "${DREAMZERO_PYTHON:-}" ]; then PY=$DREAMZERO_PYTHON; else ./scripts/install.sh; PY=.venv/bin/python; fi
"$PY" - <<'PYEOF' || fail "torch cannot use the GPU (see above)"
import sys
import torch

if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"gpu-check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
PYEOF

export RAY_AUTH_MODE=disabled PYTHONHASHSEED=0 PYTHONPATH=$PWD/clients${PYTHONPATH:+:$PYTHONPATH}
export RAY_TMPDIR=${RAY_TMPDIR:-$(mktemp -d /tmp/rayXXXX)}
export DREAMZERO_CACHE_DIR=${DREAMZERO_CACHE_DIR:-$PWD/.cache/dreamzero}
LOGS=${GPU_CHECK_LOGS:-$PWD/.cache/gpu-check}
mkdir -p "$LOGS"

# 3. the GPU tier (prints drift, chunk times, memory vs accounting, the measured budget)
echo "gpu-check: tests/gpu (at most 270 s)"
set +e
timeout 270 "$PY" -m pytest -q -rs -s -m gpu tests/gpu 2>&1 | tee "$LOGS/gpu-tier.txt"
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || fail "the GPU tier failed (exit $status; 124 = over its time); log: $LOGS/gpu-tier.txt"

# 4. the 14B benchmark into docs/benchmarks.md ("GPU"); without compile if the compiled modes do not fit the time
bench() {
  timeout "$1" "$PY" benchmarks/model_latency.py --preset droid_14b --device cuda --dtype bfloat16 \
    --warmup 1 --repeats 2 --compile "$2" --write-docs docs/benchmarks.md --section GPU 2>&1 | tee "$LOGS/bench-$3.txt"
  return "${PIPESTATUS[0]}"
}
t=$(($(left) - 5))
[ "$t" -gt 60 ] || fail "no time left for the benchmark ($t s)"
echo "gpu-check: 14B latency, compile none,dit (at most $t s)"
if ! bench "$t" none,dit compiled; then
  t=$(($(left) - 5))
  [ "$t" -gt 60 ] || fail "the benchmark with compile did not finish and no time is left for one without"
  echo "gpu-check: compiled modes did not finish; 14B latency without compile (at most $t s)"
  bench "$t" none plain || fail "the 14B benchmark failed; log: $LOGS/bench-plain.txt"
fi
echo "gpu-check: done in $(($(date +%s) - start)) s; docs/benchmarks.md has a fresh GPU section"
