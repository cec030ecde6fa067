"""Components off the GPU on a real CUDA device (marked `gpu`; the CPU rehearsal cannot show devices or the
allocator, so these skip there): a CPU-placed encoder never touches the GPU, the offloaded text encoder holds one or
two blocks on the GPU during an encode and gives the resident encoder's rows. The CPU-side logic and the numbers are
covered by tests/unit/planner/test_placement.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dreamzero.checkpoint import save_model
from dreamzero.config import preset
from dreamzero.model.dreamzero import DreamZeroModel
from dreamzero.model.text_encoder import T5TextEncoder
from dreamzero.model.tokenizer import build_local_tokenizer
from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.placement import text_encoder_layer_nbytes
from dreamzero.types import ModelBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="device placement needs a real CUDA device (the rehearsal's is the CPU)"
    ),
]

PROMPTS = ["pick up the red marker and put it in the cup", "open the drawer"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = preset("tiny")
    model = DreamZeroModel.from_config(cfg, device="cpu", dtype=torch.float32, seed=5)
    model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    return save_model(model, tmp_path_factory.mktemp("placement-gpu") / "tiny")


def _batch() -> ModelBatch:
    rng = np.random.default_rng(1)
    return ModelBatch(
        images=rng.integers(0, 256, (2, 1, 32, 64, 3), dtype=np.uint8),
        state=rng.standard_normal((2, 1, 64)).astype(np.float32),
        state_mask=np.ones((2, 1, 64), bool),
        prompts=PROMPTS,
        session_ids=["a", "b"],
    )


def test_cpu_encoders_stay_off_the_gpu(saved):
    kw = dict(device="cuda", dtype="float32", overrides={"num_inference_steps": 2, "dit_step_mask": None})
    ref = DreamZeroPipeline.load(saved, **kw).generate(_batch())
    pipe = DreamZeroPipeline.load(saved, placement={"text_encoder": "cpu", "image_encoder": "cpu"}, **kw)
    m = pipe.model
    for module in (m.text_encoder, m.image_encoder):
        assert all(t.device.type == "cpu" for t in [*module.parameters(), *module.buffers()])
    for module in (m.model, m.vae):
        assert all(p.device.type == "cuda" for p in module.parameters())
    out = pipe.generate(_batch())
    np.testing.assert_allclose(out.actions, ref.actions, rtol=0, atol=1e-3)  # CPU vs GPU matmuls
    states = [pipe.store.lookup(i)[0] for i in ("a", "b")]
    assert all(rows.device.type == "cuda" for s in states for rows in s.text_cache.values())  # moved to the GPU


def test_offloaded_text_encoder_holds_at_most_two_blocks():
    """Four real-width UMT5-XXL blocks: the GPU's peak during an offloaded encode stays under two blocks plus the
    activations (all four would be twice that), nothing stays after, and the rows equal the resident encoder's."""
    cfg = dataclasses.replace(preset("droid_14b_slice").text_encoder, num_layers=4)
    torch.manual_seed(0)
    te = T5TextEncoder(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    te.tokenizer = build_local_tokenizer(cfg.vocab_size)
    block = text_encoder_layer_nbytes(cfg, torch.bfloat16)
    te.cuda()
    ref = te.encode(PROMPTS)
    te.cpu()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    te.offload_to("cuda")
    assert all(p.is_pinned() for b in te.t5.encoder.block for p in b.parameters())
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rows = te.encode(PROMPTS)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert rows.device.type == "cuda"
    assert peak < 2 * block + (256 << 20), f"peak {peak / 2**20:.0f} MiB for blocks of {block / 2**20:.0f} MiB"
    assert torch.cuda.memory_allocated() - base <= rows.numel() * rows.element_size()
    assert all(p.device.type == "cpu" for p in te.parameters())
    torch.testing.assert_close(rows, ref, rtol=1e-2, atol=1e-2)  # the same kernels; bf16 tolerance for safety
    assert te.offload_stats["bytes_moved"] >= 4 * block
