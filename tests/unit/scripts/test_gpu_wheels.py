"""scripts/gpu-requirements.txt and the two scripts around it, checked by reading them: every line an exact pin that
pyproject's constraint for that package accepts (diffusers' `==0.42.*` included), nothing of Ray or torch, the list
closed under its packages' own requirements (as .venv's metadata states them, for CPython 3.12 on Linux) except what
the GPU machine has (a `# fallback` line stands in for one of those), and gpu-offline-env.sh never calling pip
without --no-index. Each script rule is also shown to
catch a script that breaks it. The end-to-end run of both scripts is tests/e2e/test_gpu_offline_env.py."""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]
REQUIREMENTS = ROOT / "scripts" / "gpu-requirements.txt"
OFFLINE_ENV = ROOT / "scripts" / "gpu-offline-env.sh"
WHEELS = ROOT / "scripts" / "gpu-wheels.sh"

# on the GPU machine already: what the brief of that machine names, and what those always require by their metadata
BOX = {
    *("torch", "transformers", "safetensors", "tokenizers", "sentencepiece", "numba", "msgpack", "pyyaml", "numpy"),
    *("tensorboard", "huggingface-hub", "filelock", "regex", "tqdm", "packaging", "llvmlite", "jinja2", "markupsafe"),
    *("networkx", "sympy", "mpmath", "fsspec", "setuptools", "typing-extensions"),
}
# what the Ray-free core, the client, the GPU tier and the benchmark import that the machine lacks
ROOTS = ("diffusers", "pydantic", "httpx", "websockets", "pytest", "pytest-timeout")
NEVER = ("ray", "torch", "triton", "pyarrow", "mujoco", "fastapi", "uvicorn", "starlette", "pyzmq", "nvidia-*")
BOX_PYTHON = default_environment() | {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def pins() -> dict[str, str]:
    out = {}
    for raw in REQUIREMENTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=;]+)", line)
        assert m, f"gpu-requirements.txt: {raw!r} is not NAME==VERSION"
        name = canonicalize_name(m[1])
        assert name not in out, f"gpu-requirements.txt: {name} twice"
        out[name] = m[2]
    return out


def fallbacks() -> set[str]:
    """Lines marked `# fallback`: packages the machine has, installed there only where its version is too old."""
    out = set()
    for raw in REQUIREMENTS.read_text().splitlines():
        line, _, comment = raw.partition("#")
        if line.strip() and comment.strip().startswith("fallback"):
            out.add(canonicalize_name(line.split("==")[0].strip()))
    return out


def pyproject_constraints() -> dict[str, list[Requirement]]:
    out: dict[str, list[Requirement]] = {}
    for path in (ROOT / "pyproject.toml", *sorted((ROOT / "clients").glob("*/pyproject.toml"))):
        project = tomllib.loads(path.read_text())["project"]
        texts = project["dependencies"] + [
            r for extra in project.get("optional-dependencies", {}).values() for r in extra
        ]
        for text in texts:
            req = Requirement(text)
            out.setdefault(canonicalize_name(req.name), []).append(req)
    return out


def pip_calls_without_no_index(script: str) -> list[str]:
    """The script's logical lines (continuations joined, comments dropped) that run pip but lack --no-index."""
    lines = re.sub(r"\\\n", " ", script).splitlines()
    pip = re.compile(r"(?:-m\s+pip|(?:^|[\s;&|(\"'])pip3?)\s+(?:install|download|wheel|uninstall|index)\b")
    calls = [ln for ln in lines if not ln.lstrip().startswith("#") and pip.search(ln)]
    return [ln.strip() for ln in calls if "--no-index" not in ln]


def test_every_line_is_an_exact_normalised_pin_of_a_needed_package():
    p = pins()
    for name, version in p.items():
        assert str(Version(version)) == version, f"{name}=={version}: write it as {Version(version)}"
    assert [n for n in ROOTS if n not in p] == [], "the core, the client and the GPU tier need these"


def test_pins_satisfy_pyproject_constraints():
    constraints = pyproject_constraints()
    checked = []
    for name, version in pins().items():
        for req in constraints.get(name, []):
            assert req.specifier.contains(version, prereleases=True), f"{name}=={version} is outside {req}"
            checked.append(name)
    assert {"diffusers", "pydantic", "httpx", "websockets", "pytest", "pytest-timeout"} <= set(checked)


def test_diffusers_pin_is_pyprojects_minor():
    (req,) = pyproject_constraints()["diffusers"]
    assert str(req.specifier).startswith("=="), f"pyproject pins diffusers to one minor ({req}): keep it so"
    assert req.specifier.contains(pins()["diffusers"]), f"diffusers=={pins()['diffusers']} is not {req}"


def test_nothing_of_ray_torch_or_serving_and_eval_only_stacks():
    bad = [n for n in pins() if any(re.fullmatch(pattern.replace("*", ".*"), n) for pattern in NEVER)]
    assert bad == [], f"{bad}: too big to travel, already on the GPU machine, or not needed by the GPU tier"


def test_the_list_is_closed_under_its_own_requirements():
    p = pins()
    problems, checked = [], 0
    for name, version in p.items():
        try:
            if md.version(name) != version:
                continue  # .venv has another version: its metadata says nothing about this pin
        except md.PackageNotFoundError:
            continue
        checked += 1
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(BOX_PYTHON):
                continue
            dep = canonicalize_name(req.name)
            if dep in p:
                if not req.specifier.contains(p[dep], prereleases=True):
                    problems.append(f"{name}=={version} needs {req}, the list pins {dep}=={p[dep]}")
            elif dep not in BOX:
                problems.append(f"{name}=={version} needs {req}: add it (the GPU machine lacks it)")
    assert problems == [], "\n".join(problems)
    assert checked >= len(ROOTS), f"only {checked} pins match .venv's versions: refresh the list (its header)"


def test_fallbacks_are_packages_the_machine_has_that_a_listed_package_needs():
    p, needed = pins(), set()
    for name, version in p.items():
        try:
            if md.version(name) == version:
                needed |= {canonicalize_name(Requirement(r).name) for r in md.requires(name) or []}
        except md.PackageNotFoundError:
            pass
    assert fallbacks() <= BOX, "a fallback stands in for a package the GPU machine has; list others plainly"
    assert fallbacks() <= needed, f"{fallbacks() - needed}: no listed package needs it"


def test_offline_env_never_calls_pip_without_no_index():
    script = OFFLINE_ENV.read_text()
    assert pip_calls_without_no_index(script) == []
    assert re.search(r"-m pip install[^\n]*--no-index", script), "the install itself"
    assert "PIP_NO_INDEX=1" in script and "PIP_CONFIG_FILE=/dev/null" in script
    for word in ("http://", "https://", "--index-url", "--extra-index-url", "--find-links", "-i "):
        assert word not in script, f"{word!r} in gpu-offline-env.sh: it must not name any index"
    # the rule catches a script that breaks it
    bad = 'set -e\n"$PY" -m pip install \\\n  --target "$site" x.whl\n# pip install --no-index (a comment)\n'
    assert pip_calls_without_no_index(bad) == ['"$PY" -m pip install    --target "$site" x.whl']
    assert pip_calls_without_no_index("pip3 install --no-index --no-deps x.whl\nimport pip\n") == []


def test_gpu_wheels_downloads_exactly_the_list_as_wheels():
    script = WHEELS.read_text()
    download = re.search(r"-m pip download[^\n]*", re.sub(r"\\\n", " ", script))
    assert download, "gpu-wheels.sh runs pip download"
    for flag in ("--no-deps", "--only-binary=:all:", '-r "$REQ"'):
        assert flag in download[0], f"pip download without {flag}"
    assert "scripts/gpu-requirements.txt" in script and "requirements.txt" in script


def _fake_pip_python(tmp_path, wheel_bytes: int) -> Path:
    """A Python whose `-m pip download` writes one stub wheel of `wheel_bytes` per pin (no network); anything else
    runs the real interpreter."""
    import sys

    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2 $3" = "-m pip download" ]; then\n'
        "  while [ $# -gt 0 ]; do case $1 in -d) dir=$2; shift ;; -r) req=$2; shift ;; esac; shift; done\n"
        "  grep -E '^[A-Za-z0-9]' \"$req\" | sed 's/ *#.*//' | while IFS='=' read -r name _ version; do\n"
        f'    head -c {wheel_bytes} /dev/zero > "$dir/${{name//-/_}}-$version-py3-none-any.whl"\n'
        "  done\n"
        "  exit 0\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    return fake


def test_gpu_wheels_counts_the_repository_that_travels_with_the_folder(tmp_path):
    """The wheels and the repository's tracked files must fit the 64 MiB that can travel to the GPU machine
    together: the script reports the sum and refuses a folder that would push it over (here: a lowered limit)."""
    import os
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
    repo_bytes = sum((ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (ROOT / p).exists())
    wheel_bytes = 100 * 1024
    env = {**os.environ, "PYTHON": str(_fake_pip_python(tmp_path, wheel_bytes))}

    def run(out: str, travel_mib: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(WHEELS), str(tmp_path / out)], capture_output=True, text=True, timeout=120,
            env={**env, "GPU_TRAVEL_LIMIT_MIB": str(travel_mib)},
        )  # fmt: skip

    wheels = len(pins()) * wheel_bytes
    ok = run("fits", 64)
    assert ok.returncode == 0, ok.stderr
    assert f"{wheels / 2**20:.1f} MiB of wheels + {repo_bytes / 2**20:.1f} MiB of tracked files" in ok.stdout
    assert "travel to the GPU machine (limit 64 MiB)" in ok.stdout
    too_much = run("over", int(repo_bytes / 2**20))  # the repository alone fills the limit: any wheel is too much
    assert too_much.returncode == 2, too_much.stderr
    assert "over the" in too_much.stderr and "MiB that can travel to the GPU machine" in too_much.stderr
