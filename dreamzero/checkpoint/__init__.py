"""Checkpoint I/O: one loader for the three layouts DreamZero weights come in.

| layout | what it is | module |
|---|---|---|
| `hf` | release / RLinf HF export: config.json + model.safetensors(.index.json), keys `action_head.*` | `hf` |
| `full_weights` | training-side `full_weights.pt` state dict (flat or nested), no config | `full_weights` |
| `diffusers` | sglang's `-Diffusers` component folders under model_index.json | `diffusers` |

`load_model(path, layout=None, config=None, ...)` detects the layout (`detect_layout`), checks every name and shape
against the model the config describes (missing / unexpected / misshaped tensors are named) before reading tensor
data, then streams tensor by tensor into a model built on the meta device. Writers exist for each layout
(`save_model`, `save_full_weights`, `save_diffusers`). The tokenizer is never part of a release checkpoint: it comes
from a local `google/umt5-xxl` copy (`dreamzero.model.tokenizer.resolve_tokenizer_path`). `model_nbytes` (`size`) sums
the bytes a config's model holds once loaded (every layout), `checkpoint_nbytes` an HF checkpoint's from its headers.
"""

from dreamzero.checkpoint.diffusers import MODEL_INDEX_FILE, read_diffusers_config, save_diffusers
from dreamzero.checkpoint.files import normalize_key, read_safetensors_header
from dreamzero.checkpoint.full_weights import FULL_WEIGHTS_FILE, save_full_weights
from dreamzero.checkpoint.hf import (
    CONFIG_FILE,
    DEFAULT_SHARD_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    load_dit,
    read_config,
    read_weight_map,
    release_value,
    save_model,
)
from dreamzero.checkpoint.loader import LAYOUTS, detect_layout, load_model
from dreamzero.checkpoint.size import checkpoint_nbytes, model_nbytes
from dreamzero.checkpoint.stream import check_layout
from dreamzero.model.release import RELEASE_PREFIX, ReleaseTensor

_release_value = release_value  # older name, still used by the encoder reference tests

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_SHARD_BYTES",
    "FULL_WEIGHTS_FILE",
    "INDEX_FILE",
    "LAYOUTS",
    "MODEL_INDEX_FILE",
    "RELEASE_PREFIX",
    "SINGLE_FILE",
    "ReleaseTensor",
    "check_layout",
    "checkpoint_nbytes",
    "model_nbytes",
    "detect_layout",
    "load_dit",
    "load_model",
    "normalize_key",
    "read_config",
    "read_diffusers_config",
    "read_safetensors_header",
    "read_weight_map",
    "release_value",
    "save_diffusers",
    "save_full_weights",
    "save_model",
]
