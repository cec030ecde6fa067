"""Pick the device and dtype: CUDA + bf16 when a GPU is present, else CPU + fp32; overridable by argument or env.

Precedence: explicit argument > $DREAMZERO_DEVICE / $DREAMZERO_DTYPE > automatic choice.

`$DREAMZERO_SIMULATED_GPU=141GiB` makes a machine without CUDA stand in for one GPU of that size: "cuda" resolves
to the CPU (bf16 by default, as on a GPU), the fail-early checks see a bf16-capable GPU of that memory and the
session budget asks a declared-capacity probe (`dreamzero.device_memory`). It exists to rehearse the GPU path on CPU
(`scripts/gpu-check.sh --rehearse`); speed, kernels and the real allocator are what it cannot show.

The checks a server runs before it loads anything live in `dreamzero.device_checks`, byte sizes in `dreamzero.sizes`
and the session byte budget in `dreamzero.pipeline.budget` (docs/model.md, "Memory and admission").
"""

from __future__ import annotations

import os

import torch

from dreamzero.errors import ConfigError

DEVICE_ENV = "DREAMZERO_DEVICE"
DTYPE_ENV = "DREAMZERO_DTYPE"
SIMULATED_GPU_ENV = "DREAMZERO_SIMULATED_GPU"

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


def simulated_gpu_bytes() -> int | None:
    """The memory of the GPU this CPU stands in for ($DREAMZERO_SIMULATED_GPU), or None: no simulation."""
    value = os.environ.get(SIMULATED_GPU_ENV, "").strip()
    if not value or torch.cuda.is_available():  # a real GPU is never simulated away
        return None
    from dreamzero.sizes import parse_bytes

    n = parse_bytes(value, field=f"${SIMULATED_GPU_ENV}")
    if not isinstance(n, int):
        raise ConfigError(f"${SIMULATED_GPU_ENV}={value!r}: give the simulated GPU's memory, e.g. 141GiB")
    return n


def parse_device(value: str | torch.device, source: str = "device") -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or a torch.device; CUDA must actually be available (or simulated: the CPU)."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{source}={value!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{source}={value!r}: only 'cpu' and 'cuda[:N]' are supported")
    if dev.type == "cuda" and simulated_gpu_bytes() is not None:
        return torch.device("cpu")
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
        asked = str(device)
    elif os.environ.get(DEVICE_ENV):
        asked = os.environ[DEVICE_ENV]
    else:
        asked = "cuda" if torch.cuda.is_available() else "cpu"
    dev = parse_device(asked, "device" if device is not None else f"${DEVICE_ENV}")
    if dtype is not None:
        dt = parse_dtype(dtype, "dtype")
    elif os.environ.get(DTYPE_ENV):
        dt = parse_dtype(os.environ[DTYPE_ENV], f"${DTYPE_ENV}")
    else:
        dt = torch.bfloat16 if asked.startswith("cuda") else torch.float32  # a simulated GPU runs bf16 too
    return dev, dt
