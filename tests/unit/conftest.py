"""Fixtures shared by the unit tier's folders: the TLS tests' certificates and servers, which the robot client's TLS
tests (tests/unit/client/test_tls.py) and the DROID links' (tests/unit/droid_runtime/test_tls_links.py) both take.
Made once per module that takes them."""

from __future__ import annotations

import pytest

from tests.support.tls import make_pki
from tests.support.tls import tls_servers as start_tls_servers


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The test CA and its certificates (tests.support.tls.make_pki)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_servers(pki):
    """name -> port: the same app behind each certificate, and once in plain HTTP."""
    with start_tls_servers(pki) as ports:
        yield ports
