"""LoRA on the DiT: `dreamzero-train --lora-rank R` trains low-rank adapters on the attention and FFN projections of
every block (self- and cross-attention q, k, v, o, the image keys / values of i2v, ffn.0 and ffn.2); everything else
is frozen, the encoders as always.

y = W x + b + (alpha / r) B A x, with A [r, in] (Kaiming-uniform) and B [out, r] (zeros), so training starts from
the base model's outputs exactly. Checkpoints hold the adapters only (`adapter_model.safetensors` and
`adapter_config.json`, which names the base model), not a copy of the base. `merge` folds them into the base weights,
W' = W + (alpha / r) B A: the model the ship step writes (`python -m dreamzero.train.ship`, or
`python -m dreamzero.train.lora merge` for models over the shipping cap) is a plain checkpoint, so serving needs
nothing new.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from dreamzero.errors import ConfigError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: the Linear layers of each DiT block that get adapters (names under `blocks.<i>.`)
TARGETS = (
    "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
    "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "cross_attn.k_img", "cross_attn.v_img",
    "ffn.0", "ffn.2",
)  # fmt: skip


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.rank, self.scale = base, rank, alpha / rank
        base.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, w.shape[1], device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t().to(x.dtype)) @ self.lora_B.t().to(x.dtype) * self.scale

    def merged(self) -> nn.Linear:
        """The base layer with the update folded into its weight (in float32, cast back)."""
        w = self.base.weight
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
        self.base.weight.data = (w.float() + delta).to(w.dtype)
        return self.base


def _targets(dit: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(parent module, attribute, full name) of every target Linear present in the DiT's blocks."""
    found = []
    for name, block in dit.named_modules():
        if not (name.startswith("blocks.") and name.count(".") == 1):
            continue
        for target in TARGETS:
            parent_path, _, attr = target.rpartition(".")
            try:
                parent = block.get_submodule(parent_path)
            except AttributeError:
                continue  # e.g. no k_img on a t2v model
            if isinstance(getattr(parent, attr, None), nn.Linear):
                found.append((parent, attr, f"{name}.{target}"))
    return found


def apply_lora(dit: nn.Module, rank: int, alpha: float | None = None, seed: int = 0) -> list[str]:
    """Freeze the DiT and put adapters on its target layers (A drawn from `seed`); returns the adapted names."""
    if rank < 1:
        raise ConfigError(f"lora_rank: expected >= 1, got {rank}")
    alpha = float(alpha if alpha is not None else rank)
    dit.requires_grad_(False)
    targets = _targets(dit)
    if not targets:
        raise ConfigError("lora: the DiT has none of the target layers")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for parent, attr, _ in targets:
            setattr(parent, attr, LoRALinear(getattr(parent, attr), rank, alpha))
    return [name for _, _, name in targets]


def lora_layers(dit: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in dit.named_modules() if isinstance(m, LoRALinear)}


def adapter_state(dit: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.{p}": getattr(m, p).detach().cpu().contiguous() for n, m in lora_layers(dit).items()
            for p in ("lora_A", "lora_B")}  # fmt: skip


def save_adapter(dit: nn.Module, path: Path, base: str | None, alpha: float, state: dict | None = None) -> None:
    """Write the adapters of `dit`; `state`: the DiT's full state dict to take them from (a sharded DiT's, gathered)."""
    from safetensors.torch import save_file

    layers = lora_layers(dit)
    rank = next(iter(layers.values())).rank
    if state is None:
        tensors = adapter_state(dit)
    else:
        keys = [f"{n}.{p}" for n in layers for p in ("lora_A", "lora_B")]
        tensors = {k: state[k].detach().cpu().contiguous() for k in keys}
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    config = {"rank": rank, "alpha": alpha, "targets": list(TARGETS), "base_model": base}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1) + "\n")


def read_adapter_config(path: Path) -> dict:
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise ConfigError(f"{path} has no {ADAPTER_CONFIG}: not a LoRA checkpoint")
    return json.loads(file.read_text())


def load_adapter(dit: nn.Module, path: Path) -> None:
    """Load the adapters of checkpoint `path` into a DiT that `apply_lora` prepared with the same rank."""
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    layers = lora_layers(dit)
    expected = {f"{n}.{p}" for n in layers for p in ("lora_A", "lora_B")}
    if set(state) != expected:
        raise ConfigError(f"{path}: the adapters do not match the model's LoRA layers")
    for key, value in state.items():
        name, _, param = key.rpartition(".")
        getattr(layers[name], param).data.copy_(value)


def merge_lora(dit: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer, in place; the DiT is a plain one afterwards."""
    for name, layer in lora_layers(dit).items():
        parent_name, _, attr = name.rpartition(".")
        setattr(dit.get_submodule(parent_name), attr, layer.merged())
    return dit


def merged_model(checkpoint: str | Path, device: str = "cpu"):
    """The base model named by a LoRA checkpoint with its adapters merged (a plain DreamZero model)."""
    from dreamzero.checkpoint import load_model
    from dreamzero.embedded_default import default_model_dir

    cfg = read_adapter_config(Path(checkpoint))
    base = cfg.get("base_model") or str(default_model_dir())
    if not Path(base).exists():
        raise ConfigError(f"{checkpoint}: its base model {base} is not there (adapter_config.json base_model)")
    model = load_model(base, device=device, dtype=torch.float32)
    apply_lora(model.model, int(cfg["rank"]), float(cfg["alpha"]))
    load_adapter(model.model, Path(checkpoint))
    merge_lora(model.model)
    return model


def write_merged(checkpoint: str | Path, dest: str | Path) -> Path:
    """A plain HF-layout checkpoint at `dest`: the merged model plus the checkpoint's metadata (experiment_cfg)."""
    import shutil

    from dreamzero.checkpoint import save_model

    src, dest = Path(checkpoint), Path(dest)
    model = merged_model(src)
    save_model(model, dest)
    if (src / "experiment_cfg").is_dir():
        shutil.copytree(src / "experiment_cfg", dest / "experiment_cfg", dirs_exist_ok=True)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dreamzero.train.lora", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="write a LoRA checkpoint's merged model as a plain checkpoint")
    m.add_argument("checkpoint")
    m.add_argument("dest")
    args = p.parse_args(argv)
    print(write_merged(args.checkpoint, args.dest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
