"""The DreamZero model container: the causal DiT plus its frozen encoders, in the release checkpoint's layout.

Attribute -> release key prefix (every key also starts with `action_head.`):
    .model          -> `model.`                       (CausalWanDiT, upstream names)
    .text_encoder   -> `text_encoder.`                (UMT5, Wan names)
    .image_encoder  -> `image_encoder.model.`         (CLIP ViT-H/14 visual tower + logit scale; 14B and 5B)
    .vae            -> `vae.model.`                   (Wan 2.1 / 2.2 VAE, Wan names)
`release_tensors()` lists every tensor under its release name with the parameter(s) that hold it; the checkpoint
loader and writer, and the layout test, all go through it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from dreamzero.config import DreamZeroConfig
from dreamzero.model.image_encoder import CLIPImageEncoder
from dreamzero.model.release import RELEASE_PREFIX, ReleaseTensor
from dreamzero.model.text_encoder import T5TextEncoder
from dreamzero.model.vae import WanVAE
from dreamzero.placement import Placement

_COMPONENT_PREFIX = {"model": "model.", "text_encoder": "text_encoder.", "image_encoder": "image_encoder.model."}
_COMPONENT_PREFIX["vae"] = "vae.model."


def _dit_class():
    # Imported here so that this module (and checkpoint I/O of the encoders) works while the DiT is being written.
    from dreamzero.model.dit import CausalWanDiT

    return CausalWanDiT


class DreamZeroModel(nn.Module):
    """Networks of one DreamZero checkpoint; the inference loop lives in `dreamzero.pipeline`."""

    def __init__(self, cfg: DreamZeroConfig):
        super().__init__()
        self.config = cfg
        self.model = _dit_class()(cfg.dit)
        self.text_encoder = T5TextEncoder(cfg.text_encoder, text_len=cfg.dit.text_len)
        self.image_encoder = CLIPImageEncoder(cfg.image_encoder) if cfg.image_encoder is not None else None
        self.vae = WanVAE(cfg.vae)
        self.placement = Placement()  # where the loader put each component (dreamzero.placement)

    # -- construction ------------------------------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        cfg: DreamZeroConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int | None = 0,
    ) -> DreamZeroModel:
        """Build the networks for `cfg`.

        device "meta" allocates nothing (shapes and names only). Otherwise parameters are created directly on
        `device` in `dtype` and, unless seed is None, drawn with `init_random_weights(seed)` (deterministic for a
        given device), so every pathway of an untrained model matters.
        """
        with torch.device("meta"):
            model = cls(cfg)
        if torch.device(device).type == "meta":
            return model.eval().requires_grad_(False)
        _allocate(model, torch.device(device), dtype)
        model.materialize_buffers(device)
        if seed is not None:
            init_random_weights(model, seed)
        return model.eval().requires_grad_(False)

    def materialize_buffers(self, device) -> None:
        """Recreate non-persistent buffers (never stored in checkpoints) on `device` after a meta build; `device` may
        also map component ("model", "text_encoder", "image_encoder", "vae") -> device (`Placement.devices`)."""
        devices = device if isinstance(device, Mapping) else dict.fromkeys(_COMPONENT_PREFIX, device)
        for attr in ("image_encoder", "vae", "model"):
            module = getattr(self, attr)
            if module is not None and hasattr(module, "materialize_buffers"):
                module.materialize_buffers(devices[attr])
        left = [n for n, b in self.named_buffers() if b.is_meta]
        if left and all(torch.device(d).type != "meta" for d in devices.values()):
            raise RuntimeError(f"buffers left on the meta device (add them to a materialize_buffers hook): {left}")

    # -- layout ------------------------------------------------------------------------------------------------------

    def release_tensors(self) -> list[ReleaseTensor]:
        """Every tensor of the release layout: full key (with `action_head.`), source parameters, release shape."""
        out: list[ReleaseTensor] = []
        dit_tensors = [ReleaseTensor(n, (n,), tuple(t.shape)) for n, t in self.model.state_dict(keep_vars=True).items()]
        for attr, tensors in (
            ("model", dit_tensors),
            ("text_encoder", self.text_encoder.release_tensors()),
            ("image_encoder", self.image_encoder.release_tensors() if self.image_encoder is not None else []),
            ("vae", self.vae.release_tensors()),
        ):
            prefix = RELEASE_PREFIX + _COMPONENT_PREFIX[attr]
            for t in tensors:
                out.append(ReleaseTensor(prefix + t.name, tuple(f"{attr}.{s}" for s in t.sources), t.shape))
        return out

    def num_parameters(self) -> int:
        return sum(math.prod(p.shape) for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.model.patch_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.patch_embedding.weight.dtype


def _allocate(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta tensor uninitialised storage on `device`, floating ones directly in `dtype`.

    (`Module.to_empty().to(dtype)` would first allocate fp32 everywhere, 92 GB for the 14B preset, and would untie
    shared parameters such as UMT5's shared / embed_tokens.)
    """
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for leaf, t in store.items():
                if t is None:
                    continue
                if id(t) not in done:
                    new = torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                    done[id(t)] = nn.Parameter(new, requires_grad=False) if is_param else new
                store[leaf] = done[id(t)]


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random init where every pathway matters (upstream zero-inits parts of the DiT, which would make
    an untrained model's actions trivial). Scheme of the DiT parity fixture, extended to the encoders:
    norm weights / VAE gammas 1 + N(0, 0.1); `*.modulation` N(0, 0.3); other vectors (biases, class embedding)
    N(0, 0.1); matrices N(0, 1/sqrt(fan_in)) with fan_in = in for Linear [out, in] and conv weights (all trailing
    dims), and dim 1 for CategorySpecificLinear `W` [cat, in, out]; scalars (CLIP logit scale) ln(1/0.07).
    Draws happen in parameter registration order from one generator on the parameters' device.
    """
    params = list(model.named_parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        leaf = name.rsplit(".", 1)[-1]
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if p.ndim == 0:
            value = torch.full_like(noise, math.log(1 / 0.07))
        elif leaf == "modulation":
            value = noise * 0.3
        elif leaf == "gamma" or (p.ndim == 1 and leaf == "weight"):
            value = 1 + noise * 0.1
        elif p.ndim == 1:
            value = noise * 0.1
        elif leaf == "W" and p.ndim == 3:
            value = noise * p.shape[1] ** -0.5
        elif leaf == "b" and p.ndim == 2:
            value = noise * 0.1
        else:
            value = noise * math.prod(p.shape[1:]) ** -0.5
        p.copy_(value.to(p.dtype))
