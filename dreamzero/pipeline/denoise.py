"""The loop on a bare DiT: prefill and denoise of one block for G rows.

`prefill_block` writes clean latents into the KV caches; `denoise_block` runs the two flow-UniPC schedulers (video,
action) with classifier-free guidance batched into one forward. Neither knows about sessions: the pipeline hands them
the sessions' caches layer by layer (`batch_cache.SessionCaches`) and the parity test drives them with a bare
`CausalWanDiT` and caches held whole (`BatchCache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dreamzero import rtc
from dreamzero.config import PipelineConfig
from dreamzero.model.dit import CausalWanDiT, CrossContext
from dreamzero.model.scheduler import FlowUniPCScheduler
from dreamzero.pipeline.batch_cache import BatchCache, SessionCaches
from dreamzero.pipeline.step_plan import StepPlan
from dreamzero.sessions import BRANCHES


def cfg_row_layout(num_sessions: int, guided: bool, branches: tuple[str, ...] | None = None) -> list[tuple[int, str]]:
    """(session index, CFG branch) of each forward row for `num_sessions` sessions: session-major (s0 cond, s0 uncond,
    s1 cond, ...) when guidance runs, one cond row per session otherwise, or one row per session and rank's branch in
    `branches` (CFG-parallel). `branch_rows`, the contexts and the caches all follow this layout."""
    if branches is None:
        branches = BRANCHES if guided else BRANCHES[:1]
    return [(s, b) for s in range(num_sessions) for b in branches]


def branch_rows(x: torch.Tensor | None, guided: bool) -> torch.Tensor | None:
    """[G, ...] -> [2G, ...] in `cfg_row_layout` order when guidance runs, else unchanged."""
    if x is None or not guided:
        return x
    return x.repeat_interleave(2, dim=0)


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
    kv_cache: BatchCache | SessionCaches | None,
    start_frame: int | list[int],
    y: torch.Tensor | None = None,
    write_to: SessionCaches | None = None,
) -> BatchCache | None:
    """Write clean latents [R, z, F, h, w] (t = 0) at `start_frame` (one, or one per row) into the caches.

    R rows are whatever the caller batches (typically cond + uncond rows of G sessions); `y` [R, Cy, F, h, w].
    Returns the new per-layer caches, or with `write_to` stores each layer's in those sessions as soon as the layer
    is done (replacing the old one: old and new coexist for one layer, not for all) and returns None.
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
        kv_sink=None if write_to is None else write_to.store,
    )
    return None if write_to is not None else BatchCache(out.kv_cache, out.kv_lengths)


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
    kv_cache: BatchCache | SessionCaches,
    start_frame: int | list[int],
    y: torch.Tensor | None = None,
    action_guide: rtc.ActionGuide | None = None,
    branch_group=None,
) -> DenoiseResult:
    """Denoise one block for G rows: video_noise [G, z, F, h, w], action_noise [G, A, ad], state [G, 1, S].

    With guidance (cfg_scale != 1) `context_emb` and `kv_cache` hold 2G rows, session-major (s0 cond, s0 uncond,
    s1 cond, ...), and `y` G rows; without guidance all hold G rows. `start_frame` is one frame position for all rows
    or one per session. Samples stay fp32 whatever the DiT's dtype. `action_guide` (real-time chunking) steers the
    action velocity on every step, whether the DiT ran or not, and writes the prefix at the end.
    `branch_group` (`cfg_parallel.BranchGroup`, CFG-parallel): every input holds G rows of this rank's branch only,
    and each DiT step's predictions are exchanged with the other rank before guidance combines them.
    """
    guided = cfg.cfg_scale != 1.0
    doubled = guided and branch_group is None  # both branches' rows in this forward
    g = video_noise.shape[0]
    start_frame = _starts(start_frame, 2 * g if doubled else g)
    video_sched = FlowUniPCScheduler(cfg.num_inference_steps, cfg.sigma_shift)
    action_sched = FlowUniPCScheduler(cfg.num_inference_steps, cfg.sigma_shift)
    plan = StepPlan(cfg)
    x, a = video_noise.float(), action_noise.float()
    state_rows, y_rows = branch_rows(state, doubled), branch_rows(y, doubled)
    v = v_action = None
    steps = 0
    cross_kv = dit.cross_kv(context_emb)  # the context is constant over the steps: project it once
    for i, t in enumerate(video_sched.timesteps.tolist()):
        if plan.should_run(i) or v is None:
            n = 2 * g if doubled else g
            timestep = torch.full((n, x.shape[2]), t, dtype=torch.long, device=x.device)
            timestep_action = torch.full((n, a.shape[1]), t, dtype=torch.long, device=x.device)
            out = dit(
                branch_rows(x, doubled),
                timestep,
                kv_cache=kv_cache.layers,
                kv_lengths=kv_cache.lengths,
                current_start_frame=start_frame,
                context_emb=context_emb,
                cross_kv=cross_kv,
                y=y_rows,
                action=branch_rows(a, doubled),
                timestep_action=timestep_action,
                state=state_rows,
            )
            pred_v, pred_a = out.video.float(), out.action.float()
            if guided and branch_group is not None:  # the same three tensors on both ranks: the same guidance
                v_cond, v_uncond, v_action = branch_group.exchange(pred_v, pred_a)
                v = v_uncond + cfg.cfg_scale * (v_cond - v_uncond)
            elif guided:  # guidance on video only; the action follows the conditional branch
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
