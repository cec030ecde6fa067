"""Conditioning and prefill of observed frames: what a session's caches hold before its block is denoised.

- A restarted row (`start_sessions`): CLIP of the anchor frame, VAE of [anchor, zeros...] -> the first-frame
  conditioning `y`, then prefill of the anchor latent at frame 0.
- A continuing row (`prefill_observed`): the conditioning its next block needs (`extend_conditioning`), VAE of
  [first frame, each new frame twice], then prefill of the last `num_frame_per_block` latents at
  `current_start_frame - num_frame_per_block`.
Rows of each kind share one forward whatever their frame positions (`batch_cache`: the caches are read and replaced
layer by layer); `context_emb` builds the cross-attention context of any set of rows, the denoise included.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

import torch

from dreamzero.config import DiTConfig, PipelineConfig
from dreamzero.errors import ConfigError, InvalidObservation
from dreamzero.model.dit import CrossContext
from dreamzero.model.vae import split_state, stack_states
from dreamzero.pipeline.batch_cache import SessionCaches
from dreamzero.pipeline.denoise import branch_rows, cfg_row_layout, prefill_block
from dreamzero.pipeline.rows import Row
from dreamzero.pipeline.timer import StageTimer
from dreamzero.sessions import SessionState


class Pipeline(Protocol):
    """What these stages read of the pipeline that runs them (`core.DreamZeroPipeline`; a protocol, so this module
    stays below the core that calls it)."""

    model: Any
    dit: Any
    dit_cfg: DiTConfig
    config: PipelineConfig
    device: torch.device
    dtype: torch.dtype
    guided: bool
    branches: tuple[str, ...]  # the CFG branches of this process's rows (one under CFG-parallel)


_MASK_CHANNELS = 4  # `y` = 4 first-frame mask channels + z latent channels (i2v)


def vae_encode(pipe: Pipeline, video: torch.Tensor) -> torch.Tensor:
    """[G, 3, T, H, W] in [-1, 1] -> normalised latents [G, z, T', h, w] fp32; checks the token count."""
    return check_tokens(pipe.model.vae.encode(video.to(pipe.dtype)).float(), pipe.dit_cfg)


def check_tokens(lat: torch.Tensor, dit_cfg: DiTConfig) -> torch.Tensor:
    """`lat` unchanged when its latent grid gives `dit.frame_seqlen` tokens per frame, else InvalidObservation."""
    p = dit_cfg.patch_size
    tokens = (lat.shape[-2] // p[1]) * (lat.shape[-1] // p[2])
    if tokens != dit_cfg.frame_seqlen:
        raise InvalidObservation(
            f"images give {tokens} tokens per latent frame (latent {tuple(lat.shape[-2:])}), the model expects "
            f"dit.frame_seqlen={dit_cfg.frame_seqlen}; send the embodiment's canvas size or set "
            "pipeline.model_input_hw",
            field="images",
        )
    return lat


def context_emb(pipe: Pipeline, states: list[SessionState], clip: list[torch.Tensor | None]) -> CrossContext:
    """Cross-attention context for the rows of one forward, session-major: [R, (257 +) 512, D]."""
    layout = cfg_row_layout(len(states), pipe.guided, pipe.branches)
    text = torch.cat([states[s].text_cache[b] for s, b in layout])
    img = None
    if pipe.dit_cfg.has_image_input:
        img = torch.cat([clip[s] for s, _ in layout])
    return pipe.dit.embed_context(text, img)


def start_sessions(pipe: Pipeline, rows: list[Row], anchors: torch.Tensor, timer: StageTimer) -> None:
    """Restarted rows: CLIP + first-frame conditioning, then prefill of the anchor latent at frame 0."""
    cfg = pipe.dit_cfg
    states = [r.state for r in rows]
    g = len(rows)
    if cfg.has_image_input:
        with timer("clip"):
            # the encoder may sit on the CPU (placement.image_encoder): its features come back to the serving device
            clip = pipe.model.image_encoder.encode(anchors.to(pipe.dtype)).to(pipe.device, pipe.dtype)  # [G,257,D]
    vae_states = [None] * g
    with timer("vae"):
        if cfg.has_image_input and cfg.concat_first_frame_latent:
            # [anchor, zeros...] over the window -> latents of every frame position, mask 1 on frame 0. Only the
            # frames this chunk conditions on (frame 0 and the first block) are encoded now; the encoder is causal,
            # so the rest follow chunk by chunk from its state (`extend_conditioning`), batched with other rows
            n_frames = pipe.config.num_frames
            if pipe.config.conditioning_by_chunk:
                n_frames = min(1 + 4 * cfg.num_frame_per_block, n_frames)
            video = torch.zeros(g, 3, n_frames, *anchors.shape[-2:], device=pipe.device)
            video[:, :, 0] = anchors
            lat, state = pipe.model.vae.encode_causal(video.to(pipe.dtype))
            lat = check_tokens(lat.float(), pipe.dit_cfg)  # [G, z, 1 + nfpb, h, w]
            mask = torch.zeros(g, _MASK_CHANNELS, *lat.shape[2:], device=pipe.device)
            mask[:, :, 0] = 1.0
            y = torch.cat([mask, lat], dim=1).to(pipe.dtype)
            if y.shape[1] + cfg.out_dim != cfg.in_dim:
                raise ConfigError(
                    f"y has {y.shape[1]} channels (4 mask + {lat.shape[1]} latent) but dit.in_dim - dit.out_dim "
                    f"= {cfg.in_dim - cfg.out_dim}; the VAE's z_dim does not match the DiT"
                )
            if n_frames < pipe.config.num_frames:
                vae_states = split_state(state, g)
            first_latent = lat[:, :, :1]
        else:
            y = None
            first_latent = vae_encode(pipe, anchors.unsqueeze(2))[:, :, :1]
    for gi, s in enumerate(states):
        s.first_frame = anchors[gi].to(pipe.dtype).clone()
        # own storage when batched: a session must not pin the batch's tensors (its bytes are what it holds)
        s.clip_feature = (clip[gi : gi + 1].clone() if g > 1 else clip) if cfg.has_image_input else None
        s.y = (y[gi : gi + 1].clone() if g > 1 else y) if y is not None else None
        s.vae_state = vae_states[gi]
        s.latent_hw = tuple(first_latent.shape[-2:])
        s.current_start_frame = 0
    with timer("prefill"):
        ctx = context_emb(pipe, states, [s.clip_feature for s in states])
        prefill_block(
            pipe.dit,
            branch_rows(first_latent, len(pipe.branches) > 1).to(pipe.dtype),
            context_emb=ctx,
            kv_cache=None,
            start_frame=0,
            y=branch_rows(y[:, :, :1], len(pipe.branches) > 1) if y is not None else None,
            write_to=SessionCaches(states, pipe.branches),  # released at the restart: filled layer by layer
        )
    for s in states:
        s.current_start_frame = 1


def extend_conditioning(pipe: Pipeline, states: list[SessionState], timer: StageTimer) -> None:
    """Encode the conditioning frames the next block needs (zero frames after each row's anchor) from each row's
    causal encoder state, rows needing as many frames in one batched call."""
    nfpb = pipe.dit_cfg.num_frame_per_block
    todo: dict[int, list[SessionState]] = defaultdict(list)
    for s in states:
        missing = s.current_start_frame + nfpb - s.y.shape[2]
        if missing > 0:
            if s.vae_state is None:
                raise RuntimeError(f"session {s.session_id!r} needs conditioning past its window")
            todo[missing].append(s)
    for missing, group in todo.items():
        with timer("vae"):
            hw = tuple(group[0].first_frame.shape[-2:])
            video = torch.zeros(len(group), 3, 4 * missing, *hw, device=pipe.device, dtype=pipe.dtype)
            lat, state = pipe.model.vae.encode_causal(video, stack_states([s.vae_state for s in group]))
            lat = lat.to(pipe.dtype)
            mask = lat.new_zeros(len(group), _MASK_CHANNELS, *lat.shape[2:])
            window = 1 + (pipe.config.num_frames - 1) // 4  # latent frames of the whole conditioning window
            for s, part, st in zip(group, torch.cat([mask, lat], dim=1).split(1), split_state(state, len(group))):
                s.y = torch.cat([s.y, part], dim=2)
                s.vae_state = None if s.y.shape[2] >= window else st


def prefill_observed(pipe: Pipeline, rows: list[Row], frames: torch.Tensor, timer: StageTimer) -> None:
    """Continuing rows: VAE of [first frame, each new frame twice]; prefill the last block at each row's frame."""
    nfpb = pipe.dit_cfg.num_frame_per_block
    states = [r.state for r in rows]
    size = tuple(frames.shape[-2:])
    for s in states:
        if tuple(s.first_frame.shape[-2:]) != size:
            raise InvalidObservation(
                f"session {s.session_id!r} started with {tuple(s.first_frame.shape[-2:])} frames, got {size}; "
                "the canvas size cannot change within a session (reset it)",
                field="images",
            )
    if pipe.dit_cfg.has_image_input and pipe.dit_cfg.concat_first_frame_latent:
        extend_conditioning(pipe, states, timer)  # after the canvas check: the rows' encoder states stack
    with timer("vae"):
        new = frames[[r.index for r in rows]].repeat_interleave(2, dim=1)  # [G, 2T, 3, H, W]
        first = torch.stack([s.first_frame.float() for s in states]).unsqueeze(1)  # [G, 1, 3, H, W]
        video = torch.cat([first, new], dim=1).permute(0, 2, 1, 3, 4)  # [G, 3, 1 + 2T, H, W]
        lat = vae_encode(pipe, video)[:, :, -nfpb:]  # [G, z, nfpb, h, w]
    starts = [s.current_start_frame - nfpb for s in states]
    y = None
    if pipe.dit_cfg.has_image_input and pipe.dit_cfg.concat_first_frame_latent:
        y = torch.cat([s.y[:, :, st : st + nfpb] for s, st in zip(states, starts)])
    with timer("prefill"):
        ctx = context_emb(pipe, states, [s.clip_feature for s in states])
        caches = SessionCaches(states, pipe.branches)  # each layer read, then replaced by its new one
        prefill_block(
            pipe.dit,
            branch_rows(lat, len(pipe.branches) > 1).to(pipe.dtype),
            context_emb=ctx,
            kv_cache=caches,
            start_frame=starts,
            y=branch_rows(y, len(pipe.branches) > 1),
            write_to=caches,
        )
