"""Merging concurrent requests into model calls, and splitting the results back (the Policy replica's batching).

Requests are only merged when their arrays stack (same frame count, canvas size, prompt and action-codec kinds) and
when they share no session (one in-flight step per session, in arrival order). Rows of one model call then share
every forward, whatever their sessions' frame positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dreamzero.types import ROW_OPTIONS, ChunkResult, ModelBatch


@dataclass
class _Group:
    key: tuple
    members: list[int] = field(default_factory=list)
    sessions: set[str] = field(default_factory=set)


def stack_key(batch: ModelBatch) -> tuple:
    return (
        batch.images.shape[1:],
        batch.images.dtype.str,
        batch.state.shape[1:],
        batch.negative_prompts is None,
        batch.embodiment_id is None,
        batch.action_gain is None,  # robot-unit rows (raw form) and normalised rows never share a model call
    )


def plan_groups(batches: list[ModelBatch]) -> list[list[int]]:
    """Split requests into mergeable groups, keeping each session's requests in arrival order.

    A request joins the earliest group that stacks with it and comes after every group holding one of its sessions.
    """
    groups: list[_Group] = []
    for i, batch in enumerate(batches):
        key = stack_key(batch)
        ids = set(batch.session_ids)
        after = max((g_idx for g_idx, g in enumerate(groups) if g.sessions & ids), default=-1)
        target = next((g for g in groups[after + 1 :] if g.key == key), None)
        if target is None:
            target = _Group(key)
            groups.append(target)
        target.members.append(i)
        target.sessions |= ids
    return [g.members for g in groups]


def merge_batches(batches: list[ModelBatch], default_seed: int) -> ModelBatch:
    """Concatenate stackable requests row-wise into one ModelBatch; every per-row option (`ROW_OPTIONS`) is carried,
    a request that left one unset filling its rows with what unset means."""
    if len(batches) == 1:
        return batches[0]

    def cat(name: str) -> np.ndarray:
        arrays = [getattr(b, name) for b in batches]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # a lone request's canvas is not copied

    first = batches[0]
    options = {}
    for name, (fill, always) in ROW_OPTIONS.items():
        if not always and all(getattr(b, name) is None for b in batches):
            options[name] = None
            continue
        fill = default_seed if name == "seeds" else fill
        options[name] = [row for b in batches for row in (getattr(b, name) or [fill] * len(b))]
    return ModelBatch(
        images=cat("images"),
        state=cat("state"),
        state_mask=cat("state_mask"),
        prompts=[p for b in batches for p in b.prompts],
        session_ids=[s for b in batches for s in b.session_ids],
        embodiment_id=None
        if first.embodiment_id is None
        else [e for b in batches for e in b.embodiment_id or [0] * len(b)],
        action_gain=None if first.action_gain is None else cat("action_gain"),
        action_bias=None if first.action_bias is None else cat("action_bias"),
        **options,
    )


def split_result(result: ChunkResult, sizes: list[int]) -> list[ChunkResult]:
    if len(sizes) == 1:
        return [result]
    parts, start = [], 0
    for n in sizes:
        stop = start + n
        latents = None if result.video_latents is None else result.video_latents[start:stop]
        video = None if result.video is None else result.video[start:stop]
        parts.append(
            ChunkResult(
                actions=result.actions[start:stop],
                sessions=result.sessions[start:stop],
                video_latents=latents,
                timings_ms=dict(result.timings_ms),
                dit_steps=result.dit_steps,
                video=None if video is None or all(v is None for v in video) else video,
            )
        )
        start = stop
    return parts
