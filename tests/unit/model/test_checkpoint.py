"""Checkpoint I/O on the tiny preset: save -> load is bit-identical; broken directories fail naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dreamzero.checkpoint import INDEX_FILE, load_dit, load_model, read_config, save_model
from dreamzero.config import from_checkpoint_config, preset, to_checkpoint_config
from dreamzero.device import parse_device, parse_dtype, select_device
from dreamzero.errors import CheckpointError, ConfigError
from dreamzero.model.dreamzero import DreamZeroModel
from dreamzero.model.tokenizer import build_local_tokenizer
from tests.support.checkpoints import tiny_5b_config


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    model = DreamZeroModel.from_config(cfg, device="cpu", dtype=torch.float32, seed=7)
    model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    return model


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_model(tiny, path, shard_size=1 << 20)  # ~1 MB shards: several of them
    return path


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(saved, dst)
    return dst


def _outputs(model: DreamZeroModel) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    image = torch.rand(1, 3, 32, 64, generator=g) * 2 - 1
    video = torch.rand(1, 3, 5, 32, 64, generator=g) * 2 - 1
    return {
        "text": model.text_encoder.encode(["put the cup in the bowl"]),
        "clip": model.image_encoder.encode(image),
        "latents": model.vae.encode(video),
    }


def test_save_writes_the_release_layout(saved, tiny):
    index = json.loads((saved / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(k.startswith("action_head.") for k in index["weight_map"])
    assert len(index["weight_map"]) == len(tiny.release_tensors())
    on_disk = sum((saved / s).stat().st_size for s in shards)
    assert index["metadata"]["total_size"] <= on_disk
    assert "action_head.image_encoder.model.visual.transformer.0.attn.to_qkv.weight" in index["weight_map"]
    assert read_config(saved) == tiny.config
    assert (saved / "tokenizer" / "tokenizer.json").is_file()


def test_save_then_load_is_bit_identical(saved, tiny):
    loaded = load_model(saved, device="cpu", dtype=torch.float32)
    a, b = tiny.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different
    for model in (tiny, loaded):  # the UMT5 embedding tie survives building and loading
        assert model.text_encoder.t5.shared.weight is model.text_encoder.t5.encoder.embed_tokens.weight
    for name, value in _outputs(tiny).items():
        assert torch.equal(value, _outputs(loaded)[name]), name
    # the DiT too: one prefill pass with the same inputs
    dit_in = dict(
        x=torch.randn(1, 16, 1, 8, 16),
        timestep=torch.zeros(1, 1, dtype=torch.long),
        kv_cache=None,
        current_start_frame=0,
        context=torch.randn(1, 512, 32),
        clip_feature=torch.randn(1, 257, 32),
        y=torch.randn(1, 20, 1, 8, 16),
    )
    with torch.no_grad():
        assert torch.equal(tiny.model(**dit_in).video, loaded.model(**dit_in).video)


def test_load_casts_dtype(saved):
    loaded = load_model(saved, device="cpu", dtype="bf16")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.vae.latent_mean.dtype == torch.float32  # statistics stay exact


def test_from_config_allocates_in_the_target_dtype_and_meta_models_cannot_be_saved(tmp_path):
    model = DreamZeroModel.from_config(preset("tiny"), device="cpu", dtype=torch.bfloat16, seed=1)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    again = DreamZeroModel.from_config(preset("tiny"), device="cpu", dtype=torch.bfloat16, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(CheckpointError, match="meta device"):
        save_model(DreamZeroModel.from_config(preset("tiny"), device="meta"), tmp_path / "x")


def test_single_file_layout_loads(copy, tiny):
    index = json.loads((copy / INDEX_FILE).read_text())
    merged = {}
    for shard in sorted(set(index["weight_map"].values())):
        merged.update(load_file(copy / shard))
        (copy / shard).unlink()
    (copy / INDEX_FILE).unlink()
    save_file(merged, copy / "model.safetensors")
    loaded = load_model(copy, device="cpu", dtype=torch.float32)
    assert torch.equal(loaded.model.patch_embedding.weight, tiny.model.patch_embedding.weight)


def _rewrite_shard_of(path: Path, key: str, edit) -> None:
    index = json.loads((path / INDEX_FILE).read_text())
    shard = path / index["weight_map"][key]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda p: (p / "config.json").unlink(), r"config file config\.json is missing"),
        (lambda p: (p / "config.json").write_text("{not json"), r"config\.json is not valid JSON"),
        (lambda p: (p / INDEX_FILE).unlink(), r"neither model\.safetensors\.index\.json .* nor model\.safetensors"),
        (lambda p: (p / INDEX_FILE).write_text('{"weight_map": [1]}'), r"has no 'weight_map' object"),
        (lambda p: (p / "model-00002-of-00004.safetensors").unlink(), r"missing in .*model-00002-of-00004"),
        (lambda p: (p / "tokenizer").rename(p / "tok"), r"no tokenizer found.*google/umt5-xxl"),
    ],
    ids=["no-config", "bad-config-json", "no-weights", "bad-index", "missing-shard", "no-tokenizer"],
)
def test_broken_directories_fail_naming_the_problem(copy, breakage, message):
    breakage(copy)
    with pytest.raises(CheckpointError, match=message):
        load_model(copy, device="cpu", dtype=torch.float32)


def test_truncated_and_corrupt_shards_are_reported(copy):
    shard = copy / "model-00001-of-00004.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model-00001-of-00004\.safetensors is truncated"):
        load_model(copy, device="cpu", dtype=torch.float32)
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}" + data[24:])
    with pytest.raises(CheckpointError, match=r"model-00001-of-00004\.safetensors is corrupt"):
        load_model(copy, device="cpu", dtype=torch.float32)


def test_missing_unexpected_and_misshaped_tensors_are_named(copy):
    gone = "action_head.text_encoder.blocks.1.ffn.fc2.weight"
    bent = "action_head.model.blocks.0.self_attn.q.weight"
    _rewrite_shard_of(copy, gone, lambda t: t.pop(gone))
    _rewrite_shard_of(copy, bent, lambda t: t.update({bent: torch.zeros(64, 63)}))
    index = json.loads((copy / INDEX_FILE).read_text())
    extra_shard = index["weight_map"][bent]
    _rewrite_shard_of(copy, bent, lambda t: t.update({"action_head.model.surprise": torch.zeros(2)}))
    index["weight_map"]["action_head.model.surprise"] = extra_shard
    del index["weight_map"][gone]
    (copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_model(copy, device="cpu", dtype=torch.float32)
    text = str(err.value)
    assert f"1 missing tensor(s): {gone}" in text
    assert "1 unexpected tensor(s): action_head.model.surprise" in text
    assert f"1 misshaped tensor(s): {bent} (file [64, 63], model [64, 64])" in text


def test_index_pointing_at_the_wrong_shard_is_reported(copy):
    index = json.loads((copy / INDEX_FILE).read_text())
    key = "action_head.model.patch_embedding.weight"
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][key])
    index["weight_map"][key] = wrong
    (copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"places '{key}' in {wrong}"):
        load_model(copy, device="cpu", dtype=torch.float32)


def test_bad_config_value_names_the_field(copy):
    data = json.loads((copy / "config.json").read_text())
    data["action_head_cfg"]["config"]["diffusion_model_cfg"]["num_heads"] = "two"
    (copy / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"diffusion_model_cfg\.num_heads must be int"):
        load_model(copy, device="cpu", dtype=torch.float32)


def test_release_style_config_maps_onto_presets():
    release = {
        "model_type": "vla",
        "action_horizon": 24,
        "action_dim": 32,
        "action_head_cfg": {
            "config": {
                "num_frames": 33,
                "num_frame_per_block": 2,
                "max_state_dim": 64,
                "max_action_dim": 32,
                "diffusion_model_cfg": {
                    "_target_": "groot.vla.model.dreamzero.modules.CausalWanModel",
                    "model_type": "i2v",
                    "dim": 5120,
                    "ffn_dim": 13824,
                    "num_heads": 40,
                    "num_layers": 40,
                    "in_dim": 36,
                    "out_dim": 16,
                    "frame_seqlen": 880,
                    "max_chunk_size": 4,
                    "num_action_per_block": 24,
                    "num_state_per_block": 1,
                    "num_registers": 8,
                    "diffusion_model_pretrained_path": None,
                },
                "vae_cfg": {"vae_pretrained_path": "/ckpts/Wan2.1_VAE.pth"},
            }
        },
    }
    cfg = from_checkpoint_config(release)
    droid = preset("droid_14b")
    assert cfg.dit == droid.dit and cfg.vae == droid.vae and cfg.text_encoder == droid.text_encoder
    assert cfg.image_encoder == droid.image_encoder and cfg.action_horizon == 24
    release["action_head_cfg"]["config"]["diffusion_model_cfg"].update(
        model_type="ti2v", dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48
    )
    release["action_head_cfg"]["config"]["vae_cfg"] = {"vae_pretrained_path": "/ckpts/Wan2.2_VAE.pth"}
    five = from_checkpoint_config(release)
    assert five.image_encoder == preset("libero_5b").image_encoder == preset("droid_14b").image_encoder
    assert five.vae == preset("libero_5b").vae and five.dit.has_image_input
    for name in ("droid_14b", "libero_5b", "tiny"):
        assert from_checkpoint_config(json.loads(json.dumps(to_checkpoint_config(preset(name))))) == preset(name)
    with pytest.raises(ConfigError, match="action_head_cfg.config"):
        from_checkpoint_config({"model_type": "vla"})


def test_load_dit_reads_the_parity_fixture(parity_fixture):
    config = json.loads((parity_fixture / "config.json").read_text())
    dit = load_dit(parity_fixture / "weights.safetensors", config, device="cpu", dtype=torch.float32)
    assert dit.cfg.dim == 64 and dit.cfg.text_dim == 32
    ref = load_file(parity_fixture / "weights.safetensors")
    assert len(ref) == len(dit.state_dict()) == 101
    for key, value in ref.items():
        assert torch.equal(dit.state_dict()[key.removeprefix("action_head.model.")], value)
    config["num_layers"] = 3
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): action_head\.model\.blocks\.2\."):
        load_dit(parity_fixture / "weights.safetensors", config, device="cpu", dtype=torch.float32)


def test_device_selection_and_overrides(monkeypatch):
    monkeypatch.delenv("DREAMZERO_DEVICE", raising=False)
    monkeypatch.delenv("DREAMZERO_DTYPE", raising=False)
    dev, dt = select_device()
    assert (dev.type, dt) == (("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32))
    assert select_device("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("DREAMZERO_DTYPE", "float16")
    assert select_device("cpu")[1] == torch.float16
    assert select_device("cpu", torch.float32)[1] == torch.float32  # argument beats environment
    monkeypatch.setenv("DREAMZERO_DTYPE", "int8")
    with pytest.raises(ConfigError, match=r"\$DREAMZERO_DTYPE='int8' is not a known dtype"):
        select_device("cpu")
    monkeypatch.setenv("DREAMZERO_DEVICE", "tpu")
    with pytest.raises(ConfigError, match=r"\$DREAMZERO_DEVICE='tpu'"):
        select_device(dtype="fp32")
    with pytest.raises(ConfigError, match="not a device"):
        parse_device("gpu0")
    with pytest.raises(ConfigError, match="floating-point"):
        parse_dtype(torch.int64)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            parse_device("cuda")


def test_5b_variant_round_trips_with_its_clip_and_nested_vae(tmp_path):
    cfg = tiny_5b_config()
    model = DreamZeroModel.from_config(cfg, device="cpu", dtype=torch.float32, seed=2)
    model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    path = save_model(model, tmp_path / "five")
    index = json.loads((path / INDEX_FILE).read_text())
    assert "action_head.vae.model.decoder.upsamples.0.upsamples.2.resample.1.weight" in index["weight_map"]
    assert "action_head.model.blocks.0.cross_attn.k_img.weight" in index["weight_map"]
    assert "action_head.image_encoder.model.log_scale" in index["weight_map"]
    loaded = load_model(path, device="cpu", dtype=torch.float32)
    assert loaded.config == cfg and loaded.image_encoder is not None
    a, b = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    video = torch.rand(1, 3, 5, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = loaded.vae.encode(video)
    assert z.shape == (1, 48, 2, 2, 4)  # 16x spatial, 4x temporal
    assert torch.equal(z, model.vae.encode(video))
