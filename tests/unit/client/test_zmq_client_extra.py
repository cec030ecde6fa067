"""The ZeroMQ client without its extra: the error names the extra to install, not a bare `No module named 'zmq'`
(and is still an ImportError, for code that catches one)."""

from __future__ import annotations

import sys

import pytest

from dreamzero_client.errors import MissingDependency
from dreamzero_client.zmq_client import ZmqPolicyClient


def test_without_pyzmq_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # `import zmq` now raises ImportError, as without the package
    with pytest.raises(MissingDependency, match=r"pip install 'dreamzero-client\[zmq\]'") as info:
        ZmqPolicyClient("localhost", 5555, timeout_s=1.0)
    assert isinstance(info.value, ImportError)
