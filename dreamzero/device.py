"""Pick the device and dtype: CUDA + bf16 when a GPU is present, else CPU + fp32; overridable by argument or env.

Precedence: explicit argument > $DREAMZERO_DEVICE / $DREAMZERO_DTYPE > automatic choice.

Also the Ray-free checks a server runs before it loads anything (`check_serving_device`) and the arithmetic of the
session byte budget (`parse_bytes`, `split_budget`; docs/model.md, "Memory and admission").
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from dreamzero.errors import ConfigError

DEVICE_ENV = "DREAMZERO_DEVICE"
DTYPE_ENV = "DREAMZERO_DTYPE"

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(value: str | torch.dtype, source: str = "dtype") -> torch.dtype:
    """'bf16' / 'bfloat16' / 'fp16' / 'fp32' / ... or a torch floating dtype."""
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ConfigError(f"{source} must be a floating-point dtype, got {value}")
        return value
    key = str(value).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ConfigError(f"{source}={value!r} is not a known dtype; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def parse_device(value: str | torch.device, source: str = "device") -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or a torch.device; CUDA must actually be available."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{source}={value!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{source}={value!r}: only 'cpu' and 'cuda[:N]' are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{source}={value!r} but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{source}={value!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def select_device(
    device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) from the arguments, then the environment, then what the machine has."""
    if device is not None:
        dev = parse_device(device, "device")
    elif os.environ.get(DEVICE_ENV):
        dev = parse_device(os.environ[DEVICE_ENV], f"${DEVICE_ENV}")
    else:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is not None:
        dt = parse_dtype(dtype, "dtype")
    elif os.environ.get(DTYPE_ENV):
        dt = parse_dtype(os.environ[DTYPE_ENV], f"${DTYPE_ENV}")
    else:
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, dt


# ----------------------------------------------------------------------------------------------------------------------
# Fail early: checks a builder runs before any replica loads (no Ray here)
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceFacts:
    """What the serving checks need to know about the accelerator of this machine (injectable in tests)."""

    cuda: bool
    bf16: bool = False
    total_bytes: int = 0
    name: str = "cpu"


def device_facts(index: int = 0) -> DeviceFacts:
    if not torch.cuda.is_available():
        return DeviceFacts(cuda=False)
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(
        cuda=True, bf16=bool(torch.cuda.is_bf16_supported()), total_bytes=int(props.total_memory), name=props.name
    )


_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def checkpoint_nbytes(model_path: str | os.PathLike, dtype: torch.dtype) -> int:
    """Bytes the checkpoint's tensors take once loaded at `dtype` (floating tensors are cast, the others keep their
    type), summed from the safetensors headers: nothing is read beyond them."""
    from dreamzero.checkpoint.files import SAFETENSORS_DTYPE_BYTES, read_safetensors_header
    from dreamzero.checkpoint.hf import read_weight_map

    root = Path(model_path)
    total = 0
    for shard in sorted(set(read_weight_map(root).values())):
        for code, shape in read_safetensors_header(root / shard).values():
            size = (
                torch.empty((), dtype=dtype).element_size()
                if code in _FLOAT_CODES
                else SAFETENSORS_DTYPE_BYTES.get(code, 1)
            )
            total += math.prod(shape) * size
    return total


def check_serving_device(
    num_gpus: float,
    device: str,
    dtype: str | torch.dtype | None,
    model_path: str | os.PathLike | None = None,
    facts: DeviceFacts | None = None,
) -> None:
    """Raise ConfigError for a GPU configuration that cannot work, before any replica loads: GPUs asked for on a
    machine without CUDA, a dtype the GPU cannot run, or a checkpoint larger than the GPU's memory."""
    facts = facts or device_facts()
    wants_cuda = num_gpus > 0 or str(device).startswith("cuda")
    if not wants_cuda:
        return
    if not facts.cuda:
        raise ConfigError(
            f"policy.num_gpus={num_gpus} (device {device!r}) but CUDA is not available on this machine "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); set policy.num_gpus: 0 for CPU serving"
        )
    dt = parse_dtype(dtype, "dtype") if dtype is not None else torch.bfloat16
    if dt == torch.bfloat16 and not facts.bf16:
        raise ConfigError(f"dtype bfloat16 is not supported by {facts.name}; set dtype: float16 or float32")
    if model_path is not None and facts.total_bytes:
        need = checkpoint_nbytes(model_path, dt)
        if need > facts.total_bytes:
            raise ConfigError(
                f"model_path {str(model_path)!r} holds {need / 2**30:.1f} GiB of weights at {dt}, more than the "
                f"{facts.total_bytes / 2**30:.1f} GiB of {facts.name}; use a smaller model or a GPU with more memory"
            )


# ----------------------------------------------------------------------------------------------------------------------
# The session byte budget (docs/model.md, "Memory and admission")
# ----------------------------------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(value: int | float | str | None, field: str = "sessions.max_bytes") -> int | str | None:
    """None, "auto", a byte count, or a string like "40GiB" / "512 MB" -> None | "auto" | int > 0."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None if value is None else "auto"
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r}: give bytes (e.g. 40GiB) or auto")
    if isinstance(value, (int, float)):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{field}={value!r} is not a size; use bytes, e.g. 40GiB, 512MiB, 8e9, or auto")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n <= 0 or n != n:
        raise ConfigError(f"{field}={value!r} must be > 0")
    return int(n)


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


def warmup_canvas_hw(pipeline) -> tuple[int, int]:
    """The frame size a warm-up sends: the model's input size when it resizes, else the canvas whose latent grid gives
    `frame_seqlen` tokens, the factorisation closest to the 1:2 canvases of the shipped embodiments (DROID 352x640)."""
    if pipeline.config.model_input_hw is not None:
        return tuple(pipeline.config.model_input_hw)
    cfg = pipeline.dit_cfg
    sf = getattr(pipeline.model.vae, "spatial_factor", 8)
    pairs = [(a, cfg.frame_seqlen // a) for a in range(1, cfg.frame_seqlen + 1) if cfg.frame_seqlen % a == 0]
    gh, gw = min(pairs, key=lambda p: abs(math.log(p[1] / p[0]) - math.log(2)))
    return gh * cfg.patch_size[1] * sf, gw * cfg.patch_size[2] * sf


def warmup_batch(pipeline, rows: int, canvas_hw: tuple[int, int], step: int = 0):
    """`rows` sessions `warmup-i`, 4 new frames each (the continuing-call shape), deterministic content."""
    import numpy as np

    from dreamzero.types import ModelBatch

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


def measure_session_budget(pipeline, rows: int, canvas_hw=None, margin_fraction: float = 0.05) -> SessionBudget:
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


def resolve_session_budget(spec, pipeline, rows: int, log=print) -> int | None:
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
