"""The device-memory probe: what admission asks the device (free and total bytes, the peak of a warm-up).

`sessions.max_bytes: auto` and `batching.max_batch_rows: auto` go through this one interface on every machine:
- `CudaMemory`: the CUDA allocator's own figures (`mem_get_info`, peak allocated since a reset);
- `DeclaredMemory`: a declared capacity with the project's byte accounting standing in for the allocator (weights,
  what the sessions hold, the cache copies a batch makes and an activation estimate per forward). A CPU uses it when
  it simulates a GPU (`DREAMZERO_SIMULATED_GPU=141GiB`, the rehearsal of the GPU path); tests inject it.
What only a real GPU shows: the allocator's fragmentation and its real activation peak (docs/model.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class MemoryProbe(Protocol):
    name: str

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device now."""

    measures: bool  # True: warm-ups run and their peak is read from the allocator; False: the accounting's figure

    def start_peak(self) -> None:
        """Begin a measurement: the peak is counted above what is allocated now."""

    def peak_since_start(self) -> int:
        """Most bytes allocated above the start since `start_peak`."""

    def release_cache(self) -> None:
        """Hand cached, unused blocks back (before free memory is read)."""


class CudaMemory:
    measures = True

    def __init__(self, device: torch.device):
        self.device = device
        self.name = torch.cuda.get_device_name(device)
        self._base = 0

    def mem_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def start_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self._base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_since_start(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - self._base)

    def release_cache(self) -> None:
        torch.cuda.empty_cache()


class DeclaredMemory:
    """`capacity` bytes, of which `allocated()` are in use (the caller's accounting: weights + sessions). Warm-ups are
    not run against it: their peak is the accounting's (`dreamzero.pipeline.budget.accounted_warmup_peak`), so a
    CPU rehearses the sizing of a 128-row batch without computing one."""

    measures = False

    def __init__(self, capacity: int, allocated: Callable[[], int], name: str | None = None):
        self.capacity, self.allocated = int(capacity), allocated
        self.name = name or f"declared {capacity / 2**30:.3g} GiB device"

    def mem_info(self) -> tuple[int, int]:
        return max(0, self.capacity - self.allocated()), self.capacity

    def start_peak(self) -> None:
        pass

    def peak_since_start(self) -> int:
        return 0

    def release_cache(self) -> None:
        pass


def module_nbytes(module: torch.nn.Module) -> int:
    """Bytes a module's parameters and buffers hold."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
