"""The house tier: static checks of the tree's files (import direction, module size, file references...), read from
the sources without importing the heavy packages, so `pytest tests/house` answers in seconds. Every test here is
marked `house` (`pytest -m house` / `-m "not house"` from the root)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "house: a static house-rule check of the source tree (tests/house)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.house)
