"""Stand-ins for the pipeline tests (tests/unit/pipeline): the tiny DiT with small deterministic stand-in encoders
(same call contracts as dreamzero.model.*: fast, and independent of the encoder implementations), the pipeline and
batches over it; and `ScriptedPipeline`, a pipeline that returns a fixed chunk, for the embedded policy's tests."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from dreamzero.config import apply_overrides, preset
from dreamzero.model.dit import CausalWanDiT
from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.sessions import SessionStore
from dreamzero.types import ChunkResult, ModelBatch, SessionReport

H, W = 32, 64  # canvas sent by the tests (= tiny model_input_hw)


# -- stand-in encoders (same call contracts as dreamzero.model.*) ------------------------------------------------------


class StubText:
    def __init__(self, dim: int, text_len: int = 512):
        self.table = torch.randn(256, dim, generator=torch.Generator().manual_seed(1))
        self.text_len = text_len

    def encode(self, prompts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(prompts), self.text_len, self.table.shape[1])
        for i, p in enumerate(prompts):
            ids = torch.tensor(list(p.encode()[: self.text_len]), dtype=torch.long)
            out[i, : len(ids)] = self.table[ids]  # rows past the prompt stay zero, as the real encoder's
        return out


class StubImage:
    def __init__(self, dim: int):
        self.proj = torch.randn(3, dim, generator=torch.Generator().manual_seed(2))

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, 257, dim]
        pooled = F.adaptive_avg_pool2d(x.float(), 16).flatten(2).transpose(1, 2)  # [B, 256, 3]
        tokens = torch.cat([pooled.mean(1, keepdim=True), pooled], dim=1)
        return tokens @ self.proj


class StubVAE:
    """Causal like Wan's: frame 0 alone, then 4 frames per latent frame; `factor`x spatial average."""

    def __init__(self, z: int, factor: int):
        self.proj = torch.randn(3, z, generator=torch.Generator().manual_seed(3))
        self.factor = factor

    def encode(self, video: torch.Tensor) -> torch.Tensor:  # [B, 3, T, H, W] -> [B, z, 1 + (T-1)/4, h, w]
        v = video.float()
        first = v[:, :, :1]
        rest = v[:, :, 1:]
        if rest.shape[2]:
            rest = rest.unflatten(2, (-1, 4)).mean(3)
        lat = torch.cat([first, rest], dim=2)
        lat = F.avg_pool3d(lat, (1, self.factor, self.factor))
        return torch.einsum("bcthw,cz->bzthw", lat, self.proj)

    def encode_causal(self, video: torch.Tensor, state=None):  # no state to carry: each latent sees its own frames
        if state is None:
            return self.encode(video), []
        lat = F.avg_pool3d(video.float().unflatten(2, (-1, 4)).mean(3), (1, self.factor, self.factor))
        return torch.einsum("bcthw,cz->bzthw", lat, self.proj), []


def make_model(kind: str = "i2v"):
    cfg = preset("tiny")
    if kind == "ti2v":  # libero_5b-shaped tiny variant: CLIP but no y, z=48, 16x VAE, 16-step horizon
        cfg.dit = dataclasses.replace(
            cfg.dit, model_type="ti2v", in_dim=48, out_dim=48, frame_seqlen=8, concat_first_frame_latent=False,
            num_action_per_block=16,
        )  # fmt: skip
        cfg.action_horizon = 16
        cfg.pipeline = cfg.pipeline.with_overrides({"model_input_hw": (64, 128)})  # 16x VAE -> 4x8 latent
    torch.manual_seed(0)
    dit = CausalWanDiT(cfg.dit).eval()
    with torch.no_grad():
        for name, p in dit.named_parameters():  # every pathway matters (upstream zero-inits some)
            if name.endswith("modulation"):
                p.normal_(0, 0.3)
            elif p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return SimpleNamespace(
        model=dit,
        config=cfg,
        text_encoder=StubText(cfg.dit.text_dim),
        image_encoder=StubImage(cfg.dit.image_dim),
        vae=StubVAE(cfg.dit.out_dim, 16 if kind == "ti2v" else 8),
    )


FAST = {"num_inference_steps": 4, "dit_step_mask": (True, True, False, True)}  # loop logic needs no 16 steps


def make_pipe(model, max_sessions: int = 64, fast: bool = True, **overrides) -> DreamZeroPipeline:
    config = apply_overrides(model.config.pipeline, {**(FAST if fast else {}), **overrides})
    return DreamZeroPipeline(model, config, SessionStore(max_sessions))


def make_batch(ids, t=1, prompts=None, seed_offset=0, **kw) -> ModelBatch:
    rng = np.random.default_rng(len(ids) + t + seed_offset)
    n = len(ids)
    return ModelBatch(
        images=rng.integers(0, 256, (n, t, H, W, 3), dtype=np.uint8),
        state=rng.standard_normal((n, 1, 64)).astype(np.float32),
        state_mask=np.ones((n, 1, 64), bool),
        prompts=prompts or [f"pick up the block {i}" for i in ids],
        session_ids=list(ids),
        **kw,
    )


class ScriptedPipeline:
    """Stands in for DreamZeroPipeline: returns a fixed normalised chunk and records what it was given."""

    action_horizon = 24
    max_action_dim = 32

    def __init__(self, chunk: np.ndarray):
        self.chunk = chunk  # [24, 32]
        self.batches: list[ModelBatch] = []
        self.resets: list[list[str]] = []
        self.steps: dict[str, int] = {}

    def generate(self, batch: ModelBatch) -> ChunkResult:
        self.batches.append(batch)
        reports = []
        for sid in batch.session_ids:
            new = sid not in self.steps
            self.steps[sid] = self.steps.get(sid, 0) + 1
            reports.append(SessionReport(sid, self.steps[sid], new, "new_session" if new else None, 1))
        actions = np.broadcast_to(self.chunk, (len(batch), 24, 32)).astype(np.float32)
        return ChunkResult(actions=actions, sessions=reports, timings_ms={"denoise": 1.0})

    def reset_sessions(self, ids):
        self.resets.append(list(ids))


def scripted_chunk() -> np.ndarray:
    chunk = np.zeros((24, 32), np.float32)
    chunk[:, :7] = np.linspace(-0.5, 0.5, 24)[:, None]  # joint deltas (identity stats in droid_metadata)
    chunk[:, 7] = np.where(np.arange(24) < 12, -1.0, 1.0)  # gripper 0 then 1
    return chunk
