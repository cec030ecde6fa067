"""Device memory for sessions (docs/model.md, "Memory and admission"): the byte budget and the rows per model call.

`sessions.max_bytes: auto` takes the warm-up peak of the largest batch the server admits (`warmup_batch` at
`warmup_canvas_hw`) from the device-memory probe (`dreamzero.device_memory`: measured on CUDA, the accounting's
figure on a declared device), then splits the free memory between that batch's activations, the KV cache copies a
batch makes while it runs, a margin and the sessions (`split_budget`, `measure_session_budget`,
`resolve_session_budget`). `batching.max_batch_rows: auto` picks the largest batch of full-window sessions whose
warm-up and sessions fit that way (`choose_batch_rows`); `resolve_serving_memory` settles both for a replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dreamzero.device import simulated_gpu_bytes
from dreamzero.device_memory import CudaMemory, DeclaredMemory, MemoryProbe, module_nbytes
from dreamzero.errors import ConfigError
from dreamzero.memory_fit import activation_estimate, canvas_for, fit_rows, kv_transient, margin_bytes
from dreamzero.sizes import parse_bytes
from dreamzero.types import ModelBatch

__all__ = [
    "activation_estimate",
    "canvas_for",
    "margin_bytes",
]  # re-exported: the arithmetic lives in dreamzero.memory_fit, shared with the planner

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


#: `batching.max_batch_rows: auto` where no device memory bounds a batch (plain CPU serving): enough rows for the
#: evaluation clients' usual 8-16 environments per request, and concurrent robots; set a number for larger requests
CPU_AUTO_ROWS = 32
#: how often `auto` rows are lowered and measured again when a warm-up shows the first choice does not fit
AUTO_ROWS_TRIES = 4


def split_budget(
    free: int,
    activation_peak: int,
    rows: int,
    kv_peak_per_session: int,
    total: int,
    num_layers: int,
    margin_fraction: float = 0.05,
) -> SessionBudget:
    """The session budget from measured numbers (the batch cache copies by `kv_transient`)."""
    transient = kv_transient(rows, kv_peak_per_session, num_layers)
    margin = margin_bytes(total, margin_fraction)
    budget = free - activation_peak - transient - margin
    return SessionBudget(free, activation_peak, transient, margin, budget)


def warmup_canvas_hw(pipeline: DreamZeroPipeline) -> tuple[int, int]:
    """The frame size a warm-up sends: the model's input size when it resizes, else the canvas whose latent grid gives
    `frame_seqlen` tokens, the factorisation closest to the 1:2 canvases of the shipped embodiments (DROID 352x640)."""
    return canvas_for(pipeline.dit_cfg, pipeline.config, getattr(pipeline.model.vae, "spatial_factor", 8))


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


def device_weight_bytes(model) -> int:
    """Bytes of the model's weights on the serving device: all of them but the components its placement keeps in host
    memory (`model.placement`, set by the loader; fp8 weights count one byte each)."""
    total = module_nbytes(model)
    placement = getattr(model, "placement", None)
    for name in ("text_encoder", "image_encoder"):
        module = getattr(model, name, None)
        if placement is not None and module is not None and getattr(placement, name) != "gpu":
            total -= module_nbytes(module)
    return total


def offload_transient(pipeline: DreamZeroPipeline) -> int:
    """Device bytes an offloaded text encoder holds while it encodes (two blocks), 0 for any other placement."""
    from dreamzero.placement import text_encoder_cost

    placement = getattr(pipeline.model, "placement", None)
    if placement is None or placement.text_encoder != "offload" or getattr(pipeline.model, "config", None) is None:
        return 0
    return int(text_encoder_cost(pipeline.model.config, "offload", dtype=pipeline.dtype)["device_transient_bytes"])


def memory_probe(pipeline: DreamZeroPipeline) -> MemoryProbe | None:
    """The probe of the pipeline's device: CUDA's, a declared capacity when this CPU simulates a GPU
    ($DREAMZERO_SIMULATED_GPU), else None (plain CPU serving: no device memory to fit)."""
    if pipeline.device.type == "cuda":
        return CudaMemory(pipeline.device)
    capacity = simulated_gpu_bytes()
    if capacity is None:
        return None
    weights = device_weight_bytes(pipeline.model)
    return DeclaredMemory(
        capacity, lambda: weights + pipeline.store.nbytes(), f"simulated GPU of {capacity / 2**30:.3g} GiB"
    )


def accounted_warmup_peak(pipeline: DreamZeroPipeline, rows: int, canvas_hw) -> int:
    """The peak of a `rows`-row warm-up (a restart chunk, then a continuing one) above what was allocated before it,
    by the accounting: the rows' sessions after the continuing chunk, the cache copies the batch makes and the DiT
    forward's activations."""
    fp = pipeline.footprint(pipeline.canvas_hw(canvas_hw))
    second = min(1, len(fp.by_chunk) - 1)
    kv = fp.parts[second]["kv_cache"]
    element_size = torch.empty((), dtype=pipeline.dtype).element_size()
    act = activation_estimate(pipeline.dit_cfg, pipeline.config, rows, element_size)
    return rows * fp.by_chunk[second] + kv_transient(rows, kv, pipeline.dit_cfg.num_layers) + act


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
    split = split_budget(int(free), int(peak), rows, kv_peak, int(total), pipeline.dit_cfg.num_layers, margin_fraction)
    extra = offload_transient(pipeline)
    return SessionBudget(
        split.free, split.activation_peak + extra, split.kv_transient, split.margin, split.budget - extra
    )


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
    layers = pipeline.dit_cfg.num_layers
    before = split_budget(int(free), 0, rows, kv_peak, int(total), layers)  # the warm-up itself must not OOM
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
    # device); the planner's arithmetic then fits the rows with their copies and their own sessions
    second = fp.by_chunk[min(1, len(fp.by_chunk) - 1)]
    layers = pipeline.dit_cfg.num_layers
    activation = max(0, warmup_peak(pipeline, 1, canvas, probe) - second - kv_transient(1, kv, layers))
    cap = min(max_sessions, max_bytes // one) if isinstance(max_bytes, int) else max_sessions
    fit = fit_rows(int(free), int(total), one, kv, activation, layers, max(1, cap), None, offload_transient(pipeline))
    if fit is None:
        raise ConfigError(
            f"batching.max_batch_rows=auto: not one full-window session fits {probe.name} ({free / 2**30:.1f} GiB "
            f"free after loading; one row needs {(one + activation) / 2**30:.2f} GiB and a margin of "
            f"{margin_bytes(total) / 2**30:.1f} GiB); run `dreamzero-plan` for a placement or precision that fits"
        )
    rows = fit.rows
    return int(min(rows, max_sessions))


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
