"""The committed JSON Schema (docs/schema/) is what the wire models give, and real bodies validate against it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deployments.requests.generations import parse_generation_request
from deployments.requests.replies import build_response
from dreamzero.types import SessionReport
from dreamzero_client.wire import codec, generations
from serve_graph.wire_schema import render, schema_documents
from tests.support.request_builders import normalised_observation

jsonschema = pytest.importorskip("jsonschema")  # installed with ray

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "docs" / "schema"


def _schema(name: str) -> dict:
    return json.loads((SCHEMA_DIR / f"generations-{name}.schema.json").read_text())


def _as_json(obj) -> dict:
    """What a JSON client sends or receives (arrays as nested lists)."""
    return json.loads(codec.encode_body(obj, codec.JSON)[0])


def _small_observation(form: str, b: int) -> dict:
    """Tiny arrays: the schema's recursive array rule is checked per element, so big images validate slowly."""
    if form == "normalised":
        return normalised_observation(b=b, hw=(4, 8))
    rng = np.random.default_rng(0)
    return {"video.exterior_image_1_left": rng.integers(0, 256, (b, 1, 4, 8, 3), dtype=np.uint8),
            "state.joint_position": rng.uniform(-1, 1, (b, 7)).astype(np.float32)}  # fmt: skip


def _validator(name: str):
    schema = _schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_schema_is_current():
    for name, document in schema_documents().items():
        path = SCHEMA_DIR / name
        assert path.is_file(), f"{path} missing; run python scripts/make_schema.py"
        assert path.read_text() == render(document), f"{name} is stale; run python scripts/make_schema.py"


@pytest.mark.parametrize("form", ["normalised", "raw"])
def test_request_bodies_built_by_the_client_validate(form):
    body = generations.build_request_body(
        _small_observation(form, 2), ["pick up the cup"] * 2, ["s0", "s1"], reset_mask=[True, False], seed=[1, 2],
        expected_steps=[None, 3],
        expected_incarnations=[None, "abc123"], routing_key="env-0", response_format="raw", output_format="list",
    )  # fmt: skip
    wire = _as_json(body)
    _validator("request").validate(wire)
    assert parse_generation_request(wire, codec.JSON).form == form  # and the server accepts it


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda b: b["parameters"].pop("session_ids"), "session_ids"),
        (lambda b: b["parameters"].update(expected_incarnations=[""]), "expected_incarnations"),
        (lambda b: b["parameters"].update(seed=-1), "seed"),
        (lambda b: b["runtime"].update(response_format="xml"), "response_format"),
    ],
)
def test_request_schema_rejects_what_the_parser_rejects(change, where):
    body = _as_json(generations.build_request_body(_small_observation("normalised", 1), ["p"], ["s0"]))
    change(body)
    errors = list(_validator("request").iter_errors(body))
    assert errors and any(where in "/".join(map(str, e.absolute_path)) + e.message for e in errors), errors
    with pytest.raises(Exception):  # noqa: B017 - the parser's own error type varies with the field
        parse_generation_request(body, codec.JSON)


@pytest.mark.parametrize("response_format", ["envelope", "raw"])
def test_replies_built_by_the_server_validate(response_format):
    request = parse_generation_request(
        _as_json(generations.build_request_body(
            _small_observation("normalised", 2), ["p"] * 2, ["s0", "s1"], seed=7, response_format=response_format)),
        codec.JSON,
    )  # fmt: skip
    sessions = [SessionReport("s0", 1, True, "new_session", 1, "inc0"), SessionReport("s1", 3, False, None, 3, "inc1")]
    reply = build_response(request, np.zeros((2, 24, 32), np.float32), sessions, {"decode": 0.3})
    reply.update(served_by="replica-1", batch_requests=1)  # what the ingress adds
    validator = _validator("reply")
    validator.validate(_as_json(reply))
    reply["sessions"][0]["restart_reason"] = "cosmic_ray"
    assert not validator.is_valid(_as_json(reply))


def test_error_bodies_validate():
    from deployments.error_replies import classify
    from dreamzero.errors import InvalidObservation

    body = classify(InvalidObservation("bad", field="input.prompt")).body()
    _validator("error").validate(_as_json(body))
    assert not _validator("error").is_valid({"detail": "only the FastAPI half"})
