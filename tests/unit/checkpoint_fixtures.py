"""A tiny libero_5b-shaped config: ti2v DiT with the image branch, no first-frame latent, tiny CLIP, Wan 2.2 VAE."""

from __future__ import annotations

import dataclasses

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
