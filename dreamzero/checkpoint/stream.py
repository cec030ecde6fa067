"""What every layout shares: a source of named tensors, the check of names and shapes against the model, and the
tensor-by-tensor streaming into a model built on the meta device (peak memory: the weights plus one tensor)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from dreamzero.checkpoint.files import list_names, read_safetensors_header
from dreamzero.errors import CheckpointError
from dreamzero.model.release import ReleaseTensor


class TensorSource(Protocol):
    """Named tensors of one checkpoint; `shapes` needs no tensor data, `read` yields tensors one at a time."""

    where: str

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, names: Iterable[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass
class LayoutSpec:
    """How the model's parameters appear in one layout.

    expected: every tensor the layout stores (name in the source, our parameter(s), stored shape).
    optional: expected names that may be absent; their parameters are then zero-filled (only for tensors that
    never reach an output, e.g. the CLIP block after the one DreamZero reads).
    ignore: name prefixes the source may hold that the model does not use.
    fills: our parameter name -> value maker for parameters this layout does not store at all.
    """

    expected: list[ReleaseTensor]
    optional: frozenset[str] = frozenset()
    ignore: tuple[str, ...] = ()
    fills: dict[str, Callable[[torch.Size], torch.Tensor]] = field(default_factory=dict)


@dataclass
class SafetensorsSource:
    """Tensors spread over safetensors files: name -> (file, key inside that file)."""

    where: str
    files: dict[str, tuple[Path, str]]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        headers = {p: read_safetensors_header(p) for p in sorted({p for p, _ in self.files.values()})}
        out = {}
        for name, (file, key) in self.files.items():
            if key not in headers[file]:
                raise CheckpointError(f"the index places {key!r} in {file.name}, but that shard does not hold it")
            out[name] = headers[file][key][1]
        return out

    def read(self, names: Iterable[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name][0], []).append(name)
        open_device = str(device) if device.type == "cuda" else "cpu"
        for file, group in sorted(by_file.items()):
            try:
                with safe_open(str(file), framework="pt", device=open_device) as f:
                    for name in group:
                        yield name, f.get_tensor(self.files[name][1])
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types for corrupt data
                raise CheckpointError(f"shard {file} could not be read: {exc}") from exc


def check_layout(
    expected: list[ReleaseTensor],
    found: dict[str, tuple[int, ...]],
    where: str,
    ignore: tuple[str, ...] = (),
    optional: Iterable[str] = (),
    described_by: str = "its config.json",
) -> None:
    """Fail with the names of missing, unexpected and misshaped tensors. found: name -> shape; names starting with
    one of `ignore` may be present without being expected, names in `optional` may be absent. A stored [1] matches a
    model scalar [] (FSDP checkpoints promote 0-d parameters to 1-d)."""
    want = {t.name: t for t in expected}
    optional = set(optional)
    missing = [k for k in want if k not in found and k not in optional]
    unexpected = [k for k in found if k not in want and not (ignore and k.startswith(ignore))]
    misshaped = [
        f"{k} (file {list(found[k])}, model {list(want[k].shape)})"
        for k in want
        if k in found and tuple(found[k]) != tuple(want[k].shape) and not (want[k].shape == () and found[k] == (1,))
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {list_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {list_names(unexpected)}")
    if misshaped:
        problems.append(f"{len(misshaped)} misshaped tensor(s): {list_names(misshaped)}")
    if problems:
        raise CheckpointError(f"{where} does not match the model {described_by} describes: " + "; ".join(problems))


def owners(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, list[tuple[nn.Module, str, bool]]]]:
    """name -> tensor, and tensor id -> every (module, attribute, is_parameter) holding it (ties included)."""
    by_name: dict[str, torch.Tensor] = {}
    slots_of: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for leaf, t in store.items():
                if t is None:
                    continue
                by_name[f"{mod_name}.{leaf}" if mod_name else leaf] = t
                slots = slots_of.setdefault(id(t), [])
                if not any(m is module and a == leaf for m, a, _ in slots):
                    slots.append((module, leaf, is_param))
    return by_name, slots_of


def _assign(slots_of, old: torch.Tensor, value: torch.Tensor) -> None:
    slots = slots_of[id(old)]
    new = nn.Parameter(value, requires_grad=False) if slots[0][2] else value
    for module, leaf, is_param in slots:
        (module._parameters if is_param else module._buffers)[leaf] = new


def _device_of(devices, name: str) -> torch.device:
    """devices: one device for every parameter, or component (first part of the name) -> device."""
    if isinstance(devices, Mapping):
        return devices[name.split(".", 1)[0]]
    return devices


def stream_into(
    model: nn.Module,
    spec: LayoutSpec,
    source: TensorSource,
    found,
    dev: torch.device | Mapping[str, torch.device],
    dt,
    setters: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> None:
    """Put each stored tensor (cast, on its device) in place of its meta parameter(s), then fill what the layout
    lacks. dev: one device, or component -> device (`Placement.devices`): each component's tensors are read straight
    onto its own device. setters: parameter name -> a function that takes the value (on its device, in `dt`) instead
    of the plain assignment; the fp8 DiT's Linear weights are quantised that way, one tensor at a time."""
    setters = setters or {}
    by_name, slots_of = owners(model)
    present = [rt for rt in spec.expected if rt.name in found]
    wanted = {rt.name: rt for rt in present}
    groups: dict[torch.device, list[str]] = {}
    for rt in present:  # every source of one stored tensor belongs to one component
        groups.setdefault(_device_of(dev, rt.sources[0]), []).append(rt.name)

    def put(target: str, value: torch.Tensor) -> None:
        if target in setters:
            setters[target](value)
        else:
            _assign(slots_of, by_name[target], value)

    try:
        for device, names in groups.items():
            for name, value in source.read(names, device):
                targets = wanted[name].sources
                # a quantised weight (a setter's target) may be held in another shape: it gets the stored one
                shapes = [wanted[name].shape if s in setters else by_name[s].shape for s in targets]
                parts = value.split([s[0] for s in shapes]) if len(targets) > 1 else [value]
                for target, shape, part in zip(targets, shapes, parts):
                    part = part.reshape(shape).to(device=device, dtype=dt if part.is_floating_point() else None)
                    put(target, part.contiguous())
    except CheckpointError:
        raise
    except Exception as exc:  # a tensor that cannot be read back although its header / pickle said it could
        raise CheckpointError(f"{source.where} could not be read: {exc}") from exc
    fills = dict(spec.fills)
    for rt in spec.expected:
        if rt.name not in found:  # an optional tensor: its parameters never reach an output
            fills.update({s: torch.zeros for s in rt.sources})
    for name, make in fills.items():
        old = by_name[name]
        if old.is_meta:
            floating = old.is_floating_point() or name in setters
            value = make(old.shape).to(device=_device_of(dev, name), dtype=dt if floating else old.dtype)
            put(name, value)


def finish(model, dev: torch.device | Mapping[str, torch.device]):
    """Recreate the (never stored) buffers on the device (or each component's device); any parameter still on meta
    is a layout bug."""
    model.materialize_buffers(dev)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"parameters not covered by the checkpoint layout (a bug): {list_names(left)}")
    return model.eval().requires_grad_(False)
