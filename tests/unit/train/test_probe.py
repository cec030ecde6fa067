"""The image-reliance probe: swapping images between clips of one layout changes nothing; between layouts it runs."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("imageio_ffmpeg")

from dreamzero.errors import ConfigError
from dreamzero.train.data import make_clip
from dreamzero.train.objective import encode_clips
from dreamzero.train.probe import image_reliance, main, swap_images
from dreamzero.train.trainer import LATEST_FILE, TrainConfig, Trainer
from tests.support.train_data import write_synthetic_dataset


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    dataset = write_synthetic_dataset(root / "ds", length=60)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is latency bound; extra threads only contend
    cfg = TrainConfig(dataset=str(dataset), out=str(root / "run"), steps=1, batch_size=1, blocks=1, save_every=1)
    trainer = Trainer(cfg)
    trainer.run()
    yield dataset, trainer, root / "run" / (root / "run" / LATEST_FILE).read_text().strip()
    torch.set_num_threads(before)


def test_swapped_images_of_one_layout_change_nothing(trained):
    _, trainer, _ = trained
    ep = trainer.sampler.episodes[0]
    same = encode_clips(trainer.model, [make_clip(ep, 0, 1, trainer.embodiment)] * 2)
    result = image_reliance(trainer.model.model, same, seeds=2)
    assert result["own"] > 0 and result["ratio"] == pytest.approx(1.0, abs=1e-6)


def test_swap_moves_every_visual_input_and_nothing_else(trained):
    _, trainer, _ = trained
    batch = encode_clips(trainer.model, [trainer.sampler.clip((0, 0)), trainer.sampler.clip((1, 0))])
    swapped = swap_images(batch)
    for name in ("anchor_latent", "y", "clip_feature", "block_latents"):
        torch.testing.assert_close(getattr(swapped, name)[0], getattr(batch, name)[1], msg=name)
    for name in ("state", "actions", "text"):
        torch.testing.assert_close(getattr(swapped, name), getattr(batch, name), msg=name)
    with pytest.raises(ConfigError, match="at least 2 clips"):
        image_reliance(trainer.model.model, encode_clips(trainer.model, [trainer.sampler.clip((0, 0))]))


def test_cli_reports_json(trained, capsys):
    dataset, _, ckpt = trained
    assert main(["--checkpoint", str(ckpt), "--dataset", str(dataset), "--seeds", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["clips"] == 2 and report["own"] > 0 and report["other"] > 0 and report["ratio"] > 0
    with pytest.raises(ConfigError, match="episodes"):
        main(["--checkpoint", str(ckpt), "--dataset", str(dataset), "--episodes", "a:b"])
