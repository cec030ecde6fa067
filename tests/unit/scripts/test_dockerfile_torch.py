"""The Dockerfile pins the torch the GPU check runs with (issue 44): the minor version of the GPU box's torch
(scripts/gpu-requirements.txt says which the box has), held by a pip constraint that every pip install in the image
reads, and docs/serving.md names it. Checked by reading the files (no Docker in CI)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def torch_pin(dockerfile: str) -> str | None:
    """The `torch==...` the image's pip installs are constrained to, or None when nothing pins it."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    constraint = re.search(r"^ENV PIP_CONSTRAINT=(\S+)$", dockerfile, re.M)
    if not constraint:
        return None
    written = re.search(r'echo "torch==([^"]+)" > ' + re.escape(constraint.group(1)), dockerfile)
    if not written:
        return None
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), written.group(1))


def box_torch() -> str:
    """'2.11' from the GPU box's description in scripts/gpu-requirements.txt."""
    text = (ROOT / "scripts" / "gpu-requirements.txt").read_text()
    return re.search(r"with torch (\d+\.\d+) \(CUDA\)", text).group(1)


def test_the_image_pins_the_torch_of_the_gpu_box_and_the_docs_say_which():
    text = (ROOT / "Dockerfile").read_text()
    pin = torch_pin(text)
    assert pin == f"{box_torch()}.*", pin
    assert text.index("ENV PIP_CONSTRAINT") < text.index("pip install")  # the install runs under the constraint
    assert f"torch {box_torch()}" in (ROOT / "docs" / "serving.md").read_text()


def test_an_unpinned_dockerfile_is_caught():
    text = (ROOT / "Dockerfile").read_text()
    assert torch_pin(re.sub(r"^ENV PIP_CONSTRAINT=.*\n", "", text, flags=re.M)) is None
    assert torch_pin(text.replace("ARG TORCH_VERSION=2.11.*", "ARG TORCH_VERSION=2.4.*")) == "2.4.*"
