"""How many bytes a checkpoint's tensors take once loaded, read from the safetensors headers of the HF layout."""

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
