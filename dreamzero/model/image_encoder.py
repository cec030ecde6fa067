"""CLIP vision tower: `transformers.CLIPVisionModel` holding Wan's open-clip ViT-H/14 weights after a key remap.

open-clip visual names (release checkpoint, under `action_head.image_encoder.model.visual.`) <-> transformers 5
(older versions add a `vision_model.` level, handled):

| open-clip (Wan) | transformers `CLIPVisionModel` |
|---|---|
| `patch_embedding.weight` | `embeddings.patch_embedding.weight` |
| `cls_embedding` `[1,1,W]` | `embeddings.class_embedding` `[W]` |
| `pos_embedding` `[1,257,W]` | `embeddings.position_embedding.weight` `[257,W]` |
| `pre_norm` / `post_norm` | `pre_layrnorm` / `post_layernorm` |
| `transformer.N.attn.to_qkv` `[3W,W]` | `encoder.layers.N.self_attn.{q,k,v}_proj` (split in thirds) |
| `transformer.N.attn.proj` | `encoder.layers.N.self_attn.out_proj` |
| `transformer.N.norm1/norm2` | `encoder.layers.N.layer_norm1/layer_norm2` |
| `transformer.N.mlp.0/mlp.2` | `encoder.layers.N.mlp.fc1/fc2` |

Two tensors have no transformers counterpart and are kept as plain parameters so a checkpoint round-trips:
`visual.head` (the contrastive projection `[W, 1024]`) and `model.log_scale` (the logit scale). DreamZero uses
neither: it takes the output of block 31 of 32 without post-norm, i.e. `hidden_states[-2]`.

Every LayerNorm runs in float32 and casts back (open-clip's `LayerNorm.forward(x.float()).type_as(x)`); a bf16
LayerNorm drifts visibly from the reference on real weights.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from dreamzero.config import ImageEncoderConfig
from dreamzero.model.release import ReleaseTensor

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_LAYER_MAP = {  # open-clip block suffix -> transformers layer suffix (1:1 ones)
    "attn.proj": "self_attn.out_proj",
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "mlp.0": "mlp.fc1",
    "mlp.2": "mlp.fc2",
}
_TOP_MAP = {
    "patch_embedding.weight": "embeddings.patch_embedding.weight",
    "cls_embedding": "embeddings.class_embedding",
    "pos_embedding": "embeddings.position_embedding.weight",
    "pre_norm.weight": "pre_layrnorm.weight",
    "pre_norm.bias": "pre_layrnorm.bias",
    "post_norm.weight": "post_layernorm.weight",
    "post_norm.bias": "post_layernorm.bias",
}


class _FP32LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).type_as(x)


def hf_to_openclip(name: str) -> tuple[str, int | None]:
    """transformers name -> (open-clip visual name, index in the fused qkv or None). Older transformers nest the
    tower under `vision_model.`; that level is dropped."""
    if name.startswith("vision_model."):
        name = name[len("vision_model.") :]
    for oc, hf in _TOP_MAP.items():
        if name == hf:
            return oc, None
    m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m:
        n, mod, kind = m.groups()
        qkv = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
        if mod in qkv:
            return f"transformer.{n}.attn.to_qkv.{kind}", qkv[mod]
        for oc, hf in _LAYER_MAP.items():
            if mod == hf:
                return f"transformer.{n}.{oc}.{kind}", None
    raise KeyError(f"not a CLIP vision parameter: {name!r}")


def openclip_to_hf(name: str) -> list[str]:
    """open-clip visual name -> transformers name(s) (transformers >= 5 layout, no `vision_model.` level); the fused
    qkv gives three (q, k, v order)."""
    if name in _TOP_MAP:
        return [_TOP_MAP[name]]
    m = re.fullmatch(r"transformer\.(\d+)\.(.+)\.(weight|bias)", name)
    if m:
        n, mod, kind = m.groups()
        prefix = f"encoder.layers.{n}."
        if mod == "attn.to_qkv":
            return [f"{prefix}self_attn.{p}_proj.{kind}" for p in ("q", "k", "v")]
        if mod in _LAYER_MAP:
            return [f"{prefix}{_LAYER_MAP[mod]}.{kind}"]
    raise KeyError(f"not an open-clip visual parameter: {name!r}")


def clip_vision_config(cfg: ImageEncoderConfig):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        num_channels=3,
        hidden_act="gelu",  # open-clip ViT-H/14 uses exact GELU
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
        projection_dim=cfg.projection_dim,
    )


class CLIPImageEncoder(nn.Module):
    """Images in [-1, 1] -> block-31 CLIP tokens [B, 257, width]."""

    def __init__(self, cfg: ImageEncoderConfig):
        super().__init__()
        from transformers import CLIPVisionModel

        self.cfg = cfg
        self.clip = CLIPVisionModel(clip_vision_config(cfg))
        for module in self.clip.modules():
            if type(module) is nn.LayerNorm:
                module.__class__ = _FP32LayerNorm
        # kept only so that a checkpoint round-trips (see module docstring)
        self.head = nn.Parameter(torch.empty(cfg.hidden_size, cfg.projection_dim))
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.register_buffer("pixel_mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(CLIP_STD).view(1, 3, 1, 1), persistent=False)

    @property
    def _tower(self) -> nn.Module:
        return getattr(self.clip, "vision_model", self.clip)  # transformers < 5 nests the tower one level deeper

    def materialize_buffers(self, device) -> None:
        """Recreate the non-persistent buffers after a meta-device build (they are never in a checkpoint)."""
        self.pixel_mean = torch.tensor(CLIP_MEAN, device=device).view(1, 3, 1, 1)
        self.pixel_std = torch.tensor(CLIP_STD, device=device).view(1, 3, 1, 1)
        emb = self._tower.embeddings
        emb.position_ids = torch.arange(emb.num_positions, device=device).expand((1, -1))

    def release_tensors(self) -> list[ReleaseTensor]:
        """Tensors under their open-clip names, relative to `action_head.image_encoder.model.`."""
        fused: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
        out = []
        for name, p in self.clip.named_parameters():
            oc, part = hf_to_openclip(name)
            if part is not None:
                fused.setdefault(oc, []).append((part, "clip." + name, tuple(p.shape)))
                continue
            shape = tuple(p.shape)
            if oc == "cls_embedding":
                shape = (1, 1, *shape)
            elif oc == "pos_embedding":
                shape = (1, *shape)
            out.append(ReleaseTensor("visual." + oc, ("clip." + name,), shape))
        for oc, parts in fused.items():
            parts.sort()
            first = parts[0][2]
            out.append(ReleaseTensor("visual." + oc, tuple(n for _, n, _ in parts), (3 * first[0], *first[1:])))
        out.append(ReleaseTensor("visual.head", ("head",), tuple(self.head.shape)))
        out.append(ReleaseTensor("log_scale", ("log_scale",), ()))
        return out

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        """[B,3,H,W] in [-1,1] -> bicubic squash to image_size (no crop) -> CLIP mean/std."""
        size = (self.cfg.image_size, self.cfg.image_size)
        x = F.interpolate(x.float(), size=size, mode="bicubic", align_corners=False)
        return ((x * 0.5 + 0.5) - self.pixel_mean.float()) / self.pixel_std.float()

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,3,H,W] in [-1,1] -> [B, 257, width]: output of the second-to-last block, no post-norm."""
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"image encoder input must be [B,3,H,W], got {tuple(x.shape)}")
        weight = self._tower.embeddings.patch_embedding.weight
        pixels = self.preprocess(x.to(weight.device)).to(weight.dtype)
        out = self.clip(pixel_values=pixels, output_hidden_states=True)
        return out.hidden_states[-2]
