"""One loader, three layouts: a tiny libero_5b-shaped model written as an hf folder, a full_weights.pt and a diffusers
export loads back from each (detected and named) with identical outputs; layout quirks and bad files are named."""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dreamzero.checkpoint import (
    detect_layout,
    load_model,
    normalize_key,
    save_diffusers,
    save_full_weights,
    save_model,
)
from dreamzero.errors import CheckpointError
from dreamzero.model.dreamzero import DreamZeroModel
from dreamzero.model.tokenizer import build_local_tokenizer
from tests.support.checkpoints import tiny_5b_config

LOAD = {"device": "cpu", "dtype": torch.float32}


@pytest.fixture(scope="module")
def model():
    cfg = tiny_5b_config()
    m = DreamZeroModel.from_config(cfg, device="cpu", dtype=torch.float32, seed=5)
    m.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    return m


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    hf = save_model(model, root / "hf", shard_size=1 << 20)
    full = save_full_weights(model, root / "fw" / "full_weights.pt")
    diffusers = save_diffusers(model, root / "diffusers", shard_size=1 << 20)
    return {"hf": hf, "full_weights": full, "diffusers": diffusers, "tokenizer": hf / "tokenizer"}


def _outputs(m: DreamZeroModel) -> dict[str, torch.Tensor]:
    """Every component on fixed inputs, the DiT through its image branch (CLIP of the anchor in the context)."""
    g = torch.Generator().manual_seed(11)
    image = torch.rand(1, 3, 64, 128, generator=g) * 2 - 1
    video = torch.rand(1, 3, 5, 64, 128, generator=g) * 2 - 1
    text = m.text_encoder.encode(["put the bowl on the plate"])
    clip = m.image_encoder.encode(image)
    latents = m.vae.encode(video)  # [1, 48, 2, 4, 8]
    cfg = m.config.dit
    out = m.model(
        latents,
        torch.full((1, 2), 500),
        kv_cache=None,
        current_start_frame=1,
        context=text,
        clip_feature=clip,
        action=torch.randn(1, cfg.num_action_per_block, cfg.action_dim, generator=g),
        timestep_action=torch.full((1, cfg.num_action_per_block), 500),
        state=torch.randn(1, 1, cfg.max_state_dim, generator=g),
    )
    return {"text": text, "clip": clip, "latents": latents, "video": out.video, "action": out.action}


def _load(saved, which, **kw):
    path = saved[which]
    if which == "full_weights":
        kw.setdefault("config", tiny_5b_config())
        kw.setdefault("tokenizer_path", saved["tokenizer"])
    return load_model(path, **LOAD, **kw)


def test_detection_looks_at_the_files(saved, tmp_path):
    assert detect_layout(saved["hf"]) == "hf"
    assert detect_layout(saved["full_weights"]) == "full_weights"
    assert detect_layout(saved["full_weights"].parent) == "full_weights"
    assert detect_layout(saved["diffusers"]) == "diffusers"
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="no checkpoint layout we know"):
        detect_layout(tmp_path)
    with pytest.raises(CheckpointError, match="not a torch state dict"):
        detect_layout(tmp_path / "notes.txt")
    with pytest.raises(CheckpointError, match="layout must be one of"):
        load_model(saved["hf"], layout="gguf", **LOAD)


def test_all_three_layouts_give_identical_outputs(model, saved):
    reference = _outputs(model)
    assert reference["action"].abs().sum() > 0 and reference["clip"].abs().sum() > 0
    ref_state = model.state_dict()
    for layout in ("hf", "full_weights", "diffusers"):
        for named in (None, layout):
            loaded = _load(saved, layout, layout=named)
            assert loaded.config.dit == model.config.dit and loaded.config.image_encoder == model.config.image_encoder
            state = loaded.state_dict()
            same = [k for k in ref_state if torch.equal(ref_state[k], state[k])]
            # diffusers stores neither CLIP's logit scale nor its contrastive head (never used by DreamZero)
            assert set(ref_state) - set(same) <= {"image_encoder.head", "image_encoder.log_scale"}, layout
            got = _outputs(loaded)
            for key, value in reference.items():
                assert torch.equal(got[key], value), f"{layout}: {key} differs"
    assert _load(saved, "diffusers").config == model.config  # model_index.json's dreamzero block restores the rest


def test_the_image_branch_changes_the_actions(model):
    """The ti2v DiT really conditions on the CLIP tokens (so a loader that dropped them would show)."""
    out = _outputs(model)
    with torch.no_grad():
        blocks = [b.cross_attn.k_img.weight for b in model.model.blocks]
        saved_weights = [w.clone() for w in blocks]
        for w in blocks:
            w.mul_(2)
    try:
        assert not torch.equal(_outputs(model)["action"], out["action"])
    finally:
        with torch.no_grad():
            for w, s in zip(blocks, saved_weights):
                w.copy_(s)


# -- full_weights.pt ---------------------------------------------------------------------------------------------------


def test_nested_and_prefixed_full_weights_load(model, saved, tmp_path):
    flat = torch.load(saved["full_weights"], weights_only=True)
    reference = _outputs(model)

    def wrap(key: str) -> str:  # DDP, torch.compile and PEFT leave their names in the keys
        if ".blocks.0." in key:
            return key.replace(".blocks.0.", ".blocks.0._orig_mod.").replace(".q.weight", ".q.base_layer.weight")
        return "module." + key

    promoted = {wrap(k): (v.reshape(1) if v.ndim == 0 else v) for k, v in flat.items()}  # FSDP's 0-d -> [1]
    assert any(v.ndim == 0 for v in flat.values())
    variants = {
        "fsdp": {"fsdp_checkpoint": {"model": promoted, "step": 7}},
        "state_dict": {"state_dict": promoted, "epoch": 1},
        "model": {"model": promoted},
    }
    for name, obj in variants.items():
        path = tmp_path / name / "full_weights.pt"
        path.parent.mkdir()
        torch.save(obj, path)
        loaded = load_model(path.parent, config=tiny_5b_config(), tokenizer_path=saved["tokenizer"], **LOAD)
        assert torch.equal(_outputs(loaded)["action"], reference["action"]), name
        assert loaded.image_encoder.log_scale.shape == ()


def test_full_weights_need_a_config_and_check_names(saved, tmp_path):
    with pytest.raises(CheckpointError, match=r"stores no config.*libero_5b"):
        load_model(saved["full_weights"], tokenizer_path=saved["tokenizer"], **LOAD)
    with pytest.raises(CheckpointError, match="unknown preset 'libero5b'"):
        load_model(saved["full_weights"], config="libero5b", **LOAD)
    # a config.json beside the file is used when no config is given
    shutil.copy(saved["hf"] / "config.json", saved["full_weights"].parent / "config.json")
    try:
        assert _load(saved, "full_weights", config=None).config == tiny_5b_config()
    finally:
        (saved["full_weights"].parent / "config.json").unlink()
    # the real preset is far bigger: every misshaped tensor is named before anything is read
    with pytest.raises(CheckpointError, match=r"model config 'libero_5b' describes: .*misshaped tensor\(s\)"):
        load_model(saved["full_weights"], config="libero_5b", tokenizer_path=saved["tokenizer"], **LOAD)
    flat = torch.load(saved["full_weights"], weights_only=True)
    gone = "action_head.model.blocks.1.cross_attn.k_img.weight"
    flat.pop(gone)
    flat["action_head.model.extra"] = torch.zeros(3)
    flat["module.action_head.model.head.modulation"] = flat["action_head.model.head.modulation"]
    path = tmp_path / "broken.pt"
    torch.save(flat, path)
    with pytest.raises(CheckpointError, match="both normalise to 'action_head.model.head.modulation'"):
        _load({"full_weights": path, "tokenizer": saved["tokenizer"]}, "full_weights")
    del flat["module.action_head.model.head.modulation"]
    torch.save(flat, path)
    with pytest.raises(CheckpointError) as err:
        _load({"full_weights": path, "tokenizer": saved["tokenizer"]}, "full_weights")
    assert f"1 missing tensor(s): {gone}" in str(err.value)
    assert "1 unexpected tensor(s): action_head.model.extra" in str(err.value)


class Payload:
    """Stands for any object a pickle could smuggle in."""


def test_pickles_with_other_objects_are_refused(saved, tmp_path):
    flat = torch.load(saved["full_weights"], weights_only=True)
    path = tmp_path / "full_weights.pt"
    torch.save({"model": flat, "extra": Payload()}, path)
    with pytest.raises(CheckpointError, match="objects other than tensors.*refusing"):
        _load({"full_weights": path, "tokenizer": saved["tokenizer"]}, "full_weights")
    path.write_bytes(pickle.dumps({"a": 1}))  # not a torch zip archive at all
    with pytest.raises(CheckpointError, match="full_weights.pt"):
        _load({"full_weights": path, "tokenizer": saved["tokenizer"]}, "full_weights")
    torch.save({"step": 3, "name": "x"}, path)
    with pytest.raises(CheckpointError, match="no state dict of tensors"):
        _load({"full_weights": path, "tokenizer": saved["tokenizer"]}, "full_weights")


def test_normalize_key():
    assert normalize_key("module.action_head.model._orig_mod.blocks.0.q.base_layer.weight") == (
        "action_head.model.blocks.0.q.weight"
    )
    assert normalize_key("action_head.model.head.modulation") == "action_head.model.head.modulation"


# -- diffusers -----------------------------------------------------------------------------------------------------


def _copy(saved, tmp_path) -> Path:
    dst = tmp_path / "diffusers"
    shutil.copytree(saved["diffusers"], dst)
    return dst


def _edit_component(path: Path, component: str, edit) -> None:
    """Apply `edit` to the component's tensors and store them as one file (the index is then gone)."""
    tensors = {}
    for shard in sorted((path / component).glob("*.safetensors")):
        tensors.update(load_file(shard))
        shard.unlink()
    for index in (path / component).glob("*.index.json"):
        index.unlink()
    edit(tensors)
    save_file(tensors, path / component / "model.safetensors")


def test_diffusers_layout_files(saved):
    root = saved["diffusers"]
    index = json.loads((root / "model_index.json").read_text())
    assert index["transformer"] == ["dreamzero", "DreamZeroCausalWanModel"]
    assert json.loads((root / "transformer" / "config.json").read_text())["_class_name"] == "DreamZeroCausalWanModel"
    keys = set(load_file(next((root / "transformer").glob("*.safetensors"))))
    assert "patch_embedding.weight" in keys and not any(k.startswith("action_head.") for k in keys)
    clip = set().union(*(load_file(f) for f in (root / "image_encoder").glob("*.safetensors")))
    assert "vision_model.encoder.layers.0.self_attn.q_proj.weight" in clip and "visual_projection.weight" in clip
    vae = json.loads((root / "vae" / "config.json").read_text())
    assert vae["z_dim"] == 48 and vae["is_residual"]


def test_diffusers_export_without_unused_clip_tensors_loads(model, saved, tmp_path):
    """sglang's export may lack the CLIP block after the one DreamZero reads, post_layernorm and visual_projection,
    and stores no logit scale: the model's outputs are the same."""
    path = _copy(saved, tmp_path)
    last = model.config.image_encoder.num_hidden_layers - 1

    def drop_unused(t):
        for k in [
            k for k in t if k.startswith((f"vision_model.encoder.layers.{last}.", "vision_model.post_", "visual_"))
        ]:
            del t[k]

    _edit_component(path, "image_encoder", drop_unused)
    loaded = load_model(path, **LOAD)
    assert torch.equal(loaded.image_encoder.log_scale, torch.tensor(math.log(1 / 0.07)))
    assert torch.equal(_outputs(loaded)["action"], _outputs(model)["action"])


def test_diffusers_mismatches_are_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_component(path, "transformer", lambda t: t.update({"condition_embedder.time_proj.weight": torch.zeros(2)}))
    _edit_component(path, "text_encoder", lambda t: t.pop("encoder.block.1.layer.1.DenseReluDense.wo.weight", None))
    _edit_component(path, "vae", lambda t: t.update({"quant_conv.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError) as err:
        load_model(path, **LOAD)
    text = str(err.value)
    assert "1 missing tensor(s): text_encoder/encoder.block.1.layer.1.DenseReluDense.wo.weight" in text
    assert "1 unexpected tensor(s): transformer/condition_embedder.time_proj.weight" in text
    assert "misshaped tensor(s): vae/quant_conv.weight (file [1]" in text
    config_file = path / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "_class_name": "WanTransformer3DModel"}))
    with pytest.raises(CheckpointError, match="_class_name is 'WanTransformer3DModel'"):
        load_model(path, **LOAD)
    config_file.write_text(json.dumps({**config, "num_heads": "many"}))
    with pytest.raises(CheckpointError, match=r"diffusion_model_cfg\.num_heads must be int"):
        load_model(path, **LOAD)
    config_file.write_text(json.dumps(config))
    shutil.rmtree(path / "image_encoder")
    with pytest.raises(CheckpointError, match="no image_encoder/ folder"):
        load_model(path, **LOAD)


def test_hf_export_with_peft_names_loads(model, saved, tmp_path):
    """RLinf's HF export may keep PEFT's `.base_layer.` in DiT keys: they are read under their plain names."""
    path = tmp_path / "hf"
    shutil.copytree(saved["hf"], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    plain = "action_head.model.blocks.1.self_attn.q.weight"
    peft = "action_head.model.blocks.1.self_attn.q.base_layer.weight"
    shard = path / index["weight_map"].pop(plain)
    tensors = load_file(shard)
    tensors[peft] = tensors.pop(plain)
    save_file(tensors, shard)
    index["weight_map"][peft] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(path, **LOAD)
    assert torch.equal(loaded.model.blocks[1].self_attn.q.weight, model.model.blocks[1].self_attn.q.weight)
