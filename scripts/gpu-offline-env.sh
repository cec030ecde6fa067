#!/usr/bin/env bash
# On the air-gapped GPU machine: install the wheel folder scripts/gpu-wheels.sh made (copied beside the repository)
# into a plain folder for that machine's own Python, which keeps its own torch, transformers, numpy..., then check that
# the Ray-free model core, the client and the GPU tier's tools import. pip runs with --no-index, PIP_NO_INDEX=1 and no
# pip configuration, on the folder's files only: it never reaches for the network. scripts/gpu-check.sh calls this.
#
#   scripts/gpu-offline-env.sh WHEELS_DIR SITE_DIR [--python PY]
#
# PY (default python3) must have pip and torch. Every wheel is installed, except those the folder's requirements.txt
# marks `# fallback` (a package the machine has, e.g. huggingface-hub): such a wheel is installed only where the
# machine's own version is missing or older than the other wheels require. SITE_DIR is made (or remade, when the
# wheels, PY or that choice changed since this script filled it; a second run with the same folder only repeats the
# checks, a few seconds). Progress goes to stderr; the last line, on stdout, is
# `PYTHONPATH=SITE_DIR:<repo>:<repo>/clients/<each distribution>[:what PYTHONPATH held]`, for the caller to export:
#   export "$(scripts/gpu-offline-env.sh .cache/gpu-wheels .cache/gpu-site | tail -n 1)"
# Exit status: 0 ready; 2 something is missing, and the message says what: no wheel folder (or no requirements.txt in
# it), a wheel for another Python or platform (rebuild the folder with scripts/gpu-wheels.sh --python-version X.Y), a
# wheel the folder's requirements.txt lists but lacks, no pip or no torch for PY, SITE_DIR not empty and not made here,
# or an import that fails (with the wheel to add to scripts/gpu-requirements.txt); 1 pip itself failed. A requirement
# that nothing meets, or meets at another version, is a warning: the imports decide.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STAMP=.gpu-offline-env

usage() {
  sed -n '/^#   scripts/p' "$0" | sed 's/^#   /usage: /' >&2
  exit 2
}
fail() {
  echo "gpu-offline-env: $1" >&2
  exit "${2:-2}"
}

args=() PY=python3
while [ $# -gt 0 ]; do
  case $1 in
    --python) [ $# -ge 2 ] || usage; PY=$2; shift 2 ;;
    --python=*) PY=${1#*=}; shift ;;
    -h | --help) usage ;;
    -*) echo "gpu-offline-env: unknown option $1" >&2; usage ;;
    *) args+=("$1"); shift ;;
  esac
done
[ ${#args[@]} -eq 2 ] || usage
wheels=${args[0]} site=$(realpath -m "${args[1]}")

[ -d "$wheels" ] || fail "no wheel folder at $wheels: make it on a machine with network with scripts/gpu-wheels.sh \
(default .cache/gpu-wheels) and copy it here beside the repository"
wheels=$(cd "$wheels" && pwd)
compgen -G "$wheels/*.whl" >/dev/null || fail "$wheels holds no wheels: fill it with scripts/gpu-wheels.sh $wheels"
[ -f "$wheels/requirements.txt" ] || fail "$wheels/requirements.txt is missing: copy all that gpu-wheels.sh made"
PYBIN=$(command -v "$PY") || fail "no Python '$PY' on this machine (--python PY)"
PYBIN=$(cd "$(dirname "$PYBIN")" && pwd)/$(basename "$PYBIN") # absolute, links kept (a venv's python is one)
"$PYBIN" -c "import pip" 2>/dev/null || fail "$PYBIN has no pip: it is what installs the wheels (--python PY)"

# the caller's PYTHONPATH, less what this script puts in front (so a second run sees the machine as the first did)
keep=""
IFS=: read -r -a old <<<"${PYTHONPATH:-}"
for p in "${old[@]}"; do
  case ":$site:$ROOT:$ROOT/clients/dreamzero-client:$ROOT/clients/dreamzero-droid:$ROOT/clients/dreamzero-franka:$keep:" in *":$p:"*) ;; *) keep=${keep:+$keep:}$p ;; esac
done

# every wheel is for this Python and platform, the folder holds what its requirements.txt lists, and which of its
# fallback wheels this machine needs: prints the wheels to install
choice=$(PYTHONPATH=$keep "$PYBIN" "$ROOT/scripts/gpu_offline_env.py" choose "$wheels") || exit 2
[ -n "$choice" ] || fail "$wheels has nothing to install"
mapfile -t install <<<"$choice"

# install (unless SITE_DIR already holds exactly these wheels for this Python)
want=$( (
  echo "$PYBIN"
  "$PYBIN" -c 'import sys; print(sys.version)'
  stat -c '%n %s' -- "${install[@]}"
) | sha256sum | cut -d' ' -f1)
if [ -f "$site/$STAMP" ] && [ "$(cat "$site/$STAMP")" = "$want" ]; then
  echo "gpu-offline-env: $site already holds these ${#install[@]} wheels for $PYBIN" >&2
else
  if [ -e "$site" ] && [ ! -f "$site/$STAMP" ] && [ -n "$(ls -A "$site" 2>/dev/null)" ]; then
    fail "$site is not empty and was not made by this script: give a new or empty folder"
  fi
  mkdir -p "$(dirname "$site")"
  partial=$site.partial
  rm -rf "$partial"
  echo "gpu-offline-env: installing ${#install[@]} wheels of $wheels into $site" >&2
  # no index, no pip configuration, no PIP_* of the caller's (a find-links or an index URL): only these files
  clean=()
  for v in $(compgen -e); do
    if [[ $v == PIP_* ]]; then clean+=(-u "$v"); fi
  done
  env "${clean[@]}" PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
    "$PYBIN" -m pip install -q --no-index --no-deps --no-warn-conflicts --target "$partial" "${install[@]}" ||
    fail "pip could not install the wheels of $wheels (see above)" 1
  rm -rf "$site"
  mv "$partial" "$site"
  echo "$want" >"$site/$STAMP"
fi
path=$site:$ROOT:$ROOT/clients/dreamzero-client:$ROOT/clients/dreamzero-droid:$ROOT/clients/dreamzero-franka${keep:+:$keep}

# the model core, the client and the tier's tools import, with the machine's own torch (stdout kept for the last line)
PYTHONPATH=$path "$PYBIN" "$ROOT/scripts/gpu_offline_env.py" check "$site" "$ROOT" >&2 || exit 2
echo "PYTHONPATH=$path"
