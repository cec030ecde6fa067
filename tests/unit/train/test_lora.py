"""LoRA: `--lora-rank` trains adapters only, starts at the base model's outputs, saves adapters, resumes, and the
merged model (what the ship step writes) computes what base + adapters compute."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("imageio_ffmpeg")

from dreamzero.checkpoint import load_model
from dreamzero.errors import ConfigError
from dreamzero.train.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRALinear, lora_layers, merged_model
from dreamzero.train.objective import encode_clips
from dreamzero.train.ship import ship_checkpoint
from dreamzero.train.trainer import LATEST_FILE, TrainConfig, Trainer
from tests.support.train_data import write_synthetic_dataset

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("train_lora") / "ds", length=60)


def _cfg(dataset, out, **kw) -> TrainConfig:
    base = dict(dataset=str(dataset), out=str(out), steps=3, batch_size=2, blocks=2, lr=2e-2, warmup_steps=0,
                save_every=3, lora_rank=4)  # fmt: skip
    return TrainConfig(**(base | kw))


def test_merged_model_equals_base_plus_adapters_and_ships(dataset, tmp_path):
    full = Trainer(_cfg(dataset, tmp_path / "full", lora_rank=0))
    trainer = Trainer(_cfg(dataset, tmp_path / "lora"))
    dit = trainer.model.model
    layers = lora_layers(dit)
    assert len(layers) == 12 * len(dit.blocks) and all(isinstance(m, LoRALinear) for m in layers.values())
    trainable = {n for n, p in dit.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    base_q = dit.blocks[0].self_attn.q.base.weight.detach().clone()

    batch = encode_clips(trainer.model, trainer.sampler.sample(2))
    base_loss = full.evaluate(batch, seed=5)
    assert trainer.evaluate(batch, seed=5) == pytest.approx(base_loss, rel=1e-6)  # B = 0: the base model's outputs
    trainer.run()
    adapted = _evaluate_with(trainer, dit, batch)
    assert adapted == trainer.evaluate(batch, seed=5)
    assert adapted["loss"] != pytest.approx(base_loss["loss"], rel=1e-3)  # the adapters changed the outputs
    torch.testing.assert_close(dit.blocks[0].self_attn.q.base.weight, base_q, rtol=0, atol=0)  # the base is frozen

    ckpt = tmp_path / "lora" / (tmp_path / "lora" / LATEST_FILE).read_text().strip()
    assert (ckpt / ADAPTER_WEIGHTS).is_file() and not (ckpt / "config.json").exists()
    assert json.loads((ckpt / ADAPTER_CONFIG).read_text())["rank"] == 4
    merged = merged_model(ckpt)
    assert not lora_layers(merged.model)
    # the merged model through the same loss, batch and noise as base + adapters
    merged_terms = _evaluate_with(full, merged.model, batch)
    for key in ("loss", "video_loss", "action_loss"):
        assert merged_terms[key] == pytest.approx(adapted[key], rel=1e-5, abs=1e-7), key

    shipped = ship_checkpoint(ckpt, "lora-test", dest_root=tmp_path / "shipped")
    served = load_model(shipped, device="cpu", dtype=torch.float32)
    for name, value in merged.model.state_dict().items():
        torch.testing.assert_close(served.model.state_dict()[name], value, msg=name)
    assert (shipped / "experiment_cfg" / "metadata.json").is_file()

    resumed = Trainer(_cfg(dataset, tmp_path / "lora", steps=4, save_every=10))
    assert resumed.step == 3
    for name, layer in lora_layers(resumed.model.model).items():
        torch.testing.assert_close(layer.lora_B, layers[name].lora_B, msg=name)
    with pytest.raises(ConfigError, match="lora_rank"):
        Trainer(_cfg(dataset, tmp_path / "lora", steps=4, lora_rank=8))


def _evaluate_with(trainer: Trainer, dit, batch) -> dict:
    from dreamzero.train.objective import teacher_forced_loss

    dit.eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        terms = teacher_forced_loss(dit, batch, trainer.schedule, gen)
    return {"loss": terms.loss.item(), "video_loss": terms.video.item(), "action_loss": terms.action.item()}
