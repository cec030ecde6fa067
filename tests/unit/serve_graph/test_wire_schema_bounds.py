"""The JSON Schema takes its bounds and names from the parser (`dreamzero_client.wire`), declaring none of its own:
the schema's limits are the ones `continuity_fields` enforces, at the edge and one past it."""

from __future__ import annotations

import pytest

import serve_graph.wire_schema as wire_schema
from deployments.requests.rows import continuity_fields
from dreamzero_client.errors import InvalidRequest
from dreamzero_client.wire import generations


def _params(name: str) -> dict:
    doc = wire_schema.schema_documents()["generations-request.schema.json"]
    return doc["$defs"]["GenerationParameters"]["properties"][name]


def _bounds(prop: dict, *keys: str) -> set:
    """Every value of `keys` anywhere in a property's schema."""
    found, todo = set(), [prop]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            found |= {tuple(v) if isinstance(v, list) else v for k, v in node.items() if k in keys}
            todo += list(node.values())
        elif isinstance(node, list):
            todo += node
    return found


def test_the_schema_declares_no_bounds_of_its_own():
    assert not [name for name in vars(wire_schema) if name.startswith("MAX_")]


def test_expected_steps_bound_is_the_parser_s():
    assert _bounds(_params("expected_steps"), "maximum") == {generations.MAX_EXPECTED_STEP}
    assert continuity_fields({"expected_steps": [generations.MAX_EXPECTED_STEP]}, 1)[0] == [
        generations.MAX_EXPECTED_STEP
    ]
    with pytest.raises(InvalidRequest, match="expected_steps"):
        continuity_fields({"expected_steps": [generations.MAX_EXPECTED_STEP + 1]}, 1)


def test_expected_incarnations_bound_is_the_parser_s():
    assert _bounds(_params("expected_incarnations"), "maxLength") == {generations.MAX_INCARNATION_LEN}
    longest = "i" * generations.MAX_INCARNATION_LEN
    assert continuity_fields({"expected_incarnations": [longest]}, 1)[1] == [longest]
    with pytest.raises(InvalidRequest, match="expected_incarnations"):
        continuity_fields({"expected_incarnations": [longest + "i"]}, 1)


def test_the_form_names_are_the_parser_s():
    doc = wire_schema.schema_documents()["generations-request.schema.json"]
    assert _bounds(doc["$defs"]["GenerationInput"]["properties"]["form"], "enum") == {generations.FORM_NAMES}
