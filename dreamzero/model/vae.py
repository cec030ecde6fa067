"""Wan VAE: `diffusers.AutoencoderKLWan` holding Wan 2.1 (z=16) or Wan 2.2 (z=48) weights after a key remap.

The remap below was derived by laying the original Wan module tree next to diffusers' state_dict names:

| Wan (release, under `action_head.vae.model.`) | diffusers |
|---|---|
| `conv1` / `conv2` | `quant_conv` / `post_quant_conv` |
| `{encoder,decoder}.conv1` | `{encoder,decoder}.conv_in` |
| `{encoder,decoder}.head.0` / `head.2` | `norm_out` / `conv_out` |
| `{encoder,decoder}.middle.0/1/2` | `mid_block.resnets.0` / `mid_block.attentions.0` / `mid_block.resnets.1` |
| resnet `residual.0/2/3/6`, `shortcut` | `norm1`, `conv1`, `norm2`, `conv2`, `conv_shortcut` |
| 2.1 `encoder.downsamples.K` (flat) | `encoder.down_blocks.K` (flat, same index) |
| 2.1 `decoder.upsamples.K` (flat; R+1 resnets + resample / stage) | `decoder.up_blocks.i.resnets.j` / `.upsamplers.0` |
| 2.2 `encoder.downsamples.i.downsamples.j` (j = R: resample) | `encoder.down_blocks.i.resnets.j` / `.downsampler` |
| 2.2 `decoder.upsamples.i.upsamples.j` (j = R+1: resample) | `decoder.up_blocks.i.resnets.j` / `.upsampler` |

(R = num_res_blocks.) Shapes are identical on both sides. `encode` takes the posterior mode and normalises with the
standard Wan per-channel statistics, `(mu - mean) * (1 / std)`; `decode` inverts that first.

Two speed-ups that leave the numbers alone (to float rounding): the channel RMS norms compute
`x / max(||x||_2, eps)` with a plain sum of squares instead of `F.normalize` (whose strided reduction over the channel
axis of a 5-D tensor is far slower on CPU), and on CPU the video enters the encoder channels-last, the layout oneDNN's
3-D convolutions are fastest in. Measured in docs/benchmarks.md (VAE section).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dreamzero.config import VAEConfig
from dreamzero.model.release import ReleaseTensor

try:  # diffusers' private norm class: swapped for the faster one below when it is where we expect it
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm as _WanRMSNorm
except ImportError:  # pragma: no cover - another diffusers layout: keep its own (slower, same numbers)
    _WanRMSNorm = None
from diffusers.models.autoencoders.autoencoder_kl_wan import patchify as _patchify
from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify as _unpatchify

# Standard per-channel latent statistics of the Wan 2.1 VAE (z=16) and the Wan 2.2 VAE (z=48).
WAN21_LATENT_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENT_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
WAN22_LATENT_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENT_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

_KINDS = ("wan2.1", "wan2.2")
_RESNET = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6"}
_RESNET.update({"conv_shortcut": "shortcut"})


def spatial_factor(cfg: VAEConfig) -> int:
    """Pixels per latent cell along each side: 16 for Wan 2.2, 8 for Wan 2.1."""
    return 16 if cfg.kind == "wan2.2" else 8


def latent_stats(cfg: VAEConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The standard Wan statistics for the VAE kind (z_dim must match them)."""
    mean, std = (WAN21_LATENT_MEAN, WAN21_LATENT_STD) if cfg.kind == "wan2.1" else (WAN22_LATENT_MEAN, WAN22_LATENT_STD)
    if cfg.z_dim != len(mean):
        raise ValueError(f"vae.z_dim={cfg.z_dim} but the {cfg.kind} VAE has {len(mean)} latent channels")
    return mean, std


def diffusers_kwargs(cfg: VAEConfig) -> dict:
    """AutoencoderKLWan constructor arguments for our VAEConfig."""
    if cfg.kind not in _KINDS:
        raise ValueError(f"vae.kind must be one of {_KINDS}, got {cfg.kind!r}")
    mean, std = latent_stats(cfg)
    kw = dict(
        base_dim=cfg.base_dim,
        z_dim=cfg.z_dim,
        dim_mult=list(cfg.dim_mult),
        num_res_blocks=cfg.num_res_blocks,
        attn_scales=[],
        temperal_downsample=list(cfg.temporal_downsample),
        dropout=0.0,
        latents_mean=list(mean),
        latents_std=list(std),
    )
    if cfg.kind == "wan2.2":  # 2x2 patchify in front of a 8x VAE (16x in all), residual down/up blocks
        kw.update(
            decoder_base_dim=cfg.decoder_base_dim,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
        )
    return kw


def _resnet_part(rest: str) -> str:
    # "norm1.gamma" -> "residual.0.gamma"; "conv_shortcut.weight" -> "shortcut.weight"
    head, _, tail = rest.partition(".")
    if head not in _RESNET:
        raise KeyError(rest)
    return f"{_RESNET[head]}.{tail}"


def diffusers_to_wan(name: str, cfg: VAEConfig) -> str:
    """diffusers AutoencoderKLWan name -> original Wan VAE name."""
    r = cfg.num_res_blocks
    top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    head, _, rest = name.partition(".")
    if head in top:
        return f"{top[head]}.{rest}"
    if head not in ("encoder", "decoder"):
        raise KeyError(f"not a Wan VAE parameter: {name!r}")
    side = head
    simple = {"conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}
    first, _, tail = rest.partition(".")
    if first in simple:
        return f"{side}.{simple[first]}.{tail}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d)\.(.+)", rest)
    if m:
        kind, idx, tail = m.groups()
        if kind == "attentions":
            return f"{side}.middle.1.{tail}"
        return f"{side}.middle.{0 if idx == '0' else 2}.{_resnet_part(tail)}"
    if cfg.kind == "wan2.1":
        m = re.fullmatch(r"down_blocks\.(\d+)\.(.+)", rest)
        if m:
            k, tail = m.groups()
            tail = tail if tail.startswith(("resample.", "time_conv.")) else _resnet_part(tail)
            return f"encoder.downsamples.{k}.{tail}"
        m = re.fullmatch(r"up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.+)", rest)
        if m:
            i, what, j, tail = m.groups()
            stage = int(i) * (r + 2)  # each 2.1 decoder stage: R+1 resnets then one resample
            if j is not None:
                return f"decoder.upsamples.{stage + int(j)}.{_resnet_part(tail)}"
            return f"decoder.upsamples.{stage + r + 1}.{tail}"
    else:
        m = re.fullmatch(r"down_blocks\.(\d+)\.(resnets\.(\d+)|downsampler)\.(.+)", rest)
        if m:
            i, what, j, tail = m.groups()
            if j is not None:
                return f"encoder.downsamples.{i}.downsamples.{j}.{_resnet_part(tail)}"
            return f"encoder.downsamples.{i}.downsamples.{r}.{tail}"
        m = re.fullmatch(r"up_blocks\.(\d+)\.(resnets\.(\d+)|upsampler)\.(.+)", rest)
        if m:
            i, what, j, tail = m.groups()
            if j is not None:
                return f"decoder.upsamples.{i}.upsamples.{j}.{_resnet_part(tail)}"
            return f"decoder.upsamples.{i}.upsamples.{r + 1}.{tail}"
    raise KeyError(f"not a Wan VAE parameter: {name!r}")


if _WanRMSNorm is not None:

    class _SumOfSquaresRMSNorm(_WanRMSNorm):
        """`WanRMS_norm` with the L2 norm as a sum of squares (same parameters, same result to rounding)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dim = 1 if self.channel_first else -1
            xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # fp32 statistics, as diffusers
            normalized = (xf / (xf * xf).sum(dim, keepdim=True).sqrt().clamp_min(1e-12)).to(x.dtype)
            return normalized * self.scale * self.gamma + self.bias


def use_fast_norms(module: nn.Module) -> int:
    """Swap every diffusers `WanRMS_norm` under `module` for `_SumOfSquaresRMSNorm` in place; returns how many."""
    if _WanRMSNorm is None:
        return 0
    swapped = 0
    for m in module.modules():
        if type(m) is _WanRMSNorm:
            m.__class__ = _SumOfSquaresRMSNorm
            swapped += 1
    return swapped


def stack_states(states: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """Causal encoder states of several clips (same canvas) -> one state for a batched `encode_causal`."""
    return [None if parts[0] is None else torch.cat(parts) for parts in zip(*states)]  # None: a slot never used


def split_state(state: list[torch.Tensor | None], rows: int) -> list[list[torch.Tensor | None]]:
    """A batched causal encoder state -> one state per clip (copies: a row's state must not pin the batch's)."""
    return [[None if t is None else t[i : i + 1].clone() for t in state] for i in range(rows)]


def decode_state_key(state: list | None) -> tuple:
    """What rows must share to decode in one batch: the layout of their decoder states (None, "Rep" or a tensor
    of some shape in each slot)."""
    if state is None:
        return ("fresh",)
    return tuple(t if t is None or isinstance(t, str) else tuple(t.shape[1:]) for t in state)


def stack_decode_states(states: list[list]) -> list:
    """Decoder states of several rows (one `decode_state_key`) -> one state for a batched `decode_causal`."""
    return [p[0] if p[0] is None or isinstance(p[0], str) else torch.cat(p) for p in zip(*states)]


def split_decode_state(state: list, rows: int) -> list[list]:
    """A batched decoder state -> one per row (copies, so a row's state does not pin the batch's)."""
    return [[t if t is None or isinstance(t, str) else t[i : i + 1].clone() for t in state] for i in range(rows)]


def decode_state_nbytes(state: list | None) -> int:
    return sum(t.numel() * t.element_size() for t in state or () if isinstance(t, torch.Tensor))


class WanVAE(nn.Module):
    """Video [B,3,T,H,W] in [-1,1] <-> normalised latents [B,z,T',h,w] (T' = 1 + (T-1)/4)."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        from diffusers import AutoencoderKLWan

        self.cfg = cfg
        self.autoencoder = AutoencoderKLWan(**diffusers_kwargs(cfg))
        use_fast_norms(self.autoencoder)
        self.register_buffer("latent_mean", torch.zeros(cfg.z_dim), persistent=False)
        self.register_buffer("latent_inv_std", torch.zeros(cfg.z_dim), persistent=False)
        self.materialize_buffers(None)

    @property
    def spatial_factor(self) -> int:
        return spatial_factor(self.cfg)

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(bool(t) for t in self.cfg.temporal_downsample)

    def materialize_buffers(self, device) -> None:
        """(Re)create the latent statistics; also used after a meta-device build."""
        mean, std = latent_stats(self.cfg)
        device = device if device is not None else self.latent_mean.device
        if device is not None and torch.device(device).type == "meta":
            device = None  # computing on meta would lose the values; the loader calls this again on the real device
        self.latent_mean = torch.tensor(mean, dtype=torch.float32, device=device)
        self.latent_inv_std = 1.0 / torch.tensor(std, dtype=torch.float32, device=device)

    def release_tensors(self) -> list[ReleaseTensor]:
        """Tensors under their Wan names, relative to `action_head.vae.model.`."""
        return [
            ReleaseTensor(diffusers_to_wan(n, self.cfg), ("autoencoder." + n,), tuple(p.shape))
            for n, p in self.autoencoder.named_parameters()
        ]

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1, 1, 1, 1)
        return self.latent_mean.view(shape).to(like), self.latent_inv_std.view(shape).to(like)

    def _encoder_input(self, video: torch.Tensor) -> torch.Tensor:
        """The encoder's device and dtype; channels-last on CPU, the layout oneDNN's 3-D convolutions are fastest in."""
        weight = self.autoencoder.encoder.conv_in.weight
        video = video.to(weight.device, weight.dtype)
        if video.device.type == "cpu":
            video = video.contiguous(memory_format=torch.channels_last_3d)
        return video

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """video [B,3,T,H,W] in [-1,1] -> normalised posterior mode [B,z,T',H/s,W/s]."""
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"VAE input must be [B,3,T,H,W], got {tuple(video.shape)}")
        mu = self.autoencoder.encode(self._encoder_input(video)).latent_dist.mode()
        mean, inv_std = self._stats(mu)
        return (mu - mean) * inv_std

    @torch.no_grad()
    def encode_causal(
        self, video: torch.Tensor, state: list[torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Encode `video` [B,3,T,H,W] after the frames that left the encoder in `state` (None: a fresh clip, T = 1 + 4k;
        continuing, T = 4k); returns the normalised latents of these frames and the encoder's causal state after them.

        The encoder is causal with a state of the last frames of every convolution, and diffusers' `encode` runs it
        as this does (the first frame alone, then 4 frames a pass), so encoding a clip in pieces gives its latents
        (to float rounding). The pipeline uses it to encode a session's conditioning window chunk by chunk.
        """
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"VAE input must be [B,3,T,H,W], got {tuple(video.shape)}")
        t = video.shape[2]
        if (t - (0 if state is not None else 1)) % 4 != 0 or (state is not None and t == 0):
            raise ValueError(f"encode_causal takes 1 + 4k frames for a fresh clip, 4k after a state; got {t}")
        ae = self.autoencoder
        x = self._encoder_input(video)
        if ae.config.patch_size is not None:
            x = _patchify(x, patch_size=ae.config.patch_size)
        if state is None:
            ae.clear_cache()
            feat, spans = ae._enc_feat_map, [(0, 1)] + [(i, i + 4) for i in range(1, t, 4)]
            ae.clear_cache()  # the list above is ours now
        else:
            feat, spans = list(state), [(i, i + 4) for i in range(0, t, 4)]
        outs = [ae.encoder(x[:, :, a:b], feat_cache=feat, feat_idx=[0]) for a, b in spans]
        mu = ae.quant_conv(torch.cat(outs, 2))[:, : self.cfg.z_dim]  # the posterior's mode: the mean half
        mean, inv_std = self._stats(mu)
        return (mu - mean) * inv_std, feat

    @torch.no_grad()
    def decode_causal(
        self, latents: torch.Tensor, state: list | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor | str | None]]:
        """Decode normalised latents [B,z,F,h,w] after the latent frames that left the decoder in `state` (None: a
        fresh clip); returns video [B,3,T,H,W] in [-1,1] (T = 1 + 4(F-1) fresh, 4F continuing) and the decoder's
        causal state after them.

        The decoder is causal: diffusers' `decode` runs it one latent frame a pass with a cache of the last frames of
        every convolution (a "Rep" marker where an upsampler has seen only the first frame), as this does, so a
        video decoded chunk by chunk is the whole video's decode (to float rounding). Rows of one call must share a
        state layout (`decode_state_key`).
        """
        ae = self.autoencoder
        weight = ae.decoder.conv_in.weight
        z = latents.to(weight.device, weight.dtype)
        if z.device.type == "cpu":
            z = z.contiguous(memory_format=torch.channels_last_3d)
        mean, inv_std = self._stats(z)
        x = ae.post_quant_conv(z / inv_std + mean)
        if state is None:
            ae.clear_cache()
            feat = ae._feat_map
            ae.clear_cache()  # the list above is ours now
        else:
            feat = list(state)
        outs = []
        for i in range(x.shape[2]):
            first = state is None and i == 0
            outs.append(ae.decoder(x[:, :, i : i + 1], feat_cache=feat, feat_idx=[0], first_chunk=first))
        out = torch.cat(outs, 2)
        if ae.config.patch_size is not None:
            out = _unpatchify(out, patch_size=ae.config.patch_size)
        return out.clamp(-1.0, 1.0), feat

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """normalised latents [B,z,T',h,w] -> video [B,3,T,H,W] in [-1,1]."""
        weight = self.autoencoder.decoder.conv_in.weight
        z = latents.to(weight.device, weight.dtype)
        if z.device.type == "cpu":
            z = z.contiguous(memory_format=torch.channels_last_3d)
        mean, inv_std = self._stats(z)
        return self.autoencoder.decode(z / inv_std + mean).sample
