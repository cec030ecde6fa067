"""Device memory for sessions (docs/model.md, "Memory and admission"): the byte budget and the rows per model call.

`sessions.max_bytes: auto` takes the warm-up peak of the largest batch the server admits (`warmup_batch` at
`warmup_canvas_hw`) from the device-memory probe (`dreamzero.device_memory`: measured on CUDA, the accounting's
figure on a declared device), then splits the free memory between that batch's activations, the KV cache copies a
batch makes while it runs, a margin and the sessions (`split_budget`, `measure_session_budget`,
`resolve_session_budget`). `batching.max_batch_rows: auto` picks the largest batch of full-window sessions whose
warm-up and sessions fit that way (`choose_batch_rows`); `resolve_serving_memory` settles both for a replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dreamzero.device import simulated_gpu_bytes
from dreamzero.device_memory import CudaMemory, DeclaredMemory, MemoryProbe, module_nbytes
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


#: `batching.max_batch_rows: auto` where no device memory bounds a batch (plain CPU serving): enough rows for the
#: evaluation clients' usual 8-16 environments per request, and concurrent robots; set a number for larger requests
CPU_AUTO_ROWS = 32
#: how often `auto` rows are lowered and measured again when a warm-up shows the first choice does not fit
AUTO_ROWS_TRIES = 4


def margin_bytes(total: int, margin_fraction: float = 0.05) -> int:
    """Fragmentation and allocator slack kept free: 5 % of the device, at least 1 GiB on devices over 8 GiB."""
    return max(int(margin_fraction * total), 1 << 30 if total > 8 << 30 else 0)


def kv_copies(rows: int) -> int:
    return KV_COPIES_MULTI_ROW if rows > 1 else KV_COPIES_ONE_ROW


def split_budget(
    free: int, activation_peak: int, rows: int, kv_peak_per_session: int, total: int, margin_fraction: float = 0.05
) -> SessionBudget:
    """The session budget from measured numbers; ConfigError when nothing is left for one session."""
    transient = kv_copies(rows) * rows * kv_peak_per_session
    margin = margin_bytes(total, margin_fraction)
    budget = free - activation_peak - transient - margin
    return SessionBudget(free, activation_peak, transient, margin, budget)


def warmup_canvas_hw(pipeline: DreamZeroPipeline) -> tuple[int, int]:
    """The frame size a warm-up sends: the model's input size when it resizes, else the canvas whose latent grid gives
    `frame_seqlen` tokens, the factorisation closest to the 1:2 canvases of the shipped embodiments (DROID 352x640)."""
    return canvas_for(pipeline.dit_cfg, pipeline.config, getattr(pipeline.model.vae, "spatial_factor", 8))


def canvas_for(cfg, pipeline_cfg, sf: int) -> tuple[int, int]:
    """`warmup_canvas_hw` from the configs alone (DiTConfig, PipelineConfig, the VAE's spatial factor)."""
    if pipeline_cfg.model_input_hw is not None:
        return tuple(pipeline_cfg.model_input_hw)
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


def memory_probe(pipeline: DreamZeroPipeline) -> MemoryProbe | None:
    """The probe of the pipeline's device: CUDA's, a declared capacity when this CPU simulates a GPU
    ($DREAMZERO_SIMULATED_GPU), else None (plain CPU serving: no device memory to fit)."""
    if pipeline.device.type == "cuda":
        return CudaMemory(pipeline.device)
    capacity = simulated_gpu_bytes()
    if capacity is None:
        return None
    weights = module_nbytes(pipeline.model)
    return DeclaredMemory(
        capacity, lambda: weights + pipeline.store.nbytes(), f"simulated GPU of {capacity / 2**30:.3g} GiB"
    )


def activation_estimate(dit, pipeline_cfg, rows: int, element_size: int) -> int:
    """Bytes a DiT forward of `rows` sessions holds while it runs, by the accounting (what the declared device counts
    for a warm-up; CUDA measures it): per CFG row and query token the hidden states, q / k / v, attention output,
    residual and modulation copies (~8 x dim) and the FFN's hidden layer; the keys and values over the cache plus the
    new tokens; the cross-attention keys and values of the text and image context."""
    branches = 1 if pipeline_cfg.cfg_scale == 1.0 else 2
    tokens = dit.num_frame_per_block * dit.frame_seqlen + dit.num_action_per_block + dit.num_state_per_block
    kv_tokens = dit.max_attention_frames * dit.frame_seqlen + tokens
    context = dit.text_len + (257 if dit.has_image_input else 0)
    per_row = tokens * (8 * dit.dim + dit.ffn_dim) + 2 * kv_tokens * dit.dim + 2 * context * dit.dim
    return rows * branches * per_row * element_size


def accounted_warmup_peak(pipeline: DreamZeroPipeline, rows: int, canvas_hw) -> int:
    """The peak of a `rows`-row warm-up (a restart chunk, then a continuing one) above what was allocated before it,
    by the accounting: the rows' sessions after the continuing chunk, the cache copies the batch makes and the DiT
    forward's activations."""
    fp = pipeline.footprint(pipeline.canvas_hw(canvas_hw))
    second = min(1, len(fp.by_chunk) - 1)
    kv = fp.parts[second]["kv_cache"]
    element_size = torch.empty((), dtype=pipeline.dtype).element_size()
    act = activation_estimate(pipeline.dit_cfg, pipeline.config, rows, element_size)
    return rows * fp.by_chunk[second] + kv_copies(rows) * rows * kv + act


def warmup_peak(pipeline: DreamZeroPipeline, rows: int, canvas_hw, probe: MemoryProbe) -> int:
    """Run `rows` fresh sessions through a restart and a continuing chunk and read the peak from the probe (CUDA);
    a declared device gives the accounting's figure instead, without running anything. The warm-up's sessions are
    dropped and its restarts are not counted as any client's."""
    canvas_hw = tuple(canvas_hw)
    if not probe.measures:
        return accounted_warmup_peak(pipeline, rows, canvas_hw)
    limit, pipeline.store.max_bytes = pipeline.store.max_bytes, None  # the warm-up itself is not admitted
    ids = [f"warmup-{i}" for i in range(rows)]
    try:
        probe.start_peak()
        for step in range(2):  # restart chunk, then a continuing one (stacked caches, observed-block prefill)
            pipeline.generate(warmup_batch(pipeline, rows, canvas_hw, step))
        return probe.peak_since_start()
    finally:
        pipeline.drop_sessions(ids)
        pipeline.store.restarts.clear()  # the warm-up's starts are no client's
        pipeline.store.max_bytes = limit
        probe.release_cache()


def measure_session_budget(
    pipeline: DreamZeroPipeline, rows: int, canvas_hw=None, margin_fraction: float = 0.05, probe=None
) -> SessionBudget:
    """The warm-up peak of `rows` sessions (the largest batch the server admits) from the probe, then the free device
    memory split between activations and sessions (`split_budget`). ConfigError on a device without a probe."""
    probe = probe or memory_probe(pipeline)
    if probe is None:
        raise ConfigError(
            "measuring the session budget needs a GPU (or a simulated one); on CPU set sessions.max_bytes or leave "
            "it auto"
        )
    canvas_hw = tuple(canvas_hw or warmup_canvas_hw(pipeline))
    peak = warmup_peak(pipeline, rows, canvas_hw, probe)
    free, total = probe.mem_info()
    parts = pipeline.footprint(pipeline.canvas_hw(canvas_hw)).parts
    kv_peak = max(p["kv_cache"] for p in parts)
    return split_budget(int(free), int(peak), rows, kv_peak, int(total), margin_fraction)


def resolve_session_budget(spec, pipeline: DreamZeroPipeline, rows: int, log=print, probe=None) -> int | None:
    """`sessions.max_bytes` -> the store's byte budget: bytes as given; `auto` from the probe
    (`measure_session_budget` with the largest batch) and no limit without one (plain CPU); None no limit.
    ConfigError when a device's budget holds no session."""
    value = parse_bytes(spec)
    if value != "auto":
        return value
    probe = probe or memory_probe(pipeline)
    if probe is None:
        return None
    canvas = warmup_canvas_hw(pipeline)
    footprint = pipeline.footprint(pipeline.canvas_hw(canvas))
    one, kv_peak = footprint.peak, max(p["kv_cache"] for p in footprint.parts)
    free, total = probe.mem_info()
    before = split_budget(int(free), 0, rows, kv_peak, int(total))  # the warm-up itself must not be what OOMs
    if before.budget < rows * one:
        raise ConfigError(
            f"batching.max_batch_rows={rows}: a batch of {rows} full-window sessions needs "
            f"{before.kv_transient / 2**30:.1f} GiB of cache copies plus {rows * one / 2**30:.1f} GiB of sessions, "
            f"more than the {free / 2**30:.1f} GiB free on {probe.name} after loading; lower it or set it to auto"
        )
    try:
        split = measure_session_budget(pipeline, rows, canvas, probe=probe)
    except torch.cuda.OutOfMemoryError as exc:
        raise ConfigError(
            f"the warm-up of batching.max_batch_rows={rows} rows ran out of device memory; lower it ({exc})"
        ) from exc
    log(f"{split.describe()} (warm-up: {rows} rows at {canvas[0]}x{canvas[1]}, {probe.name})")
    if split.budget < one:
        raise ConfigError(
            f"sessions.max_bytes=auto leaves {split.budget / 2**30:.2f} GiB for sessions on {probe.name}, less "
            f"than one session's {one / 2**30:.2f} GiB ({split.describe()}); lower batching.max_batch_rows "
            f"(now {rows}) or use a GPU with more memory"
        )
    return split.budget


def choose_batch_rows(pipeline: DreamZeroPipeline, max_sessions: int, max_bytes, probe, log=print) -> int:
    """`batching.max_batch_rows: auto`: the largest batch of full-window sessions that fits the device with its
    warm-up (activations, cache copies, margin) and its own sessions in the budget; capped by `max_sessions` and by
    an explicit `sessions.max_bytes`. Without a probe (plain CPU) `CPU_AUTO_ROWS`."""
    if probe is None:
        return min(CPU_AUTO_ROWS, max_sessions)
    canvas = warmup_canvas_hw(pipeline)
    fp = pipeline.footprint(pipeline.canvas_hw(canvas))
    one, kv = fp.peak, max(p["kv_cache"] for p in fp.parts)
    free, total = probe.mem_info()
    # a 1-row warm-up gives the activations per row (they grow with the rows; the accounting says so for a declared
    # device); a batch of R rows then needs R x (its activations, its warm-up sessions, its copies counted twice as
    # split_budget does, and the R sessions the budget must hold)
    second = fp.by_chunk[min(1, len(fp.by_chunk) - 1)]
    activation = max(0, warmup_peak(pipeline, 1, canvas, probe) - second - KV_COPIES_ONE_ROW * kv)
    per_row = activation + second + 2 * KV_COPIES_MULTI_ROW * kv + one
    rows = (free - margin_bytes(total)) // per_row
    if isinstance(max_bytes, int):
        rows = min(rows, max_bytes // one)
    if rows < 1:
        raise ConfigError(
            f"batching.max_batch_rows=auto: not one full-window session fits {probe.name} ({free / 2**30:.1f} GiB "
            f"free after loading; one row needs {per_row / 2**30:.2f} GiB); use a smaller model or a larger GPU"
        )
    return int(min(rows, max_sessions))


def check_fit(facts, weights: int, footprint, rows, max_bytes, rows_field: str | None = None) -> None:
    """At `serve run`, before any replica loads (`facts`: the GPU's `DeviceFacts`, `weights`: bytes loaded,
    `footprint`: a session's at the warm-up canvas): ConfigError saying what to change when the weights alone, the
    weights plus a batch of `rows` full-window sessions (a number; `auto` / null must hold at least one) with the
    cache copies the batch makes and the margin, or an explicit `max_bytes` cannot fit the device. `rows_field`: how
    the message names the rows (default `batching.max_batch_rows=<rows>`)."""
    total, name, g = facts.total_bytes, facts.name, 2**30
    if not total:
        return
    if weights > total:
        raise ConfigError(
            f"model_path: the model holds {weights / g:.1f} GiB of weights at this dtype, more than the "
            f"{total / g:.1f} GiB of {name}; use a smaller model or a GPU with more memory"
        )
    one, kv = footprint.peak, max(p["kv_cache"] for p in footprint.parts)
    n = rows if isinstance(rows, int) else 1
    sessions, copies, margin = n * one, kv_copies(n) * n * kv, margin_bytes(total)
    if weights + sessions + copies + margin > total:
        field = (rows_field or f"batching.max_batch_rows={rows}") if isinstance(rows, int) else "model_path"
        fix = "lower it or set it to auto" if isinstance(rows, int) else "use a GPU with more memory"
        raise ConfigError(
            f"{field}: {weights / g:.1f} GiB of weights + {n} full-window session(s) {sessions / g:.1f} GiB + their "
            f"batch cache copies {copies / g:.1f} GiB + margin {margin / g:.1f} GiB exceed the {total / g:.1f} GiB "
            f"of {name}; {fix}"
        )
    if isinstance(max_bytes, int):
        if weights + max_bytes + margin > total:
            raise ConfigError(
                f"sessions.max_bytes={max_bytes / g:.1f} GiB + {weights / g:.1f} GiB of weights + margin "
                f"{margin / g:.1f} GiB exceed the {total / g:.1f} GiB of {name}; lower it or set it to auto"
            )
        if max_bytes < n * one:
            raise ConfigError(
                f"sessions.max_bytes={max_bytes / g:.2f} GiB holds {max_bytes // one} full-window session(s) of "
                f"{one / g:.2f} GiB, fewer than one batch of {n}; raise it, lower batching.max_batch_rows or use auto"
            )


@dataclass(frozen=True)
class ServingMemory:
    """What a Policy replica settled at start: rows per model call and the session byte budget."""

    rows: int
    budget: int | None  # None: no byte limit (plain CPU)
    device: str | None  # the probe's name; None: no device memory to fit
    total_bytes: int | None

    def as_dict(self) -> dict:
        return {"rows": self.rows, "budget_bytes": self.budget, "device": self.device, "total_bytes": self.total_bytes}


def resolve_serving_memory(
    pipeline: DreamZeroPipeline, rows_spec, bytes_spec, max_sessions: int, log=print, probe=None
) -> ServingMemory:
    """`batching.max_batch_rows` (a number, `auto`, or None = `max_sessions`) and `sessions.max_bytes` for this
    replica's device. With `auto` rows a first choice whose measured budget holds fewer sessions than one batch is
    lowered and measured again (at most `AUTO_ROWS_TRIES` times); a warm-up out of memory halves it."""
    probe = probe if probe is not None else memory_probe(pipeline)
    total = probe.mem_info()[1] if probe is not None else None
    name = probe.name if probe is not None else None
    if rows_spec != "auto":
        rows = int(rows_spec or max_sessions)
        return ServingMemory(rows, resolve_session_budget(bytes_spec, pipeline, rows, log, probe), name, total)
    rows = choose_batch_rows(pipeline, max_sessions, parse_bytes(bytes_spec), probe, log)
    if probe is None:
        log(f"batching.max_batch_rows=auto: {rows} rows (no device memory to fit)")
        return ServingMemory(rows, resolve_session_budget(bytes_spec, pipeline, rows, log, probe), name, total)
    one = pipeline.footprint(pipeline.canvas_hw(warmup_canvas_hw(pipeline))).peak
    for _ in range(AUTO_ROWS_TRIES):
        try:
            budget = resolve_session_budget(bytes_spec, pipeline, rows, log, probe)
        except ConfigError:
            if rows == 1:
                raise
            rows = max(1, rows // 2)
            continue
        if budget is None or budget >= rows * one or rows == 1:
            log(f"batching.max_batch_rows=auto: {rows} rows of full-window sessions on {name}")
            return ServingMemory(rows, budget, name, total)
        rows = max(1, min(rows - 1, budget // one))
    raise ConfigError(
        f"batching.max_batch_rows=auto found no batch size whose sessions fit the budget on {name} after "
        f"{AUTO_ROWS_TRIES} tries; set batching.max_batch_rows to a number"
    )
