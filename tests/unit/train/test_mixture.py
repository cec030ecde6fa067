"""Mixture datasets: a DROID-keyed and a franka_pnp-keyed dataset (different embodiments, columns and canvases)
train together, clips drawn by weight, each through its own embodiment; the checkpoint carries both statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("imageio_ffmpeg")

from dreamzero.errors import ConfigError
from dreamzero.train.cli import main
from dreamzero.train.mixture import parse_dataset_arg, read_mixture_spec
from dreamzero.train.trainer import LATEST_FILE, TrainConfig, Trainer
from tests.support.train_data import write_franka_pnp_dataset, write_synthetic_dataset

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    return write_synthetic_dataset(root / "droid", length=60), write_franka_pnp_dataset(root / "franka", length=60)


def _cfg(datasets, out, weights=(3.0, 1.0), **kw) -> TrainConfig:
    droid, franka = datasets
    mixture = [
        {"path": str(droid), "weight": weights[0], "embodiment": "oxe_droid"},
        {"path": str(franka), "weight": weights[1], "embodiment": "franka_pnp"},
    ]
    base = dict(dataset=str(droid), out=str(out), mixture=mixture, steps=2, batch_size=4, blocks=1, lr=1e-3,
                warmup_steps=0, save_every=2)  # fmt: skip
    return TrainConfig(**(base | kw))


def test_batches_follow_the_weights_and_each_clip_its_embodiment(datasets, tmp_path):
    trainer = Trainer(_cfg(datasets, tmp_path / "run"))
    keys = trainer.sampler.sample_keys(4000)
    share = np.mean([k[0] == 0 for k in keys])
    assert abs(share - 0.75) < 0.03, share  # binomial sd 0.007 at n = 4000
    droid, franka = trainer.embodiments
    assert (droid.tag, franka.tag) == ("oxe_droid", "franka_pnp")
    clip_d, clip_f = trainer.sampler.clip((0, 0, 0)), trainer.sampler.clip((1, 0, 0))
    assert clip_d.anchor.shape[:2] == tuple(droid.canvas_hw) and clip_f.anchor.shape[:2] == tuple(franka.canvas_hw)
    assert clip_d.anchor.shape != clip_f.anchor.shape
    assert clip_d.action_mask.sum() == droid.action_dim == 8 and clip_f.action_mask.sum() == franka.action_dim == 7
    assert "cube" in clip_d.prompt and "red block" in clip_f.prompt

    # a batch with both embodiments encodes at the model's input size, rows in the keys' order
    batch = trainer._encode([(1, 0, 0), (0, 0, 0), (1, 1, 12)])
    assert batch.block_latents.shape[0] == 3
    assert batch.action_mask[:, :8].sum(1).tolist() == [7.0, 8.0, 7.0]
    alone = trainer._encode([(0, 0, 0)])
    torch.testing.assert_close(batch.block_latents[1], alone.block_latents[0], atol=1e-5, rtol=1e-4)


def test_a_mixture_trains_and_its_checkpoint_holds_both_statistics(datasets, tmp_path):
    trainer = Trainer(_cfg(datasets, tmp_path / "run"))
    records = trainer.run()
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    ckpt = tmp_path / "run" / (tmp_path / "run" / LATEST_FILE).read_text().strip()
    meta = json.loads((ckpt / "experiment_cfg" / "metadata.json").read_text())
    assert {"oxe_droid", "franka_pnp"} <= set(meta)
    resumed = Trainer(_cfg(datasets, tmp_path / "run", steps=3, save_every=5))
    assert resumed.step == 2 and len(resumed.embodiments) == 2


def test_the_cli_reads_weights_and_a_yaml_spec(datasets, tmp_path, capsys):
    droid, franka = datasets
    spec = parse_dataset_arg(f"{franka}:0.5:franka_pnp")
    assert (spec.weight, spec.embodiment) == (0.5, "franka_pnp")
    (tmp_path / "mix.yaml").write_text(
        f"datasets:\n  - {{path: {droid}, weight: 4}}\n  - {{path: {franka}, weight: 1, embodiment: franka_pnp}}\n"
    )
    specs = read_mixture_spec(tmp_path / "mix.yaml")
    assert [s.weight for s in specs] == [4.0, 1.0] and specs[0].embodiment is None
    argv = ["--dataset", f"{droid}:2", "--dataset", f"{franka}:1:franka_pnp", "--out", str(tmp_path / "cli"),
            "--steps", "1", "--batch-size", "2", "--blocks", "1"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
    for bad, field in ((f"{droid}:x", "weight"), (f"{droid}:-1", "weight"), (str(tmp_path / "nope"), "no such")):
        with pytest.raises(ConfigError, match=field):
            parse_dataset_arg(bad)
    (tmp_path / "bad.yaml").write_text("datasets:\n  - {path: x, wieght: 2}\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        read_mixture_spec(tmp_path / "bad.yaml")


def test_datasets_of_one_tag_are_normalised_by_all_their_frames(datasets, tmp_path, capsys):
    """Two recordings of one robot: the tag's statistics span both (the first's range alone would clamp the second's
    reach in training); `--metadata` with a mixture of one tag is that file for every dataset, and with two tags it
    is refused, naming the field."""
    from dreamzero.lerobot_dataset import LeRobotDataset, get_preset
    from dreamzero.metadata_cli import compute_metadata
    from dreamzero.train.trainer import _metadata_for

    droid, _ = datasets
    other = write_synthetic_dataset(tmp_path / "droid-2", length=60, seed=7)
    alone = [compute_metadata(LeRobotDataset(p), get_preset("oxe_droid"), progress=False)["oxe_droid"]
             for p in (droid, other)]  # fmt: skip
    mixture = [{"path": str(droid), "embodiment": "oxe_droid"}, {"path": str(other), "embodiment": "oxe_droid"}]
    cfg = TrainConfig(dataset=str(droid), out=str(tmp_path / "run"), mixture=mixture)
    both = _metadata_for(cfg)["oxe_droid"]["statistics"]["action"]
    for name, stats in both.items():
        lo = np.minimum(*(np.asarray(a["statistics"]["action"][name]["min"]) for a in alone))
        hi = np.maximum(*(np.asarray(a["statistics"]["action"][name]["max"]) for a in alone))
        np.testing.assert_allclose(stats["min"], lo, rtol=1e-6)
        np.testing.assert_allclose(stats["max"], hi, rtol=1e-6)
    first = alone[0]["statistics"]["action"]
    assert any(not np.allclose(both[n]["max"], first[n]["max"]) for n in both)  # the second reaches past the first

    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"oxe_droid": alone[0]}))
    common = ["--out", str(tmp_path / "cli"), "--steps", "1", "--batch-size", "2", "--blocks", "1"]
    assert main(["--dataset", str(droid), "--dataset", str(other), "--metadata", str(meta), *common]) == 0
    ckpt = tmp_path / "cli" / (tmp_path / "cli" / LATEST_FILE).read_text().strip()
    written = json.loads((ckpt / "experiment_cfg" / "metadata.json").read_text())["oxe_droid"]
    assert written["statistics"]["action"] == alone[0]["statistics"]["action"]
    _, franka = datasets
    two_tags = ["--dataset", str(droid), "--dataset", f"{franka}:1:franka_pnp", "--metadata", str(meta), *common]
    capsys.readouterr()
    assert main(two_tags) == 2
    assert "metadata: this mixture has 2 embodiment tags" in capsys.readouterr().err
