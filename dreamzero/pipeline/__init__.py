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

Where each part lives:

| module | what |
|---|---|
| `core` | `DreamZeroPipeline`: load, compile warm-up, session control, admission by bytes, `generate` (steps 1-6) |
| `inputs` | `validate_batch` (bad input named by field before any session is touched), `model_frames` (-> [-1, 1]) |
| `rows` | step 1: `Row`, `resolve_rows` (find or create each row's session, whether and why it restarts) |
| `prompts` | step 2: `encode_prompts` and the prompt -> T5 rows LRU cache |
| `conditioning` | step 3: `start_sessions`, `extend_conditioning`, `prefill_observed`, `context_emb` |
| `noise` | step 4: `row_noise` |
| `denoise` | step 5 on a bare DiT: `cfg_row_layout`, `branch_rows`, `prefill_block`, `denoise_block` |
| `step_plan` | `StepPlan`: which scheduler steps run the DiT (static mask / dynamic cosine skip) |
| `batch_cache` | `SessionCaches` (a forward's rows, stacked a layer at a time), `batch_kv_transient` |
| `compile` | `compile_model` (`pipeline.compile` levels) |
| `budget` | a replica's measured byte budget and rows (`resolve_serving_memory`; `dreamzero.memory_fit`) |
| `timer` | `StageTimer`: per-stage wall time (`ChunkResult.timings_ms`) |
| `video` | predicted video: the rows that ask (`return_video`) decode their chunk into uint8 frames |
| `cfg_parallel` | `BranchGroup`: the two guidance branches on two ranks (`policy.cfg_parallel: 2`) |
"""

from dreamzero.pipeline.batch_cache import BatchCache, split_caches, stack_caches
from dreamzero.pipeline.compile import compile_model
from dreamzero.pipeline.core import DreamZeroPipeline
from dreamzero.pipeline.denoise import DenoiseResult, branch_rows, cfg_row_layout, denoise_block, prefill_block
from dreamzero.pipeline.step_plan import StepPlan

__all__ = [
    "BatchCache",
    "DenoiseResult",
    "DreamZeroPipeline",
    "StepPlan",
    "branch_rows",
    "cfg_row_layout",
    "compile_model",
    "denoise_block",
    "prefill_block",
    "split_caches",
    "stack_caches",
]
