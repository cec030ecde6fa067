"""The LIBERO simulator behind a small backend interface the runner and its env workers use.

A backend is a picklable description of a task suite: the parent process asks it for the task list
(`tasks()`), each env worker process asks it for the env of one task (`make(task_id)`). An env answers
`reset(init_index) -> obs`, `step(action) -> obs` and `is_success()`, with robosuite's observation dicts. Tests pass
a fake backend with the same three methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

#: LIBERO suites and the step limit per episode used by the published evaluations (longest demonstration + margin)
SUITE_MAX_STEPS = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
CONTROL_HZ = 20.0
DEFAULT_RESOLUTION = 256  # the libero_sim checkpoints were trained on 256x256 views


@dataclass(frozen=True)
class TaskInfo:
    task_id: int
    instruction: str
    num_init_states: int


class TaskEnv(Protocol):
    instruction: str

    def reset(self, init_index: int) -> dict: ...

    def step(self, action: np.ndarray) -> dict: ...

    def is_success(self) -> bool: ...

    def close(self) -> None: ...


class EnvBackend(Protocol):
    suite: str

    def tasks(self) -> list[TaskInfo]: ...

    def make(self, task_id: int) -> TaskEnv: ...


def _benchmark(suite: str):
    from eval.libero.offline import prepare_offline

    prepare_offline()
    from libero.libero import benchmark

    suites = benchmark.get_benchmark_dict()
    if suite not in suites:
        raise ValueError(f"suite: unknown LIBERO suite {suite!r}; known: {sorted(suites)}")
    return suites[suite]()


class LiberoTaskEnv:
    """One LIBERO task: `reset(i)` restores init state i (the published eval's initial scene), `step` one action."""

    def __init__(self, suite: str, task_id: int, resolution: int = DEFAULT_RESOLUTION, seed: int = 0):
        import os

        from libero.libero import get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        bench = _benchmark(suite)
        if not 0 <= task_id < bench.n_tasks:
            raise ValueError(f"task_id: {suite} has tasks 0..{bench.n_tasks - 1}, got {task_id}")
        task = bench.get_task(task_id)
        self.instruction = task.language
        self.init_states = np.asarray(bench.get_task_init_states(task_id))
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        self._env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=resolution, camera_widths=resolution)
        self._env.seed(seed)

    def reset(self, init_index: int) -> dict:
        if not 0 <= init_index < len(self.init_states):
            raise ValueError(f"init_index: this task has init states 0..{len(self.init_states) - 1}, got {init_index}")
        self._env.reset()
        return self._env.set_init_state(self.init_states[init_index])

    def step(self, action: np.ndarray) -> dict:
        obs, _reward, _done, _info = self._env.step(np.asarray(action, dtype=np.float64))
        return obs

    def is_success(self) -> bool:
        return bool(self._env.check_success())

    def close(self) -> None:
        self._env.close()


@dataclass(frozen=True)
class LiberoBackend:
    """A LIBERO suite (picklable: the env workers rebuild envs from it)."""

    suite: str = "libero_spatial"
    resolution: int = DEFAULT_RESOLUTION
    seed: int = 0

    def tasks(self) -> list[TaskInfo]:
        bench = _benchmark(self.suite)
        out = []
        for i in range(bench.n_tasks):
            task = bench.get_task(i)
            out.append(TaskInfo(i, task.language, len(bench.get_task_init_states(i))))
        return out

    def make(self, task_id: int) -> LiberoTaskEnv:
        return LiberoTaskEnv(self.suite, task_id, self.resolution, self.seed)


def default_max_steps(suite: str) -> int:
    if suite not in SUITE_MAX_STEPS:
        raise ValueError(
            f"suite: no default step limit for {suite!r}; pass max_steps (known: {sorted(SUITE_MAX_STEPS)})"
        )
    return SUITE_MAX_STEPS[suite]


def describe(backend: Any) -> str:
    return f"{type(backend).__name__}({getattr(backend, 'suite', '?')})"
