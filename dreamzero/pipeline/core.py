"""`DreamZeroPipeline`: a DreamZero model plus its session store; load, warm-up, session control, admission by bytes
and `generate`, which runs the stages of the sibling modules in order (the walk-through is in the package docstring,
`dreamzero/pipeline/__init__.py`)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from dreamzero import rtc
from dreamzero.config import DiTConfig, PipelineConfig, apply_overrides
from dreamzero.errors import ConfigError
from dreamzero.model.dit import CausalWanDiT
from dreamzero.pipeline.batch_cache import stack_caches
from dreamzero.pipeline.compile import compile_model
from dreamzero.pipeline.conditioning import context_emb, prefill_observed, start_sessions
from dreamzero.pipeline.denoise import DenoiseResult, denoise_block
from dreamzero.pipeline.inputs import model_frames, validate_batch
from dreamzero.pipeline.noise import row_noise
from dreamzero.pipeline.prompts import encode_prompts
from dreamzero.pipeline.rows import Row, resolve_rows
from dreamzero.pipeline.timer import StageTimer
from dreamzero.pipeline.video import predicted_frames, video_state_nbytes, wants_video
from dreamzero.sessions import BRANCHES, SessionFootprint, SessionStore, footprint_for
from dreamzero.types import ChunkResult, ModelBatch, SessionReport

log = logging.getLogger(__name__)


def _canvas_hw(model_cfg) -> tuple[int, int] | None:
    """The canvas the model's embodiment sends, if its tag is registered."""
    from dreamzero.embodiments import get_embodiment

    if model_cfg is None:
        return None
    try:
        return tuple(get_embodiment(model_cfg.embodiment_tag).canvas_hw)
    except ConfigError:  # a tag this process does not know: the caller says the warm-up was skipped
        return None


class DreamZeroPipeline:  # More than ~15 methods on purpose: a facade, each method a step of one loop module.
    """A DreamZero model plus session store: `generate(ModelBatch) -> ChunkResult` for any mix of sessions."""

    def __init__(
        self, model, config: PipelineConfig | None = None, store: SessionStore | None = None, branch_group=None
    ):
        self.model = model
        # CFG-parallel (`cfg_parallel.BranchGroup`): this process runs one guidance branch's rows of every call, in
        # lock-step with the rank running the other; None runs both branches here
        self.branch_group = branch_group
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
        # prompt -> T5 rows [1, text_len, text_dim], LRU (`prompts.encode_prompts`): new sessions mostly reuse a few
        # prompts (and every guided row the same negative prompt), so T5 runs once per prompt rather than once per
        # session
        self._prompt_rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.compiled = compile_model(model, self.config.compile)
        self.warmup_ms: float | None = None
        self._footprints: dict[tuple[int, int], SessionFootprint] = {}
        self._video_bytes: dict[tuple[int, int], int] = {}  # decoder state of a session asking for video, per canvas

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
        placement=None,
    ) -> DreamZeroPipeline:
        """Load a checkpoint (None: the embedded tiny default) and wrap it with a session store.

        `layout` / `config` / `placement`: as `dreamzero.checkpoint.load_model` takes them (None: detect / the
        checkpoint's own / everything on `device` in `dtype`).

        `overrides` replaces PipelineConfig fields by name (e.g. {"dynamic_skip": True}); the session store holds at
        most `max_sessions` sessions and `session_max_bytes` bytes of their tensors, evicting idle ones.
        """
        from dreamzero.checkpoint import load_model

        if model_path is None:
            from dreamzero.embedded_default import default_model_dir

            model_path = default_model_dir()
        model = load_model(
            model_path,
            device=device,
            dtype=dtype,
            tokenizer_path=tokenizer_path,
            layout=layout,
            config=config,
            placement=placement,
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
            enc = getattr(getattr(self.model, "config", None), "image_encoder", None)
            vae = self.model.vae
            self._footprints[canvas_hw] = footprint_for(
                self.dit_cfg, self.config, getattr(vae, "cfg", None), enc, canvas_hw, self.dtype,
                getattr(vae, "spatial_factor", 8), branches=len(self.branches),
            )  # fmt: skip
        return self._footprints[canvas_hw]

    def admit(self, batch: ModelBatch, busy: Iterable[str] = ()) -> None:
        """Reserve the peak footprint of every session of `batch` (CapacityError when they cannot fit); the ids stay
        protected from eviction until `store.release`. Validates the batch first."""
        self._validate(batch)
        self._reserve(batch, busy)

    def _reserve(self, batch: ModelBatch, busy: Iterable[str] = ()) -> None:
        # no byte budget (the CPU default): only protect the ids; sessions then count what they hold
        if self.store.max_bytes is None:
            self.store.admit({sid: 0 for sid in batch.session_ids}, busy)
            return
        canvas = self.canvas_hw(batch.images.shape[2:4])
        peak, video = self.footprint(canvas).peak, 0
        if wants_video(batch.return_video):
            video = self.video_state_bytes(canvas)
        asks = batch.return_video or [False] * len(batch)
        self.store.admit({sid: peak + (video if a else 0) for sid, a in zip(batch.session_ids, asks)}, busy)

    def video_state_bytes(self, canvas_hw: tuple[int, int]) -> int:
        """Bytes a session asking for video holds on top of its footprint (its VAE decoder state), per canvas."""
        canvas_hw = tuple(int(v) for v in canvas_hw)
        vae_cfg = getattr(self.model.vae, "cfg", None)
        if canvas_hw not in self._video_bytes:
            nfpb = self.dit_cfg.num_frame_per_block
            self._video_bytes[canvas_hw] = (
                0 if vae_cfg is None else video_state_nbytes(vae_cfg, canvas_hw, self.dtype, nfpb)
            )
        return self._video_bytes[canvas_hw]

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
        timer = StageTimer(self.device)
        self._validate(batch)
        with timer("inputs"):
            frames = model_frames(batch.images, self.device, self.config.model_input_hw)  # [B, T, 3, H, W] in [-1, 1]
        self._reserve(batch)  # before any session is touched; a no-op for sessions a server admitted already
        try:
            rows = self._resolve_rows(batch)  # under CFG-parallel an exchange with the other rank, which may fail
            return self._generate(batch, rows, frames, timer, t_start, return_latents, noise)
        except Exception:
            # a failed call may have advanced some caches but not the frame positions: forget these sessions so
            # their state is never reused silently (their next call restarts as a new session)
            self.store.drop(batch.session_ids)
            raise
        finally:
            self.store.release(batch.session_ids)  # stored sessions keep their reservation, the others return it

    def _generate(self, batch, rows, frames, timer, t_start, return_latents, noise) -> ChunkResult:
        n = len(batch)
        # 1. text (cached per session; only new / changed prompts are encoded, in one call)
        with timer("text"):
            encode_prompts(
                rows,
                self._prompt_rows,
                self.config.prompt_cache_size,
                self.model.text_encoder,
                self.branches,
                self.device,
                self.dtype,
            )

        # 2. restarted rows: anchor conditioning and prefill at frame 0
        restarts = [r for r in rows if r.restarted]
        if restarts:
            anchor_t = frames.shape[1] - 1 if frames.shape[1] > 1 else 0
            anchors = frames[[r.index for r in restarts], anchor_t]  # [G, 3, H, W]
            start_sessions(self, restarts, anchors, timer)

        # 3. continuing rows: prefill the observed block (one forward whatever their frame positions)
        continuing = [r for r in rows if not r.restarted]
        if continuing:
            prefill_observed(self, continuing, frames, timer)

        # 4. denoise every row in one batch (restarted rows sit at frame 1, continuing ones further on)
        block = (self.dit_cfg.num_action_per_block, self.dit_cfg.action_dim)
        guide, rtc_sources = rtc.plan(batch, [r.state for r in rows], self.action_horizon, block, self.device)
        res = self._denoise(rows, batch, noise, timer, guide)
        actions = torch.zeros(n, self.action_horizon, self.max_action_dim)  # rows are in batch order
        act = res.action[:, : self.action_horizon].cpu()
        actions[:, :, : act.shape[2]] = act
        for r in rows:
            r.state.prev_chunk = rtc.remember(batch, r.index, actions[r.index].numpy())
        video = None
        answers = self.branch_group is None or self.branch_group.rank == 0  # a CFG rank 1's result is dropped
        if answers and wants_video(batch.return_video):  # after the denoise, at the chunk's end: only when asked
            with timer("video"):
                video = predicted_frames(self.model.vae, rows, res.video, batch.return_video)
        else:
            for r in rows:
                r.state.video_state = None  # a gap in the session's video: asking again starts afresh
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
            video=video,
        )

    # -- stages (the rest live in the sibling modules) ----------------------------------------------------------------

    @property
    def guided(self) -> bool:
        """Whether classifier-free guidance runs (cfg_scale != 1): each session then has a cond and an uncond row."""
        return self.config.cfg_scale != 1.0

    @property
    def branches(self) -> tuple[str, ...]:
        """The CFG branches of each session's caches: ("cond", "uncond") when guided, else ("cond",)."""
        if self.branch_group is not None and self.guided:
            return (self.branch_group.branch,)
        return BRANCHES if self.guided else BRANCHES[:1]

    def _resolve_rows(self, batch: ModelBatch) -> list[Row]:
        """Step 1; under CFG-parallel both ranks agree on it (rank 0 decides, `BranchGroup.agree_rows`)."""

        def resolve(decided=None):
            return resolve_rows(batch, self.store, self.dit_cfg.max_attention_frames, self.config.default_seed, decided)

        if self.branch_group is None or not self.guided:
            return resolve()
        own = resolve() if self.branch_group.rank == 0 else None
        return self.branch_group.agree_rows(own, batch, self.store, resolve)

    def _validate(self, batch: ModelBatch) -> None:
        validate_batch(batch, self.dit_cfg, self.action_horizon, self.max_action_dim)

    def _denoise(
        self, rows: list[Row], batch: ModelBatch, noise: Mapping | None, timer: StageTimer, guide=None
    ) -> DenoiseResult:
        """Denoise every row's block in one batch: noise, state, each row's `y` slice, context and stacked caches."""
        cfg = self.dit_cfg
        states = [r.state for r in rows]
        starts, nfpb = [s.current_start_frame for s in states], cfg.num_frame_per_block
        shape_a = (cfg.num_action_per_block, cfg.action_dim)
        video_noise, action_noise = row_noise(
            rows, (cfg.out_dim, nfpb, *states[0].latent_hw), shape_a, noise, self.device
        )
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
            ctx = context_emb(self, states, [s.clip_feature for s in states])
            return denoise_block(
                self.dit,
                self.config,
                video_noise=video_noise,
                action_noise=action_noise,
                state=state,
                context_emb=ctx,
                kv_cache=stack_caches(states, self.branches),  # stacked layer by layer as the DiT runs
                start_frame=starts,
                y=y,
                action_guide=guide,
                branch_group=self.branch_group if self.guided else None,
            )
