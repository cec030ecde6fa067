"""Predicted video: the chunk's denoised video latents -> uint8 frames, for the rows that asked (`return_video`).

Each asking session keeps the VAE decoder's causal state (`SessionState.video_state`), so its chunks decode into one
continuous video: the decode of [anchor latent, chunk 1, chunk 2, ...] as a whole, less its first frame (the anchor,
which the client sent). The state is primed with the session's anchor (its first frame, encoded) when the session
(re)starts or first asks, so every chunk gives `4 * num_frame_per_block` frames whether the row is new or continuing
and the rows of one batch stack. A session that does not ask in a call drops its state (its video would have a gap);
asking again primes it afresh. Nothing here runs for a call where no row asks.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from dreamzero.model.vae import decode_state_key, split_decode_state, stack_decode_states
from dreamzero.pipeline.rows import Row


def wants_video(return_video: list[bool] | None) -> bool:
    return bool(return_video) and any(return_video)


def to_uint8(video: torch.Tensor) -> np.ndarray:
    """[B, 3, T, H, W] in [-1, 1] -> uint8 [B, T, H, W, 3]."""
    x = ((video.float().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).cpu().numpy()


def _prime(vae, rows: list[Row]) -> None:
    """Decoder state after each row's anchor latent (one batched encode + decode of the first frames)."""
    first = torch.stack([r.state.first_frame for r in rows]).unsqueeze(2)  # [G, 3, 1, H, W]
    anchor = vae.encode(first.to(next(vae.parameters()).dtype))[:, :, :1]
    _, state = vae.decode_causal(anchor)
    for r, st in zip(rows, split_decode_state(state, len(rows))):
        r.state.video_state = st


def predicted_frames(vae, rows: list[Row], latents: torch.Tensor, return_video: list[bool]) -> list[np.ndarray | None]:
    """uint8 [T, H, W, 3] per asking row (None for the others), in batch order; advances the asking rows' decoder
    states and drops the others'. `latents` [B, z, F, h, w] are this chunk's predicted latents in batch order."""
    out: list[np.ndarray | None] = [None] * len(rows)
    asking = [r for r in rows if return_video[r.index]]
    for r in rows:
        if not return_video[r.index]:
            r.state.video_state = None
    fresh = [r for r in asking if r.restarted or r.state.video_state is None]
    if fresh:
        _prime(vae, fresh)
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in asking:  # rows decode together when their decoder states have one layout
        groups[decode_state_key(r.state.video_state)].append(r)
    for group in groups.values():
        state = stack_decode_states([r.state.video_state for r in group])
        video, state = vae.decode_causal(latents[[r.index for r in group]], state)
        frames = to_uint8(video)
        for r, st, f in zip(group, split_decode_state(state, len(group)), frames):
            r.state.video_state = st
            out[r.index] = f
    return out


def video_state_nbytes(vae_cfg, canvas_hw: tuple[int, int], dtype: torch.dtype, num_frame_per_block: int) -> int:
    """Bytes of one row's decoder state at the model-input `canvas_hw`, after its anchor and one chunk: measured on
    the meta device (shapes only), what admission adds for a session that asks for video."""
    from dreamzero.model.vae import WanVAE, decode_state_nbytes, spatial_factor

    s = spatial_factor(vae_cfg)
    with torch.device("meta"):
        meta = WanVAE(vae_cfg).to(dtype)
        z = torch.zeros(1, vae_cfg.z_dim, 1, canvas_hw[0] // s, canvas_hw[1] // s, dtype=dtype)
        _, state = meta.decode_causal(z)
        _, state = meta.decode_causal(z.expand(-1, -1, num_frame_per_block, -1, -1), state)
    return decode_state_nbytes(state)
