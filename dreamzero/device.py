"""Pick the device and dtype: CUDA + bf16 when a GPU is present, else CPU + fp32; overridable by argument or env.

Precedence: explicit argument > $DREAMZERO_DEVICE / $DREAMZERO_DTYPE > automatic choice.

The checks a server runs before it loads anything live in `dreamzero.device_checks`, byte sizes in `dreamzero.sizes`
and the session byte budget in `dreamzero.pipeline.budget` (docs/model.md, "Memory and admission").
"""

from __future__ import annotations

import os

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
