"""The GPU server's Dockerfile, checked by reading it (there is no Docker in CI): a CUDA base image with the Ray that
pyproject.toml pins, only sources copied (no weights, no virtualenv), the client package and the project installed
under pyproject's names with pip's CUDA torch, a non-root user and `serve run` as the command. Each rule is also
shown to catch a Dockerfile that breaks it."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
WEIGHTS = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".gguf")
PACKAGE_WEIGHTS = "dreamzero/assets/models/*/*.safetensors"  # the embedded default the shipped config serves
TEST_ONLY_EXTRAS = {"dev", "sim", "libero", "libero-runtime", "isaac"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        word, _, rest = (current + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def ray_pin() -> str:
    """'2.60' from pyproject's ray[serve]==2.60.*"""
    (pin,) = [d for d in PYPROJECT["project"]["dependencies"] if name(d) == "ray"]
    return re.fullmatch(r"ray\[serve\]==(\d+\.\d+)\.\*", pin).group(1)


def base_image_problems(steps) -> list[str]:
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    image = [a for kind, a in steps if kind == "FROM"][-1].split()[0]
    image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
    ray = re.fullmatch(r"rayproject/ray:(\d+\.\d+)\.\d+-py3\d+-(gpu|cu\d+)", image)
    if ray and ray.group(1) != ray_pin():
        return [f"base image {image} has Ray {ray.group(1)}, pyproject.toml pins ray[serve]=={ray_pin()}.*"]
    if not ray and not re.fullmatch(r"nvidia/cuda:[\w.]+-(cudnn\d*-)?runtime-[\w.]+", image):
        return [f"base image {image} is no CUDA runtime image (nvidia/cuda:*-runtime-* or rayproject/ray:*-gpu)"]
    return []


def copy_problems(steps) -> list[str]:
    problems, copied = [], set()
    for kind, arguments in steps:
        words = shlex.split(arguments)
        if kind not in ("COPY", "ADD") or any(w.startswith("--from") for w in words):
            continue
        for source in [w for w in words if not w.startswith("--")][:-1]:
            path = source.rstrip("/")
            copied.add(path)
            if path in (".", "") or "*" in path:
                problems.append(f"COPY {source}: copies the whole context; name the sources")
            elif path.split("/")[0] in (".venv", ".git"):
                problems.append(f"COPY {source}: a virtualenv or the git history has no place in the image")
            elif path.endswith(WEIGHTS):
                problems.append(f"COPY {source}: weights are mounted (/models), never copied")
            elif not (ROOT / path).exists():
                problems.append(f"COPY {source}: no such path in the repository")
            elif (ROOT / path).is_dir():
                for f in (ROOT / path).rglob("*"):
                    rel = f.relative_to(ROOT).as_posix()
                    if f.suffix in WEIGHTS and not fnmatch.fnmatch(rel, PACKAGE_WEIGHTS) and "__pycache__" not in rel:
                        problems.append(f"COPY {source}: would copy the weights {rel}")
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    for needed in sorted(packages | {"clients", "pyproject.toml", "README.md", "serve_config.yaml"}):
        if needed not in copied:
            problems.append(f"{needed} is not copied: pip install would build a different project")
    return problems


def install_problems(steps) -> list[str]:
    runs = [a for kind, a in steps if kind == "RUN" and "pip install" in a]
    if len(runs) != 1:
        return [f"expected one RUN with pip install, found {len(runs)}"]
    words = shlex.split(runs[0].split("&&")[0])
    words = words[words.index("install") + 1 :]
    problems = [f"pip install {w}: a CPU-only torch" for w in words if "cpu" in w.lower()]
    problems += [f"pip install {w}: torch comes from pyproject's torch>=2.4" for w in words if name(w) == "torch"]
    installed, own_extras = {}, {}
    for target in [w for w in words if not w.startswith("-")]:
        path, _, extras = target.partition("[")
        if not (ROOT / path / "pyproject.toml").is_file():
            problems.append(f"pip install {target}: not a project of this repository")
            continue
        project = tomllib.loads((ROOT / path / "pyproject.toml").read_text())["project"]
        installed[project["name"]] = {e for e in extras.rstrip("]").split(",") if e}
        own_extras[project["name"]] = set(project.get("optional-dependencies", {}))
    root = PYPROJECT["project"]
    wanted = {root["name"]} | {name(d) for d in root["dependencies"] if name(d).startswith("dreamzero")}
    if set(installed) != wanted:
        problems.append(f"installs {sorted(installed)}, pyproject names {sorted(wanted)}")
    for project, extras in installed.items():
        declared = own_extras[project]
        problems += [f"{project}[{e}]: no such extra in pyproject.toml" for e in sorted(extras - declared)]
        problems += [f"{project}[{e}]: tests/simulator extra in the server" for e in sorted(extras & TEST_ONLY_EXTRAS)]
    return problems


def runtime_problems(steps) -> list[str]:
    problems = []
    users = [a for kind, a in steps if kind == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the image runs as root; end with USER <an unprivileged user>")
    cmds = [a for kind, a in steps if kind == "CMD"]
    cmd = json.loads(cmds[-1]) if cmds and cmds[-1].startswith("[") else None
    if not cmd or cmd[:2] != ["serve", "run"] or len(cmd) < 3 or not (ROOT / cmd[2]).is_file():
        problems.append(f"CMD {cmds[-1] if cmds else None}: must be the exec form of `serve run <config>`")
    return problems


def problems(text: str) -> list[str]:
    steps = instructions(text)
    return base_image_problems(steps) + copy_problems(steps) + install_problems(steps) + runtime_problems(steps)


def test_the_dockerfile_keeps_every_rule():
    assert problems(DOCKERFILE.read_text()) == []


def test_the_build_context_leaves_out_weights_and_the_virtualenv():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".git", "**/*.safetensors", "**/*.pt", f"!{PACKAGE_WEIGHTS}"} <= ignored


def test_render_script_and_dockerfile_name_the_same_ray():
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_rayservice", ROOT / "scripts" / "render_rayservice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.RAY_VERSION.rsplit(".", 1)[0] == ray_pin()
    assert f"rayproject/ray:{module.RAY_VERSION}-" in DOCKERFILE.read_text()


SHIPPED = DOCKERFILE.read_text()
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PIP_LINE = next(line for line in SHIPPED.splitlines() if "pip install" in line)
BROKEN = {
    "not a CUDA image": (SHIPPED.replace("rayproject/ray:2.60.0-py311-gpu", "python:3.11-slim"), "no CUDA runtime"),
    "CPU Ray image": (SHIPPED.replace("2.60.0-py311-gpu", "2.60.0-py311-cpu"), "no CUDA runtime"),
    "other Ray": (SHIPPED.replace("rayproject/ray:2.60.0", "rayproject/ray:2.59.0"), "has Ray 2.59"),
    "whole context": (SHIPPED.replace("COPY --chown=ray:users eval/", "COPY . ./\nCOPY eval/"), "whole context"),
    "virtualenv": (SHIPPED.replace("COPY --chown=ray:users eval/", "COPY .venv/ .venv/\nCOPY eval/"), "virtualenv"),
    "weights": (
        SHIPPED.replace("EXPOSE", "COPY dreamzero/assets/models/small-scene1/model-00001-of-00001.safetensors /m/\nEX"),
        "weights are mounted",
    ),
    "missing source": (SHIPPED.replace("COPY --chown=ray:users eval/", "COPY ckpt/ /models/\nCOPY eval/"), "no such"),
    "package left out": (SHIPPED.replace("COPY --chown=ray:users eval/ eval/\n", ""), "eval is not copied"),
    "sim extras": (SHIPPED.replace("-e . ", '-e ".[sim,dev]" '), "tests/simulator extra"),
    "unknown extra": (SHIPPED.replace("-e . ", '-e ".[gpu]" '), "no such extra"),
    "client left out": (SHIPPED.replace("-e ./clients/dreamzero-droid ", ""), "installs ['dreamzero-client', 'dr"),
    "CPU torch": (
        SHIPPED.replace(PIP_LINE, PIP_LINE.replace("install", f"install --index-url {CPU_INDEX}")),
        "CPU-only",
    ),
    "root": (SHIPPED.replace("EXPOSE", "USER root\nEXPOSE"), "runs as root"),
    "other command": (SHIPPED.replace('CMD ["serve", "run", "serve_config.yaml"]', "CMD python -m http.server"), "CMD"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_rule_catches_a_dockerfile_that_breaks_it(case):
    text, expected = BROKEN[case]
    assert text != SHIPPED, f"{case}: the mutation did not apply; update it to the Dockerfile"
    found = problems(text)
    assert any(expected in p for p in found), f"{case}: {found}"
