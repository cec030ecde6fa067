"""The inference-loop knobs (`PipelineConfig`: `pipeline:` in serve_config.yaml, `overrides=` of the pipeline) and the
one wording of a bad knob (`unknown_knob_message`, `describe_errors`) every way in shares."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from dreamzero.errors import ConfigError

_Step = Annotated[StrictInt, Field(ge=0)]
_Pixels = Annotated[StrictInt, Field(ge=1)]
_Similarity = Annotated[StrictFloat, Field(ge=-1.0, le=1.0)]
# upstream default: run the DiT on 8 of 16 steps and reuse the last prediction on the others
_UPSTREAM_STEP_MASK = (
    True, True, True, False, False, False, True, False, False, False, True, False, False, True, True, True,
)  # fmt: skip


class PipelineConfig(BaseModel):
    """Inference-loop knobs (all overridable per deployment: `pipeline:` in serve_config.yaml, `overrides=` of
    `DreamZeroPipeline.load`). Validated on construction and frozen: a PipelineConfig in hand is always usable;
    `with_overrides` makes a changed copy."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    num_inference_steps: StrictInt = Field(16, ge=1, description="Flow-matching scheduler steps per action chunk.")
    sigma_shift: StrictFloat = Field(5.0, gt=0, description="Timestep shift of the flow-UniPC sigma schedule.")
    cfg_scale: StrictFloat = Field(
        5.0, description="Classifier-free guidance scale on the video; 1.0 runs no unconditional rows at all."
    )
    dit_step_mask: tuple[StrictBool, ...] | None = Field(
        _UPSTREAM_STEP_MASK,
        description="One bool per scheduler step: run the DiT (true) or reuse the last prediction (false); the "
        "first entry must be true. null runs the DiT on every step. Ignored when dynamic_skip is true.",
    )
    dynamic_skip: StrictBool = Field(
        False, description="Skip DiT steps by the cosine similarity of successive predictions instead of the mask."
    )
    dynamic_skip_warmup: StrictInt = Field(
        2, ge=1, description="Steps that always run before dynamic skipping may start."
    )
    dynamic_skip_thresholds: tuple[tuple[_Similarity, _Step], ...] = Field(
        ((0.95, 4), (0.93, 2)),
        description="[similarity, steps] pairs: when the cosine similarity exceeds `similarity` (-1..1), skip the "
        "next `steps` (>= 0) DiT steps; the highest matching threshold wins.",
    )
    default_seed: StrictInt = Field(1140, ge=0, description="Noise seed of rows whose request carries none.")
    num_frames: StrictInt = Field(
        33, ge=1, description="Frames of the i2v conditioning window (8 * max_chunk_size + 1 on DROID)."
    )
    model_input_hw: tuple[_Pixels, _Pixels] | None = Field(
        None,
        description="[height, width] the input frames are resized to inside the model (bilinear; 5B: [160, 320]); "
        "null keeps the size sent.",
    )
    prompt_cache_size: StrictInt = Field(
        32, ge=0, description="T5 rows of recent prompts shared by all sessions (ours); 0 encodes per session."
    )
    conditioning_by_chunk: StrictBool = Field(
        True,
        description="Encode the i2v conditioning chunk by chunk from a per-session VAE state (ours; about 0.6 GB "
        "per 14B DROID session until its window is full); false encodes the whole window at each restart, as "
        "upstream, and keeps no state.",
    )
    compile: Literal["none", "dit", "all"] = Field(
        "none",
        description="torch.compile level: none (eager), dit (each DiT block), all (also the text/image encoders and "
        "the VAE). Compiled models are warmed up at load. See docs/model.md, 'Compile levels'.",
    )

    @field_validator("dit_step_mask")
    @classmethod
    def _first_step_runs(cls, mask: tuple[bool, ...] | None) -> tuple[bool, ...] | None:
        if mask is not None and (not mask or not mask[0]):
            raise ValueError("the first entry must be true (step 0 has no prediction to reuse); or use null")
        return mask

    @model_validator(mode="after")
    def _mask_covers_every_step(self) -> PipelineConfig:
        mask = self.dit_step_mask
        if mask is not None and len(mask) != self.num_inference_steps:
            raise ValueError(
                f"dit_step_mask has {len(mask)} entries but num_inference_steps is {self.num_inference_steps}; "
                "give one bool per step, or null to run the DiT on every step"
            )
        return self

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> PipelineConfig:
        """A copy with the knobs in `overrides` replaced, validated as a whole; a bad or unknown knob raises
        ConfigError naming it (and the closest known name)."""
        if not overrides:
            return self
        return parse_pipeline_config({**self.model_dump(), **overrides})


def parse_pipeline_config(data: Mapping[str, Any]) -> PipelineConfig:
    """`data` (e.g. from YAML / JSON) as a PipelineConfig, or ConfigError listing every bad knob."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"pipeline must be a mapping of knob names to values, got {type(data).__name__}")
    try:
        return PipelineConfig.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(describe_errors(err, "pipeline")) from None


def unknown_knob_message(name: str, where: str = "pipeline") -> str:
    """The one place that names an unknown pipeline knob: the closest known name and the full list."""
    known = list(PipelineConfig.model_fields)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {where} knob {name!r}.{hint} Known knobs: {known}"


_TYPE_NAMES = {  # pydantic error type -> what the field wants, in config-file words
    **dict.fromkeys(("bool_type", "bool_parsing"), "true or false"),
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "int"),
    **dict.fromkeys(("float_type", "float_parsing"), "float"),
    "string_type": "str",
    **dict.fromkeys(("tuple_type", "list_type"), "a list"),
    **dict.fromkeys(("dict_type", "model_type", "dataclass_type"), "an object"),
}


def describe_errors(err: ValidationError, where: str) -> str:
    """A pydantic ValidationError as one line per problem, each naming the field (`where.field`) and the fix."""
    lines = []
    for e in err.errors():
        loc = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"])
        loc = loc.removeprefix(".")
        got = e.get("input")
        if e["type"] == "extra_forbidden":
            lines.append(unknown_knob_message(str(e["loc"][-1]), where))
            continue
        kind = _TYPE_NAMES.get(e["type"])
        if kind is not None:
            lines.append(f"{loc} must be {kind}, got {got!r}")
            continue
        msg = "missing; give a value" if e["type"] == "missing" else e["msg"].removeprefix("Value error, ")
        if not isinstance(got, (dict, list, tuple)) and e["type"] not in ("value_error", "missing"):
            msg += f", got {got!r}"
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)


def apply_overrides(config: PipelineConfig, overrides: Mapping[str, Any] | None) -> PipelineConfig:
    """`config.with_overrides(overrides)` (kept for callers that hold a config and a dict)."""
    return config.with_overrides(overrides)
