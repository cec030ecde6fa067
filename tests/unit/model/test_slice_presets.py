"""The slice presets (`droid_14b_slice`, `libero_5b_slice`): the real presets cut to 1 DiT block, 1 T5 block and
2 CLIP blocks, every layer with the real checkpoint's tensor shapes, saved and loaded through the normal loader.

Shapes "per layer": a tensor of layer N (`blocks.N.`, `transformer.N.`) is compared under its name with the layer
index taken out, so the slice's one block must hold exactly the shapes every one of the real preset's 40 (or 30)
blocks holds; the tensors outside the layers (embeddings, heads, registers, the whole VAE) must equal the real
ones name for name. The one exception is the T5 vocabulary (`SLICE_VOCAB` rows of the real width, 4096).

Cost on this repository's 2-core CPU, quiet (in brackets: while other jobs shared the cores):
- shapes on the meta device: < 1 s each, no memory;
- `droid_14b_slice` (1.10 B values): build with random bf16 weights ~10 s, `save_model` ~6 s, `load_model` < 1 s
  (the shards are memory-mapped), the value check ~1 s: 15 s (27 s) and 2.2 GB on disk (hf layout);
- `libero_5b_slice` (1.25 B values, 0.70 B of them the whole Wan 2.2 VAE): build ~13 s, hf ~6 s, full_weights.pt
  ~9 s, one restart chunk of the loaded model at 1 DiT step a few s: 23 s (39-58 s, marked slow) and 2.5 GB per
  layout; the hf folder is deleted before the full_weights.pt is written, so the test never holds more than 2.5 GB.
"""

from __future__ import annotations

import math
import re
import shutil

import numpy as np
import pytest
import torch

from dreamzero.checkpoint import detect_layout, load_model, save_full_weights, save_model
from dreamzero.config import SLICE_VOCAB, from_checkpoint_config, preset, to_checkpoint_config
from dreamzero.model.dreamzero import DreamZeroModel
from dreamzero.model.tokenizer import build_local_tokenizer

SLICES = {"droid_14b_slice": "droid_14b", "libero_5b_slice": "libero_5b"}
#: the layer lists of the release layout: DiT blocks, T5 blocks, CLIP's visual transformer
_LAYER = re.compile(
    r"^(action_head\.(?:model\.blocks|text_encoder\.blocks|image_encoder\.model\.visual\.transformer))\.\d+\."
)
_VOCAB = "action_head.text_encoder.token_embedding.weight"


def per_layer_shapes(model) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """(release name with the layer index replaced by `*` -> its one shape, layer list -> number of layers)."""
    shapes: dict[str, set[tuple[int, ...]]] = {}
    layers: dict[str, set[str]] = {}
    for t in model.release_tensors():
        m = _LAYER.match(t.name)
        name = t.name if m is None else _LAYER.sub(r"\1.*.", t.name)
        if m is not None:
            layers.setdefault(m.group(1), set()).add(t.name[m.end(1) + 1 :].split(".")[0])
        shapes.setdefault(name, set()).add(tuple(t.shape))
    assert all(len(s) == 1 for s in shapes.values()), "a layer list whose layers differ in shape"
    return {n: s.pop() for n, s in shapes.items()}, {k: len(v) for k, v in layers.items()}


def assert_real_shapes(model, real_name: str) -> None:
    """Every tensor of `model` has the shape its layer has in the real preset `real_name` (built on meta)."""
    real, real_layers = per_layer_shapes(DreamZeroModel.from_config(preset(real_name), device="meta"))
    got, got_layers = per_layer_shapes(model)
    assert set(got) == set(real), f"names differ: {sorted(set(got) ^ set(real))[:8]}"
    diff = {n: (got[n], real[n]) for n in real if got[n] != real[n] and n != _VOCAB}
    assert not diff, f"shapes differ from {real_name}: {diff}"
    assert got[_VOCAB] == (SLICE_VOCAB, real[_VOCAB][1])
    assert real_layers == {
        "action_head.model.blocks": {"droid_14b": 40, "libero_5b": 30}[real_name],
        "action_head.text_encoder.blocks": 24,
        "action_head.image_encoder.model.visual.transformer": 32,
    }
    assert got_layers == {
        "action_head.model.blocks": 1,
        "action_head.text_encoder.blocks": 1,
        "action_head.image_encoder.model.visual.transformer": 2,
    }


@pytest.mark.parametrize("name", list(SLICES))
def test_slices_have_the_real_shapes_per_layer(name):
    cfg, real = preset(name), preset(SLICES[name])
    assert_real_shapes(DreamZeroModel.from_config(cfg, device="meta"), SLICES[name])
    # what the loop reads from the config beyond the tensors: token counts, canvas, horizon, embodiment
    for field in ("frame_seqlen", "num_frame_per_block", "num_action_per_block", "num_state_per_block", "head_dim"):
        assert getattr(cfg.dit, field) == getattr(real.dit, field), field
    assert (cfg.pipeline, cfg.action_horizon, cfg.embodiment_tag, cfg.vae) == (
        real.pipeline,
        real.action_horizon,
        real.embodiment_tag,
        real.vae,
    )
    assert from_checkpoint_config(to_checkpoint_config(cfg)) == cfg


def _build(name: str) -> DreamZeroModel:
    model = DreamZeroModel.from_config(preset(name), dtype=torch.bfloat16, seed=0)
    model.text_encoder.tokenizer = build_local_tokenizer(SLICE_VOCAB)
    return model


def _assert_loaded(loaded, model, name: str) -> None:
    assert loaded.config == preset(name) and loaded.dtype == torch.bfloat16
    assert_real_shapes(loaded, SLICES[name])
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert not unequal, f"values changed in the round trip: {unequal[:5]}"


def _disk_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_droid_14b_slice_saves_and_loads_in_the_release_layout(tmp_path):
    model = _build("droid_14b_slice")
    values = model.num_parameters()
    assert values == pytest.approx(1.098e9, rel=1e-3)
    path = save_model(model, tmp_path / "hf")
    assert detect_layout(path) == "hf"
    assert len(list(path.glob("model-*.safetensors"))) == 1  # under the 5 GiB shard size
    assert _disk_bytes(path) == pytest.approx(2 * values, rel=0.01)  # 2.2 GB
    _assert_loaded(load_model(path, device="cpu", dtype=torch.bfloat16), model, "droid_14b_slice")


@pytest.mark.slow  # 23 s on 2 quiet cores, up to ~60 s on busy ones: 1.25 B values, two layouts
def test_libero_5b_slice_saves_and_loads_as_hf_and_full_weights(tmp_path):
    model = _build("libero_5b_slice")
    values = model.num_parameters()
    assert values == pytest.approx(1.254e9, rel=1e-3)
    assert sum(math.prod(p.shape) for p in model.vae.parameters()) == pytest.approx(0.705e9, rel=1e-3)

    hf = save_model(model, tmp_path / "hf")
    assert _disk_bytes(hf) == pytest.approx(2 * values, rel=0.01)  # 2.5 GB
    loaded = load_model(hf, device="cpu", dtype=torch.bfloat16)
    _assert_loaded(loaded, model, "libero_5b_slice")
    # the loaded slice runs the loop at LIBERO's real sizes: 256x512 canvas -> 160x320 -> 50 tokens per frame
    from dreamzero.pipeline import DreamZeroPipeline
    from tests.support.drift import chunk_batch

    pipe = DreamZeroPipeline(
        loaded, loaded.config.pipeline.with_overrides({"num_inference_steps": 1, "dit_step_mask": None})
    )
    res = pipe.generate(chunk_batch(0, (256, 512)))
    assert res.actions.shape == (1, 16, 32) and np.isfinite(res.actions).all() and res.dit_steps == 1
    state, _ = pipe.store.lookup("d")
    assert state.kv_cache[0].shape[2:] == (50, 24, 128)  # [2, branches, L, heads, head_dim]: the anchor frame
    del loaded, pipe, state
    shutil.rmtree(hf)

    file = save_full_weights(model, tmp_path / "fw" / "full_weights.pt")
    model.text_encoder.tokenizer.save_pretrained(str(file.parent / "tokenizer"))  # found beside the file
    assert file.stat().st_size == pytest.approx(2 * values, rel=0.01)
    assert detect_layout(file) == "full_weights" == detect_layout(file.parent)
    _assert_loaded(
        load_model(file, device="cpu", dtype=torch.bfloat16, config="libero_5b_slice"), model, "libero_5b_slice"
    )
