"""The column presets of the three embodiment tags (which columns make which state / action subkeys), shared by the
metadata generator, training and ReplayPolicy, and the LeRobot reader that applies them.

Reading (v2.x and v3.0 layouts) is `dreamzero_droid.lerobot`'s, the one module that also writes our datasets (the
robot's recorder, the eval recorder and the sim demos); this module adds only what is the model's: the presets and
`LeRobotDataset.resolve_slices`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from dreamzero.errors import ConfigError
from dreamzero_droid.lerobot.reader import LeRobotDataset as _Reader
from dreamzero_droid.lerobot.reader import column_to_array

__all__ = ["PRESETS", "ColumnSlice", "DatasetPreset", "LeRobotDataset", "column_to_array", "get_preset"]

# ---------------------------------------------------------------------------------------------------------------------
# 1. Column specs and presets
# ---------------------------------------------------------------------------------------------------------------------

_SPEC_RE = re.compile(r"^(?P<name>[^=]+)=(?P<column>[^\[\]]+)(\[(?P<start>\d*):(?P<end>\d*)\])?$")


@dataclass(frozen=True)
class ColumnSlice:
    """One state/action subkey = `column[start:end]` of a parquet column (None: the whole column)."""

    name: str  # subkey, e.g. "joint_position"
    column: str  # parquet column, e.g. "observation.state"
    start: int | None = None
    end: int | None = None

    @classmethod
    def parse(cls, text: str) -> ColumnSlice:
        """`NAME=COLUMN` or `NAME=COLUMN[START:END]` (the command-line form)."""
        m = _SPEC_RE.match(text.strip())
        if m is None:
            raise ConfigError(f"cannot parse {text!r}: expected NAME=COLUMN or NAME=COLUMN[START:END]")
        start, end = m.group("start"), m.group("end")
        return cls(m.group("name").strip(), m.group("column").strip(), int(start) if start else None,
                   int(end) if end else None)  # fmt: skip

    def take(self, values: np.ndarray) -> np.ndarray:
        return values[:, self.start : self.end]


@dataclass
class DatasetPreset:
    """Which columns make which state/action subkeys for one embodiment tag."""

    tag: str
    state: list[ColumnSlice] = field(default_factory=list)  # empty: from meta/modality.json
    action: list[ColumnSlice] = field(default_factory=list)
    video: dict[str, str] = field(default_factory=dict)  # short name -> feature key
    modality_state_column: str = "observation.state"  # used when slices come from modality.json
    modality_action_column: str = "action"
    relative: dict[str, str] = field(default_factory=dict)  # action subkey -> state subkey (relative stats)
    horizon: int = 1  # chunk length of relative statistics


PRESETS: dict[str, DatasetPreset] = {
    "libero_sim": DatasetPreset(
        tag="libero_sim",
        state=[ColumnSlice("state", "state")],
        action=[ColumnSlice("actions", "actions")],
        video={"image": "image", "wrist_image": "wrist_image"},
    ),
    "oxe_droid": DatasetPreset(
        tag="oxe_droid",
        video={
            "exterior_image_1_left": "observation.images.exterior_image_1_left",
            "exterior_image_2_left": "observation.images.exterior_image_2_left",
            "wrist_image_left": "observation.images.wrist_image_left",
        },
        # the DROID model predicts joint deltas from the current joints over its 24-step chunk
        relative={"joint_position": "joint_position"},
        horizon=24,
    ),
    "franka_pnp": DatasetPreset(
        tag="franka_pnp",
        state=[ColumnSlice("state", "state")],
        action=[ColumnSlice("actions", "actions")],
        video={"image": "observation.images.image", "wrist_image": "observation.images.wrist_image"},
    ),
}


def get_preset(tag: str) -> DatasetPreset:
    if tag not in PRESETS:
        raise ConfigError(f"no dataset preset for {tag!r}; presets exist for {sorted(PRESETS)} (else pass columns)")
    return PRESETS[tag]


# ---------------------------------------------------------------------------------------------------------------------
# 2. The dataset reader (dreamzero_droid.lerobot's) with the presets' slices
# ---------------------------------------------------------------------------------------------------------------------


class LeRobotDataset(_Reader):
    """`dreamzero_droid.lerobot.LeRobotDataset` plus `resolve_slices`, which reads an embodiment preset."""

    # -- presets ------------------------------------------------------------------------------------------------------

    def resolve_slices(self, preset: DatasetPreset) -> tuple[list[ColumnSlice], list[ColumnSlice]]:
        """The preset's state/action slices; empty ones come from meta/modality.json."""
        state, action = list(preset.state), list(preset.action)
        if state and action:
            return state, action
        modality = self.modality()
        if modality is None:
            raise ConfigError(
                f"{self.root}: the {preset.tag} preset takes its state/action slices from meta/modality.json, which is "
                "missing; pass --state NAME=COLUMN[START:END] and --action ... instead"
            )
        groups = {"state": (state, preset.modality_state_column), "action": (action, preset.modality_action_column)}
        for group, (slices, default_column) in groups.items():
            if slices:
                continue
            entries = modality.get(group)
            if not isinstance(entries, dict) or not entries:
                raise ConfigError(f"{self.root}/meta/modality.json has no {group!r} entries")
            for name, spec in entries.items():
                if not isinstance(spec, dict) or "start" not in spec or "end" not in spec:
                    raise ConfigError(f"meta/modality.json {group}.{name} needs 'start' and 'end'")
                column = spec.get("original_key", default_column)
                slices.append(ColumnSlice(name, column, int(spec["start"]), int(spec["end"])))
        return state, action
