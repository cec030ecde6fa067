"""fp8 DiT weights against fp32, as actions: the bounds documented in docs/model.md, "Reduced precision".

The figures come from benchmarks/precision_drift.py (docs/benchmarks.md, "Reduced precision: action drift"); each
bound is about twice the worst drift measured there, so a change that makes the fp8 path worse (a per-tensor scale, a
scale rounded to bf16, codes truncated instead of rounded, the embeddings quantised too) fails, while a seed does
not. A lower bound checks the run really used fp8 (an fp32 copy would match to ~1e-6).

- The tiny model's whole loop, 4 chunks of one session (a restart and 3 continuing over the KV cache), fp32 weights
  quantised to fp8 with fp32 activations, and with bf16 activations (the weights cast to bf16, then quantised, as
  the loader quantises a bf16 release). ~25 s per seed on 2 busy cores (6 runs of the loop), 2 seeds here.
- The 5B-shaped slice's DiT (`libero_5b_slice`: width 3072, 50 tokens per latent frame), one denoise forward of the
  first chunk from bf16 weights, fp8 with fp32 activations against fp32.
"""

from __future__ import annotations

import pytest

from tests.support.precision import FP32, OPTIONS, action_diff, session_actions, slice_forward_actions, tiny_model

FP8_FP32, FP8_BF16 = OPTIONS[0], OPTIONS[1]
# normalised action units (actions of mean magnitude ~1): max abs / mean abs over every entry of every chunk
TINY_BOUND = {"max_abs": 0.25, "mean_abs": 0.06}
SLICE_BOUND = {"max_abs": 0.1, "mean_abs": 0.03}


@pytest.mark.parametrize("seed", [0, 1])
def test_tiny_session_fp8_actions_stay_near_fp32(seed, one_thread):
    base = tiny_model(seed)
    ref = session_actions(base, FP32, chunks=4, seed=seed)
    for option in (FP8_FP32, FP8_BF16):
        got = session_actions(base, option, chunks=4, seed=seed)
        for k, (a, b) in enumerate(zip(ref, got)):
            d = action_diff(a, b)
            print(f"seed {seed}, {option.name}, chunk {k}: {d}")
            assert d.max_abs <= TINY_BOUND["max_abs"] and d.mean_abs <= TINY_BOUND["mean_abs"], (option.name, k, d)
            assert d.mean_abs > 1e-4  # it ran in fp8


@pytest.mark.slow  # building the 5B slice's DiT and T5 block, then four forwards at width 3072
def test_5b_slice_dit_forward_fp8_stays_near_fp32(all_cores):
    acts = slice_forward_actions("libero_5b_slice", (FP8_FP32,), seed=0)
    d = action_diff(acts[FP32.name], acts[FP8_FP32.name])
    print(f"libero_5b_slice DiT forward, fp8 vs fp32: {d}")
    assert d.max_abs <= SLICE_BOUND["max_abs"] and d.mean_abs <= SLICE_BOUND["mean_abs"], d
    assert d.mean_abs > 1e-4
