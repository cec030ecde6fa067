"""The batched DreamZero inference loop: one action chunk for each of B sessions per `generate` call.

Per chunk and session (dreamzero-model.md, "One action chunk"):
  1. decide whether the session restarts (new / evicted, reset requested, step mismatch, prompt changed, 1-frame
     input after the first call, window full);
  2. T5 of prompt and negative prompt (cached per session);
  3. restart: CLIP of the anchor frame, VAE of [anchor, zeros...] -> first-frame conditioning `y`, prefill of the
     anchor latent at frame 0; otherwise VAE of [first frame, each new frame twice] and prefill of the last
     `num_frame_per_block` latents at `current_start_frame - num_frame_per_block`;
  4. noise from the row's seed (CPU generator: independent of batch composition and device);
  5. two flow-UniPC schedulers (video, action); the DiT runs on the steps the static mask or the dynamic
     cosine-similarity rule allows, conditional and unconditional rows batched into one forward; guidance on video
     only, the action follows the conditional prediction;
  6. `current_start_frame += num_frame_per_block`, `step += 1`.
Rows whose sessions sit at different frame positions share the same forwards: each row carries its own RoPE offset,
and the KV caches are front-padded to a common length with the padding masked (`BatchCache`); when every row sits at
one position nothing is padded and the unmasked path runs exactly as upstream's.
`prefill_block` and `denoise_block` are the loop itself, usable with a bare DiT (the parity test drives them).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dreamzero import rtc
from dreamzero.config import DiTConfig, PipelineConfig, apply_overrides
from dreamzero.embodiments.transforms import NEGATIVE_PROMPT as DEFAULT_NEGATIVE_PROMPT
from dreamzero.errors import ConfigError, InvalidObservation
from dreamzero.model.dit import CausalWanDiT, CrossContext
from dreamzero.model.scheduler import FlowUniPCScheduler
from dreamzero.model.vae import split_state, stack_states
from dreamzero.sessions import (
    BRANCHES,
    SessionFootprint,
    SessionState,
    SessionStore,
    session_footprint,
    vae_state_nbytes,
)
from dreamzero.types import ChunkResult, ModelBatch, SessionReport

log = logging.getLogger(__name__)

_MASK_CHANNELS = 4  # `y` = 4 first-frame mask channels + z latent channels (i2v)


# ----------------------------------------------------------------------------------------------------------------------
# 1. Config checks and the step plan
# ----------------------------------------------------------------------------------------------------------------------


class StepPlan:
    """Which scheduler steps run the DiT: the static mask, every step, or the dynamic cosine-similarity rule."""

    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg
        self._skip_left = 0
        self._prev_v: torch.Tensor | None = None

    def should_run(self, i: int) -> bool:
        if self.cfg.dynamic_skip:
            if i < self.cfg.dynamic_skip_warmup or self._skip_left == 0:
                return True
            self._skip_left -= 1
            return False
        mask = self.cfg.dit_step_mask
        return True if mask is None else bool(mask[i])

    def observe(self, i: int, v: torch.Tensor) -> None:
        """After a DiT step: compare the guided video velocity with the previous one and plan the next skip.

        Rows of one forward share the decision, so the least similar row decides (min over rows).
        """
        if not self.cfg.dynamic_skip:
            return
        # the first `warmup` steps always run; from the last of them on, a similar pair may skip the next steps
        if self._prev_v is not None and i >= self.cfg.dynamic_skip_warmup - 1:
            sim = F.cosine_similarity(v.flatten(1).float(), self._prev_v.flatten(1).float(), dim=1).min().item()
            for thr, n in sorted(self.cfg.dynamic_skip_thresholds, reverse=True):
                if sim > thr:
                    self._skip_left = n
                    break
        self._prev_v = v


# ----------------------------------------------------------------------------------------------------------------------
# 2. The loop on a bare DiT: prefill and denoise of one block for G rows
# ----------------------------------------------------------------------------------------------------------------------


def cfg_row_layout(num_sessions: int, guided: bool) -> list[tuple[int, str]]:
    """(session index, CFG branch) of each forward row for `num_sessions` sessions: session-major (s0 cond, s0 uncond,
    s1 cond, ...) when guidance runs, one cond row per session otherwise. `branch_rows`, the contexts and the caches
    all follow this layout."""
    branches = BRANCHES if guided else BRANCHES[:1]
    return [(s, b) for s in range(num_sessions) for b in branches]


def branch_rows(x: torch.Tensor | None, guided: bool) -> torch.Tensor | None:
    """[G, ...] -> [2G, ...] in `cfg_row_layout` order when guidance runs, else unchanged."""
    if x is None or not guided:
        return x
    return x.repeat_interleave(2, dim=0)


@dataclass
class BatchCache:
    """The self-attention KV caches of one forward's rows: per layer [2, R, L, N, d].

    `lengths` (None: all L tokens valid) gives each row's own tokens, the trailing ones; rows at different frame
    positions are front-padded to the longest and the DiT masks the padding.
    """

    layers: list[torch.Tensor]
    lengths: list[int] | None = None


def _starts(start_frame: int | list[int], rows: int) -> int | list[int]:
    """A per-session start frame list -> per forward row (the cond and uncond rows of a session share it)."""
    if isinstance(start_frame, int) or len(start_frame) == rows:
        return start_frame
    if not start_frame or rows % len(start_frame):
        raise ValueError(f"{len(start_frame)} start frames for {rows} rows")
    return [sf for sf in start_frame for _ in range(rows // len(start_frame))]


@torch.no_grad()
def prefill_block(
    dit: CausalWanDiT,
    latents: torch.Tensor,
    *,
    context_emb: CrossContext | torch.Tensor,
    kv_cache: BatchCache | None,
    start_frame: int | list[int],
    y: torch.Tensor | None = None,
) -> BatchCache:
    """Write clean latents [R, z, F, h, w] (t = 0) at `start_frame` (one, or one per row) into the caches.

    R rows are whatever the caller batches (typically cond + uncond rows of G sessions); `y` [R, Cy, F, h, w].
    Returns the new per-layer caches.
    """
    t = torch.zeros(latents.shape[0], latents.shape[2], dtype=torch.long, device=latents.device)
    out = dit(
        latents,
        t,
        kv_cache=None if kv_cache is None else kv_cache.layers,
        kv_lengths=None if kv_cache is None else kv_cache.lengths,
        current_start_frame=_starts(start_frame, latents.shape[0]),
        context_emb=context_emb,
        y=y,
    )
    return BatchCache(out.kv_cache, out.kv_lengths)


@dataclass
class DenoiseResult:
    video: torch.Tensor  # [G, z, F, h, w] fp32 predicted clean latents
    action: torch.Tensor  # [G, A, action_dim] fp32 predicted normalised actions
    dit_steps: int  # DiT forwards run (each covers all 2G rows)


@torch.no_grad()
def denoise_block(
    dit: CausalWanDiT,
    cfg: PipelineConfig,
    *,
    video_noise: torch.Tensor,
    action_noise: torch.Tensor,
    state: torch.Tensor,
    context_emb: CrossContext | torch.Tensor,
    kv_cache: BatchCache,
    start_frame: int | list[int],
    y: torch.Tensor | None = None,
    action_guide: rtc.ActionGuide | None = None,
) -> DenoiseResult:
    """Denoise one block for G rows: video_noise [G, z, F, h, w], action_noise [G, A, ad], state [G, 1, S].

    With guidance (cfg_scale != 1) `context_emb` and `kv_cache` hold 2G rows, session-major (s0 cond, s0 uncond,
    s1 cond, ...), and `y` G rows; without guidance all hold G rows. `start_frame` is one frame position for all rows
    or one per session. Samples stay fp32 whatever the DiT's dtype. `action_guide` (real-time chunking) steers the
    action velocity on every step, whether the DiT ran or not, and writes the prefix at the end.
    """
    guided = cfg.cfg_scale != 1.0
    g = video_noise.shape[0]
    start_frame = _starts(start_frame, 2 * g if guided else g)
    video_sched = FlowUniPCScheduler(cfg.num_inference_steps, cfg.sigma_shift)
    action_sched = FlowUniPCScheduler(cfg.num_inference_steps, cfg.sigma_shift)
    plan = StepPlan(cfg)
    x, a = video_noise.float(), action_noise.float()
    state_rows, y_rows = branch_rows(state, guided), branch_rows(y, guided)
    v = v_action = None
    steps = 0
    cross_kv = dit.cross_kv(context_emb)  # the context is constant over the steps: project it once
    for i, t in enumerate(video_sched.timesteps.tolist()):
        if plan.should_run(i) or v is None:
            n = 2 * g if guided else g
            timestep = torch.full((n, x.shape[2]), t, dtype=torch.long, device=x.device)
            timestep_action = torch.full((n, a.shape[1]), t, dtype=torch.long, device=x.device)
            out = dit(
                branch_rows(x, guided),
                timestep,
                kv_cache=kv_cache.layers,
                kv_lengths=kv_cache.lengths,
                current_start_frame=start_frame,
                context_emb=context_emb,
                cross_kv=cross_kv,
                y=y_rows,
                action=branch_rows(a, guided),
                timestep_action=timestep_action,
                state=state_rows,
            )
            pred_v, pred_a = out.video.float(), out.action.float()
            if guided:  # guidance on video only; the action follows the conditional branch
                v_cond, v_uncond = pred_v.unflatten(0, (g, 2)).unbind(1)
                v = v_uncond + cfg.cfg_scale * (v_cond - v_uncond)
                v_action = pred_a.unflatten(0, (g, 2))[:, 0]
            else:
                v, v_action = pred_v, pred_a
            plan.observe(i, v)
            steps += 1
        x = video_sched.step(v, i, x)
        if action_guide is None:
            a = action_sched.step(v_action, i, a)
        else:  # the clamp edits this step's velocity only: a reused prediction stays the DiT's
            a = action_sched.step(action_guide.velocity(a, v_action, float(action_sched.sigmas[i])), i, a)
    if action_guide is not None:
        a = action_guide.finish(a)
    return DenoiseResult(video=x, action=a, dit_steps=steps)


def stack_caches(states: list[SessionState]) -> BatchCache:
    """One forward's caches, session-major rows; a lone session's cache is used as is.

    Sessions at different frame positions hold caches of different lengths: shorter ones are front-padded with zeros
    (masked by the DiT) and `lengths` says how many trailing tokens are each row's own.
    """
    if len(states) == 1:
        return BatchCache(list(states[0].kv_cache))
    lengths = [s.kv_cache[0].shape[2] for s in states]
    longest = max(lengths)
    layers = []
    for layer in range(len(states[0].kv_cache)):
        parts = [s.kv_cache[layer] for s in states]
        if longest != min(lengths):
            parts = [F.pad(p, (0, 0, 0, 0, longest - p.shape[2], 0)) for p in parts]  # pad dim 2 at the front
        layers.append(torch.cat(parts, dim=1))
    if longest == min(lengths):
        return BatchCache(layers)
    rows = [n for s, n in zip(states, lengths) for _ in range(s.kv_cache[0].shape[1])]
    return BatchCache(layers, rows)


def split_caches(caches: BatchCache, states: list[SessionState], branches: tuple[str, ...]) -> None:
    """Give each session its rows of the batched caches, without padding (cloned when batched: a session must not
    pin the batch)."""
    nb = len(branches)
    for si, state in enumerate(states):
        state.branches = branches
        if len(states) == 1 and caches.lengths is None:
            state.kv_cache = list(caches.layers)
            continue
        keep = caches.layers[0].shape[2] if caches.lengths is None else caches.lengths[si * nb]
        state.kv_cache = [c[:, si * nb : (si + 1) * nb, c.shape[2] - keep :].clone() for c in caches.layers]


# ----------------------------------------------------------------------------------------------------------------------
# 3. Compile levels
# ----------------------------------------------------------------------------------------------------------------------


def _encoder_networks(model) -> dict[str, torch.nn.Module]:
    """The networks of the encoders the loop calls (stand-in encoders without them are skipped)."""
    found = {
        "text_encoder.t5": getattr(getattr(model, "text_encoder", None), "t5", None),
        "image_encoder.clip": getattr(getattr(model, "image_encoder", None), "clip", None),
        "vae.encoder": getattr(getattr(getattr(model, "vae", None), "autoencoder", None), "encoder", None),
    }
    return {name: net for name, net in found.items() if isinstance(net, torch.nn.Module)}


def compile_model(model, level: str) -> list[str]:
    """Apply a `pipeline.compile` level to `model` in place; returns what was compiled.

    "dit": each DiT block (`CausalWanDiT.compile_blocks`); "all": also the T5 and CLIP networks and the VAE encoder,
    compiled where the loop calls them. Never CUDA graphs: the caches change shape every chunk.
    """
    if level == "none":
        return []
    if level not in ("dit", "all"):
        raise ConfigError(f"pipeline.compile must be none, dit or all, got {level!r}")
    model.model.compile_blocks()
    done = ["dit.blocks"]
    if level == "all":
        for name, net in _encoder_networks(model).items():
            if getattr(net, "_compiled_call_impl", None) is None:
                net.compile(dynamic=True)
            done.append(name)
    return done


# ----------------------------------------------------------------------------------------------------------------------
# 4. Per-row bookkeeping
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class _Row:
    index: int
    state: SessionState
    restarted: bool
    reason: str | None
    seed: int


class _Timer:
    """Accumulates wall time per stage; synchronises CUDA so GPU work is charged to the stage that queued it."""

    def __init__(self, device: torch.device):
        self.ms: dict[str, float] = defaultdict(float)
        self._cuda = device.type == "cuda"

    @contextmanager
    def __call__(self, stage: str):
        if self._cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize()
            self.ms[stage] += (time.perf_counter() - t0) * 1000.0


# ----------------------------------------------------------------------------------------------------------------------
# 5. The pipeline
# ----------------------------------------------------------------------------------------------------------------------


def _canvas_hw(model_cfg) -> tuple[int, int] | None:
    """The canvas the model's embodiment sends, if its tag is registered."""
    from dreamzero.embodiments import get_embodiment

    if model_cfg is None:
        return None
    try:
        return tuple(get_embodiment(model_cfg.embodiment_tag).canvas_hw)
    except ConfigError:  # a tag this process does not know: the caller says the warm-up was skipped
        return None


class DreamZeroPipeline:
    """A DreamZero model plus session store: `generate(ModelBatch) -> ChunkResult` for any mix of sessions."""

    def __init__(self, model, config: PipelineConfig | None = None, store: SessionStore | None = None):
        self.model = model
        self.dit: CausalWanDiT = model.model
        self.dit_cfg: DiTConfig = self.dit.cfg
        model_cfg = getattr(model, "config", None)
        self.config = config or (model_cfg.pipeline if model_cfg is not None else PipelineConfig())
        if not isinstance(self.config, PipelineConfig):  # validated on construction: only its type needs a check
            raise ConfigError(f"config must be a PipelineConfig, got {type(self.config).__name__}")
        self.store = store if store is not None else SessionStore()
        self.action_horizon = int(getattr(model_cfg, "action_horizon", self.dit_cfg.num_action_per_block))
        self.max_action_dim = self.dit_cfg.action_dim
        if self.action_horizon > self.dit_cfg.num_action_per_block:
            raise ConfigError(
                f"action_horizon {self.action_horizon} exceeds dit.num_action_per_block "
                f"{self.dit_cfg.num_action_per_block}"
            )
        if self.dit_cfg.has_image_input and getattr(model, "image_encoder", None) is None:
            raise ConfigError("a DiT with the image branch (i2v, ti2v) needs model.image_encoder (CLIP); none given")
        p = next(self.dit.parameters())
        self.device, self.dtype = p.device, p.dtype
        # prompt -> T5 rows [1, text_len, text_dim], LRU: new sessions mostly reuse a few prompts (and every guided
        # row the same negative prompt), so T5 runs once per prompt rather than once per session
        self._prompt_rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.compiled = compile_model(model, self.config.compile)
        self.warmup_ms: float | None = None
        self._footprints: dict[tuple[int, int], SessionFootprint] = {}

    # -- construction ------------------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model_path=None,
        *,
        device=None,
        dtype=None,
        overrides: dict | None = None,
        tokenizer_path=None,
        max_sessions: int = 64,
        session_ttl_s: float | None = None,
        session_max_bytes: int | None = None,
        layout: str | None = None,
        config=None,
    ) -> DreamZeroPipeline:
        """Load a checkpoint (None: the embedded tiny default) and wrap it with a session store.

        `layout` / `config`: as `dreamzero.checkpoint.load_model` takes them (None: detect / the checkpoint's own).

        `overrides` replaces PipelineConfig fields by name (e.g. {"dynamic_skip": True}); the session store holds at
        most `max_sessions` sessions and `session_max_bytes` bytes of their tensors, evicting idle ones.
        """
        from dreamzero.checkpoint import load_model

        if model_path is None:
            from dreamzero.embedded_default import default_model_dir

            model_path = default_model_dir()
        model = load_model(
            model_path, device=device, dtype=dtype, tokenizer_path=tokenizer_path, layout=layout, config=config
        )
        config = apply_overrides(model.config.pipeline, overrides)
        store = SessionStore(max_sessions=max_sessions, ttl_s=session_ttl_s, max_bytes=session_max_bytes)
        pipe = cls(model, config, store)
        if pipe.compiled:
            pipe.warm_up()
        return pipe

    def warm_up(self, image_hw: tuple[int, int] | None = None) -> float | None:
        """Run the loop once so that compiled graphs are built before the first request; returns the time it took
        (ms), or None when no input size is known (pass `image_hw`).

        Two scratch sessions (two, so no batch size of 1 is baked into a graph) are started and continued once: a
        new session's chunk (text, CLIP, VAE, prefill at frame 0, denoise) and a continuing chunk (conditioning
        extension, observed-block prefill, denoise with a longer cache). Sessions at different frame positions in one
        batch (the masked path) still compile at their first use. The session store and prompt cache are left as
        they were.
        """
        hw = image_hw or self.config.model_input_hw or _canvas_hw(getattr(self.model, "config", None))
        if hw is None:
            log.warning("warm-up skipped: no input size known (set pipeline.model_input_hw or pass image_hw)")
            return None
        t0 = time.perf_counter()
        store, prompts = self.store, OrderedDict(self._prompt_rows)
        self.store = SessionStore(max_sessions=4)
        try:
            ids = ["warm-up-0", "warm-up-1"]
            for frames in (1, 2 * self.dit_cfg.num_frame_per_block):
                self.generate(
                    ModelBatch(
                        images=np.zeros((2, frames, *hw, 3), dtype=np.uint8),
                        state=np.zeros((2, 1, self.dit_cfg.max_state_dim), dtype=np.float32),
                        state_mask=np.zeros((2, 1, self.dit_cfg.max_state_dim), dtype=bool),
                        prompts=["warm up", "warm up"],
                        session_ids=ids,
                    )
                )
        finally:
            self.store, self._prompt_rows = store, prompts
        self.warmup_ms = (time.perf_counter() - t0) * 1000.0
        log.info("warm-up of %s took %.0f ms", ", ".join(self.compiled) or "the eager loop", self.warmup_ms)
        return self.warmup_ms

    # -- session control -----------------------------------------------------------------------------------------------

    def reset_sessions(self, session_ids: Iterable[str]) -> None:
        """Restart these sessions at their next call (reason "reset_requested"); unknown ids are ignored."""
        for sid in session_ids:
            state, _ = self.store.lookup(sid)
            if state is not None:
                state.reset_pending = True

    def drop_sessions(self, session_ids: Iterable[str]) -> int:
        return self.store.drop(session_ids)

    def stats(self) -> dict:
        return self.store.stats()

    # -- admission by bytes (docs/model.md, "Memory and admission") ----------------------------------------------------

    def canvas_hw(self, images_hw: tuple[int, int]) -> tuple[int, int]:
        """The model-input size of frames sent at `images_hw`."""
        hw = self.config.model_input_hw
        return tuple(hw) if hw is not None else tuple(images_hw)

    def footprint(self, canvas_hw: tuple[int, int]) -> SessionFootprint:
        """A session's bytes chunk by chunk at this model-input size (cached per size)."""
        canvas_hw = tuple(int(v) for v in canvas_hw)
        if canvas_hw not in self._footprints:
            vae_bytes = 0
            if self.dit_cfg.has_image_input and self.dit_cfg.concat_first_frame_latent:
                vae = self.model.vae
                vae_bytes = vae_state_nbytes(vae, canvas_hw, self.dtype, self.dit_cfg.num_frame_per_block)
            enc = getattr(getattr(self.model, "config", None), "image_encoder", None)
            clip_tokens = (enc.image_size // enc.patch_size) ** 2 + 1 if enc is not None else 257
            self._footprints[canvas_hw] = session_footprint(
                self.dit_cfg,
                self.config,
                canvas_hw,
                torch.empty((), dtype=self.dtype).element_size(),
                vae_bytes,
                getattr(self.model.vae, "spatial_factor", 8),
                clip_tokens,
            )
        return self._footprints[canvas_hw]

    def admit(self, batch: ModelBatch, busy: Iterable[str] = ()) -> None:
        """Reserve the peak footprint of every session of `batch` (CapacityError when they cannot fit); the ids stay
        protected from eviction until `store.release`. Validates the batch first."""
        self._validate(batch)
        self._reserve(batch, busy)

    def _reserve(self, batch: ModelBatch, busy: Iterable[str] = ()) -> None:
        # no byte budget (the CPU default): only protect the ids; sessions then count what they hold
        peak = 0 if self.store.max_bytes is None else self.footprint(self.canvas_hw(batch.images.shape[2:4])).peak
        self.store.admit({sid: peak for sid in batch.session_ids}, busy)

    # -- generate ------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, batch: ModelBatch, return_latents: bool = False, noise: Mapping | None = None) -> ChunkResult:
        """One action chunk per row of `batch` (any mix of new, continuing and restarting sessions).

        Returns normalised actions [B, action_horizon, 32] (zero padded past action_dim), one SessionReport per row,
        per-stage timings and, with return_latents, the predicted latents [B, z, F, h, w]. `noise` replaces the
        seeded noise (parity tests, replays): {"video": [B, z, F, h, w], "action": [B, A, action_dim]}.
        Bad input raises InvalidObservation naming the field before any session is touched; a failure inside the
        model forgets the batch's sessions (they restart next time) and never touches other sessions.
        """
        t_start = time.perf_counter()
        timer = _Timer(self.device)
        self._validate(batch)
        with timer("inputs"):
            frames = self._model_frames(batch.images)  # [B, T, 3, H, W] in [-1, 1]
        self._reserve(batch)  # before any session is touched; a no-op for sessions a server admitted already
        rows = self._resolve(batch)
        try:
            return self._generate(batch, rows, frames, timer, t_start, return_latents, noise)
        except Exception:
            # a failed call may have advanced some caches but not the frame positions: forget these sessions so
            # their state is never reused silently (their next call restarts as a new session)
            self.store.drop([r.state.session_id for r in rows])
            raise
        finally:
            self.store.release(batch.session_ids)  # stored sessions keep their reservation, the others return it

    def _generate(self, batch, rows, frames, timer, t_start, return_latents, noise) -> ChunkResult:
        n = len(batch)
        # 1. text (cached per session; only new / changed prompts are encoded, in one call)
        with timer("text"):
            self._encode_text(rows)

        # 2. restarted rows: anchor conditioning and prefill at frame 0
        restarts = [r for r in rows if r.restarted]
        if restarts:
            anchor_t = frames.shape[1] - 1 if frames.shape[1] > 1 else 0
            anchors = frames[[r.index for r in restarts], anchor_t]  # [G, 3, H, W]
            self._start_sessions(restarts, anchors, timer)

        # 3. continuing rows: prefill the observed block (one forward whatever their frame positions)
        continuing = [r for r in rows if not r.restarted]
        if continuing:
            self._prefill_observed(continuing, frames, timer)

        # 4. denoise every row in one batch (restarted rows sit at frame 1, continuing ones further on)
        block = (self.dit_cfg.num_action_per_block, self.dit_cfg.action_dim)
        guide, rtc_sources = rtc.plan(batch, [r.state for r in rows], self.action_horizon, block, self.device)
        res = self._denoise(rows, batch, noise, timer, guide)
        actions = torch.zeros(n, self.action_horizon, self.max_action_dim)  # rows are in batch order
        act = res.action[:, : self.action_horizon].cpu()
        actions[:, :, : act.shape[2]] = act
        for r in rows:
            r.state.prev_chunk = rtc.remember(batch, r.index, actions[r.index].numpy())
        latents = res.video.cpu()
        dit_steps = res.dit_steps
        for r in rows:
            r.state.current_start_frame += self.dit_cfg.num_frame_per_block
            r.state.step += 1

        # 5. store and report
        ids = [r.state.session_id for r in rows]
        for r in rows:
            self.store.put(r.state, protect=ids)
            if r.restarted:
                self.store.record_restart(r.reason)
        reports = [
            SessionReport(
                session_id=r.state.session_id,
                step=r.state.step,
                restarted=r.restarted,
                restart_reason=r.reason,
                frame_position=r.state.current_start_frame,
                incarnation=r.state.incarnation,
                rtc=rtc_sources[r.index],
            )
            for r in rows
        ]
        timer.ms["total"] = (time.perf_counter() - t_start) * 1000.0
        return ChunkResult(
            actions=actions.numpy().astype(np.float32),
            sessions=reports,
            video_latents=latents.numpy().astype(np.float32) if return_latents else None,
            timings_ms=dict(timer.ms),
            dit_steps=dit_steps,
        )

    # -- stages --------------------------------------------------------------------------------------------------------

    def _validate(self, batch: ModelBatch) -> None:
        n = len(batch.session_ids)
        if n == 0:
            raise InvalidObservation("session_ids is empty: a batch needs at least one row", field="session_ids")
        if any(not isinstance(s, str) or not s for s in batch.session_ids):
            raise InvalidObservation("every session id must be a non-empty string", field="session_ids")
        if len(set(batch.session_ids)) != n:
            dup = sorted({s for s in batch.session_ids if batch.session_ids.count(s) > 1})
            raise InvalidObservation(f"session ids must be unique within a batch; repeated: {dup}", field="session_ids")
        img = batch.images
        if not isinstance(img, np.ndarray) or img.ndim != 5 or img.shape[-1] != 3 or img.dtype != np.uint8:
            got = f"{getattr(img, 'dtype', type(img).__name__)} {getattr(img, 'shape', '')}"
            raise InvalidObservation(f"images must be uint8 [B, T, H, W, 3], got {got}", field="images")
        if img.shape[0] != n:
            raise InvalidObservation(f"images has {img.shape[0]} rows, session_ids has {n}", field="images")
        block = 2 * self.dit_cfg.num_frame_per_block  # new frames per chunk (4 on DROID)
        if img.shape[1] not in (1, block):
            raise InvalidObservation(
                f"images must hold 1 or {block} frames per row, got {img.shape[1]}", field="images"
            )
        want = (n, 1, self.dit_cfg.max_state_dim)
        if not isinstance(batch.state, np.ndarray) or tuple(batch.state.shape) != want:
            raise InvalidObservation(
                f"state must be float [B, 1, {want[2]}], got {getattr(batch.state, 'shape', None)}", field="state"
            )
        if not np.isfinite(batch.state).all():
            raise InvalidObservation("state holds NaN or inf", field="state")
        for name in ("prompts", "negative_prompts"):
            value = getattr(batch, name)
            if (value is not None or name == "prompts") and (
                not isinstance(value, (list, tuple)) or any(not isinstance(p, str) for p in value)
            ):
                raise InvalidObservation(f"{name} must be a list of {n} strings", field=name)
        for name in ("prompts", "negative_prompts", "reset_mask", "expected_steps", "expected_incarnations", "seeds"):
            value = getattr(batch, name)
            if value is not None and len(value) != n:
                raise InvalidObservation(f"{name} has {len(value)} entries, the batch has {n} rows", field=name)
        if batch.seeds is not None and any(not isinstance(s, (int, np.integer)) or s < 0 for s in batch.seeds):
            raise InvalidObservation("seeds must be non-negative integers", field="seeds")
        rtc.requests(batch, self.action_horizon, self.max_action_dim)  # real-time chunking options

    def _model_frames(self, images: np.ndarray) -> torch.Tensor:
        """uint8 [B, T, H, W, 3] -> [B, T, 3, H', W'] in [-1, 1] at the model's input size (bilinear resize)."""
        images = np.ascontiguousarray(images)
        with warnings.catch_warnings():
            # read-only arrays (decoded wire bytes, Ray's object store) are only read: `.float()` below makes new
            # memory before anything could write, so no copy is taken here
            warnings.simplefilter("ignore", UserWarning)
            x = torch.from_numpy(images)
        x = x.to(self.device)
        b, t, h, w, _ = x.shape
        x = x.permute(0, 1, 4, 2, 3).reshape(b * t, 3, h, w).float() / 127.5 - 1.0
        hw = self.config.model_input_hw
        if hw is not None and tuple(hw) != (h, w):
            x = F.interpolate(x, size=tuple(hw), mode="bilinear", align_corners=False)
        return x.reshape(b, t, 3, x.shape[-2], x.shape[-1])

    def _resolve(self, batch: ModelBatch) -> list[_Row]:
        """Find or create each row's session and decide whether (and why) it restarts."""
        single_frame = batch.images.shape[1] == 1
        rows = []
        for i, sid in enumerate(batch.session_ids):
            prompt = batch.prompts[i]
            negative = batch.negative_prompts[i] if batch.negative_prompts else DEFAULT_NEGATIVE_PROMPT
            state, reason = self.store.lookup(sid)
            expected = batch.expected_steps[i] if batch.expected_steps else None
            expected_inc = batch.expected_incarnations[i] if batch.expected_incarnations else None
            if state is None:
                pass  # reason is "new_session" or "evicted"
            elif (batch.reset_mask and batch.reset_mask[i]) or state.reset_pending:
                reason = "reset_requested"
            elif (expected is not None and int(expected) != state.step) or (
                expected_inc is not None and expected_inc != state.incarnation
            ):
                reason = "step_mismatch"
            elif prompt != state.prompt or negative != state.negative_prompt:
                reason = "prompt_changed"
            elif single_frame:
                reason = "single_frame"
            elif state.current_start_frame >= self.dit_cfg.max_attention_frames:
                reason = "window_full"
            if reason is not None:
                old_text = state.text_cache if state is not None else {}
                keep = {}
                if state is not None and state.prompt == prompt and "cond" in old_text:
                    keep["cond"] = old_text["cond"]
                if state is not None and state.negative_prompt == negative and "uncond" in old_text:
                    keep["uncond"] = old_text["uncond"]
                prev_chunk = rtc.carried_chunk(state, reason)  # the robot's motion outlives some model restarts
                if state is not None:
                    state.release_tensors()  # the old caches go before the new ones come: never two footprints
                state = SessionState(
                    session_id=sid, prompt=prompt, negative_prompt=negative, text_cache=keep, prev_chunk=prev_chunk
                )
            seed = int(batch.seeds[i]) if batch.seeds is not None else self.config.default_seed
            rows.append(_Row(index=i, state=state, restarted=reason is not None, reason=reason, seed=seed))
        return rows

    def _encode_text(self, rows: list[_Row]) -> None:
        todo: list[tuple[_Row, str, str]] = []
        for r in rows:
            for branch, text in (("cond", r.state.prompt), ("uncond", r.state.negative_prompt)):
                if branch not in r.state.text_cache:
                    todo.append((r, branch, text))
        if not self._guided:
            todo = [t for t in todo if t[1] == "cond"]
        if not todo:
            return
        lookup = {}
        for text in dict.fromkeys(text for _, _, text in todo):
            if text in self._prompt_rows:
                self._prompt_rows.move_to_end(text)
                lookup[text] = self._prompt_rows[text]
        unique = sorted({text for _, _, text in todo} - lookup.keys())
        if unique:
            emb = self.model.text_encoder.encode(unique).to(self.device, self.dtype)  # [U, 512, text_dim]
            for j, text in enumerate(unique):
                lookup[text] = emb[j : j + 1].clone()  # own storage: neither a session nor the cache pins the batch
                if self.config.prompt_cache_size:
                    self._prompt_rows[text] = lookup[text]
            while len(self._prompt_rows) > self.config.prompt_cache_size:
                self._prompt_rows.popitem(last=False)
        for r, branch, text in todo:
            r.state.text_cache[branch] = lookup[text]  # read-only: sessions share the rows of one prompt

    @property
    def _guided(self) -> bool:
        return self.config.cfg_scale != 1.0

    @property
    def _branches(self) -> tuple[str, ...]:
        return BRANCHES if self._guided else BRANCHES[:1]

    def _vae_encode(self, video: torch.Tensor) -> torch.Tensor:
        """[G, 3, T, H, W] in [-1, 1] -> normalised latents [G, z, T', h, w] fp32; checks the token count."""
        return self._check_tokens(self.model.vae.encode(video.to(self.dtype)).float())

    def _check_tokens(self, lat: torch.Tensor) -> torch.Tensor:
        p = self.dit_cfg.patch_size
        tokens = (lat.shape[-2] // p[1]) * (lat.shape[-1] // p[2])
        if tokens != self.dit_cfg.frame_seqlen:
            raise InvalidObservation(
                f"images give {tokens} tokens per latent frame (latent {tuple(lat.shape[-2:])}), the model expects "
                f"dit.frame_seqlen={self.dit_cfg.frame_seqlen}; send the embodiment's canvas size or set "
                "pipeline.model_input_hw",
                field="images",
            )
        return lat

    def _context_emb(self, states: list[SessionState], clip: list[torch.Tensor | None]) -> CrossContext:
        """Cross-attention context for the rows of one forward, session-major: [R, (257 +) 512, D]."""
        layout = cfg_row_layout(len(states), self._guided)
        text = torch.cat([states[s].text_cache[b] for s, b in layout])
        img = None
        if self.dit_cfg.has_image_input:
            img = torch.cat([clip[s] for s, _ in layout])
        return self.dit.embed_context(text, img)

    def _start_sessions(self, rows: list[_Row], anchors: torch.Tensor, timer: _Timer) -> None:
        """Restarted rows: CLIP + first-frame conditioning, then prefill of the anchor latent at frame 0."""
        cfg = self.dit_cfg
        states = [r.state for r in rows]
        g = len(rows)
        if cfg.has_image_input:
            with timer("clip"):
                clip = self.model.image_encoder.encode(anchors.to(self.dtype)).to(self.dtype)  # [G, 257, image_dim]
        vae_states = [None] * g
        with timer("vae"):
            if cfg.has_image_input and cfg.concat_first_frame_latent:
                # [anchor, zeros...] over the window -> latents of every frame position, mask 1 on frame 0. Only the
                # frames this chunk conditions on (frame 0 and the first block) are encoded now; the encoder is causal,
                # so the rest follow chunk by chunk from its state (`_extend_conditioning`), batched with other rows
                n_frames = self.config.num_frames
                if self.config.conditioning_by_chunk:
                    n_frames = min(1 + 4 * cfg.num_frame_per_block, n_frames)
                video = torch.zeros(g, 3, n_frames, *anchors.shape[-2:], device=self.device)
                video[:, :, 0] = anchors
                lat, state = self.model.vae.encode_causal(video.to(self.dtype))
                lat = self._check_tokens(lat.float())  # [G, z, 1 + nfpb, h, w]
                mask = torch.zeros(g, _MASK_CHANNELS, *lat.shape[2:], device=self.device)
                mask[:, :, 0] = 1.0
                y = torch.cat([mask, lat], dim=1).to(self.dtype)
                if y.shape[1] + cfg.out_dim != cfg.in_dim:
                    raise ConfigError(
                        f"y has {y.shape[1]} channels (4 mask + {lat.shape[1]} latent) but dit.in_dim - dit.out_dim "
                        f"= {cfg.in_dim - cfg.out_dim}; the VAE's z_dim does not match the DiT"
                    )
                if n_frames < self.config.num_frames:
                    vae_states = split_state(state, g)
                first_latent = lat[:, :, :1]
            else:
                y = None
                first_latent = self._vae_encode(anchors.unsqueeze(2))[:, :, :1]
        for gi, s in enumerate(states):
            s.first_frame = anchors[gi].to(self.dtype).clone()
            # own storage when batched: a session must not pin the batch's tensors (its bytes are what it holds)
            s.clip_feature = (clip[gi : gi + 1].clone() if g > 1 else clip) if cfg.has_image_input else None
            s.y = (y[gi : gi + 1].clone() if g > 1 else y) if y is not None else None
            s.vae_state = vae_states[gi]
            s.latent_hw = tuple(first_latent.shape[-2:])
            s.current_start_frame = 0
        with timer("prefill"):
            ctx = self._context_emb(states, [s.clip_feature for s in states])
            caches = prefill_block(
                self.dit,
                branch_rows(first_latent, self._guided).to(self.dtype),
                context_emb=ctx,
                kv_cache=None,
                start_frame=0,
                y=branch_rows(y[:, :, :1], self._guided) if y is not None else None,
            )
        split_caches(caches, states, self._branches)
        for s in states:
            s.current_start_frame = 1

    def _extend_conditioning(self, states: list[SessionState], timer: _Timer) -> None:
        """Encode the conditioning frames the next block needs (zero frames after each row's anchor) from each row's
        causal encoder state, rows needing as many frames in one batched call."""
        nfpb = self.dit_cfg.num_frame_per_block
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
                video = torch.zeros(len(group), 3, 4 * missing, *hw, device=self.device, dtype=self.dtype)
                lat, state = self.model.vae.encode_causal(video, stack_states([s.vae_state for s in group]))
                lat = lat.to(self.dtype)
                mask = lat.new_zeros(len(group), _MASK_CHANNELS, *lat.shape[2:])
                window = 1 + (self.config.num_frames - 1) // 4  # latent frames of the whole conditioning window
                for s, part, st in zip(group, torch.cat([mask, lat], dim=1).split(1), split_state(state, len(group))):
                    s.y = torch.cat([s.y, part], dim=2)
                    s.vae_state = None if s.y.shape[2] >= window else st

    def _prefill_observed(self, rows: list[_Row], frames: torch.Tensor, timer: _Timer) -> None:
        """Continuing rows: VAE of [first frame, each new frame twice]; prefill the last block at each row's frame."""
        nfpb = self.dit_cfg.num_frame_per_block
        states = [r.state for r in rows]
        size = tuple(frames.shape[-2:])
        for s in states:
            if tuple(s.first_frame.shape[-2:]) != size:
                raise InvalidObservation(
                    f"session {s.session_id!r} started with {tuple(s.first_frame.shape[-2:])} frames, got {size}; "
                    "the canvas size cannot change within a session (reset it)",
                    field="images",
                )
        if self.dit_cfg.has_image_input and self.dit_cfg.concat_first_frame_latent:
            self._extend_conditioning(states, timer)  # after the canvas check: the rows' encoder states stack
        with timer("vae"):
            new = frames[[r.index for r in rows]].repeat_interleave(2, dim=1)  # [G, 2T, 3, H, W]
            first = torch.stack([s.first_frame.float() for s in states]).unsqueeze(1)  # [G, 1, 3, H, W]
            video = torch.cat([first, new], dim=1).permute(0, 2, 1, 3, 4)  # [G, 3, 1 + 2T, H, W]
            lat = self._vae_encode(video)[:, :, -nfpb:]  # [G, z, nfpb, h, w]
        starts = [s.current_start_frame - nfpb for s in states]
        y = None
        if self.dit_cfg.has_image_input and self.dit_cfg.concat_first_frame_latent:
            y = torch.cat([s.y[:, :, st : st + nfpb] for s, st in zip(states, starts)])
        with timer("prefill"):
            ctx = self._context_emb(states, [s.clip_feature for s in states])
            caches = prefill_block(
                self.dit,
                branch_rows(lat, self._guided).to(self.dtype),
                context_emb=ctx,
                kv_cache=stack_caches(states),
                start_frame=starts,
                y=branch_rows(y, self._guided),
            )
        split_caches(caches, states, self._branches)

    def _noise(self, rows: list[_Row], shape_v: tuple, noise: Mapping | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row noise from the row's seed on a CPU generator (or the caller's), fp32 on the model device."""
        shape_a = (self.dit_cfg.num_action_per_block, self.dit_cfg.action_dim)
        if noise is not None:
            v = torch.as_tensor(np.asarray(noise["video"]))[[r.index for r in rows]].float()
            a = torch.as_tensor(np.asarray(noise["action"]))[[r.index for r in rows]].float()
            if tuple(v.shape[1:]) != tuple(shape_v) or tuple(a.shape[1:]) != shape_a:
                raise ValueError(
                    f"noise shapes {tuple(v.shape)}, {tuple(a.shape)}; want [B, *{shape_v}], [B, *{shape_a}]"
                )
            return v.to(self.device), a.to(self.device)
        vs, acts = [], []
        for r in rows:
            # a fresh generator per tensor, as upstream re-seeds per call: identical across calls and batch layouts
            vs.append(torch.randn(shape_v, generator=torch.Generator().manual_seed(r.seed)))
            acts.append(torch.randn(shape_a, generator=torch.Generator().manual_seed(r.seed)))
        return torch.stack(vs).to(self.device), torch.stack(acts).to(self.device)

    def _denoise(
        self, rows: list[_Row], batch: ModelBatch, noise: Mapping | None, timer: _Timer, guide=None
    ) -> DenoiseResult:
        cfg = self.dit_cfg
        states = [r.state for r in rows]
        starts, nfpb = [s.current_start_frame for s in states], cfg.num_frame_per_block
        video_noise, action_noise = self._noise(rows, (cfg.out_dim, nfpb, *states[0].latent_hw), noise)
        state = torch.from_numpy(np.ascontiguousarray(batch.state[[r.index for r in rows]])).float().to(self.device)
        y = None
        if cfg.has_image_input and cfg.concat_first_frame_latent:  # ti2v (5B): CLIP only, no first-frame latent
            for s in states:
                if s.current_start_frame + nfpb > s.y.shape[2]:
                    raise RuntimeError(
                        f"frame position {s.current_start_frame} is past the conditioning window "
                        f"({s.y.shape[2]} frames)"
                    )
            y = torch.cat([s.y[:, :, s.current_start_frame : s.current_start_frame + nfpb] for s in states])
        with timer("denoise"):
            ctx = self._context_emb(states, [s.clip_feature for s in states])
            return denoise_block(
                self.dit,
                self.config,
                video_noise=video_noise,
                action_noise=action_noise,
                state=state,
                context_emb=ctx,
                kv_cache=stack_caches(states),
                start_frame=starts,
                y=y,
                action_guide=guide,
            )
