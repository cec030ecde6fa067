"""bf16 against fp32 on the CPU (CPU torch runs bf16; the GPU tier repeats the tiny check on CUDA).

The bounds are measured, not guessed (docs/model.md, "bf16 drift", has the figures): each is about twice the worst
drift seen over many seeds, so they catch a change that makes bf16 numerics worse (a dtype lost on the way, an fp32
reference silently run in bf16, a norm or softmax in bf16) without flaking on a seed.

- The tiny model's whole loop, 4 chunks (a restart and 3 continuing, to the window's end) with the default plan
  (16 steps, 8-step mask, CFG 5), from one set of fp32 weights cast to each dtype, the same inputs and noise. Over 20
  seeds x 4 chunks the worst drift of the actions (RMS ~1.2) was 0.030 max abs and 0.0056 relative L2; bounds 0.06
  and 0.012. Cost ~1 s per seed (plus ~10 s of one-time set-up when it runs first in a process), 3 seeds here.
- The 14B-shaped slice's DiT (droid_14b_slice: width 5120, 40 heads, the real 880 tokens per latent frame): one
  denoise forward of the first chunk (2 noisy frames + 24 action + 1 state tokens over the anchor frame's KV cache)
  from the same bf16 weights (a release's dtype) and inputs. Over 5 seeds the worst drift was 0.015 max abs and
  0.0067 relative L2 on the actions (RMS ~0.6), 0.035 and 0.0051 on the video prediction (RMS ~1.25); bounds 0.03 /
  0.014 (actions), 0.07 / 0.011 (video). A full chunk at these sizes costs minutes in fp32 on 2 cores, so this runs
  one forward (and the bf16 prefill that makes its cache). Cost on 2 quiet cores 28 s: building the weights ~10 s,
  the bf16 prefill 3 s, the fp32 forward 11 s, the bf16 one 6 s; 70-110 s while other jobs share the cores.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.drift import drift, slice_dit, slice_dit_forward, slice_inputs, tiny_chunks

TINY_BOUND = {"max_abs": 0.06, "rel_l2": 0.012}
SLICE_BOUND = {"action": {"max_abs": 0.03, "rel_l2": 0.014}, "video": {"max_abs": 0.07, "rel_l2": 0.011}}


def _within(d, bound: dict, what: str) -> None:
    assert d.max_abs <= bound["max_abs"] and d.rel_l2 <= bound["rel_l2"], f"{what}: bf16 drift {d} over {bound}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_loop_bf16_actions_stay_near_fp32(seed, one_thread):
    out = tiny_chunks(chunks=4, weight_seed=seed, input_seed=seed, noise_seed=1140 + seed)
    for k, (a32, a16) in enumerate(zip(out[torch.float32], out[torch.bfloat16])):
        d = drift(a32, a16)
        print(f"seed {seed} chunk {k}: {d}")
        _within(d, TINY_BOUND, f"seed {seed} chunk {k}")
        # and the bf16 run is really a bf16 run: it differs from fp32 (an fp32 run would match to ~1e-6)
        assert d.rel_l2 > 1e-4


@pytest.mark.slow  # 28 s on 2 quiet cores (more on busy ones): three forwards at 14B width, 880-1785 tokens
def test_14b_slice_dit_forward_bf16_stays_near_fp32(all_cores):
    dit = slice_dit("droid_14b_slice", seed=0)
    assert dit.cfg.frame_seqlen == 880 and dit.cfg.dim == 5120 and dit.cfg.num_heads == 40
    out = slice_dit_forward(dit, slice_inputs(dit, seed=0))
    ref, bf16 = out[torch.float32], out[torch.bfloat16]
    assert ref.video.shape == (1, 16, 2, 44, 80) and ref.action.shape == (1, 24, 32)
    for what in ("action", "video"):
        d = drift(getattr(ref, what), getattr(bf16, what))
        print(f"14B slice DiT forward, {what}: {d}")
        _within(d, SLICE_BOUND[what], what)
        assert d.rel_l2 > 1e-4
