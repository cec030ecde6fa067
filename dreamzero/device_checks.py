"""Fail early: the checks a builder runs before any replica loads (no Ray here): GPUs asked for on a machine without
CUDA, a dtype the GPU cannot run, a checkpoint larger than the GPU's memory."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dreamzero.checkpoint.size import checkpoint_nbytes
from dreamzero.device import parse_dtype, simulated_gpu_bytes
from dreamzero.errors import ConfigError


@dataclass(frozen=True)
class DeviceFacts:
    """What the serving checks need to know about the accelerator of this machine (injectable in tests)."""

    cuda: bool
    bf16: bool = False
    total_bytes: int = 0
    name: str = "cpu"


def device_facts(index: int = 0) -> DeviceFacts:
    simulated = simulated_gpu_bytes()
    if simulated is not None:
        return DeviceFacts(
            cuda=True, bf16=True, total_bytes=simulated, name=f"simulated GPU of {simulated / 2**30:.3g} GiB"
        )
    if not torch.cuda.is_available():
        return DeviceFacts(cuda=False)
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(
        cuda=True, bf16=bool(torch.cuda.is_bf16_supported()), total_bytes=int(props.total_memory), name=props.name
    )


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
