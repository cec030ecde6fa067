"""DreamZero's training objective: joint flow matching on video latents and actions, teacher-forced block by block.

1. Conditioning (frozen encoders, no gradient), as the pipeline computes it when serving:
   T5 rows of the prompt, CLIP of the anchor (i2v / ti2v), the i2v first-frame conditioning `y` (mask + latents of
   [anchor, zeros...]), the anchor's clean latent, and per block the clean latents of [anchor, its frames twice].
2. Teacher forcing (upstream: clean copies of the latents in the same sequence, a block-causal mask in which a noisy
   block attends to the clean first frame, the clean earlier blocks, itself and its own action / state registers).
   We run that attention pattern through the serving forward itself: prefill the clean anchor into the KV cache,
   then for each block k one denoise pass (noisy block k + noisy actions k + state k over the cache of clean frames
   before it) and one prefill of clean block k that extends the cache. Gradients flow through the cache, so the
   clean context is trained too, and the model trained is exactly the model served.
3. Noise: one timestep per block (uniform over the 1000-entry table), shared by the block's latent frames and its
   actions ("coupled", upstream's default); x_t = (1 - sigma) x0 + sigma eps, target eps - x0.
4. Loss: per block, MSE of the video velocity (mean over channels and pixels) and of the action velocity (padded
   action dims masked to 0, mean over all model dims as upstream), each times the schedule weight of the block's
   timestep; total = mean video term + action_weight * mean action term (upstream: action_weight 1).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

from dreamzero.train.data import Clip
from dreamzero.train.schedule import TrainingSchedule

_MASK_CHANNELS = 4  # i2v `y`: 4 mask channels (1 on the anchor frame) + the conditioning latents


@dataclass
class EncodedBatch:
    """Frozen-encoder outputs of B clips; everything the DiT needs besides the noise."""

    text: torch.Tensor  # [B, text_len, text_dim] T5 rows
    clip_feature: torch.Tensor | None  # [B, 257, image_dim]
    y: torch.Tensor | None  # [B, 4 + z, 1 + K nfpb, h, w]
    anchor_latent: torch.Tensor  # [B, z, 1, h, w]
    block_latents: torch.Tensor  # [B, K, z, nfpb, h, w]
    state: torch.Tensor  # [B, K, 1, max_state_dim]
    actions: torch.Tensor  # [B, K, A, action_dim]
    action_mask: torch.Tensor  # [B, action_dim]

    @property
    def blocks(self) -> int:
        return self.block_latents.shape[1]

    @staticmethod
    def cat(batches: list[EncodedBatch]) -> EncodedBatch:
        """One batch of the clips of several (same blocks, same model)."""

        def join(name):
            parts = [getattr(b, name) for b in batches]
            return None if parts[0] is None else torch.cat(parts, dim=0)

        return EncodedBatch(**{f.name: join(f.name) for f in fields(EncodedBatch)})

    def rows(self, index) -> EncodedBatch:
        """The clips at `index` (a list of rows or a slice)."""

        def take(name):
            value = getattr(self, name)
            return None if value is None else value[index]

        return EncodedBatch(**{f.name: take(f.name) for f in fields(EncodedBatch)})


def _frames(images: np.ndarray, hw, device, dtype) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> [N, 3, H', W'] in [-1, 1] at the model's input size (the pipeline's resize)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    if hw is not None and tuple(hw) != tuple(x.shape[-2:]):
        x = F.interpolate(x, size=tuple(hw), mode="bilinear", align_corners=False)
    return x.to(dtype)


@torch.no_grad()
def encode_clips(model, clips: list[Clip]) -> EncodedBatch:
    """Run the frozen encoders on B clips (all with the same number of blocks)."""
    cfg, dit_cfg = model.config, model.config.dit
    device, dtype = model.device, model.dtype
    hw = cfg.pipeline.model_input_hw
    b, k, nfpb = len(clips), clips[0].block_frames.shape[0], dit_cfg.num_frame_per_block
    anchors = _frames(np.stack([c.anchor for c in clips]), hw, device, dtype)  # [B, 3, H, W]
    text = model.text_encoder.encode([c.prompt for c in clips]).to(device, dtype)
    clip_feature = model.image_encoder.encode(anchors).to(dtype) if dit_cfg.has_image_input else None
    y = None
    if dit_cfg.has_image_input and dit_cfg.concat_first_frame_latent:
        video = torch.zeros(b, 3, 1 + 4 * nfpb * k, *anchors.shape[-2:], device=device, dtype=dtype)
        video[:, :, 0] = anchors
        lat, _ = model.vae.encode_causal(video)
        mask = torch.zeros(b, _MASK_CHANNELS, *lat.shape[2:], device=device, dtype=lat.dtype)
        mask[:, :, 0] = 1.0
        y = torch.cat([mask, lat], dim=1).to(dtype)
    anchor_latent = model.vae.encode(anchors.unsqueeze(2)).float()[:, :, :1]
    blocks = []
    for j in range(k):
        frames = np.stack([c.block_frames[j] for c in clips])  # [B, 4, H, W, 3]
        x = _frames(frames.reshape(-1, *frames.shape[2:]), hw, device, dtype).unflatten(0, (b, frames.shape[1]))
        x = x.repeat_interleave(2, dim=1)  # each frame twice, as the pipeline encodes observed frames
        video = torch.cat([anchors.unsqueeze(1), x], dim=1).permute(0, 2, 1, 3, 4)  # [B, 3, 1 + 8, H, W]
        blocks.append(model.vae.encode(video).float()[:, :, -nfpb:])
    return EncodedBatch(
        text=text,
        clip_feature=clip_feature,
        y=y,
        anchor_latent=anchor_latent,
        block_latents=torch.stack(blocks, dim=1),
        state=torch.from_numpy(np.stack([c.state for c in clips])).to(device).unsqueeze(2),
        actions=torch.from_numpy(np.stack([c.actions for c in clips])).to(device)[..., : dit_cfg.action_dim],
        action_mask=torch.from_numpy(np.stack([c.action_mask for c in clips])).to(device)[:, : dit_cfg.action_dim],
    )


@dataclass
class DrawnNoise:
    """The random draws of one step: timestep indices [B, K], video noise (as block_latents), action noise (as actions).
    Drawn for the global batch and sliced by row, a distributed step sees the noise a single process would."""

    idx: torch.Tensor
    video: torch.Tensor
    action: torch.Tensor

    def rows(self, index) -> DrawnNoise:
        return DrawnNoise(self.idx[index], self.video[index], self.action[index])


def draw_noise(schedule: TrainingSchedule, generator: torch.Generator, rows: int, batch: EncodedBatch) -> DrawnNoise:
    """Draws for `rows` clips shaped like `batch`'s, in the order a plain step draws them (indices, video, action)."""
    k = batch.block_latents.shape[1]
    idx = schedule.sample_indices((rows, k), generator)
    video = torch.randn((rows, *batch.block_latents.shape[1:]), generator=generator, device=generator.device)
    action = torch.randn((rows, *batch.actions.shape[1:]), generator=generator, device=generator.device)
    return DrawnNoise(idx, video, action)


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar with grad: video + action
    video: torch.Tensor  # scalar (detached)
    action: torch.Tensor  # scalar (detached)


def teacher_forced_loss(
    dit,
    batch: EncodedBatch,
    schedule: TrainingSchedule,
    generator: torch.Generator,
    autocast_dtype=None,
    action_weight: float = 1.0,
    noise: DrawnNoise | None = None,
) -> LossTerms:
    """Flow-matching loss of B clips, block by block over the KV cache (see the module docstring).

    `generator` draws the timesteps and the noise (on its own device, then moved): reseeding it replays the same
    noisy inputs, which is how a fixed batch is evaluated. `autocast_dtype` (e.g. torch.bfloat16) runs the DiT under
    torch.autocast on the batch's device type; losses are always computed in float32. `action_weight` scales the
    action term of the total (the returned `action` term is unscaled). `noise`: draws made beforehand (`draw_noise`,
    a distributed step's slice of the global batch's); None draws them here from `generator`.
    """
    b, k = batch.block_latents.shape[:2]
    nfpb = dit.cfg.num_frame_per_block
    device = batch.block_latents.device
    if noise is None:
        noise = draw_noise(schedule, generator, b, batch)
    idx = noise.idx  # [B, K]
    video_noise, action_noise = noise.video.to(device), noise.action.to(device)
    t_int = schedule.timesteps[idx.to(schedule.timesteps.device)].long().to(device)  # [B, K] as the DiT takes them
    weight = schedule.weights[idx.to(schedule.weights.device)].to(device)  # [B, K]
    enabled = autocast_dtype is not None
    y = batch.y

    def y_at(start: int, frames: int):
        return None if y is None else y[:, :, start : start + frames]

    with torch.autocast(device_type=device.type, dtype=autocast_dtype or torch.bfloat16, enabled=enabled):
        ctx = dit.embed_context(batch.text, batch.clip_feature)
        zeros = torch.zeros(b, 1, dtype=torch.long, device=device)
        cache = dit(
            batch.anchor_latent, zeros, kv_cache=None, current_start_frame=0, context_emb=ctx, y=y_at(0, 1)
        ).kv_cache
        video_terms, action_terms = [], []
        for j in range(k):
            start = 1 + j * nfpb
            x0, a0 = batch.block_latents[:, j], batch.actions[:, j]
            noisy_x = schedule.add_noise(x0, video_noise[:, j], idx[:, j])
            noisy_a = schedule.add_noise(a0, action_noise[:, j], idx[:, j])
            t = t_int[:, j : j + 1]
            out = dit(
                noisy_x,
                t.expand(b, nfpb),
                kv_cache=cache,
                current_start_frame=start,
                context_emb=ctx,
                y=y_at(start, nfpb),
                action=noisy_a,
                timestep_action=t.expand(b, a0.shape[1]),
                state=batch.state[:, j],
            )
            v_target, a_target = video_noise[:, j] - x0, action_noise[:, j] - a0
            v_err = (out.video.float() - v_target.float()).pow(2).mean(dim=(1, 2, 3, 4))  # [B]
            a_err = ((out.action.float() - a_target.float()).pow(2) * batch.action_mask[:, None]).mean(dim=(1, 2))
            video_terms.append(v_err * weight[:, j])
            action_terms.append(a_err * weight[:, j])
            if j + 1 < k:  # the clean block joins the context of the next one
                clean_t = torch.zeros(b, nfpb, dtype=torch.long, device=device)
                cache = dit(
                    x0, clean_t, kv_cache=cache, current_start_frame=start, context_emb=ctx, y=y_at(start, nfpb)
                ).kv_cache
    video = torch.stack(video_terms).mean()
    action = torch.stack(action_terms).mean()
    return LossTerms(loss=video + action_weight * action, video=video.detach(), action=action.detach())
