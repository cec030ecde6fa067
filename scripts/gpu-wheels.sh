#!/usr/bin/env bash
# On a machine with network: download the wheels the air-gapped GPU machine lacks (scripts/gpu-requirements.txt, one
# wheel per line, no dependency resolution) for that machine's Python and platform, so the Ray-free model core, the
# GPU test tier and the latency benchmark run there without a package index (scripts/gpu-offline-env.sh installs them).
#
#   scripts/gpu-wheels.sh [OUT_DIR] [--python-version 3.12|X.Y|current] [--platform manylinux_2_28_x86_64]
#
# OUT_DIR (default .cache/gpu-wheels in the repository) ends up holding exactly one wheel per line of the list and
# OUT_DIR/requirements.txt (the pins, `# fallback` marks kept: gpu-offline-env.sh decides on the GPU machine whether
# those are needed); other wheels there are removed. --python-version is the target Python (default
# 3.12, the GPU machine's; `current` means the Python running pip here, and then its own platform: what CI's rehearsal
# uses); --platform a manylinux tag (older manylinux tags are accepted too). The pip used is $PYTHON -m pip, by
# default .venv/bin/python's (else python3's). Prints every wheel with its size and the folder's total.
# Exit status: 0 done; 1 pip could not download a wheel (no network, or no wheel for that Python/platform: its
# message says which); 2 bad arguments, the folder is over $GPU_WHEELS_LIMIT_MIB (default 28 MiB), or the folder and
# the repository's tracked files together are over $GPU_TRAVEL_LIMIT_MIB (default 64 MiB, what can travel to the GPU
# machine): the message names the largest wheels to drop.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REQ=$ROOT/scripts/gpu-requirements.txt
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-28}
TRAVEL_MIB=${GPU_TRAVEL_LIMIT_MIB:-64}

usage() {
  sed -n '/^#   scripts/p' "$0" | sed 's/^#   /usage: /' >&2
  exit 2
}
fail() {
  echo "gpu-wheels: $1" >&2
  exit "${2:-2}"
}

out="" pyver=3.12 platform=manylinux_2_28_x86_64
while [ $# -gt 0 ]; do
  case $1 in
    --python-version) [ $# -ge 2 ] || usage; pyver=$2; shift 2 ;;
    --python-version=*) pyver=${1#*=}; shift ;;
    --platform) [ $# -ge 2 ] || usage; platform=$2; shift 2 ;;
    --platform=*) platform=${1#*=}; shift ;;
    -h | --help) usage ;;
    -*) echo "gpu-wheels: unknown option $1" >&2; usage ;;
    *) [ -z "$out" ] || usage; out=$1; shift ;;
  esac
done
out=${out:-$ROOT/.cache/gpu-wheels}
[[ $pyver == current || $pyver =~ ^3\.[0-9]+$ ]] || fail "--python-version: 3.12, another X.Y or current, not '$pyver'"
[[ $platform =~ ^[a-z0-9_]+$ ]] || fail "--platform: a platform tag such as manylinux_2_28_x86_64, not '$platform'"
[ -f "$REQ" ] || fail "$REQ is missing"

PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; fi
"$PY" -c "import pip" 2>/dev/null || fail "no pip for $PY (set PYTHON to a Python that has pip)"

target=()
if [ "$pyver" = current ]; then
  pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  where="Python $pyver and the platform of the machine that downloaded them"
else
  # pip matches --platform literally: list the older manylinux tags a manylinux_2_X machine also runs
  target=(--python-version "$pyver" --implementation cp --platform "$platform")
  if [[ $platform =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    glibc=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]}
    for ((v = glibc - 1; v >= 5; v--)); do target+=(--platform "manylinux_2_${v}_$arch"); done
    for legacy in 2014:17 2010:12 1:5; do
      [ "$glibc" -lt "${legacy#*:}" ] || target+=(--platform "manylinux${legacy%:*}_$arch")
    done
  fi
  where="CPython $pyver on $platform"
fi
echo "gpu-wheels: $(grep -c '^[A-Za-z0-9]' "$REQ") wheels for $where, with $PY -m pip" >&2

mkdir -p "$(dirname "$out")"
stage=$(mktemp -d "${out%/}.partial.XXXXXX")
trap 'rm -rf "$stage"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "${target[@]}" \
  -d "$stage" -r "$REQ" ||
  fail "pip could not download every wheel of $REQ for Python $pyver (see its message above)" 1

# exactly one wheel per pin; OUT_DIR/requirements.txt is the list as downloaded
"$PY" - "$REQ" "$stage" "$where" <<'PYEOF' || exit 2
import pathlib
import re
import sys

req, stage, where = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
canon = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
pins, fallback = {}, set()
for raw in pathlib.Path(req).read_text().splitlines():
    line, _, comment = (part.strip() for part in raw.partition("#"))
    if line:
        name, sep, version = line.partition("==")
        if not sep:
            sys.exit(f"gpu-wheels: {req}: '{line}' is not pinned (NAME==VERSION)")
        pins[canon(name)] = version.strip()
        if comment.startswith("fallback"):
            fallback.add(canon(name))
wheels = {}
for w in stage.glob("*.whl"):
    name, version = w.name.split("-")[:2]
    wheels.setdefault(canon(name), []).append((version, w.name))
problems = [f"no wheel for {n}=={v}" for n, v in pins.items() if n not in wheels]
problems += [f"unexpected wheel {f}" for n, ws in wheels.items() for _, f in ws if n not in pins]
problems += [f"{n}: {[f for _, f in ws]}" for n, ws in wheels.items() if len(ws) > 1]
problems += [f"{f} is not {n}=={pins[n]}" for n, ws in wheels.items() for v, f in ws if n in pins and v != pins[n]]
if problems:
    sys.exit("gpu-wheels: the download does not match the list:\n  " + "\n  ".join(problems))
header = f"# scripts/gpu-wheels.sh for {where}: one wheel of this folder per line\n"
lines = [f"{n}=={v}" + ("  # fallback" if n in fallback else "") + "\n" for n, v in sorted(pins.items())]
(stage / "requirements.txt").write_text(header + "".join(lines))
PYEOF

mkdir -p "$out"
rm -f "$out"/*.whl "$out/requirements.txt"
mv "$stage"/* "$out"/
out=$(cd "$out" && pwd)

listing=$(cd "$out" && stat -c '%s %n' -- *.whl requirements.txt | sort -rn)
awk '{printf "  %8.2f MiB  %s\n", $1 / 1048576, $2}' <<<"$listing"
bytes=$(awk '{b += $1} END {print b}' <<<"$listing")
total=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
echo "gpu-wheels: $(grep -c '\.whl$' <<<"$listing") wheels, $total MiB in $out (limit $LIMIT_MIB MiB)"
largest=$(grep '\.whl$' <<<"$listing" | head -3 |
  awk '{printf "%s%s (%.1f MiB)", (NR > 1 ? ", " : ""), $2, $1 / 1048576}')
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  fail "$out is $total MiB, over the $LIMIT_MIB MiB that leaves room for the repository beside it: drop from \
scripts/gpu-requirements.txt what the GPU machine already has or the GPU tier does not need; the largest: $largest"
fi

# the repository's tracked files travel with the folder (outside a git checkout there is nothing to count)
repo_bytes=$(cd "$ROOT" && git ls-files -z 2>/dev/null | xargs -0 -r stat -c %s -- 2>/dev/null |
  awk '{b += $1} END {print b + 0}') || true
if [ "${repo_bytes:-0}" -gt 0 ]; then
  travel=$((bytes + repo_bytes))
  sizes=$(awk -v w="$bytes" -v r="$repo_bytes" \
    'BEGIN {printf "%.1f MiB of wheels + %.1f MiB of tracked files = %.1f MiB", w / 2^20, r / 2^20, (w + r) / 2^20}')
  echo "gpu-wheels: $sizes travel to the GPU machine (limit $TRAVEL_MIB MiB)"
  if [ "$travel" -gt $((TRAVEL_MIB * 1048576)) ]; then
    fail "$sizes, over the $TRAVEL_MIB MiB that can travel to the GPU machine: drop wheels from \
scripts/gpu-requirements.txt (the largest: $largest) or leave large tracked files the GPU check does not read behind"
  fi
fi
