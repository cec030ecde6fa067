#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtualenv in .venv with the client packages (./clients/*), the project,
# its test tools and the sim extras (MuJoCo DROID scene and LIBERO; DREAMZERO_SKIP_LIBERO=1 leaves LIBERO out, it
# downloads ~360 MB of scene assets). test.sh and serve.sh call this first; it returns at once when nothing changed.
# On a machine without an NVIDIA GPU we install the CPU build of torch first (small and fast); with a GPU, pip picks
# the CUDA build that `torch>=2.4` resolves to.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.installed
want=$(cat pyproject.toml clients/*/pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # where a local CPU wheel of 2.13.0 is offered (as on our CI machines) this takes seconds; else pip resolves below
  .venv/bin/pip install -q "torch==2.13.0" || echo "torch==2.13.0 not available: letting pip resolve torch>=2.4"
fi
# the three client distributions, the robot's client first (the others depend on it; none is on the index)
CLIENTS=(-e "./clients/dreamzero-client[http,zmq]" -e ./clients/dreamzero-droid -e ./clients/dreamzero-franka)
if [ "${DREAMZERO_SKIP_LIBERO:-0}" = "1" ]; then
  .venv/bin/pip install -q "${CLIENTS[@]}" -e ".[sim,dev]"
else
  # lean LIBERO: its run-time needs and scene assets, then hf-libero without its training stack (docs/libero.md)
  .venv/bin/pip install -q "${CLIENTS[@]}" -e ".[sim,dev,libero-runtime]"
  .venv/bin/pip install -q --no-deps "hf-libero==0.1.4"
  # LIBERO's config.yaml in our cache (no prompt on import), pointing at the installed assets: runs need no network
  .venv/bin/python -m eval.libero.offline
fi
# openpi-client is only the reference that tests/unit/droid_runtime/test_image_tools.py compares our numpy resize_with_pad
# with, bit for bit; without its dependencies (its image_tools needs only numpy and pillow, from the sim extra)
.venv/bin/pip install -q --no-deps "openpi-client==0.1.2"
# Headless rendering for the MuJoCo scenes (Mesa EGL); best effort, the libraries are usually already present.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  if ! ldconfig -p | grep -q libEGL_mesa; then
    (apt-get update -qq && apt-get install -y -qq libegl1 libegl-mesa0 libgl1-mesa-dri libgbm1) >/dev/null 2>&1 || true
  fi
fi
echo "installed: $(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)')"
echo "$want" >"$STAMP"
