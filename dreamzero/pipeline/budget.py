"""The session byte budget (docs/model.md, "Memory and admission"): how much device memory sessions may reserve.

`sessions.max_bytes: auto` on CUDA runs a warm-up of the largest batch the server admits (`warmup_batch` at
`warmup_canvas_hw`), then splits the free memory between that batch's activations, the KV cache copies a batch makes
while it runs, a margin and the sessions (`split_budget`, `measure_session_budget`, `resolve_session_budget`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dreamzero.errors import ConfigError
from dreamzero.sizes import parse_bytes
from dreamzero.types import ModelBatch

if TYPE_CHECKING:
    from dreamzero.pipeline.core import DreamZeroPipeline


@dataclass(frozen=True)
class SessionBudget:
    """How the free device memory after loading and warm-up is split (all bytes)."""

    free: int  # free device memory after the warm-up (its sessions dropped, caches emptied)
    activation_peak: int  # the warm-up's peak allocation above what was allocated before it
    kv_transient: int  # cache copies a batch of full-window sessions makes while it runs (stack, new, split)
    margin: int  # fragmentation and allocator slack
    budget: int  # what sessions may reserve

    def describe(self) -> str:
        g = 2**30
        return (
            f"session budget {self.budget / g:.2f} GiB = free {self.free / g:.2f} GiB - activation peak "
            f"{self.activation_peak / g:.2f} GiB - batch cache copies {self.kv_transient / g:.2f} GiB - margin "
            f"{self.margin / g:.2f} GiB"
        )


#: copies of its rows' KV caches a multi-row batch holds at once while it runs: the stacked caches, the prefill's new
#: ones, and the per-session clones (a one-row batch uses its cache as is and only makes the new one)
KV_COPIES_MULTI_ROW, KV_COPIES_ONE_ROW = 3, 1


def split_budget(
    free: int, activation_peak: int, rows: int, kv_peak_per_session: int, total: int, margin_fraction: float = 0.05
) -> SessionBudget:
    """The session budget from measured numbers; ConfigError when nothing is left for one session."""
    copies = KV_COPIES_MULTI_ROW if rows > 1 else KV_COPIES_ONE_ROW
    transient = copies * rows * kv_peak_per_session
    margin = max(int(margin_fraction * total), 1 << 30 if total > 8 << 30 else 0)
    budget = free - activation_peak - transient - margin
    return SessionBudget(free, activation_peak, transient, margin, budget)


def warmup_canvas_hw(pipeline: DreamZeroPipeline) -> tuple[int, int]:
    """The frame size a warm-up sends: the model's input size when it resizes, else the canvas whose latent grid gives
    `frame_seqlen` tokens, the factorisation closest to the 1:2 canvases of the shipped embodiments (DROID 352x640)."""
    if pipeline.config.model_input_hw is not None:
        return tuple(pipeline.config.model_input_hw)
    cfg = pipeline.dit_cfg
    sf = getattr(pipeline.model.vae, "spatial_factor", 8)
    pairs = [(a, cfg.frame_seqlen // a) for a in range(1, cfg.frame_seqlen + 1) if cfg.frame_seqlen % a == 0]
    gh, gw = min(pairs, key=lambda p: abs(math.log(p[1] / p[0]) - math.log(2)))
    return gh * cfg.patch_size[1] * sf, gw * cfg.patch_size[2] * sf


def warmup_batch(pipeline: DreamZeroPipeline, rows: int, canvas_hw: tuple[int, int], step: int = 0) -> ModelBatch:
    """`rows` sessions `warmup-i`, 4 new frames each (the continuing-call shape), deterministic content."""
    rng = np.random.default_rng(step)
    frames = 2 * pipeline.dit_cfg.num_frame_per_block
    state_dim = pipeline.dit_cfg.max_state_dim
    return ModelBatch(
        images=rng.integers(0, 256, (rows, frames, *canvas_hw, 3), dtype=np.uint8),
        state=np.zeros((rows, 1, state_dim), np.float32),
        state_mask=np.ones((rows, 1, state_dim), bool),
        prompts=["warm-up"] * rows,
        session_ids=[f"warmup-{i}" for i in range(rows)],
    )


def measure_session_budget(
    pipeline: DreamZeroPipeline, rows: int, canvas_hw=None, margin_fraction: float = 0.05
) -> SessionBudget:
    """Run `rows` fresh sessions through a restart and a continuing chunk (the largest batch the server admits), then
    split the free device memory (`torch.cuda.mem_get_info`) between activations and sessions (`split_budget`).
    The warm-up's sessions are dropped before free memory is read. CUDA only."""
    dev = pipeline.device
    if dev.type != "cuda":
        raise ConfigError("measure_session_budget needs a CUDA model; on CPU set sessions.max_bytes or leave it auto")
    canvas_hw = tuple(canvas_hw or warmup_canvas_hw(pipeline))
    limit, pipeline.store.max_bytes = pipeline.store.max_bytes, None  # the warm-up itself is not admitted
    ids = [f"warmup-{i}" for i in range(rows)]
    try:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        for step in range(2):  # restart chunk, then a continuing one (stacked caches, observed-block prefill)
            pipeline.generate(warmup_batch(pipeline, rows, canvas_hw, step))
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    finally:
        pipeline.drop_sessions(ids)
        pipeline.store.restarts.clear()  # the warm-up's starts are no client's
        pipeline.store.max_bytes = limit
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    parts = pipeline.footprint(pipeline.canvas_hw(canvas_hw)).parts
    kv_peak = max(p["kv_cache"] for p in parts)
    return split_budget(int(free), int(peak), rows, kv_peak, int(total), margin_fraction)


def resolve_session_budget(spec, pipeline: DreamZeroPipeline, rows: int, log=print) -> int | None:
    """`sessions.max_bytes` -> the store's byte budget: bytes as given; `auto` measured on CUDA
    (`measure_session_budget` with the largest batch) and no limit on CPU; None no limit. ConfigError when a GPU
    budget holds no session."""
    value = parse_bytes(spec)
    if value != "auto":
        return value
    if pipeline.device.type != "cuda":
        return None
    canvas = warmup_canvas_hw(pipeline)
    footprint = pipeline.footprint(pipeline.canvas_hw(canvas))
    one, kv_peak = footprint.peak, max(p["kv_cache"] for p in footprint.parts)
    free, total = torch.cuda.mem_get_info(pipeline.device)
    before = split_budget(int(free), 0, rows, kv_peak, int(total))  # the warm-up itself must not be what OOMs
    if before.budget < rows * one:
        raise ConfigError(
            f"batching.max_batch_rows={rows}: a batch of {rows} full-window sessions needs "
            f"{before.kv_transient / 2**30:.1f} GiB of cache copies plus {rows * one / 2**30:.1f} GiB of sessions, "
            f"more than the {free / 2**30:.1f} GiB free on {pipeline.device} after loading; lower it"
        )
    try:
        split = measure_session_budget(pipeline, rows, canvas)
    except torch.cuda.OutOfMemoryError as exc:
        raise ConfigError(
            f"the warm-up of batching.max_batch_rows={rows} rows ran out of device memory; lower it ({exc})"
        ) from exc
    log(f"{split.describe()} (warm-up: {rows} rows at {canvas[0]}x{canvas[1]})")
    if split.budget < one:
        raise ConfigError(
            f"sessions.max_bytes=auto leaves {split.budget / 2**30:.2f} GiB for sessions on {pipeline.device}, less "
            f"than one session's {one / 2**30:.2f} GiB ({split.describe()}); lower batching.max_batch_rows "
            f"(now {rows}) or use a GPU with more memory"
        )
    return split.budget
