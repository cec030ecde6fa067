"""Scene 4, the two-object table: the cube and the can, the bowl and the mug at once, and four instructions over them.

Every instruction names one object and one target, and each object and each target is named by two of the four, so
neither the picture nor half of the sentence tells a policy what to do: it has to read both nouns. The layout is
drawn per episode from the reset seed (`sample_layout`); the instruction is the caller's choice, or, with "all", one
of the four per episode from the same seed, so that every four consecutive seeds ask for each instruction once
(`episode_instruction`: a run of N episodes is balanced to within two episodes per instruction).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dreamzero.errors import ConfigError

SCENE_ID = 4
OBJECTS = ("cube", "can")
TARGETS = ("bowl", "mug")
ALL = "all"


@dataclass(frozen=True)
class Task:
    """One instruction of the scene and the object and target it names."""

    instruction: str
    object_name: str
    target_name: str

    @property
    def other_object(self) -> str:
        return OBJECTS[1 - OBJECTS.index(self.object_name)]

    @property
    def other_target(self) -> str:
        return TARGETS[1 - TARGETS.index(self.target_name)]


TASKS = tuple(Task(f"put the {o} in the {t}", o, t) for o in OBJECTS for t in TARGETS)
INSTRUCTIONS = tuple(t.instruction for t in TASKS)

#: the table patch every body is drawn from (m, base frame): wider than scene 1's "wide" patch, as four bodies share it
LAYOUT_X = (0.36, 0.64)
LAYOUT_Y = (-0.30, 0.30)
#: minimum centre distances (m). Targets: the bowl (8.5 cm radius) and the mug (9 cm with its handle) never touch.
#: Object to target: the object starts outside the success radius (12 cm) and the open fingers clear the rim.
#: Object to object: the fingers close on one object without touching the other.
MIN_TARGET_TARGET_M = 0.22
MIN_OBJECT_TARGET_M = 0.17
MIN_OBJECT_OBJECT_M = 0.13


def task_for(instruction: str) -> Task:
    for task in TASKS:
        if task.instruction == instruction:
            return task
    raise ConfigError(f"instruction: expected one of {list(INSTRUCTIONS)} or {ALL!r}, got {instruction!r}")


def check_instruction_choice(choice: str | None) -> str:
    """`choice`: one of `INSTRUCTIONS`, or "all" / None (one per episode from its seed); returns it, None as "all"."""
    if choice is None or choice == ALL:
        return ALL
    return task_for(choice).instruction


def episode_instruction(seed: int, choice: str | None = ALL) -> Task:
    """The episode's task: the chosen one, or with "all" the seed's: seeds 4k..4k+3 take the four instructions in
    an order shuffled by k."""
    choice = check_instruction_choice(choice)
    if choice != ALL:
        return task_for(choice)
    order = np.random.default_rng([int(seed) // 4, SCENE_ID]).permutation(len(TASKS))
    return TASKS[int(order[int(seed) % 4])]


def sample_layout(rng: np.random.Generator) -> dict[str, tuple[float, float]]:
    """Where each of the four bodies starts (x, y), drawn uniformly over the patch and kept apart (bounded retries)."""
    names = (*OBJECTS, *TARGETS)
    lo, hi = (LAYOUT_X[0], LAYOUT_Y[0]), (LAYOUT_X[1], LAYOUT_Y[1])
    for _ in range(10000):
        pts = rng.uniform(lo, hi, size=(len(names), 2))
        if _apart(pts):
            return {name: (float(x), float(y)) for name, (x, y) in zip(names, pts)}
    raise RuntimeError("could not place the four bodies of scene 4 apart (the layout patch is too small)")


def _apart(pts: np.ndarray) -> bool:
    (c, n, b, m) = pts  # cube, can, bowl, mug
    dist = np.linalg.norm
    return (
        dist(b - m) >= MIN_TARGET_TARGET_M
        and dist(c - n) >= MIN_OBJECT_OBJECT_M
        and min(dist(o - t) for o in (c, n) for t in (b, m)) >= MIN_OBJECT_TARGET_M
    )
