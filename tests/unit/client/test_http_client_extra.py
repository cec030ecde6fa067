"""The HTTP client without its extra: the error names the extra to install, not a bare `No module named 'httpx'`
(and is still an ImportError, for code that catches one)."""

from __future__ import annotations

import importlib
import sys

import pytest

import dreamzero_client.http_client  # noqa: F401 - imported first, so that monkeypatch puts it back after the test
from dreamzero_client.errors import MissingDependency


def test_without_httpx_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)  # `import httpx` now raises ImportError, as without the package
    monkeypatch.delitem(sys.modules, "dreamzero_client.http_client", raising=False)
    # importing it still works (a module that only reads the constants needs no httpx); monkeypatch puts the module
    # with httpx back afterwards
    module = importlib.import_module("dreamzero_client.http_client")
    with pytest.raises(MissingDependency, match=r"pip install 'dreamzero-client\[http\]'") as info:
        module.ActionClient("http://localhost:8000")
    assert isinstance(info.value, ImportError)
