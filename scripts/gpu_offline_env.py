"""The two Python halves of scripts/gpu-offline-env.sh, run by the machine's own Python (stdlib + pip's packaging).

  gpu_offline_env.py choose WHEELS_DIR   every wheel suits this Python and platform, the folder holds what its
                                          requirements.txt lists; prints the wheels to install (fallbacks only where
                                          this machine's own copy is missing or too old)
  gpu_offline_env.py check SITE_DIR ROOT  the installed wheels, the Ray-free model core, the client and the GPU tier's
                                          tools import with this machine's torch
Problems go to stderr prefixed `gpu-offline-env:` and exit 1.
"""

import importlib
import importlib.metadata as md
import os
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


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def say(msg: str) -> None:
    print(f"gpu-offline-env: {msg}", file=sys.stderr)


def requirements(texts):
    """The requirements that apply here (no extras), skipping any this packaging cannot read."""
    for text in texts or []:
        try:
            req = Requirement(text)
        except Exception:  # noqa: BLE001 - an old package's odd metadata: not ours to judge
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            yield req


def from_site(dist, site: str) -> bool:
    where = os.path.realpath(str(dist.locate_file("")))
    return where == site or where.startswith(site + os.sep)


def choose(folder: pathlib.Path) -> None:
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
                f"warning: {name} {have} here is too old ({'; '.join(short)}), but its fallback {version} does "
                f"not suit this machine ({'; '.join(against)}): left out"
            )
        else:
            say(f"{name} {have or '(none)'} here, {'; '.join(short)}: installing the fallback {w.name}")
            install.append(w)
    print("\n".join(sorted(str(w) for w in install)))


def check(site: str, root: str) -> None:
    # what the installed wheels need, and what this machine's packages need of the ones the wheels shadow (warnings:
    # the imports below decide)
    dists, seen = [], set()
    for d in md.distributions():  # in import order: a later copy of a package is shadowed by the first
        name = canon(d.metadata["Name"] or "")
        dists.append((name, from_site(d, site), d, name in seen))
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
                say(
                    f"warning: {dist.metadata['Name']} {dist.version} needs {req}: "
                    "no wheel and nothing installed has it"
                )
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


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "choose":
        choose(pathlib.Path(sys.argv[2]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "check":
        check(os.path.realpath(sys.argv[2]), sys.argv[3])
    else:
        sys.exit(__doc__)
