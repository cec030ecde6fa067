#!/usr/bin/env bash
# One command on a machine with one NVIDIA GPU (sized for an H200): install, then within 8 minutes the GPU test tier
# (tests/gpu) and the DROID 14B latency benchmark, every figure into the "GPU" section of docs/benchmarks.md
# (scripts/gpu_check.py holds the stages). `--rehearse` runs every stage on this CPU with a simulated GPU (CI does).
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
# Other arguments go to scripts/gpu_check.py (--budget-s, --only, --serve-config, --docs; see its --help). Logs:
# .cache/gpu-check/. The last line says PASS or FAIL <stage>: <why>.
set -euo pipefail
cd "$(dirname "$0")/.."
label="gpu-check"
for arg in "$@"; do [ "$arg" = "--rehearse" ] && label="gpu-check rehearsal"; done
fail() { echo "$label: FAIL $1: $2"; exit 1; }
# whether the package index answers (a TCP connect, bounded): the air-gapped box must not wait for pip's retries
index_host=$(printf '%s' "${PIP_INDEX_URL:-https://pypi.org/simple}" | sed -E 's#^[a-z+]+://([^/@]*@)?([^/:]+).*#\2#')
reachable() { timeout "${GPU_CHECK_NET_PROBE_S:-5}" bash -c "exec 3<>/dev/tcp/$index_host/443" 2>/dev/null; }

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
  fail install "no network (${index_host}:443 unreachable within ${GPU_CHECK_NET_PROBE_S:-5} s) and no wheel folder \
at $WHEELS: on a networked machine run scripts/gpu-wheels.sh (it fills .cache/gpu-wheels for this box's Python 3.12), \
carry that folder here as $WHEELS (or set GPU_WHEELS), and run this again; or set DREAMZERO_PYTHON to a Python that \
has the project's dependencies"
else
  ./scripts/install.sh || fail install "scripts/install.sh failed (see above)"
  PY=.venv/bin/python
fi
export PYTHONPATH=$PWD:$PWD/clients${PYTHONPATH:+:$PYTHONPATH}
export RAY_AUTH_MODE=disabled PYTHONHASHSEED=0
export RAY_TMPDIR=${RAY_TMPDIR:-$(mktemp -d /tmp/rayXXXX)}
export DREAMZERO_CACHE_DIR=${DREAMZERO_CACHE_DIR:-$PWD/.cache/dreamzero}

# 3. where two GPUs are present: the two-GPU row of the CFG-parallel comparison (policy.cfg_parallel: 2; docs/
#    benchmarks.md "CFG-parallel (two GPUs)"), before the clock and bounded on its own. It needs no Ray (two
#    torch.distributed ranks over NCCL), so the air-gapped install runs it too.
cfg2_skip=""
if [ "$label" != "gpu-check" ]; then
  cfg2_skip="a rehearsal simulates one GPU"
elif [ "$(nvidia-smi -L | grep -c '^GPU ')" -lt 2 ]; then
  cfg2_skip="$(nvidia-smi -L | grep -c '^GPU ') GPU here; the row needs two"
else
  for arg in "$@"; do [ "$arg" = "--only" ] && cfg2_skip="--only names the stages to run"; done
fi
if [ -n "$cfg2_skip" ]; then
  echo "gpu-check: CFG-parallel two-GPU row skipped: $cfg2_skip"
else
  cfg2_log=.cache/gpu-check/cfg-parallel.txt
  mkdir -p .cache/gpu-check
  echo "gpu-check: CFG-parallel two-GPU row: benchmarks/cfg_parallel.py --device cuda (at most ${GPU_CHECK_CFG2_S:-420} s)"
  timeout "${GPU_CHECK_CFG2_S:-420}" "$PY" benchmarks/cfg_parallel.py --device cuda --write-docs >"$cfg2_log" 2>&1 \
    || fail cfg-parallel "exit $?: $(tail -1 "$cfg2_log" | cut -c1-300); log: $cfg2_log"
  tail -5 "$cfg2_log"
fi

# 4. the stages, each bounded by the time left (the clock starts here)
exec "$PY" scripts/gpu_check.py "$@"
