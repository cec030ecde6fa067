"""Fuzzing `POST /v1/actions/generations` parsing (normalised and raw forms) from bytes on, as the server sees it."""

from __future__ import annotations

from hypothesis import given, settings

from deployments.requests.generations import parse_generation_request
from dreamzero_client.errors import DreamZeroError, InvalidObservation
from dreamzero_client.wire import codec
from tests.support.fuzz import CI, TARGETS_BY_NAME

GENERATIONS = TARGETS_BY_NAME["generations"]


@settings(CI)
@given(GENERATIONS.strategy())
def test_mutated_requests_raise_only_typed_errors(example):
    GENERATIONS.run(example)


def _under(field: str, prefix: str) -> bool:
    return field == prefix or field.startswith(prefix + ".")


def test_the_mutations_reach_deep_fields():
    """The strategy is only worth its examples if rejections come from deep inside the body, not just the decoder."""
    fields: set[str] = set()
    outcomes: set[str] = set()

    # more examples than the crash test: which examples a derandomized run draws also shifts with what the process
    # imported before (the whole suite draws others than this module alone), and 300 of them reached 2 deep fields
    @settings(CI, max_examples=1000)
    @given(GENERATIONS.strategy())
    def collect(example):
        body, ctype = example
        try:
            obj, flavour = codec.decode_body(body, ctype)
            parse_generation_request(obj, flavour)
            outcomes.add("accepted")
        except InvalidObservation as exc:
            fields.add(exc.field or "")
            outcomes.add("invalid_observation")
        except DreamZeroError:
            outcomes.add("rejected")

    collect()
    assert outcomes == {"accepted", "invalid_observation", "rejected"}
    # each deep field, with its raw-form spelling; a rejection at or below one of them counts for it
    deep = {
        "images": ("input.observation.images", "input.observation.video"),
        "state": ("input.observation.state",),
        "session_ids": ("parameters.session_ids",),
        "prompt": ("input.prompt",),
    }
    reached = {name for name, prefixes in deep.items() if any(_under(f, p) for f in fields for p in prefixes)}
    # which deep fields a derandomized run reaches shifts with the strategies' code; most of them must be reached
    assert len(reached) >= 3, (set(deep) - reached, fields)
