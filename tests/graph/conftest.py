"""The graph tier's fixtures: a serving graph in Ray Serve's local testing mode (in-process, no routers) with the
embedded tiny model, reached over its HTTP door in-process (`graph`), and the ingress alone in-process over a
recording stand-in policy (`door`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def graph():
    """An HTTP client of the graph (tests.support.request_builders.served_over_http)."""
    from tests.support.request_builders import GRAPH_ARGS, served_over_http

    with served_over_http(GRAPH_ARGS, "graph-test") as client:
        yield client


@pytest.fixture
def door(monkeypatch):
    """(client, policy, ingress, counted) of the ingress in-process (tests.support.ingress.local_door)."""
    from tests.support.ingress import local_door

    with local_door(monkeypatch) as served:
        yield served
