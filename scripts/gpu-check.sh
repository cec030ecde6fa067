#!/usr/bin/env bash
# One command on a machine with NVIDIA GPUs (an 80 GB H100 or a 141 GB H200): install, then the stages of
# scripts/gpu_check.py, each in its own process with its own timeout, the most valuable figures first (environment,
# a torch.compile smoke test, the 14B eager latency, the 14B compiled latency, the GPU tier, robots per GPU, the 5B,
# the two-GPU CFG-parallel row where two GPUs are present). Every figure is appended to .cache/gpu-check/results.jsonl
# as soon as it exists and the "GPU" section of docs/benchmarks.md is written after every stage, marked incomplete
# where a stage did not finish. `--rehearse` runs the stages on this CPU with simulated GPUs (CI does).
#
# Install, before the clock starts:
#   - DREAMZERO_PYTHON=/path/to/python: use that interpreter as it is;
#   - else a wheel folder ($GPU_WHEELS, default .cache/gpu-wheels, made by scripts/gpu-wheels.sh on a networked
#     machine): the air-gapped case. The machine's own Python (or $GPU_CHECK_PYTHON) gets the few wheels the Ray-free
#     model core needs, installed offline into .cache/gpu-site (scripts/gpu-offline-env.sh); no network is touched and
#     the tier's serve test is skipped where Ray is not installed;
#   - else ./scripts/install.sh (a networked machine: the project's .venv); on a GPU machine whose package index does
#     not answer (the air-gapped box without its wheel folder) it stops at once, saying how to build and carry the
#     folder, and creates nothing.
# Other arguments go to scripts/gpu_check.py (--out, --budget-s, --only, --timeout, --docs; see its --help). Results,
# logs and the written docs: .cache/gpu-check/ (--out). The last line says PASS or FAIL <stage>: <why>.
set -euo pipefail
cd "$(dirname "$0")/.."
label="gpu-check"
for arg in "$@"; do [ "$arg" = "--rehearse" ] && label="gpu-check rehearsal"; done
fail() { echo "$label: FAIL $1: $2"; exit 1; }
# whether pip's package index answers (a TCP connection to its host, bounded): the air-gapped box must not wait for
# pip's retries. The index is pip's own: $PIP_INDEX_URL, its configuration, else its default.
index_host() {
  local py=${GPU_CHECK_PYTHON:-python3} url=${PIP_INDEX_URL:-}
  [ -n "$url" ] || url=$("$py" -m pip config get global.index-url 2>/dev/null || true)
  [ -n "$url" ] || url=$("$py" -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)' 2>/dev/null)
  printf '%s' "$url" | sed -E 's#^[a-z+]+://([^/@]*@)?([^/:]+).*#\2#'
}
reachable() {
  local host
  host=$(index_host)
  [ -n "$host" ] && timeout "${GPU_CHECK_NET_PROBE_S:-5}" bash -c "exec 3<>/dev/tcp/$host/443" 2>/dev/null
}

# 1. fail fast: no driver, no GPU (a rehearsal needs neither)
if [ "$label" = "gpu-check" ]; then
  command -v nvidia-smi >/dev/null 2>&1 || fail preflight "no NVIDIA driver (nvidia-smi not found): run this on a GPU machine"
  nvidia-smi -L >/dev/null 2>&1 || fail preflight "nvidia-smi sees no GPU: $(nvidia-smi -L 2>&1 | head -1)"
fi

# 2. install (not counted in the budget)
WHEELS=${GPU_WHEELS:-.cache/gpu-wheels}
if [ -n "${DREAMZERO_PYTHON:-}" ]; then
  PY=$DREAMZERO_PYTHON
elif [ -d "$WHEELS" ] && [ "$label" = "gpu-check" ]; then
  PY=${GPU_CHECK_PYTHON:-python3}
  line=$(scripts/gpu-offline-env.sh "$WHEELS" .cache/gpu-site --python "$PY" | tail -1) \
    || fail install "the offline install from $WHEELS failed (see above)"
  export "${line?}"
elif [ "$label" = "gpu-check" ] && ! reachable; then
  # the air-gapped GPU box without its wheel folder: install.sh would make a bare venv and fail only after pip's
  # retries, minutes of the GPU window; say at once what to carry instead, and create nothing
  fail install "no network (pip's package index $(index_host) did not answer within ${GPU_CHECK_NET_PROBE_S:-5} s) and no wheel folder \
at $WHEELS: on a networked machine run scripts/gpu-wheels.sh (it fills .cache/gpu-wheels for this box's Python 3.12), \
carry that folder here as $WHEELS (or set GPU_WHEELS), and run this again; or set DREAMZERO_PYTHON to a Python that \
has the project's dependencies"
else
  ./scripts/install.sh || fail install "scripts/install.sh failed (see above)"
  PY=.venv/bin/python
fi
export PYTHONPATH=$PWD:$PWD/clients/dreamzero-client:$PWD/clients/dreamzero-droid:$PWD/clients/dreamzero-franka${PYTHONPATH:+:$PYTHONPATH}
export RAY_AUTH_MODE=disabled PYTHONHASHSEED=0
export RAY_TMPDIR=${RAY_TMPDIR:-$(mktemp -d /tmp/rayXXXX)}
export DREAMZERO_CACHE_DIR=${DREAMZERO_CACHE_DIR:-$PWD/.cache/dreamzero}

# 3. the stages, each in its own process with its own timeout (the clock starts here; scripts/gpu_check.py)
exec "$PY" scripts/gpu_check.py "$@"
