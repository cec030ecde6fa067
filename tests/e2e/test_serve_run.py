"""`serve run serve_config.yaml` as a user runs it, behind Serve's own Python proxy (the default front door): the
shipped config as is, except the HTTP port (a free one), on the e2e tier's shared `serve run` (tests/e2e/conftest.py).
The same checks behind HAProxy, and the SIGTERM exit, are in test_haproxy_front_door.py (tests/support/front_door.py:
the HTTP route in msgpack, a malformed body, an OpenPI WebSocket episode and the 16 MiB WebSocket message cap).
"""

from __future__ import annotations

import pytest

from tests.support.front_door import check_front_door

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_serve_run_serves_the_shipped_config(shipped_server):
    check_front_door(shipped_server, "e2e-proxy")
