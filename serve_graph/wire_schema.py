"""JSON Schema of `POST /v1/actions/generations` (request, reply, error body), derived from pydantic models of the
wire shape.

The models describe the JSON form (arrays as nested lists); a msgpack body has the same structure once its array
markers are decoded. They mirror the server's parser and reply builder (`deployments.requests`) and the clients'
body builder (`dreamzero_client.wire`), and take their constants (forms, reply formats, restart reasons, bounds), so a
change there shows up here; the committed files under docs/schema/ are written by `scripts/make_schema.py`, and a
test fails when they are stale or when a body built by `build_request_body` / `build_response` does not validate.
Reference: docs/wire-protocol.md.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from typing_extensions import TypeAliasType

from deployments.requests import fields
from dreamzero_client.wire import generations, replies
from dreamzero_client.wire.replies import RTC_SOURCES

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# --- building blocks -------------------------------------------------------------------------------------------------

JsonArray = TypeAliasType("JsonArray", "list[JsonArray] | float | bool | str")
Observation = TypeAliasType("Observation", "dict[str, JsonArray | Observation]")

SessionId = Annotated[str, Field(min_length=1, max_length=fields.MAX_SESSION_ID_LEN)]
Seed = Annotated[int, Field(ge=0, le=fields.MAX_SEED)]
ExpectedStep = Annotated[int, Field(ge=0, le=generations.MAX_EXPECTED_STEP)]
Incarnation = Annotated[str, Field(min_length=1, max_length=generations.MAX_INCARNATION_LEN)]
RtcCount = Annotated[int, Field(ge=0, le=generations.MAX_RTC_ACTIONS)]
TrafficClass = Literal[generations.TRAFFIC_CLASSES]  # type: ignore[valid-type]
DeadlineMs = Annotated[float, Field(ge=0, le=generations.MAX_DEADLINE_MS)]
ActionPrefix = list[list[float]]  # [P, D]
ActionValues = list[list[list[float]]]  # [B, H, D]


class _Open(BaseModel):
    # the parser ignores keys it does not know, so the schema allows them too
    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- request -------------------------------------------------------------------------------------------------------


class NormalisedObservation(_Closed):
    """RLinf's normalised form: the stitched canvas and the q99-normalised, padded state."""

    images: JsonArray = Field(description="uint8 [B, T, H, W, 3] with T 1 or 4 ([B, H, W, 3] reads as T = 1).")
    state: JsonArray = Field(description="float32 [B, 1, 64] ([B, 64] accepted), finite.")
    state_mask: JsonArray = Field(description="bool [B, 1, 64] ([B, 64] accepted).")
    embodiment_id: JsonArray | None = Field(None, description="int [B] or one int; accepted, unused.")
    has_lapa_action: JsonArray | None = Field(None, description="bool [B]; accepted, unused.")
    is_cotrain_instance: JsonArray | None = Field(None, description="bool [B]; accepted, unused.")


class GenerationInput(_Open):
    prompt: str | list[str] = Field(description="One instruction per row; one string is used for every row.")
    observation: NormalisedObservation | Observation = Field(
        description="The normalised form (images/state/state_mask) or the embodiment's raw keys, each array with a "
        "leading batch dimension B; nested objects read as dotted keys (state.joint_position)."
    )
    form: Literal[generations.FORM_NAMES] | None = Field(  # type: ignore[valid-type]
        None, description="The request form; inferred from the observation keys when absent."
    )


class GenerationParameters(_Open):
    session_ids: list[SessionId] | SessionId = Field(
        description="One unique id per row; their count B sizes every per-row field."
    )
    reset_mask: list[bool] | bool | None = Field(None, description="Per row: start the session fresh.")
    negative_prompts: list[str] | str | None = Field(None, description="Per row; default: the model's own.")
    seed: list[Seed] | Seed | None = Field(None, description="Noise seed: one for every row, or one per row.")
    expected_steps: list[ExpectedStep | None] | ExpectedStep | None = Field(
        None, description="Per row: the `step` of that session's last reply (null: no expectation)."
    )
    expected_incarnations: list[Incarnation | None] | Incarnation | None = Field(
        None, description="Per row: the `incarnation` of that session's last reply (null: no expectation)."
    )
    routing_key: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="Pins every session of the request to one policy replica; default: the first session id."
    )
    rtc_prefix_len: list[RtcCount | None] | RtcCount | None = Field(
        None, description="Real-time chunking: d, actions already executing when the chunk arrives (docs/rtc.md)."
    )
    rtc_exec_horizon: list[RtcCount | None] | RtcCount | None = Field(
        None, description="Real-time chunking: s, actions of the previous chunk executed between two requests."
    )
    action_prefix: list[ActionPrefix | None] | ActionPrefix | None = Field(
        None,
        description="Real-time chunking: the client's own prefix [P, D] (robot units in the raw form), for "
        "every row or one per row; wins over the session's cached chunk.",
    )
    traffic_class: list[TrafficClass] | TrafficClass | None = Field(
        None,
        description="The fleet (docs/fleet.md): `realtime` (a robot) or `batch` (an evaluation farm), for every row "
        "or one per row; default: the tenant's class, else realtime for one row and batch for more.",
    )
    deadline_ms: list[DeadlineMs | None] | DeadlineMs | None = Field(
        None,
        description="Per row: milliseconds from the server receiving the request until that row's client runs out "
        "of actions (actions left / control rate); realtime rows are served in deadline order.",
    )
    observed_at: list[float | None] | float | None = Field(
        None,
        description="Per row: when the observation was taken, seconds on the client's own clock; echoed unchanged "
        "in the row's session report.",
    )


class GenerationRuntime(_Open):
    response_format: Literal[generations.RESPONSE_FORMATS] = "envelope"  # type: ignore[valid-type]
    output_format: Literal[generations.OUTPUT_FORMATS] = "numpy"  # type: ignore[valid-type]
    return_video: bool = Field(
        False, description="Also return each row's predicted video of this chunk (uint8 [B, T, H, W, 3])."
    )


class GenerationRequestBody(_Open):
    """`POST /v1/actions/generations`: actions for B sessions."""

    model: str | None = Field(None, description="Echoed back; the server serves one model.")
    input: GenerationInput
    parameters: GenerationParameters
    runtime: GenerationRuntime | None = None


# --- reply ---------------------------------------------------------------------------------------------------------


class SessionReportBody(_Closed):
    """Continuity of one row's session on the replica that served it."""

    session_id: str
    step: Annotated[int, Field(ge=1)] = Field(
        description="Chunks this session produced on this replica (1 after a restart)."
    )
    restarted: bool
    restart_reason: Literal[replies.RESTART_REASONS] | None  # type: ignore[valid-type]
    frame_position: Annotated[int, Field(ge=0)] = Field(description="Latent frames of the session placed so far.")
    incarnation: str | None = Field(description="Id of this session state, new at every (re)start: echo it back.")
    rtc: Literal[RTC_SOURCES] | None = Field(  # type: ignore[valid-type]
        None, description="Present when real-time chunking was asked: what the chunk was steered towards."
    )
    observed_at: float | None = Field(
        None,
        description="The observation time this chunk answers: the request's `observed_at` echoed unchanged, else the "
        "server's receive time (unix seconds).",
    )
    observed_at_source: Literal["client", "server"] | None = Field(
        None, description="Where `observed_at` came from: the client's field, or the server's receive time."
    )
    server_ms: Annotated[float, Field(ge=0)] | None = Field(
        None, description="Milliseconds from the door receiving the request to the door replying."
    )
    traffic_class: TrafficClass | None = Field(None, description="The class the row was served as.")


class _ReplyExtras(_Closed):
    sessions: list[SessionReportBody] = Field(description="One report per row, in row order.")
    timings: dict[str, float] = Field(description="Milliseconds per stage (decode, preprocess, policy, model.*, ...).")
    form: Literal[generations.FORMS]  # type: ignore[valid-type]
    served_by: str | None = Field(None, description="The policy replica that computed the chunk.")
    batch_requests: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Requests merged into the model call that served this one."
    )


class ActionBody(_Closed):
    type: Literal["continuous"]
    dtype: Literal["float32"]
    shape: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=3, max_length=3)]
    values: ActionValues = Field(description="float32 [B, H, D]: the whole batch in one array.")


class VideoBody(_Closed):
    type: Literal["rgb"]
    dtype: Literal["uint8"]
    shape: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=5, max_length=5)]
    values: list[list[list[list[list[int]]]]] = Field(
        description="uint8 [B, T, H, W, 3]: the predicted frames at the model's canvas."
    )


class ActionItem(_Closed):
    index: int
    input_index: int
    candidate_index: int
    action: ActionBody
    video: VideoBody | None = Field(None, description="Present when `runtime.return_video` was set.")


class EnvelopeReply(_ReplyExtras):
    """`runtime.response_format: "envelope"` (the default): the sglang action envelope."""

    id: str
    object: Literal["action.generation"]
    created: int
    model: str
    data: Annotated[list[ActionItem], Field(min_length=1, max_length=1)]
    usage: dict[str, Any]


class RawReplyParameters(_Closed):
    session_ids: list[str]
    reset_mask: list[bool]
    seeds: list[int] | None = None


class RawReply(_ReplyExtras):
    """`runtime.response_format: "raw"`: the actions at the top level."""

    request_id: str
    actions: ActionValues = Field(description="float32 [B, H, D].")
    parameters: RawReplyParameters
    video: VideoBody | None = Field(None, description="Present when `runtime.return_video` was set.")


# --- errors --------------------------------------------------------------------------------------------------------


class ErrorDetail(_Closed):
    code: str = Field(description="Stable error code, e.g. invalid_observation, no_capacity.")
    message: str
    field: str | None = Field(None, description="The request field at fault (dotted path), when there is one.")


class ErrorBody(_Closed):
    """Every HTTP error reply (4xx / 5xx)."""

    error: ErrorDetail
    detail: str = Field(description="The message again, where FastAPI-style clients look for it.")


# --- documents -----------------------------------------------------------------------------------------------------

DOCUMENTS: dict[str, tuple[str, Any]] = {
    "generations-request.schema.json": ("POST /v1/actions/generations request body", GenerationRequestBody),
    "generations-reply.schema.json": ("POST /v1/actions/generations reply (200)", EnvelopeReply | RawReply),
    "generations-error.schema.json": ("POST /v1/actions/generations error reply (4xx / 5xx)", ErrorBody),
}


def schema_documents() -> dict[str, dict]:
    """file name -> JSON Schema document."""
    out = {}
    for name, (title, shape) in DOCUMENTS.items():
        schema = {k: v for k, v in TypeAdapter(shape).json_schema().items() if k != "title"}
        out[name] = {"$schema": JSON_SCHEMA_DIALECT, "title": title, **schema}
    return out


def render(document: dict) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
