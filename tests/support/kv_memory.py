"""What a model call's KV caches cost in memory, measured on CPU: a tracer of live tensor bytes and a KV-dominated
pipeline (tests/unit/pipeline/test_batch_kv_memory.py, benchmarks/batch_cache_memory.py).

`LiveBytes` counts, under a `TorchDispatchMode`, every storage an operator allocates while it is active (and the
storages `hold` registers before), until the storage is freed: its `peak` is the most bytes live at once. The
pipeline is the tiny DiT made deep, with a long window and no image branch, and stub encoders, so that the DiT's KV
caches and their copies are most of a call's memory; `last_chunk_transient` counts the K/V-shaped tensors alone
unless asked for all.
"""

from __future__ import annotations

import dataclasses
import weakref
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dreamzero.config import preset
from dreamzero.model.dit import CausalWanDiT
from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.sessions import SessionState, SessionStore
from dreamzero.types import ModelBatch

CANVAS = (64, 128)  # 8x VAE -> 8x16 latent -> 32 tokens per frame


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made under this mode (and those `hold` registers) that are still alive; `peak` the most.

    With `last_dims` only storages first made with those trailing dimensions count: (heads, head_dim) picks the KV
    caches, their stacked rows and copies, and the attention's keys and values (the DiT's other activations and the
    input frames do not). A storage is counted once, when an operator returns it and none of the operator's inputs
    holds it (a view or an in-place result is not new memory), and uncounted when Python frees it (torch keeps one
    Python object per storage, so a weak reference sees the storage's own end, not a tensor's).
    """

    def __init__(self, last_dims: tuple[int, ...] | None = None):
        super().__init__()
        self.last_dims = last_dims  # count only tensors made with these trailing dims ((heads, head_dim): K/V)
        self.live = 0
        self.peak = 0
        self._ids: set[int] = set()

    def hold(self, tensors) -> None:
        """Count tensors that exist already (the sessions' own state), so that their frees are seen."""
        for t in tensors:
            self._track(t.untyped_storage())

    def reset_peak(self) -> None:
        self.peak = self.live

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._ids:
            return
        n = storage.nbytes()
        self._ids.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self._ids.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                if self.last_dims is not None and tuple(t.shape[-len(self.last_dims) :]) != self.last_dims:
                    continue
                storage = t.untyped_storage()
                if id(storage) not in inputs:
                    self._track(storage)
        return out


def session_tensors(state: SessionState) -> list[torch.Tensor]:
    """Every tensor a session holds (the parts of `SessionState.nbytes`)."""
    tensors = list(state.kv_cache) + list(state.text_cache.values())
    tensors += [t for t in (state.clip_feature, state.y, state.first_frame) if t is not None]
    tensors += [t for t in state.vae_state or () if t is not None]
    return tensors


class _Text:
    def __init__(self, dim: int, text_len: int):
        self.dim, self.text_len = dim, text_len

    def encode(self, prompts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(prompts), self.text_len, self.dim)
        for i, p in enumerate(prompts):
            ids = torch.tensor(list(p.encode()), dtype=torch.float32)
            out[i, : len(ids)] = torch.sin(ids[:, None] * torch.arange(1, self.dim + 1))  # rows past the prompt: 0
        return out


class _VAE:
    """Causal like Wan's (frame 0 alone, then 4 frames per latent frame), 8x spatial average, a fixed projection."""

    def __init__(self, z: int):
        self.proj = torch.randn(3, z, generator=torch.Generator().manual_seed(3))

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        v = video.float()
        rest = v[:, :, 1:].unflatten(2, (-1, 4)).mean(3) if v.shape[2] > 1 else v[:, :, :0]
        lat = torch.nn.functional.avg_pool3d(torch.cat([v[:, :, :1], rest], dim=2), (1, 8, 8))
        return torch.einsum("bcthw,cz->bzthw", lat, self.proj)


def kv_dominated_model(layers: int = 8, max_chunk_size: int = 8, dim: int = 256):
    """The tiny DiT, `layers` deep and `dim` wide, text-to-video (no CLIP tokens in the context), a window of
    2 x max_chunk_size + 1 frames of 32 tokens, fp32; stub text and VAE encoders: a full window's cache outweighs a
    chunk's activations and input frames, as the 14B's does."""
    cfg = preset("tiny")
    cfg.dit = dataclasses.replace(
        cfg.dit, model_type="t2v", in_dim=16, dim=dim, num_heads=dim // 128, ffn_dim=dim, num_layers=layers,
        max_chunk_size=max_chunk_size, frame_seqlen=32,
    )  # fmt: skip
    cfg.pipeline = cfg.pipeline.with_overrides(
        {"model_input_hw": CANVAS, "num_inference_steps": 2, "dit_step_mask": None}
    )
    torch.manual_seed(0)
    dit = CausalWanDiT(cfg.dit).eval()
    return SimpleNamespace(
        model=dit, config=cfg, text_encoder=_Text(cfg.dit.text_dim, cfg.dit.text_len), image_encoder=None,
        vae=_VAE(cfg.dit.out_dim),
    )  # fmt: skip


def batch(ids: list[str], t: int, seed: int) -> ModelBatch:
    rng = np.random.default_rng(seed)
    n = len(ids)
    return ModelBatch(
        images=rng.integers(0, 256, (n, t, *CANVAS, 3), dtype=np.uint8),
        state=rng.standard_normal((n, 1, 64)).astype(np.float32),
        state_mask=np.ones((n, 1, 64), bool),
        prompts=[f"pick up the block {i}" for i in ids],
        negative_prompts=["no"] * n,  # short: the cross-attention context stays a few tokens beside the caches
        session_ids=list(ids),
        seeds=list(range(n)),
    )


def last_chunk_transient(model, rows: int, stagger: bool = False, kv_only: bool = True) -> dict:
    """Run `rows` sessions up to the chunk before their window is full, then measure that call (the largest caches:
    prefill of the observed block into them, denoise over them).

    `stagger`: session i is i chunks behind session 0 (rows at different frame positions, front-padded caches).
    `kv_only`: count the KV-shaped tensors only (`LiveBytes.last_dims`), else every tensor the call makes.
    Returns the live-bytes peak of the call above the larger of the bytes the sessions held before and after it
    (`transient`), the most KV bytes one session holds after the call (`kv_per_session`), and the layers.
    """
    pipe = DreamZeroPipeline(model, store=SessionStore(64))
    ids = [f"s{i}" for i in range(rows)]
    chunks = model.config.dit.max_chunk_size  # chunks 0 .. max_chunk_size - 1 before the window is full
    for k in range(chunks - 1):
        live = [sid for i, sid in enumerate(ids) if not stagger or k >= i]
        if live:
            pipe.generate(_rows_at(live, pipe, seed=k))
    call = _rows_at(ids, pipe, seed=100)
    states = [pipe.store.lookup(sid)[0] for sid in ids]
    dit = model.config.dit
    with LiveBytes((dit.num_heads, dit.head_dim) if kv_only else None) as meter:
        for s in states:
            meter.hold(s.kv_cache if kv_only else session_tensors(s))
        before = meter.live
        meter.reset_peak()
        res = pipe.generate(call)
        del res
        after = meter.live
    kv = max(sum(c.numel() * c.element_size() for c in pipe.store.lookup(sid)[0].kv_cache) for sid in ids)
    return {
        "rows": rows,
        "transient": meter.peak - max(before, after),
        "kv_per_session": kv,
        "num_layers": model.config.dit.num_layers,
        "before": before,
        "after": after,
        "peak": meter.peak,
    }


def _rows_at(ids: list[str], pipe: DreamZeroPipeline, seed: int) -> ModelBatch:
    """A call for `ids`: one frame when every session is new, else four (a new session starts from the last)."""
    return batch(ids, 4 if any(pipe.store.lookup(sid)[0] is not None for sid in ids) else 1, seed)
