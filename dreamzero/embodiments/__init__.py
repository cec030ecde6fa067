"""Embodiments by tag: how raw robot observations become model inputs and model outputs become robot actions.

    emb = get_embodiment("oxe_droid")                 # shipped synthetic statistics
    emb = get_embodiment("oxe_droid", "/ckpt")        # a checkpoint dir (experiment_cfg/metadata.json) or a file
    batch, ctx = emb.preprocess(observation, "pick up the cup")
    robot_actions = emb.postprocess(model_actions, ctx)

A new robot: subclass `Embodiment`, then `register_embodiment(MyRobot)` (docs/embodiments.md).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from dreamzero.embodiments.base import Embodiment, PostprocessContext, PreprocessedBatch
from dreamzero.embodiments.franka_pnp import FrankaPnp
from dreamzero.embodiments.libero_sim import LiberoSim
from dreamzero.embodiments.oxe_droid import OxeDroid
from dreamzero.errors import ConfigError
from dreamzero.metadata import EmbodimentMetadata

__all__ = [
    "Embodiment",
    "PostprocessContext",
    "PreprocessedBatch",
    "get_embodiment",
    "known_tags",
    "register_embodiment",
]

_REGISTRY: dict[str, type[Embodiment]] = {}


def register_embodiment(cls: type[Embodiment], replace: bool = False) -> type[Embodiment]:
    """Make `cls` available under `cls.tag` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Embodiment)) or not getattr(cls, "tag", None):
        raise ConfigError(f"{cls!r} is not an Embodiment subclass with a `tag`")
    check_frame_history(cls)
    if cls.tag in _REGISTRY and _REGISTRY[cls.tag] is not cls and not replace:
        raise ConfigError(f"embodiment tag {cls.tag!r} is already registered by {_REGISTRY[cls.tag].__name__}")
    _REGISTRY[cls.tag] = cls
    return cls


def check_frame_history(cls: type[Embodiment]) -> None:
    """`frame_offsets` (oldest first, increasing, ending at 0) and `language_key` are declared: the doors advertise
    them, so a robot without them fails here, at registration, not on a client's first call."""
    offsets = getattr(cls, "frame_offsets", None)
    ok = (
        isinstance(offsets, tuple)
        and len(offsets) > 0
        and all(isinstance(o, int) for o in offsets)
        and offsets[-1] == 0
        and all(a < b for a, b in zip(offsets, offsets[1:]))
    )
    if not ok:
        raise ConfigError(
            f"{cls.__name__}.frame_offsets: expected a tuple of increasing ints ending at 0 (e.g. (-23, -16, -8, 0)), "
            f"got {offsets!r}"
        )
    if not isinstance(getattr(cls, "language_key", None), str) or not cls.language_key:
        raise ConfigError(f"{cls.__name__}.language_key: expected the instruction's observation key, e.g. "
                          "'annotation.language.language_instruction'")  # fmt: skip


def known_tags() -> list[str]:
    return sorted(_REGISTRY)


def get_embodiment(tag: str, metadata: EmbodimentMetadata | dict | str | Path | None = None) -> Embodiment:
    """The embodiment `tag` with statistics from `metadata` (a dict, a metadata.json / checkpoint path, or None for
    the shipped synthetic file). An unknown tag fails with the known tags and the closest match."""
    if tag not in _REGISTRY:
        close = difflib.get_close_matches(str(tag), _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown embodiment tag {tag!r}; known tags: {known_tags()}.{hint}")
    return _REGISTRY[tag](metadata)


for _cls in (OxeDroid, LiberoSim, FrankaPnp):
    register_embodiment(_cls)
