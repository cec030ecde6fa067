"""A tiny libero_5b-shaped config: ti2v DiT with the image branch, no first-frame latent, tiny CLIP, Wan 2.2 VAE."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from dreamzero.config import preset


def tiny_5b_config():
    tiny, five = preset("tiny"), preset("libero_5b")
    dit = dataclasses.replace(
        tiny.dit, model_type="ti2v", in_dim=48, out_dim=48, concat_first_frame_latent=False, num_action_per_block=16
    )
    vae = dataclasses.replace(five.vae, base_dim=8, decoder_base_dim=16, num_res_blocks=1)
    pipeline = tiny.pipeline.with_overrides({"model_input_hw": (64, 128)})  # 16x VAE -> 4x8 latent, 8 tokens
    return dataclasses.replace(
        tiny, name="tiny_5b", dit=dit, vae=vae, pipeline=pipeline, action_horizon=16, embodiment_tag=five.embodiment_tag
    )


def write_tiny_layouts(root) -> dict[str, Path]:
    """The tiny preset's seeded model written in each checkpoint layout under `root`, each with the shipped statistics
    as experiment_cfg/metadata.json and a tokenizer/ folder: {"hf": dir, "full_weights": file, "diffusers": dir}.
    The full_weights.pt stores no config: load it with config / checkpoint_config "tiny"."""
    import torch

    from dreamzero.checkpoint import save_diffusers, save_full_weights, save_model
    from dreamzero.metadata import default_metadata_path
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import build_local_tokenizer

    cfg = preset("tiny")
    model = DreamZeroModel.from_config(cfg, device="cpu", dtype=torch.float32, seed=3)
    model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    root = Path(root)
    paths = {
        "hf": save_model(model, root / "hf"),
        "full_weights": save_full_weights(model, root / "fw" / "full_weights.pt"),
        "diffusers": save_diffusers(model, root / "diffusers"),
    }
    shutil.copytree(paths["hf"] / "tokenizer", root / "fw" / "tokenizer")
    for folder in (paths["hf"], root / "fw", paths["diffusers"]):
        (folder / "experiment_cfg").mkdir(exist_ok=True)
        shutil.copy(default_metadata_path(), folder / "experiment_cfg" / "metadata.json")
    return paths
