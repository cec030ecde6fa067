"""The card matrix (docs/model.md, "Fitting a card"): the shipped `serve_config.yaml`, changed only as the README says
(`model_path`, `policy.num_gpus: 1`), on simulated 24, 32, 48, 80 and 141 GiB GPUs.

- `serve run`'s fit check plans the full-depth DROID 14B and RLinf 5B LIBERO (their config.json alone, sized on the
  meta device): it passes where the planner's table says the card starts and fails naming what would fit elsewhere.
- The placements those plans choose are then actually run by the real Policy replica class on the 1-layer slices of
  the same widths: the 5B slice serves a chunk with each placement (CPU-resident and offloaded text encoder, CPU
  image encoder, fp8 DiT weights), and the 14B slice loads with each of its placements and encodes a prompt where
  the plan puts the text encoder. On this CPU "gpu" is the CPU too: what is checked is that every path runs and that
  the replica reports the plan it loaded by (`GET /v1/models`'s `plan`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dreamzero.config import preset, to_checkpoint_config
from dreamzero.device import SIMULATED_GPU_ENV
from dreamzero.errors import ConfigError
from dreamzero.plan_cli import TABLE_CHECKPOINTS, card_table
from dreamzero.planner import CARDS

ROOT = Path(__file__).resolve().parents[2]
SLICES = {"libero_5b": "libero_5b_slice", "droid_14b": "droid_14b_slice"}


@pytest.fixture(scope="module")
def table():
    return card_table()


@pytest.fixture(scope="module")
def full_depth_configs(tmp_path_factory) -> dict[str, Path]:
    """A folder per released checkpoint holding only its config.json: what `serve run` reads before any weight."""
    out = {}
    for name, preset_name in TABLE_CHECKPOINTS.items():
        folder = tmp_path_factory.mktemp(preset_name)
        (folder / "config.json").write_text(json.dumps(to_checkpoint_config(preset(preset_name))))
        out[name] = folder
    return out


def shipped_args(model_path: Path) -> dict:
    """The shipped app args, changed as the README says for a GPU."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    args = dict(cfg["applications"][0]["args"])
    args["model_path"] = str(model_path)
    args["policy"] = {**(args.get("policy") or {}), "num_gpus": 1}
    return args


@pytest.mark.parametrize("card", list(CARDS))
@pytest.mark.parametrize("checkpoint", list(TABLE_CHECKPOINTS))
def test_serve_run_plans_the_shipped_config_on_each_card(card, checkpoint, table, full_depth_configs, monkeypatch):
    from serve_graph.builder import check_gpu_fit
    from serve_graph.config import parse_app_args

    monkeypatch.setenv(SIMULATED_GPU_ENV, str(CARDS[card]))
    plan = table.plans[checkpoint][card]
    args = parse_app_args(shipped_args(full_depth_configs[checkpoint]))
    if plan.fits:
        check_gpu_fit(args)
    else:
        with pytest.raises(ConfigError, match="model_path: .*what would: .*cfg_parallel: 2"):
            check_gpu_fit(args)


def _placements(table, checkpoint: str) -> list[dict]:
    seen = []
    for plan in table.plans[checkpoint].values():
        if plan.fits and plan.placement.as_dict() not in seen:
            seen.append(plan.placement.as_dict())
    return seen


@pytest.fixture(scope="module")
def slice_checkpoints(tmp_path_factory) -> dict[str, Path]:
    from dreamzero.checkpoint import save_model
    from dreamzero.config import SLICE_VOCAB
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import build_local_tokenizer

    out = {}
    for full, name in SLICES.items():
        model = DreamZeroModel.from_config(preset(name), dtype=torch.bfloat16, seed=0)
        model.text_encoder.tokenizer = build_local_tokenizer(SLICE_VOCAB)
        out[full] = save_model(model, tmp_path_factory.mktemp(name) / "ckpt")
        del model
    return out


def test_the_5b_slice_serves_a_chunk_with_every_placement_the_plans_choose(table, slice_checkpoints, monkeypatch):
    from deployments.config.settings import PolicySettings
    from deployments.policy import PolicyDeployment
    from dreamzero.pipeline.budget import warmup_batch, warmup_canvas_hw

    placements = _placements(table, "RLinf 5B LIBERO")
    assert {p["text_encoder"] for p in placements} >= {"gpu", "cpu"}  # the table moves it off on the small cards
    monkeypatch.setenv(SIMULATED_GPU_ENV, str(CARDS["24 GB (RTX 4090)"]))
    for placement in placements + [{"text_encoder": "offload", "image_encoder": "cpu", "dit_weights": "fp8"}]:
        policy = PolicyDeployment(
            PolicySettings(
                model_path=str(slice_checkpoints["libero_5b"]),
                device="cuda",
                pipeline={"num_inference_steps": 2, "dit_step_mask": None},
                placement=placement,
                sessions={"max_sessions": 4},
            )
        )
        loaded = policy.pipeline.model.placement.as_dict()
        assert loaded == placement and policy.info()["memory"]["plan"]["placement"] == placement
        batch = warmup_batch(policy.pipeline, 1, warmup_canvas_hw(policy.pipeline))
        out = asyncio.run(policy.generate(batch))
        assert np.isfinite(out.result.actions).all(), placement
        del policy


def test_the_14b_slice_loads_with_each_placement_and_encodes_where_the_plan_says(table, slice_checkpoints):
    from dreamzero.model.fp8 import Fp8Linear
    from dreamzero.pipeline import DreamZeroPipeline

    placements = _placements(table, "DROID 14B")
    assert any(p["dit_weights"] == "fp8" for p in placements) and any(p["dit_weights"] == "model" for p in placements)
    for placement in placements:
        pipe = DreamZeroPipeline.load(slice_checkpoints["droid_14b"], device="cpu", dtype="bfloat16",
                                      placement=placement, max_sessions=2)  # fmt: skip
        assert pipe.model.placement.as_dict() == placement
        fp8 = any(isinstance(m, Fp8Linear) for m in pipe.dit.modules())
        assert fp8 == (placement["dit_weights"] == "fp8")
        rows = pipe.model.text_encoder.encode(["put the cube in the bowl"])
        assert rows.shape[0] == 1 and torch.isfinite(rows.float()).all()
        del pipe
