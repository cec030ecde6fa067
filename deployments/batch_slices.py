"""A batch request's rows in slices, so a robot never waits behind a farm call longer than its budget.

A model call is never interrupted. A farm's request of many rows (an evaluation posting 16 environments) is one call
of all of them unless it is cut: on a CPU a 16-row call of the tiny model takes about a second, longer than a robot
at DROID's pace has left when it asks. While the batcher knows a realtime session's budget
(`ContinuousBatcher.slice_rows`: the most rows whose call, followed by the robot's own, fits the tightest budget), a
batch-class request larger than that is submitted as slices of that many rows (`slice_batch`), each its own request
to the batcher; slices queued together still join one call when no robot is due (the batcher's rules decide), and a
robot's request goes between them when one is. The slices' results are joined back in row order (`join_results`).
With no robot, or on a device where the whole request fits the budget, nothing is cut.
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from dreamzero.types import ROW_OPTIONS, ChunkResult, ModelBatch

#: the row-indexed arrays of a ModelBatch besides the per-row options
_ROW_ARRAYS = ("images", "state", "state_mask", "action_gain", "action_bias")
_ROW_LISTS = ("prompts", "session_ids", "embodiment_id", *ROW_OPTIONS)


def slice_batch(batch: ModelBatch, start: int, stop: int) -> ModelBatch:
    """Rows [start, stop) of `batch`, every row-indexed field cut alike (the routing key is kept)."""
    cut = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if value is not None and (f.name in _ROW_ARRAYS or f.name in _ROW_LISTS):
            cut[f.name] = value[start:stop]
    return replace(batch, **cut)


def slices(batch: ModelBatch, rows: int | None) -> list[ModelBatch]:
    """`batch` cut into slices of at most `rows` rows (None, or a batch that fits: the batch itself)."""
    n = len(batch)
    if rows is None or rows < 1 or n <= rows:
        return [batch]
    return [slice_batch(batch, i, min(n, i + rows)) for i in range(0, n, rows)]


def join_results(results: list[ChunkResult]) -> ChunkResult:
    """The slices' results as one, in row order (timings and DiT steps: the slowest slice's)."""
    if len(results) == 1:
        return results[0]
    latents = [r.video_latents for r in results]
    videos = [r.video for r in results]
    slowest = max(results, key=lambda r: sum(r.timings_ms.values()))
    return ChunkResult(
        actions=np.concatenate([r.actions for r in results]),
        sessions=[s for r in results for s in r.sessions],
        video_latents=None if any(v is None for v in latents) else np.concatenate(latents),
        timings_ms=dict(slowest.timings_ms),
        dit_steps=max(r.dit_steps for r in results),
        video=None
        if all(v is None for v in videos)
        else [x for r, v in zip(results, videos) for x in (v if v is not None else [None] * len(r.sessions))],
    )
