"""TensorBoard event files beside the JSONL log: every logged number, read back with tensorboard's own reader."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("imageio_ffmpeg")
pytest.importorskip("tensorboard")

from dreamzero.train.tb_log import SCALARS, TB_DIR, read_scalars
from dreamzero.train.trainer import LOG_FILE, TrainConfig, Trainer
from tests.support.train_data import write_synthetic_dataset


def test_event_files_hold_the_logged_numbers(tmp_path):
    torch.set_num_threads(1)
    dataset = write_synthetic_dataset(tmp_path / "ds", n_episodes=1, length=40)
    out = tmp_path / "run"
    cfg = TrainConfig(dataset=str(dataset), out=str(out), steps=3, batch_size=1, blocks=1, warmup_steps=0,
                      save_every=10, log_every=1)  # fmt: skip
    Trainer(cfg).run()
    records = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    assert (out / TB_DIR).is_dir() and any((out / TB_DIR).iterdir())
    scalars = read_scalars(out)
    assert set(scalars) == {f"train/{k}" for k in SCALARS}
    for key in SCALARS:
        steps, values = zip(*scalars[f"train/{key}"])
        assert list(steps) == [r["step"] for r in records] == [1, 2, 3]
        assert values == pytest.approx([r[key] for r in records], rel=1e-6), key
