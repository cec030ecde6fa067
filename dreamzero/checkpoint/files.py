"""Reading the files a checkpoint is made of: JSON documents and safetensors headers (no tensor data)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

from dreamzero.errors import CheckpointError

SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
SAFETENSORS_DTYPE_BYTES.update({"F8_E4M3": 1, "F8_E5M2": 1})


def read_json(path: Path, what: str) -> dict:
    """The JSON object in `path`; missing file, bad JSON or a non-object fail naming `what` and the path."""
    if not path.is_file():
        raise CheckpointError(f"{what} {path.name} is missing in {path.parent}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


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
        if dtype in SAFETENSORS_DTYPE_BYTES and stop - start != math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]:
            raise CheckpointError(f"shard {path} is corrupt: {key!r} spans {stop - start} bytes for {dtype}{shape}")
        out[key] = (dtype, shape)
        end = max(end, stop)
    if 8 + header_len + end > size:
        raise CheckpointError(f"shard {path} is truncated: {size} bytes, its header needs {8 + header_len + end}")
    return out


def read_safetensors_folder(folder: Path, index_name: str | None = None) -> dict[str, str]:
    """key -> file name for a folder of safetensors files: from its index (`index_name`, or the one
    `*.safetensors.index.json` there) when present, else from the headers of every `*.safetensors` file."""
    indexes = [folder / index_name] if index_name else sorted(folder.glob("*.safetensors.index.json"))
    indexes = [p for p in indexes if p.is_file()]
    if len(indexes) > 1:
        raise CheckpointError(f"{folder} holds several safetensors indexes: {[p.name for p in indexes]}")
    if indexes:
        index = read_json(indexes[0], "index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{indexes[0]} has no 'weight_map' object of key -> shard file name")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise CheckpointError(f"shard file(s) named in {indexes[0].name} are missing in {folder}: {missing}")
        return dict(weight_map)
    out: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        for key in read_safetensors_header(file):
            if key in out:
                raise CheckpointError(f"{key!r} is in both {out[key]} and {file.name} in {folder}")
            out[key] = file.name
    return out


def normalize_key(key: str) -> str:
    """Drop wrapper names trainers leave in keys: `_orig_mod.` anywhere (torch.compile), leading `module.`
    (DDP / FSDP) and the `.base_layer.` infix (PEFT)."""
    parts = [p for p in key.split(".") if p != "_orig_mod"]
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(p for p in parts if p != "base_layer")


def normalized_names(keys: Iterable[str], where: str) -> dict[str, str]:
    """normalised name -> stored key; two keys that normalise alike fail naming both."""
    out: dict[str, str] = {}
    for key in keys:
        name = normalize_key(key)
        if name in out:
            raise CheckpointError(f"{where}: {out[name]!r} and {key!r} both normalise to {name!r}")
        out[name] = key
    return out


def list_names(items: Iterable[str], limit: int = 8) -> str:
    """Sorted, comma-separated, at most `limit` names (then how many more)."""
    items = sorted(items)
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
