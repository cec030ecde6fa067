"""The `Embodiment` base class: raw observation -> model inputs, and model output -> robot actions.

A robot is a subclass that declares its keys, view size, canvas layout, prompt template and action rules as class
attributes and implements `stitch`; the statistics come from metadata.json. Everything the class does is composed
from the transforms in `transforms.py`. See docs/embodiments.md ("Adding a robot").
"""
# Longer than ~400 lines on purpose: the base class is the whole transform contract every robot inherits (preprocess,
# postprocess, action codec, canvas slots); one place to read it.

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dreamzero.embodiments.canvas import CanvasWriter, Slot
from dreamzero.embodiments.observation import (
    ParsedObservation,
    as_array,
    batch_mode_from_state,
    parse_frames,
    parse_instructions,
    parse_state,
)
from dreamzero.embodiments.transforms import (
    NEGATIVE_PROMPT,
    AddCurrentState,
    BinariseGripper,
    CropResize,
    PromptTemplate,
    Q99Normaliser,
    pad_with_mask,
)
from dreamzero.errors import ConfigError, InvalidObservation, InvalidRequest
from dreamzero.metadata import EmbodimentMetadata, load_embodiment_metadata
from dreamzero.types import ModelBatch
from dreamzero_client.wire.openpi import OPENPI_CONTROL_KEYS  # the one list of the wire

#: RLinf-style rollout dict keys (env outputs); mapped onto the embodiment's own keys
#: the largest magnitude a normalised state may have: training data lies within about +-1 after q99 normalisation, and
#: a value far beyond (a finite 1e30) overflows the model's first layer into NaN actions (issue 45)
MAX_NORMALISED_STATE = 1e4
ROLLOUT_KEYS = ("main_images", "wrist_images", "extra_view_images", "states", "task_descriptions")


@dataclass
class PreprocessedBatch:
    """Model inputs for B rows (the `ModelBatch` fields an embodiment decides)."""

    images: np.ndarray  # uint8 [B, T, H, W, 3] stitched canvas
    state: np.ndarray  # float32 [B, 1, max_state_dim], q99-normalised, zero padded
    state_mask: np.ndarray  # bool [B, 1, max_state_dim]
    prompts: list[str]  # B formatted prompts
    negative_prompts: list[str]  # B negative prompts
    # float64 [B, max_action_dim] each: robot = gain * model + bias for this row's state (`Embodiment.action_codec`)
    action_gain: np.ndarray | None = None
    action_bias: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def to_model_batch(
        self,
        session_ids: list[str],
        reset_mask: list[bool] | None = None,
        expected_steps: list[int | None] | None = None,
        seeds: list[int] | None = None,
        **rtc_options,
    ) -> ModelBatch:
        """`rtc_options`: the ModelBatch real-time chunking fields (rtc_prefix_len, rtc_exec_horizon, action_prefix);
        the action codec travels with the batch so a prefix in robot units can be brought to model units."""
        if len(session_ids) != len(self):
            raise InvalidRequest(f"session_ids: expected {len(self)} ids (one per row), received {len(session_ids)}")
        return ModelBatch(
            images=self.images, state=self.state, state_mask=self.state_mask, prompts=list(self.prompts),
            session_ids=list(session_ids), negative_prompts=list(self.negative_prompts), reset_mask=reset_mask,
            expected_steps=expected_steps, seeds=seeds, action_gain=self.action_gain, action_bias=self.action_bias,
            **rtc_options,
        )  # fmt: skip


@dataclass
class PostprocessContext:
    """What postprocess needs from the request: the raw current state per key. Plain numpy (it crosses Ray)."""

    tag: str
    state: dict[str, np.ndarray]  # state key -> float64 [B, D], environment scale
    batched: bool = True  # False when the caller sent one unbatched observation

    @property
    def batch_size(self) -> int:
        return next(iter(self.state.values())).shape[0]


class Embodiment:
    """Transforms of one robot/dataset family. Subclasses set the class attributes below and `stitch`."""

    # More than ~15 methods on purpose: one robot's wire keys, widths, canvas and action codec, read in both
    # directions (observation in, actions out) from the same class attributes; a subclass overrides single steps.

    tag: ClassVar[str]
    action_horizon: ClassVar[int]
    video_keys: ClassVar[tuple[str, ...]]  # in the order `stitch` receives them
    wrist_key: ClassVar[str]  # the video key of the wrist camera (rollout `wrist_images`)
    state_keys: ClassVar[tuple[str, ...]]  # concat order
    action_keys: ClassVar[tuple[str, ...]]  # concat order
    known_widths: ClassVar[dict[str, int]] = {}  # widths fixed by the robot; checked against metadata
    view_hw: ClassVar[tuple[int, int]]  # per-view size after crop + resize
    canvas_hw: ClassVar[tuple[int, int]]  # stitched canvas size
    # where each view lands on the canvas (the layout `stitch` makes): views go there in one pass, no stitch copy
    canvas_slots: ClassVar[dict[str, Slot] | None] = None
    crop_scale: ClassVar[float] = 0.95
    prompt_template: ClassVar[PromptTemplate]
    negative_prompt: ClassVar[str] = NEGATIVE_PROMPT
    relative_actions: ClassVar[tuple[AddCurrentState, ...]] = ()
    gripper_rules: ClassVar[tuple[BinariseGripper, ...]] = ()
    openpi_key_map: ClassVar[dict[str, str]] = {}  # OpenPI wire key -> own key
    openpi_ignored_keys: ClassVar[tuple[str, ...]] = ()  # sent by OpenPI clients but unused
    openpi_action_space: ClassVar[str] = "joint_position"
    wire_image_hw: ClassVar[tuple[int, int]]  # the image size clients are told to send
    # the frames a session's later queries send per camera, as offsets in control steps from the current one, oldest
    # first, ending at 0 (a first query sends 1 frame): the one definition the doors advertise and the evals send
    frame_offsets: ClassVar[tuple[int, ...]]
    # where a GR00T / RLDX-1 observation carries the instruction for this robot's data (the ZeroMQ door advertises it)
    language_key: ClassVar[str]
    max_state_dim: ClassVar[int] = 64
    max_action_dim: ClassVar[int] = 32

    def __init__(self, metadata: EmbodimentMetadata | dict | str | Path | None = None):
        self.metadata = load_embodiment_metadata(metadata, self.tag)
        bounds = self.metadata.bounds
        self.state_normalisers = {
            k: Q99Normaliser.from_stats(self.metadata.stats(k), bounds["state"]) for k in self.state_keys
        }
        self.action_normalisers = {
            k: Q99Normaliser.from_stats(self.metadata.stats(k), bounds["action"]) for k in self.action_keys
        }
        for key, norm in {**self.state_normalisers, **self.action_normalisers}.items():
            want = self.known_widths.get(key)
            if want is not None and norm.dim != want:
                raise ConfigError(f"metadata[{self.tag!r}]: {key} has {norm.dim} dims, {self.tag} needs {want}")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            raise ConfigError(
                f"{self.tag}: state ({self.state_dim}) / action ({self.action_dim}) dims exceed the model's "
                f"{self.max_state_dim} / {self.max_action_dim}"
            )
        for rule in self.relative_actions:
            a, st = self.action_widths.get(rule.action_key), self.state_widths.get(rule.state_key)
            if a is None or a != st:
                raise ConfigError(
                    f"{self.tag}: relative action {rule.action_key} ({a} dims) vs {rule.state_key} ({st})"
                )
        for grip in self.gripper_rules:
            width = self.action_widths.get(grip.action_key, 0)
            if not -width <= grip.index < width:
                raise ConfigError(f"{self.tag}: gripper dim {grip.index} is outside {grip.action_key} ({width} dims)")
        self.crop_resize = CropResize(out_hw=self.view_hw, scale=self.crop_scale)
        slots = self.canvas_slots
        self.canvas_writer = CanvasWriter(self.crop_resize, slots, self.canvas_hw) if slots else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tag={self.tag!r}, action_dim={self.action_dim}, horizon={self.action_horizon})"

    # -----------------------------------------------------------------------------------------------------------------
    # Shapes and wire description
    # -----------------------------------------------------------------------------------------------------------------

    @property
    def state_widths(self) -> dict[str, int]:
        return {k: n.dim for k, n in self.state_normalisers.items()}

    @property
    def action_widths(self) -> dict[str, int]:
        return {k: n.dim for k, n in self.action_normalisers.items()}

    @property
    def state_dim(self) -> int:
        return sum(self.state_widths.values())

    @property
    def action_dim(self) -> int:
        """Robot-side action width (8 for DROID: 7 joints + gripper)."""
        return sum(self.action_widths.values())

    def openpi_server_config(self) -> dict[str, Any]:
        """The handshake dict an OpenPI/RoboArena client receives on connect."""
        exteriors = [k for k in self.video_keys if k != self.wrist_key]
        return {
            "image_resolution": list(self.wire_image_hw),
            "n_external_cameras": len(exteriors),
            "needs_wrist_camera": self.wrist_key in self.video_keys,
            "needs_stereo_camera": False,
            "needs_session_id": True,
            "action_space": self.openpi_action_space,
            "action_horizon": self.action_horizon,
            "action_dim": self.action_dim,
        }

    def format_prompt(self, instruction: str | None) -> str:
        return self.prompt_template(instruction)

    # -----------------------------------------------------------------------------------------------------------------
    # Raw observation -> model inputs
    # -----------------------------------------------------------------------------------------------------------------

    def stitch(self, views: dict[str, np.ndarray]) -> np.ndarray:
        """Resized views {key: [B, T, h, w, 3]} -> canvas [B, T, *canvas_hw, 3]."""
        raise NotImplementedError

    def render_canvas(self, views: dict[str, np.ndarray]) -> np.ndarray:
        """Views {key: [B, T, H, W, 3]} -> canvas [B, T, *canvas_hw, 3]: one pass per view into `canvas_slots`,
        else crop + resize per view and `stitch` (same bytes)."""
        if self.canvas_writer is not None:
            return self.canvas_writer.render(views)
        resized = {}
        for key, frames in views.items():
            b, t = frames.shape[:2]
            flat = self.crop_resize(frames.reshape(b * t, *frames.shape[2:]))  # [B*T, h, w, 3]
            resized[key] = flat.reshape(b, t, *flat.shape[1:])
        return self.stitch(resized)

    def warm_up(self) -> None:
        """Compile the image kernel and plan the wire image size now, not on the first request."""
        if self.canvas_writer is not None:
            self.canvas_writer.warm_up(getattr(self, "wire_image_hw", None))

    def _is_rollout(self, observation: dict) -> bool:
        """True for an RLinf rollout dict; mixing its keys with any other key is an error."""
        keys = set(observation)
        rollout_keys = keys & set(ROLLOUT_KEYS)
        if rollout_keys and keys - rollout_keys:
            unknown = sorted(keys - rollout_keys)
            raise InvalidObservation(
                f"observation mixes rollout keys {sorted(rollout_keys)} with {unknown}", unknown[0]
            )
        return bool(rollout_keys)

    def _rename(self, observation: dict) -> dict[str, tuple[str, Any]]:
        """Map own and OpenPI keys onto own keys: {own key: (key as sent, value)}; unknown keys fail."""
        own_known = set(self.video_keys) | set(self.state_keys)
        renamed: dict[str, tuple[str, Any]] = {}
        for key, value in observation.items():
            if key in self.openpi_ignored_keys or key in OPENPI_CONTROL_KEYS:
                continue
            own = key if key in own_known else self.openpi_key_map.get(key)
            if own is None:
                expected = sorted(own_known | set(self.openpi_key_map))
                raise InvalidObservation(f"{key}: unknown observation key for {self.tag}; expected {expected}", key)
            if own in renamed:
                raise InvalidObservation(f"{key}: {own} was sent twice (under two names)", field=key)
            renamed[own] = (key, value)
        return renamed

    def _parse_rollout(self, obs: dict, batched: bool | None) -> ParsedObservation:
        """RLinf env dict: main/wrist/extra views, concatenated `states`, `task_descriptions`."""
        if "states" not in obs:
            raise InvalidObservation(
                f"states: missing; expected ({self.state_dim},) or (B, {self.state_dim})", "states"
            )
        states = as_array(obs["states"], "states")
        if batched is None:
            batched = batch_mode_from_state(states, "states")
        full = parse_state(states, "states", self.state_dim, batched)
        state, start = {}, 0
        for key, width in self.state_widths.items():  # split in concat order
            state[key] = full[:, start : start + width]
            start += width
        exteriors = [k for k in self.video_keys if k != self.wrist_key]
        sources: dict[str, tuple[str, Any]] = {}
        if "main_images" in obs and exteriors:
            sources[exteriors[0]] = ("main_images", obs["main_images"])
        if "wrist_images" in obs:
            sources[self.wrist_key] = ("wrist_images", obs["wrist_images"])
        if "extra_view_images" in obs and len(exteriors) > 1:
            extra = as_array(obs["extra_view_images"], "extra_view_images")
            axis = 1 if batched else 0  # [B, N, ...] or [N, ...]
            if extra.ndim < 4 + int(batched):
                raise InvalidObservation(
                    f"extra_view_images: expected (B, N, H, W, 3), received shape {tuple(extra.shape)}",
                    "extra_view_images",
                )
            for i, key in enumerate(exteriors[1:]):
                if i < extra.shape[axis]:
                    sources[key] = ("extra_view_images", np.take(extra, i, axis=axis))
        views = {k: parse_frames(v, name, batched) for k, (name, v) in sources.items()}
        if not views:
            raise InvalidObservation("main_images: a rollout observation needs at least one image", "main_images")
        first = next(iter(views.values()))
        for key in self.video_keys:  # a missing view is a black screen, as in training's dropped views
            views.setdefault(key, np.zeros_like(first))
        instructions = None
        if "task_descriptions" in obs:
            instructions = parse_instructions(obs["task_descriptions"], "task_descriptions")
        return self._check_consistent(ParsedObservation(views, state, instructions, batched), sources)

    def parse_observation(self, observation: dict, batched: bool | None = None) -> ParsedObservation:
        """Validate a raw observation and bring it to [B, T, H, W, 3] views and [B, D] states under own keys."""
        if not isinstance(observation, dict):
            raise InvalidObservation(
                f"observation: expected a mapping of keys to arrays, received {type(observation).__name__}",
                field="observation",
            )
        if self._is_rollout(observation):
            return self._parse_rollout(observation, batched)
        renamed = self._rename(observation)
        for key in (*self.state_keys, *self.video_keys):
            if key not in renamed:
                raise InvalidObservation(f"{key}: missing from the observation ({self._expected(key)})", field=key)
        if batched is None:
            name, value = renamed[self.state_keys[0]]
            state0 = as_array(value, name)
            batched = batch_mode_from_state(state0, name)
            # a [1, D] state next to a single [H, W, 3] image is one unbatched observation, not a batch of one
            first_view = np.asarray(renamed[self.video_keys[0]][1])
            if batched and state0.ndim == 2 and state0.shape[0] == 1 and first_view.ndim == 3:
                batched = False
        state = {k: parse_state(renamed[k][1], renamed[k][0], self.state_widths[k], batched) for k in self.state_keys}
        views = {k: parse_frames(renamed[k][1], renamed[k][0], batched) for k in self.video_keys}
        # an OpenPI frame carries its instruction as `prompt`
        instructions = parse_instructions(observation["prompt"], "prompt") if "prompt" in observation else None
        return self._check_consistent(ParsedObservation(views, state, instructions, batched), renamed)

    def _expected(self, key: str) -> str:
        if key in self.state_widths:
            return f"expected shape ({self.state_widths[key]},) or (B, {self.state_widths[key]})"
        return "expected (H, W, 3) or (T, H, W, 3) or batched (B, T, H, W, 3) images"

    def _check_consistent(self, parsed: ParsedObservation, sent_as: dict) -> ParsedObservation:
        """Every key must agree on B (and every view on T)."""
        b = parsed.batch_size
        ref_t = None
        for key, value in {**parsed.state, **parsed.views}.items():
            name = sent_as.get(key, (key,))[0]
            if value.shape[0] != b:
                raise InvalidObservation(f"{name}: batch size {value.shape[0]} differs from the state's {b}", name)
            if key in parsed.views:
                ref_t = value.shape[1] if ref_t is None else ref_t
                if value.shape[1] != ref_t:
                    raise InvalidObservation(f"{name}: {value.shape[1]} frames, other views have {ref_t}", name)
        if parsed.instructions is not None and len(parsed.instructions) not in (1, b):
            raise InvalidObservation(
                f"instructions: expected {b} strings (one per row), received {len(parsed.instructions)}", "instructions"
            )
        return parsed

    def _prompts(self, instructions, parsed: ParsedObservation) -> list[str]:
        b = parsed.batch_size
        if instructions is None:
            items: list[str | None] = list(parsed.instructions) if parsed.instructions is not None else [None]
        elif isinstance(instructions, str):
            items = [instructions]
        else:
            items = [None if i is None else i for i in instructions]
            if any(i is not None and not isinstance(i, str) for i in items):
                raise InvalidObservation("instructions: expected strings", field="instructions")
        if len(items) == 1:
            items = items * b
        if len(items) != b:
            raise InvalidObservation(
                f"instructions: expected {b} strings (one per row), received {len(items)}", field="instructions"
            )
        return [self.format_prompt(i) for i in items]

    def preprocess(
        self, observation: dict, instructions: list[str] | str | None = None, batched: bool | None = None
    ) -> tuple[PreprocessedBatch, PostprocessContext]:
        """Raw observation -> (model inputs, what postprocess needs)."""
        parsed = self.parse_observation(observation, batched)
        b = parsed.batch_size
        # 1. images: per-view crop + resize, then the trained canvas layout
        canvas = self.render_canvas(parsed.views)  # [B, T, *canvas_hw, 3]
        if canvas.shape[2:4] != tuple(self.canvas_hw):
            raise ConfigError(
                f"{self.tag}: stitch() made a {canvas.shape[2:4]} canvas, canvas_hw says {self.canvas_hw}"
            )
        # 2. state: q99 per key in concat order, zero padded with a mask
        for key in self.state_keys:
            self._check_state_range(key, parsed.state[key])
        normalised = np.concatenate([self.state_normalisers[k].normalise(parsed.state[k]) for k in self.state_keys], -1)
        state, state_mask = pad_with_mask(normalised, self.max_state_dim)
        # 3. prompts
        prompts = self._prompts(instructions, parsed)
        gain, bias = self.action_codec(parsed.state)
        batch = PreprocessedBatch(canvas, state, state_mask, prompts, [self.negative_prompt] * b, gain, bias)
        context = PostprocessContext(self.tag, {k: parsed.state[k].copy() for k in self.state_keys}, parsed.batched)
        return batch, context

    def _check_state_range(self, key: str, values: np.ndarray) -> None:
        """InvalidObservation naming `key` when a raw state lies beyond MAX_NORMALISED_STATE training spans of the
        checkpoint's statistics: clipped, it would reach the model as an ordinary value, and a relative action adds
        it back (a state of 1e30 would command a robot to 1e30). A constant dim's span counts as max(1, |q01|)."""
        norm = self.state_normalisers[key]
        x = np.asarray(values, np.float64)
        span = np.asarray(norm.q99 - norm.q01, np.float64)
        scale = np.where(span > 0, span, np.maximum(1.0, np.abs(np.asarray(norm.q01, np.float64))))
        z = 2.0 * (x - norm.q01) / scale - 1.0
        if x.size and not (np.abs(z).max() <= MAX_NORMALISED_STATE):
            raise InvalidObservation(
                f"{key}: beyond +-{MAX_NORMALISED_STATE:g} once normalised by the checkpoint's statistics (its "
                "training range maps to +-1): check the state's units",
                field=key,
            )

    # -----------------------------------------------------------------------------------------------------------------
    # Model output -> robot actions
    # -----------------------------------------------------------------------------------------------------------------

    def split_actions(self, actions: np.ndarray) -> dict[str, np.ndarray]:
        """[..., >= action_dim] -> {action key: [..., width]} in concat order."""
        out, start = {}, 0
        for key, width in self.action_widths.items():
            out[key] = actions[..., start : start + width]
            start += width
        return out

    def action_codec(self, state: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The affine map postprocess applies before the gripper rule, per row: robot = gain * model + bias.

        state: raw current state per key [B, D]. Returns float64 (gain, bias) [B, max_action_dim]: q99 un-normalising
        gives gain = (q99 - q01) / 2 and bias = q01 + gain, relative keys add the current state to the bias; gain is
        0 on padding and on constant dims (they carry no information), so real-time chunking never steers them.
        """
        b = next(iter(state.values())).shape[0]
        gain, bias = np.zeros((b, self.max_action_dim)), np.zeros((b, self.max_action_dim))
        offsets = {rule.action_key: np.asarray(state[rule.state_key], np.float64) for rule in self.relative_actions}
        start = 0
        for key in self.action_keys:
            norm = self.action_normalisers[key]
            half_span = (norm.q99 - norm.q01) / 2.0
            stop = start + norm.dim
            gain[:, start:stop] = half_span
            bias[:, start:stop] = norm.q01 + half_span + offsets.get(key, 0.0)
            start = stop
        return gain, bias

    def postprocess(self, actions: np.ndarray, context: PostprocessContext) -> np.ndarray:
        """Normalised [B, A, >= action_dim] -> robot actions float32 [B, A, action_dim]."""
        actions = np.asarray(actions)
        if context.tag != self.tag:
            raise InvalidRequest(f"postprocess context is for {context.tag!r}, this embodiment is {self.tag!r}")
        if actions.ndim != 3 or actions.shape[0] != context.batch_size or actions.shape[2] < self.action_dim:
            raise InvalidRequest(
                f"actions: expected (B={context.batch_size}, A, >= {self.action_dim}), received {actions.shape}"
            )
        # 1. slice + un-normalise each key
        per_key = {k: self.action_normalisers[k].unnormalise(v) for k, v in self.split_actions(actions).items()}
        # 2. relative -> absolute
        for rule in self.relative_actions:
            per_key[rule.action_key] = rule(per_key[rule.action_key], context.state[rule.state_key])
        # 3. gripper rule
        for rule in self.gripper_rules:
            per_key[rule.action_key] = rule(per_key[rule.action_key])
        out = np.concatenate([per_key[k] for k in self.action_keys], axis=-1).astype(np.float32)
        if not np.isfinite(out).all():  # a NaN / inf action must never reach a robot
            rows = sorted({int(r) for r in np.argwhere(~np.isfinite(out))[:, 0]})
            raise InvalidObservation(
                f"actions: the robot actions of row(s) {rows[:8]} are NaN or infinite and were not sent; an input "
                "far outside the training range causes this: check the observation",
                field="actions",
            )
        return out
