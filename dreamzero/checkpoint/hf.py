"""Layout "hf": the release / RLinf HF-export directory.

`config.json` (the release DreamZero config: `action_head_cfg.config.diffusion_model_cfg` and friends; RLinf adds
`skip_component_loading: true`, which changes nothing here) and either `model.safetensors.index.json` + shards or a
single `model.safetensors`; every tensor key starts with `action_head.` (component prefixes in
`dreamzero.model.dreamzero`). `experiment_cfg/metadata.json` (normalisation statistics) is read by the serving side.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from dreamzero.checkpoint.files import normalized_names, read_json, read_safetensors_folder, read_safetensors_header
from dreamzero.checkpoint.stream import LayoutSpec, SafetensorsSource, check_layout, owners, stream_into
from dreamzero.errors import CheckpointError, ConfigError
from dreamzero.model.release import RELEASE_PREFIX, ReleaseTensor

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30


def read_config(path: str | os.PathLike):
    """DreamZeroConfig of a checkpoint directory (from its config.json)."""
    from dreamzero.config import from_checkpoint_config

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    data = read_json(path / CONFIG_FILE, "config file")
    try:
        return from_checkpoint_config(data)
    except ConfigError as exc:
        raise CheckpointError(f"{path / CONFIG_FILE}: {exc}") from exc


def read_weight_map(path: str | os.PathLike) -> dict[str, str]:
    """tensor key -> shard file name (relative to the directory); checks that every shard exists."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        return read_safetensors_folder(path, INDEX_FILE)
    if (path / SINGLE_FILE).is_file():
        return {k: SINGLE_FILE for k in read_safetensors_header(path / SINGLE_FILE)}
    raise CheckpointError(f"{path} holds neither {INDEX_FILE} (with shards) nor {SINGLE_FILE}")


def hf_source(path: Path) -> SafetensorsSource:
    """Keys with wrapper names (RLinf exports may keep PEFT's `.base_layer.`) are read under their plain names."""
    weight_map = read_weight_map(path)
    names = normalized_names(weight_map, f"checkpoint {path}")
    return SafetensorsSource(f"checkpoint {path}", {n: (path / weight_map[k], k) for n, k in names.items()})


def release_spec(model) -> LayoutSpec:
    """The release names (`action_head.*`), shared by the hf and full_weights layouts."""
    return LayoutSpec(model.release_tensors())


def load_dit(
    path: str | os.PathLike,
    config,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
):
    """Only the DiT: from a `.safetensors` file or a checkpoint directory, keys under `action_head.model.`.

    config: a DiTConfig, or the upstream `CausalWanModel` kwargs / `diffusion_model_cfg` dict. Other components'
    tensors in the file are ignored; missing / unexpected `action_head.model.*` / misshaped tensors fail.
    """
    from dreamzero.config import DiTConfig, from_checkpoint_config
    from dreamzero.device import select_device
    from dreamzero.model.dit import CausalWanDiT

    path = Path(path)
    dev, dt = select_device(device, dtype)
    if not isinstance(config, DiTConfig):
        try:
            config = from_checkpoint_config({"action_head_cfg": {"config": {"diffusion_model_cfg": config}}}).dit
        except ConfigError as exc:
            raise CheckpointError(f"DiT config: {exc}") from exc
    if path.is_dir():
        source = hf_source(path)
    elif path.is_file():
        source = SafetensorsSource(f"DiT weights {path}", {k: (path, k) for k in read_safetensors_header(path)})
    else:
        raise CheckpointError(f"{str(path)!r} is neither a checkpoint directory nor a safetensors file")
    prefix = RELEASE_PREFIX + "model."
    source.files = {k: v for k, v in source.files.items() if k.startswith(prefix)}
    with torch.device("meta"):
        dit = CausalWanDiT(config)
    tensors = dit.state_dict(keep_vars=True)
    spec = LayoutSpec([ReleaseTensor(prefix + n, (n,), tuple(t.shape)) for n, t in tensors.items()])
    found = source.shapes()
    check_layout(spec.expected, found, f"DiT weights {path}", described_by="its DiT config")
    stream_into(dit, spec, source, found, dev, dt)
    if hasattr(dit, "materialize_buffers"):
        dit.materialize_buffers(dev)
    return dit.eval().requires_grad_(False)


# -- saving ------------------------------------------------------------------------------------------------------------


def release_value(rt: ReleaseTensor, by_name: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stored value of `rt` (fused sources concatenated, reshaped to the stored shape), on the CPU."""
    parts = [by_name[s].detach() for s in rt.sources]
    value = parts[0] if len(parts) == 1 else torch.cat([p.reshape(p.shape[0], -1) for p in parts])
    return value.reshape(rt.shape).to("cpu").contiguous()


def values_of(model, tensors: list[ReleaseTensor]) -> dict[str, torch.Tensor]:
    """name -> tensor of the model's parameters; fails on a meta-device model (it holds no values)."""
    by_name, _ = owners(model)
    if any(by_name[s].is_meta for rt in tensors for s in rt.sources):
        raise CheckpointError("cannot save a model built on the meta device (it holds no values)")
    return by_name


def write_shards(
    folder: Path, tensors: list[ReleaseTensor], by_name, stem: str, index_name: str, shard_size: int
) -> dict[str, str]:
    """Write `tensors` as `{stem}-0000i-of-0000n.safetensors` shards of at most ~shard_size bytes (a tensor never
    spans two) plus the index `index_name`; only one shard's tensors are on the CPU at a time."""
    from safetensors.torch import save_file

    shards: list[list[ReleaseTensor]] = [[]]
    filled = 0
    for rt in tensors:  # plan from sizes alone, so the file names can say "-of-n"
        nbytes = math.prod(rt.shape) * by_name[rt.sources[0]].element_size()
        if shards[-1] and filled + nbytes > shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(rt)
        filled += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(shards, start=1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        data = {rt.name: release_value(rt, by_name) for rt in group}
        total += sum(t.numel() * t.element_size() for t in data.values())
        save_file(data, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in data})
        del data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return weight_map


def save_model(model, path: str | os.PathLike, shard_size: int = DEFAULT_SHARD_BYTES, save_tokenizer: bool = True):
    """Write `model` in the release layout: config.json, model.safetensors.index.json and
    `model-0000i-of-0000n.safetensors` shards of at most ~shard_size bytes (a tensor never spans two shards).
    Also writes the text encoder's tokenizer to `tokenizer/` when it has one and save_tokenizer is true."""
    from dreamzero.config import to_checkpoint_config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = model.release_tensors()
    by_name = values_of(model, tensors)
    write_shards(path, tensors, by_name, "model", INDEX_FILE, shard_size)
    (path / CONFIG_FILE).write_text(json.dumps(to_checkpoint_config(model.config), indent=2) + "\n")
    save_tokenizer_of(model, path, save_tokenizer)
    return path


def save_tokenizer_of(model, path: Path, enabled: bool = True) -> None:
    tokenizer = getattr(model.text_encoder, "tokenizer", None)
    if enabled and tokenizer is not None:
        tokenizer.save_pretrained(str(path / "tokenizer"))
