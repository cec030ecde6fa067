"""bf16 vs fp32 drift, shared by the CPU tests (tests/unit/model/test_bf16_drift.py) and the GPU tier (tests/gpu).

`tiny_chunks` runs the tiny model's full loop chunk after chunk in several dtypes from one set of fp32 weights (each
dtype gets a copy cast from them, as a user casting a checkpoint would), the same inputs and the same noise seeds;
`slice_dit_forward` runs one denoise forward of a slice preset's DiT (the real widths and token counts) in several
dtypes from the same bf16 weights and inputs; `drift` compares two outputs. The measured figures and the bounds
are in docs/model.md, "bf16 drift".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

TINY_CANVAS = (32, 64)  # the tiny preset's model_input_hw: nothing is resized


@dataclass(frozen=True)
class Drift:
    max_abs: float  # largest |other - ref| of any entry
    rel_l2: float  # ||other - ref|| / ||ref||

    def __str__(self) -> str:
        return f"max abs {self.max_abs:.4f}, relative L2 {self.rel_l2:.4f}"


def drift(ref, other) -> Drift:
    """How far `other` is from `ref` (arrays or tensors of one shape), in float64."""
    a = np.asarray(torch.as_tensor(ref).double().cpu())
    b = np.asarray(torch.as_tensor(other).double().cpu())
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if not np.isfinite(b).all():
        return Drift(float("inf"), float("inf"))
    return Drift(float(np.abs(b - a).max()), float(np.linalg.norm(b - a) / max(np.linalg.norm(a), 1e-12)))


def chunk_batch(step: int, hw: tuple[int, int] = TINY_CANVAS, session: str = "d", input_seed: int = 0, seed=None):
    """One session's 4-frame call (a restart at step 0, continuing after), deterministic content per step."""
    from dreamzero.types import ModelBatch

    rng = np.random.default_rng([input_seed, step])
    return ModelBatch(
        images=rng.integers(0, 256, (1, 4, *hw, 3), dtype=np.uint8),
        state=(rng.standard_normal((1, 1, 64)) * 0.5).astype(np.float32),
        state_mask=np.ones((1, 1, 64), bool),
        prompts=["pick up the cup and put it in the bowl"],
        session_ids=[session],
        seeds=None if seed is None else [seed],
    )


def tiny_chunks(
    device: str | torch.device = "cpu",
    dtypes=(torch.float32, torch.bfloat16),
    chunks: int = 4,
    weight_seed: int = 0,
    input_seed: int = 0,
    noise_seed: int | None = None,
    overrides: dict | None = None,
) -> dict[torch.dtype, list[np.ndarray]]:
    """The tiny model's actions [1, 24, 32] chunk by chunk (the first a restart), once per dtype, from one set of fp32
    weights (seed `weight_seed`) cast to each dtype, the same inputs and the same noise seed (None: 1140)."""
    from dreamzero.config import preset
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import build_local_tokenizer
    from dreamzero.pipeline import DreamZeroPipeline

    ref = DreamZeroModel.from_config(preset("tiny"), seed=weight_seed)  # fp32 on CPU, copied at each dtype
    out = {}
    for dtype in dtypes:
        model = copy.deepcopy(ref).to(device, dtype)
        model.text_encoder.tokenizer = build_local_tokenizer(model.config.text_encoder.vocab_size)
        pipe = DreamZeroPipeline(model, model.config.pipeline.with_overrides(overrides))
        out[dtype] = [
            pipe.generate(chunk_batch(k, input_seed=input_seed, seed=noise_seed)).actions for k in range(chunks)
        ]
    return out


@dataclass
class SliceForward:
    video: torch.Tensor  # [1, out_dim, 2, h, w] fp32 video prediction
    action: torch.Tensor  # [1, A, action_dim] fp32 action prediction


def slice_dit(preset_name: str = "droid_14b_slice", seed: int = 0, device: str | torch.device = "cpu"):
    """A slice preset's DiT with seeded random weights, built in bf16 (a release checkpoint's dtype)."""
    from dreamzero.config import preset
    from dreamzero.model.dit import CausalWanDiT
    from dreamzero.model.dreamzero import _allocate, init_random_weights

    with torch.device("meta"):
        dit = CausalWanDiT(preset(preset_name).dit)
    _allocate(dit, torch.device(device), torch.bfloat16)
    init_random_weights(dit, seed)
    return dit.eval().requires_grad_(False)


def slice_inputs(dit, seed: int = 0, prompt_tokens: int = 40) -> dict:
    """Inputs of the first chunk's denoise forward at the preset's real sizes: the anchor latent (one frame,
    `frame_seqlen` tokens) to prefill, then 2 noisy latent frames + the action and state registers, T5 rows zero past
    `prompt_tokens` (as the text encoder pads), a CLIP feature and, for i2v, `y`."""
    cfg = dit.cfg
    g = torch.Generator().manual_seed(seed)
    h, w = latent_grid(cfg)
    frames = cfg.num_frame_per_block
    context = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g)
    context[:, prompt_tokens:] = 0
    y = None
    if cfg.has_image_input and cfg.concat_first_frame_latent:
        y = torch.randn(1, cfg.in_dim - cfg.out_dim, 1 + frames, h, w, generator=g)
    return {
        "context": context,
        "clip": torch.randn(1, 257, cfg.image_dim, generator=g) if cfg.has_image_input else None,
        "y": y,
        "anchor": torch.randn(1, cfg.out_dim, 1, h, w, generator=g),
        "noise": torch.randn(1, cfg.out_dim, frames, h, w, generator=g),
        "action": torch.randn(1, cfg.num_action_per_block, cfg.action_dim, generator=g),
        "state": torch.randn(1, cfg.num_state_per_block, cfg.max_state_dim, generator=g) * 0.5,
        "t": 937,  # the 5th of the 16 scheduler timesteps: mid-noise
    }


def latent_grid(cfg) -> tuple[int, int]:
    """The latent (h, w) whose 2x2 patches give `frame_seqlen` tokens: DROID 44x80 (880), LIBERO 10x20 (50)."""
    known = {880: (44, 80), 50: (10, 20), 8: (4, 8), 32: (8, 16)}
    if cfg.frame_seqlen not in known:
        raise ValueError(f"no latent grid known for frame_seqlen {cfg.frame_seqlen}")
    return known[cfg.frame_seqlen]


@torch.no_grad()
def slice_dit_forward(dit, inputs: dict, dtypes=(torch.float32, torch.bfloat16)) -> dict[torch.dtype, SliceForward]:
    """Per dtype, one denoise forward (video + registers over the anchor's KV cache) of `dit` cast to that dtype.

    The anchor's cache is prefilled once, in bf16, and given to every dtype's forward (cast): it is an input here,
    so the figures are one forward's drift. The DiT is cast in place and left in the last dtype."""
    y = inputs["y"]
    dit.to(torch.bfloat16)
    emb = dit.embed_context(inputs["context"], inputs["clip"])
    prefill = dit(
        inputs["anchor"],
        torch.zeros(1, 1, dtype=torch.long),
        kv_cache=None,
        current_start_frame=0,
        context_emb=emb,
        y=None if y is None else y[:, :, :1],
    )
    out = {}
    for dtype in dtypes:
        dit.to(dtype)
        out[dtype] = SliceForward(
            *_denoise(dit, inputs, [kv.to(dtype) for kv in prefill.kv_cache], None if y is None else y[:, :, 1:])
        )
    return out


def _denoise(dit, inputs: dict, cache, y):
    cfg = dit.cfg
    t = inputs["t"]
    res = dit(
        inputs["noise"],
        torch.full((1, cfg.num_frame_per_block), t),
        kv_cache=cache,
        current_start_frame=1,
        context_emb=dit.embed_context(inputs["context"], inputs["clip"]),
        y=y,
        action=inputs["action"],
        timestep_action=torch.full((1, cfg.num_action_per_block), t),
        state=inputs["state"],
    )
    return res.video.float(), res.action.float()
