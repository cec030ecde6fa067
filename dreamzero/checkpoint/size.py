"""How many bytes a model takes once loaded: from a config (every layout: `model_nbytes`), or from the safetensors
headers of an HF-layout checkpoint (`checkpoint_nbytes`)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from dreamzero.checkpoint.files import SAFETENSORS_DTYPE_BYTES, read_safetensors_header
from dreamzero.checkpoint.hf import read_weight_map

_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def checkpoint_nbytes(model_path: str | os.PathLike, dtype: torch.dtype) -> int:
    """Bytes the checkpoint's tensors take once loaded at `dtype` (floating tensors are cast, the others keep their
    type), summed from the safetensors headers: nothing is read beyond them."""
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


def model_nbytes(config, dtype: torch.dtype) -> int:
    """Bytes the networks of `config` (a DreamZeroConfig) hold once loaded at `dtype`: floating tensors in `dtype`,
    the others in their own type, shared tensors once. Built on the meta device: nothing is allocated or read, so
    it is the same for the HF, full_weights and Diffusers layouts of one model."""
    from dreamzero.model.dreamzero import DreamZeroModel

    model = DreamZeroModel.from_config(config, device="meta")
    element = torch.empty((), dtype=dtype).element_size()
    tensors = list(model.parameters()) + list(model.buffers())  # both iterators skip tensors already seen
    return sum(t.numel() * (element if t.is_floating_point() else t.element_size()) for t in tensors)
