"""Layout "full_weights": a `full_weights.pt` torch state dict of the whole training-side policy.

RLinf's FSDP trainer writes the full policy state dict (keys `action_head.*`, the release names) either flat or
nested (`fsdp_checkpoint.model` after a DCP conversion; `state_dict`, `model_state_dict`, `model`, `module` from
other savers), sometimes with wrapper names left in the keys: `_orig_mod.` (torch.compile), a leading `module.`
(DDP / FSDP) or a `.base_layer.` infix (PEFT). FSDP also promotes 0-d parameters to shape [1] (CLIP's `log_scale`).
No config is stored: a preset (or a `config.json` beside the file) supplies it.

Only tensors and plain containers are ever unpickled (`weights_only=True`): a file holding any other object is
refused. Names and shapes are read on the meta device first; the values are then streamed from a memory map.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dreamzero.checkpoint.files import list_names, normalized_names
from dreamzero.errors import CheckpointError

FULL_WEIGHTS_FILE = "full_weights.pt"
#: where trainers nest the state dict, tried in this order after the flat form
NESTINGS = (("fsdp_checkpoint", "model"), ("state_dict",), ("model_state_dict",), ("model",), ("module",))


def _torch_load(path: Path, **kwargs):
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain containers; refusing to unpickle them "
            f"(only weights_only loading is allowed): {exc}"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable torch state dict: {exc}") from exc


def _find_state_dict(obj, path: Path) -> tuple[tuple[str, ...], dict]:
    """(nesting, the dict of name -> tensor) inside what torch.load returned."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} must hold a dict (a state dict), got {type(obj).__name__}")
    for nesting in ((), *NESTINGS):
        node = obj
        for part in nesting:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node and all(isinstance(v, torch.Tensor) for v in node.values()):
            return nesting, node
    tried = ", ".join(".".join(n) for n in NESTINGS)
    odd = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    raise CheckpointError(
        f"{path} holds no state dict of tensors: not flat (non-tensor entries: {list_names(map(str, odd))}) "
        f"and none under {tried}"
    )


@dataclass
class FullWeightsSource:
    """The tensors of one full_weights.pt under their normalised names."""

    path: Path

    def __post_init__(self):
        self.where = f"full weights {self.path}"
        nesting, state = _find_state_dict(_torch_load(self.path, map_location="meta"), self.path)
        self.nesting = nesting
        self.keys = normalized_names(state, str(self.path))  # normalised name -> key in the file
        self._shapes = {name: tuple(state[key].shape) for name, key in self.keys.items()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, names: Iterable[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        obj = _torch_load(self.path, map_location="cpu", mmap=True)
        state = obj
        for part in self.nesting:
            state = state[part]
        for name in names:
            yield name, state[self.keys[name]]


def save_full_weights(model, path: str | os.PathLike) -> Path:
    """Write `model` as a flat full_weights.pt (release names, as RLinf's trainer saves the policy)."""
    from dreamzero.checkpoint.hf import release_value, values_of

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = model.release_tensors()
    by_name = values_of(model, tensors)
    torch.save({rt.name: release_value(rt, by_name) for rt in tensors}, path)
    return path
