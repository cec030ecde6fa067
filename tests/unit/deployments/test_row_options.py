"""One object for a request's per-row options (docs/architecture.md, "A new per-row option"): every shared option is
declared once (`deployments.requests.rows.OPTIONS`); each door's decoder fills it from its own wire (HTTP
`parameters` / `runtime`, an OpenPI message, ZeroMQ `options`), and it reaches the model batch unchanged on both
forms, through the batcher's merge. The table below names a sample per option: an option added without one fails
here, so a new option is seen through every door to the model batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deployments.batch_merge import merge_batches
from deployments.doors.openpi_ws import WsSession, to_generation_request
from deployments.preprocess import load_embodiment, normalised_batch, preprocess_request
from deployments.requests.generations import parse_generation_request
from deployments.requests.openpi import CONTROL_KEYS, parse_openpi_request
from deployments.requests.rldx import parse_get_action
from deployments.requests.rows import OPTIONS, RowOptions
from dreamzero.errors import InvalidObservation
from dreamzero.types import ROW_OPTIONS, ModelBatch
from dreamzero_client.wire.openpi import OPENPI_DROID_KEY_MAP
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import droid_raw_observation, normalised_observation
from tests.support.rldx import droid_rldx_observation

PREFIX = np.arange(16, dtype=np.float64).reshape(2, 8)
#: option -> (the value a client sends for one row, the row list the request holds, a value the readers refuse)
SAMPLES = {
    "seeds": (7, [7], -1),
    "expected_steps": ([3], [3], [-3]),
    "expected_incarnations": (["inc-1"], ["inc-1"], [""]),
    "rtc_prefix_len": (2, [2], "two"),
    "rtc_exec_horizon": ([5], [5], [10**6]),
    "action_prefix": (PREFIX, [PREFIX], np.full((2, 8), np.nan)),
    "return_video": (True, True, "yes"),
    "traffic_class": ("batch", ["batch"], "fast"),
    "deadline_ms": (120, [120.0], -1),
    "observed_at": ([1.7e9], [1.7e9], "now"),
}
#: options that are no `ModelBatch` field (`RowOption.to_batch` None) -> the batch field they become (None: none)
BATCH_FIELD = {"deadline_ms": "deadline_at", "observed_at": None}


def _same(a, b) -> bool:
    if isinstance(a, list) and a and isinstance(a[0], np.ndarray):
        return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    return a == b


def _option(name: str):
    return next(o for o in OPTIONS if o.name == name)


def test_every_option_is_declared_once_and_has_a_sample():
    names = [o.name for o in OPTIONS]
    assert len(set(names)) == len(names) and set(names) == set(SAMPLES), "add the new option's sample to SAMPLES"
    row_fields = {f.name for f in dataclasses.fields(RowOptions)}
    batch_fields = {f.name for f in dataclasses.fields(ModelBatch)}
    for name in names:  # a RowOptions field, a ModelBatch field, and how merged requests fill it
        assert name in row_fields, name
        if _option(name).to_batch is None:  # stays at the door, or reaches the batch as another field
            assert name in BATCH_FIELD and name not in batch_fields, name
            name = BATCH_FIELD[name]
            if name is None:
                continue
        assert name in batch_fields and name in ROW_OPTIONS, name
    assert {o.wire for o in OPTIONS} <= CONTROL_KEYS  # never read as an OpenPI observation key


def _http(name: str, value) -> RowOptions:
    o = _option(name)
    body = {"input": {"prompt": "p", "observation": normalised_observation(1)}, "parameters": {"session_ids": ["s"]}}
    body.setdefault("runtime" if o.runtime else "parameters", {})[o.wire] = value
    return parse_generation_request(body).rows


def _openpi(name: str, value) -> RowOptions:
    return parse_openpi_request({**openpi_droid_observation(0, "s"), _option(name).wire: value}).rows


def _zmq(name: str, value) -> RowOptions:
    data = {"observation": droid_rldx_observation(1), "options": {_option(name).wire: value}}
    return parse_get_action(data, "annotation.language.language_instruction").rows


DECODERS = {"http": _http, "openpi": _openpi, "zmq": _zmq}
WHERE = {"http": "parameters.", "openpi": "", "zmq": "options."}


@pytest.mark.parametrize("door", sorted(DECODERS))
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_doors_decoder_fills_the_option_and_names_it_when_bad(door, name):
    sent, rows, bad = SAMPLES[name]
    assert _same(getattr(DECODERS[door](name, sent), name), rows)
    others = {o.name for o in OPTIONS} - {name}
    unset = DECODERS[door](name, None)
    assert all(getattr(unset, n) in (None, False) for n in others | {name})  # not sent: not asked
    with pytest.raises(InvalidObservation) as err:
        DECODERS[door](name, bad)
    o = _option(name)
    prefix = "runtime." if door == "http" and o.runtime else WHERE[door]
    assert err.value.field.startswith(prefix + o.wire), err.value.field


def _batch_value(name: str, request) -> tuple[str | None, object]:
    """(the batch field the option becomes, the value it should hold there for this decoded request)."""
    sent, rows, _ = SAMPLES[name]
    o = _option(name)
    if o.to_batch is not None:
        return name, o.to_batch(rows, 1)
    if name == "deadline_ms":  # a deadline on the wall clock, from when the door received the request
        return "deadline_at", [request.rows.received_at + rows[0] / 1000.0]
    return BATCH_FIELD[name], None


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_the_option_reaches_the_model_batch_on_both_forms_and_through_the_merge(name):
    sent, _, _ = SAMPLES[name]
    request = parse_generation_request(_body(name, sent, normalised_observation(1)))
    field, want = _batch_value(name, request)
    normalised = normalised_batch(request)
    if field is None:  # stays at the door (the reply echoes it): nothing on the batch holds it
        assert name not in {f.name for f in dataclasses.fields(ModelBatch)}
        return
    assert _same(getattr(normalised, field), want)
    raw_request = parse_generation_request(_body(name, sent))
    raw, _ = preprocess_request(load_embodiment("oxe_droid"), raw_request)
    assert _same(getattr(raw, field), _batch_value(name, raw_request)[1])

    plain = normalised_batch(parse_generation_request(_body(name, None, normalised_observation(1), sid="other")))
    merged = merge_batches([plain, normalised], default_seed=1140)
    assert merged.session_ids == ["other", "s"]
    assert _same(getattr(merged, field)[1:], want), getattr(merged, field)


def _body(name: str, value, observation: dict | None = None, sid: str = "s") -> dict:
    o = _option(name)
    obs = droid_raw_observation(1) if observation is None else observation
    body = {"input": {"prompt": "p", "observation": obs}, "parameters": {"session_ids": [sid]}}
    if value is not None:
        body.setdefault("runtime" if o.runtime else "parameters", {})[o.wire] = value
    return body


def test_the_websocket_door_carries_its_rows_and_adds_only_its_session_state():
    msg = {**openpi_droid_observation(0, "s"), "seed": 7, "rtc_prefix_len": 2, "action_prefix": PREFIX}
    session = WsSession("s", "ws-c:s", reset_next=False, last_step=4, last_incarnation="inc")
    rows = to_generation_request(parse_openpi_request(msg), session, OPENPI_DROID_KEY_MAP).rows
    assert (rows.session_ids, rows.reset_mask, rows.seeds, rows.rtc_prefix_len) == (["ws-c:s"], [False], [7], [2])
    assert (rows.expected_steps, rows.expected_incarnations) == ([4], ["inc"])  # the socket's continuity
    assert np.array_equal(rows.action_prefix[0], PREFIX)


def test_rows_that_disagree_with_the_observation_are_refused_naming_the_field():
    rows = RowOptions(["a", "b"], ["s0", "s1"], [False, False])
    batch = normalised_batch(parse_generation_request(_body("seeds", None, normalised_observation(1))))
    with pytest.raises(InvalidObservation) as err:
        rows.to_batch(batch)
    assert err.value.field == "session_ids"
