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
# `PYTHONPATH=SITE_DIR:<repo>:<repo>/clients[:what PYTHONPATH held]`, for the caller to export:
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
  case ":$site:$ROOT:$ROOT/clients:$keep:" in *":$p:"*) ;; *) keep=${keep:+$keep:}$p ;; esac
done

# every wheel is for this Python and platform, the folder holds what its requirements.txt lists, and which of its
# fallback wheels this machine needs: prints the wheels to install
choice=$(PYTHONPATH=$keep "$PYBIN" - "$wheels" <<'PYEOF'
import importlib.metadata as md
import pathlib
import re
import sys
import zipfile

try:
    from packaging import tags
    from packaging.requirements import Requirement
except ImportError:  # the copy pip carries
    from pip._vendor.packaging import tags
    from pip._vendor.packaging.requirements import Requirement

folder = pathlib.Path(sys.argv[1])
canon = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
say = lambda msg: print(f"gpu-offline-env: {msg}", file=sys.stderr)  # noqa: E731


def requirements(texts):
    """The requirements that apply here (no extras), skipping any this packaging cannot read."""
    for text in texts or []:
        try:
            req = Requirement(text)
        except Exception:  # noqa: BLE001 - an old package's odd metadata: not ours to judge
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            yield req


here = set(tags.sys_tags())
problems, foreign, files = [], [], {}
for w in sorted(folder.glob("*.whl")):
    parts = w.name[:-4].split("-")
    if len(parts) not in (5, 6):
        problems.append(f"{w.name} is not a wheel file name")
        continue
    files.setdefault(canon(parts[0]), []).append(w)
    py, abi, plat = (p.split(".") for p in parts[-3:])
    wheel_tags = {tags.Tag(i, a, p) for i in py for a in abi for p in plat}
    if not wheel_tags & here:
        foreign.append(w.name)
if foreign:
    v = sys.version_info
    problems.append(
        f"wheels for another Python or platform ({', '.join(foreign)}); this one is CPython {v[0]}.{v[1]} on "
        f"{next(iter(here)).platform}: rebuild the folder on a machine with network with "
        f"scripts/gpu-wheels.sh --python-version {v[0]}.{v[1]}"
    )
for name, ws in files.items():
    if len(ws) > 1:
        problems.append(f"one wheel per package, not {', '.join(w.name for w in ws)}")
    if name in ("ray", "torch"):
        problems.append(f"{ws[0].name}: this machine's own {name} is used, remove the wheel")
fallback = set()
for line in (folder / "requirements.txt").read_text().splitlines():
    pin, _, comment = line.partition("#")
    name = canon(pin.split("==")[0].strip())
    if not name:
        continue
    if name not in files:
        problems.append(f"{folder}/requirements.txt lists {pin.strip()} but the folder has no wheel of it: copy it")
    elif comment.strip().startswith("fallback"):
        fallback.add(name)
if problems:
    sys.exit("gpu-offline-env: " + "\ngpu-offline-env: ".join(problems))

needs = {}  # what the other wheels require of each fallback
for name, (w,) in files.items():
    if name in fallback:
        continue
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        lines = z.read(meta).decode().splitlines()
    for req in requirements(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")):
        if canon(req.name) in fallback:
            needs.setdefault(canon(req.name), []).append((name, req))
install = [w for name, (w,) in files.items() if name not in fallback]
for name in sorted(fallback):
    (w,) = files[name]
    version = w.name.split("-")[1]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    short = [
        f"{who} needs {req}"
        for who, req in needs.get(name, [])
        if have is None or not req.specifier.contains(have, prereleases=True)
    ]
    if not short:
        say(f"{name} {have} here meets what the wheels need: its fallback wheel is left out")
        continue
    # the fallback replaces this machine's copy for everything here: only if what needs it here accepts it too
    against, seen = [], set()
    for dist in md.distributions():  # in import order: a later copy of a package is shadowed by the first
        if canon(dist.metadata["Name"] or "") in seen:
            continue
        seen.add(canon(dist.metadata["Name"] or ""))
        for req in requirements(dist.requires):
            if canon(req.name) == name and not req.specifier.contains(version, prereleases=True):
                against.append(f"{dist.metadata['Name']} {dist.version} needs {req}")
    if against:
        say(
            f"warning: {name} {have} here is too old ({'; '.join(short)}), but its fallback {version} does not suit "
            f"this machine ({'; '.join(against)}): left out"
        )
    else:
        say(f"{name} {have or '(none)'} here, {'; '.join(short)}: installing the fallback {w.name}")
        install.append(w)
print("\n".join(sorted(str(w) for w in install)))
PYEOF
) || exit 2
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
path=$site:$ROOT:$ROOT/clients${keep:+:$keep}

# the model core, the client and the tier's tools import, with the machine's own torch (stdout kept for the last line)
PYTHONPATH=$path "$PYBIN" - "$site" "$ROOT" <<'PYEOF' >&2 || exit 2
import importlib
import importlib.metadata as md
import os
import re
import sys

site, root = os.path.realpath(sys.argv[1]), sys.argv[2]
canon = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
say = lambda msg: print(f"gpu-offline-env: {msg}", file=sys.stderr)  # noqa: E731
try:
    from packaging.requirements import Requirement
except ImportError:  # the copy pip carries
    from pip._vendor.packaging.requirements import Requirement


def requirements(texts):
    """The requirements that apply here (no extras), skipping any this packaging cannot read."""
    for text in texts or []:
        try:
            req = Requirement(text)
        except Exception:  # noqa: BLE001 - an old package's odd metadata: not ours to judge
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            yield req


def from_site(dist) -> bool:
    where = os.path.realpath(str(dist.locate_file("")))
    return where == site or where.startswith(site + os.sep)


# what the installed wheels need, and what this machine's packages need of the ones the wheels shadow (warnings:
# the imports below decide)
dists, seen = [], set()
for d in md.distributions():  # in import order: a later copy of a package is shadowed by the first
    name = canon(d.metadata["Name"] or "")
    dists.append((name, from_site(d), d, name in seen))
    seen.add(name)
ours = {name for name, mine, _, _ in dists if mine}
shadowed = {name for name, mine, _, _ in dists if not mine and name in ours}
unmet = {}
for _, mine, dist, hidden in dists:
    if hidden:
        continue  # a copy nothing imports
    for req in requirements(dist.requires):
        dep = canon(req.name)
        if not mine and dep not in shadowed:
            continue  # this machine's packages among themselves: theirs, not ours to check
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            say(f"warning: {dist.metadata['Name']} {dist.version} needs {req}: no wheel and nothing installed has it")
            unmet[dep] = str(req)
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            whose = "the wheels'" if dep in ours else "this machine's"
            say(f"warning: {dist.metadata['Name']} {dist.version} needs {req}; {whose} is {have}")
            unmet[dep] = str(req)

errors = []
try:
    import torch
except Exception as exc:  # noqa: BLE001 - any failure to import it is the same answer
    sys.exit(f"gpu-offline-env: {sys.executable} has no working torch ({exc}): this machine's own torch is used")
if os.path.realpath(torch.__file__).startswith(site + os.sep):
    errors.append(f"torch comes from {site}, not from this machine: remove its wheel")
say(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) from {os.path.dirname(torch.__file__)}")

modules = {"PIL": "pillow", "yaml": "pyyaml"}
for module in (
    *("diffusers", "pydantic", "pytest", "transformers", "httpx", "websockets"),
    *("dreamzero.pipeline", "dreamzero.checkpoint", "dreamzero_client.wire"),
):
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - report every failing import, whatever it raised
        missing = exc.name if type(exc) in (ImportError, ModuleNotFoundError) and exc.name else None
        dist = canon(modules.get(missing.split(".")[0], missing.split(".")[0])) if missing else None
        hint = f": add a wheel of {unmet.get(dist, dist)} to scripts/gpu-requirements.txt" if dist else ""
        errors.append(f"import {module} fails: {type(exc).__name__}: {exc}{hint}")
if errors:
    sys.exit("gpu-offline-env: " + "\ngpu-offline-env: ".join(errors))
found = [f"{n} {md.version(n)}" for n in ("diffusers", "pydantic", "pytest")]
say(f"{', '.join(found)} from {site}; dreamzero and dreamzero_client from {root}: ready")
PYEOF
echo "PYTHONPATH=$path"
