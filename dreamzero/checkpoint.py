"""Checkpoint I/O in the release HF layout.

A checkpoint directory holds `config.json` (read by `dreamzero.config.from_checkpoint_config`) and either
`model.safetensors.index.json` + shards or a single `model.safetensors`; every tensor key starts with `action_head.`
(see `dreamzero.model.dreamzero` for the component prefixes). The tokenizer is not part of release checkpoints: it
comes from a local `google/umt5-xxl` copy (`dreamzero.model.tokenizer.resolve_tokenizer_path`).

Loading validates everything it can before reading a single tensor (file list, JSON, shard headers, names, shapes),
then streams tensor by tensor into a model built on the meta device, so peak memory is one copy of the weights plus
one tensor.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dreamzero.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

RELEASE_PREFIX = "action_head."
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30
# Tensors a checkpoint may carry that a model variant does not use (5B has no CLIP, but may ship one).
_UNUSED_PREFIX_WITHOUT_IMAGE_ENCODER = RELEASE_PREFIX + "image_encoder."

_ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_ST_DTYPES.update({"F8_E4M3": 1, "F8_E5M2": 1})


@dataclass(frozen=True)
class ReleaseTensor:
    """One tensor of the release layout and where it lives in our modules.

    name: key in the checkpoint (relative to the component while components describe themselves; full key, with
    `action_head.`, from `DreamZeroModel.release_tensors()`). sources: our parameter names; several sources are
    concatenated along dim 0 (CLIP's fused qkv). shape: the shape stored in the checkpoint (may differ from the
    source's by leading 1-dims, e.g. CLIP's `cls_embedding [1,1,W]` vs `class_embedding [W]`).
    """

    name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]


# -- reading the directory ---------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{what} {path.name} is missing in {path.parent}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_config(path: str | os.PathLike):
    """DreamZeroConfig of a checkpoint directory (from its config.json)."""
    from dreamzero.config import from_checkpoint_config

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    data = _read_json(path / CONFIG_FILE, "config file")
    try:
        return from_checkpoint_config(data)
    except ConfigError as exc:
        raise CheckpointError(f"{path / CONFIG_FILE}: {exc}") from exc


def read_weight_map(path: str | os.PathLike) -> dict[str, str]:
    """tensor key -> shard file name (relative to the directory); checks that every shard exists."""
    path = Path(path)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        index = _read_json(index_path, "index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path} has no 'weight_map' object of key -> shard file name")
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"shard file(s) named in {INDEX_FILE} are missing in {path}: {missing}")
        return dict(weight_map)
    if (path / SINGLE_FILE).is_file():
        return {k: SINGLE_FILE for k in read_safetensors_header(path / SINGLE_FILE)}
    raise CheckpointError(f"{path} holds neither {INDEX_FILE} (with shards) nor {SINGLE_FILE}")


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (dtype, shape) from a safetensors header, checking that the file holds every byte it promises."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"shard {path} is corrupt: {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise CheckpointError(
                    f"shard {path} is corrupt or truncated: header of {header_len} bytes, file {size}"
                )
            header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"shard {path} is corrupt: its header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {path} is corrupt: header is not an object")
    out, end = {}, 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"shard {path} is corrupt: bad header entry for {key!r}") from exc
        if dtype in _ST_DTYPES and stop - start != math.prod(shape) * _ST_DTYPES[dtype]:
            raise CheckpointError(f"shard {path} is corrupt: {key!r} spans {stop - start} bytes for {dtype}{shape}")
        out[key] = (dtype, shape)
        end = max(end, stop)
    if 8 + header_len + end > size:
        raise CheckpointError(f"shard {path} is truncated: {size} bytes, its header needs {8 + header_len + end}")
    return out


def _names(items: Iterable[str], limit: int = 8) -> str:
    items = sorted(items)
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_layout(
    expected: list[ReleaseTensor], found: dict[str, tuple[int, ...]], where: str, ignore: tuple[str, ...] = ()
) -> None:
    """Fail with the names of missing, unexpected and misshaped tensors. found: key -> shape; keys starting with
    one of `ignore` may be present without being expected."""
    want = {t.name: t for t in expected}
    missing = [k for k in want if k not in found]
    unexpected = [k for k in found if k not in want and not (ignore and k.startswith(ignore))]
    misshaped = [
        f"{k} (file {list(found[k])}, model {list(want[k].shape)})"
        for k in want
        if k in found and tuple(found[k]) != tuple(want[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_names(unexpected)}")
    if misshaped:
        problems.append(f"{len(misshaped)} misshaped tensor(s): {_names(misshaped)}")
    if problems:
        raise CheckpointError(f"{where} does not match the model its config.json describes: " + "; ".join(problems))


# -- loading -----------------------------------------------------------------------------------------------------------


def _owners(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, list[tuple[nn.Module, str, bool]]]]:
    """name -> tensor, and tensor id -> every (module, attribute, is_parameter) holding it (ties included)."""
    by_name: dict[str, torch.Tensor] = {}
    owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for leaf, t in store.items():
                if t is None:
                    continue
                by_name[f"{mod_name}.{leaf}" if mod_name else leaf] = t
                slots = owners.setdefault(id(t), [])
                if not any(m is module and a == leaf for m, a, _ in slots):
                    slots.append((module, leaf, is_param))
    return by_name, owners


def _assign(owners, old: torch.Tensor, value: torch.Tensor) -> None:
    slots = owners[id(old)]
    new = nn.Parameter(value, requires_grad=False) if slots[0][2] else value
    for module, leaf, is_param in slots:
        (module._parameters if is_param else module._buffers)[leaf] = new


def _stream_into(model: nn.Module, expected: list[ReleaseTensor], weight_map: dict[str, str], root: Path, dev, dt):
    """Read each expected tensor from its shard and put it (cast, on `dev`) in place of the meta parameter(s)."""
    from safetensors import safe_open

    by_name, owners = _owners(model)
    by_shard: dict[str, list[ReleaseTensor]] = {}
    for rt in expected:
        by_shard.setdefault(weight_map[rt.name], []).append(rt)
    open_device = str(dev) if dev.type == "cuda" else "cpu"
    for shard, tensors in sorted(by_shard.items()):
        try:
            with safe_open(str(root / shard), framework="pt", device=open_device) as f:
                for rt in tensors:
                    value = f.get_tensor(rt.name)
                    sources = [by_name[s] for s in rt.sources]
                    parts = value.split([s.shape[0] for s in sources]) if len(sources) > 1 else [value]
                    for src, part in zip(sources, parts):
                        part = part.reshape(src.shape).to(device=dev, dtype=dt if part.is_floating_point() else None)
                        _assign(owners, src, part.contiguous())
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt data
            raise CheckpointError(f"shard {root / shard} could not be read: {exc}") from exc


def _found_shapes(root: Path, weight_map: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """key -> shape from the shard headers (validating every shard and the index's placement)."""
    headers = {shard: read_safetensors_header(root / shard) for shard in sorted(set(weight_map.values()))}
    found = {}
    for key, shard in weight_map.items():
        if key not in headers[shard]:
            raise CheckpointError(f"{INDEX_FILE} places {key!r} in {shard}, but that shard does not hold it")
        found[key] = headers[shard][key][1]
    return found


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
        root, weight_map = path, read_weight_map(path)
    elif path.is_file():
        root, weight_map = path.parent, {k: path.name for k in read_safetensors_header(path)}
    else:
        raise CheckpointError(f"{str(path)!r} is neither a checkpoint directory nor a safetensors file")
    prefix = RELEASE_PREFIX + "model."
    weight_map = {k: v for k, v in weight_map.items() if k.startswith(prefix)}
    with torch.device("meta"):
        dit = CausalWanDiT(config)
    expected = [ReleaseTensor(prefix + n, (n,), tuple(t.shape)) for n, t in dit.state_dict(keep_vars=True).items()]
    check_layout(expected, _found_shapes(root, weight_map), f"DiT weights {path}")
    _stream_into(dit, expected, weight_map, root, dev, dt)
    if hasattr(dit, "materialize_buffers"):
        dit.materialize_buffers(dev)
    return dit.eval().requires_grad_(False)


def load_model(
    path: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    tokenizer_path: str | os.PathLike | None = None,
    require_tokenizer: bool = True,
):
    """Load a DreamZeroModel from a checkpoint directory (release HF layout), streaming tensor by tensor.

    device / dtype default to `dreamzero.device.select_device()` (CUDA + bf16 when present, else CPU + fp32).
    The tokenizer comes from `tokenizer_path`, the config, `<path>/tokenizer` or $DREAMZERO_TOKENIZER_PATH; with
    require_tokenizer=False a missing one only logs a warning (the text encoder then cannot encode).
    """
    from dreamzero.device import select_device
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    path = Path(path)
    dev, dt = select_device(device, dtype)
    cfg = read_config(path)

    # 1. everything that can be checked without reading tensor data
    weight_map = read_weight_map(path)
    found = _found_shapes(path, weight_map)
    tokenizer = None
    try:
        tokenizer = load_tokenizer(resolve_tokenizer_path(tokenizer_path, cfg.text_encoder.tokenizer_path, path))
    except CheckpointError:
        if require_tokenizer:
            raise
        log.warning("no tokenizer for %s: the text encoder cannot encode prompts", path, exc_info=True)
    if tokenizer is not None and len(tokenizer) > cfg.text_encoder.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {len(tokenizer)} tokens but text_encoder.vocab_size is {cfg.text_encoder.vocab_size}"
        )

    with torch.device("meta"):
        model = DreamZeroModel(cfg)
    expected = model.release_tensors()
    ignore = (_UNUSED_PREFIX_WITHOUT_IMAGE_ENCODER,) if model.image_encoder is None else ()
    check_layout(expected, found, f"checkpoint {path}", ignore)
    if ignore and any(k.startswith(ignore) for k in found):
        log.warning("%s: ignoring %s* tensors (this model variant has no image encoder)", path, ignore[0])

    # 2. stream: one tensor at a time into the meta skeleton
    _stream_into(model, expected, weight_map, path, dev, dt)

    # 3. buffers are never stored: recreate them on the device
    model.materialize_buffers(dev)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"parameters not covered by the release layout (a bug): {_names(left)}")
    model.text_encoder.tokenizer = tokenizer
    return model.eval().requires_grad_(False)


# -- saving ------------------------------------------------------------------------------------------------------------


def _release_value(rt: ReleaseTensor, by_name: dict[str, torch.Tensor]) -> torch.Tensor:
    parts = [by_name[s].detach() for s in rt.sources]
    value = parts[0] if len(parts) == 1 else torch.cat([p.reshape(p.shape[0], -1) for p in parts])
    return value.reshape(rt.shape).to("cpu").contiguous()


def save_model(model, path: str | os.PathLike, shard_size: int = DEFAULT_SHARD_BYTES, save_tokenizer: bool = True):
    """Write `model` in the release layout: config.json, model.safetensors.index.json and
    `model-0000i-of-0000n.safetensors` shards of at most ~shard_size bytes (a tensor never spans two shards).
    Also writes the text encoder's tokenizer to `tokenizer/` when it has one and save_tokenizer is true."""
    from safetensors.torch import save_file

    from dreamzero.config import to_checkpoint_config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = model.release_tensors()
    by_name, _ = _owners(model)
    if any(by_name[s].is_meta for rt in tensors for s in rt.sources):
        raise CheckpointError("cannot save a model built on the meta device (it holds no values)")

    # 1. plan the shards from sizes alone, so the file names can say "-of-n"
    shards: list[list[ReleaseTensor]] = [[]]
    filled = 0
    for rt in tensors:
        nbytes = math.prod(rt.shape) * by_name[rt.sources[0]].element_size()
        if shards[-1] and filled + nbytes > shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(rt)
        filled += nbytes
    n = len(shards)

    # 2. write one shard at a time (only that shard's tensors are copied to CPU)
    weight_map, total = {}, 0
    for i, group in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        data = {rt.name: _release_value(rt, by_name) for rt in group}
        total += sum(t.numel() * t.element_size() for t in data.values())
        save_file(data, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in data})
        del data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(to_checkpoint_config(model.config), indent=2) + "\n")
    tokenizer = getattr(model.text_encoder, "tokenizer", None)
    if save_tokenizer and tokenizer is not None:
        tokenizer.save_pretrained(str(path / "tokenizer"))
    return path
