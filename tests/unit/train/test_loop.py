"""`dreamzero-train` on the tiny preset: the loss on a fixed batch falls, checkpoints load and resume continues."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("imageio_ffmpeg")

from dreamzero.checkpoint import load_model
from dreamzero.errors import ConfigError
from dreamzero.train.cli import main
from dreamzero.train.objective import EncodedBatch, encode_clips
from dreamzero.train.trainer import LATEST_FILE, LOG_FILE, STATE_FILE, TrainConfig, Trainer
from tests.support.train_data import write_synthetic_dataset

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("train_loop") / "ds", length=60)


def _cfg(dataset, out, **kw) -> TrainConfig:
    base = dict(dataset=str(dataset), out=str(out), steps=4, batch_size=2, blocks=2, lr=1e-3, warmup_steps=0)
    return TrainConfig(**(base | kw))


def test_loss_falls_on_a_fixed_batch(dataset, tmp_path):
    trainer = Trainer(_cfg(dataset, tmp_path / "run"))
    batch = encode_clips(trainer.model, trainer.sampler.sample(2))
    assert batch.block_latents.shape[:2] == (2, 2) and batch.y.shape[2] == 5  # anchor + 2 blocks of 2 latents
    before = trainer.evaluate(batch, seed=7)
    for _ in range(8):
        record = trainer.train_step(batch)
        assert record["grad_norm"] > 0
    after = trainer.evaluate(batch, seed=7)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert after["action_loss"] < before["action_loss"] and after["video_loss"] < before["video_loss"]
    # only the DiT trains: the frozen encoders are untouched and have no gradients
    assert all(p.grad is None for p in trainer.model.text_encoder.parameters())
    assert all(p.grad is None for p in trainer.model.vae.parameters())


def test_checkpoints_load_and_resume_continues(dataset, tmp_path):
    out = tmp_path / "run"
    first = Trainer(_cfg(dataset, out, steps=2, save_every=2))
    first.run()
    ckpt = out / (out / LATEST_FILE).read_text().strip()
    assert ckpt.name == "checkpoint-0000002" and (ckpt / STATE_FILE).is_file()
    assert json.loads((ckpt / "experiment_cfg" / "metadata.json").read_text())["oxe_droid"]["statistics"]
    loaded = load_model(ckpt, device="cpu")
    for (name, p), q in zip(first.model.model.named_parameters(), loaded.model.parameters()):
        torch.testing.assert_close(p, q, msg=name)

    second = Trainer(_cfg(dataset, out, steps=3, save_every=10))
    assert second.step == 2
    saved = torch.load(ckpt / STATE_FILE, weights_only=False)["optimizer"]["state"]  # keyed by parameter name
    first_param = next(iter(second.model.model.parameters()))
    resumed = second.optimizer.state[first_param]
    torch.testing.assert_close(resumed["exp_avg"], saved["patch_embedding.weight"]["exp_avg"])
    second.run()
    assert second.step == 3 and (out / "checkpoint-0000003").is_dir()
    steps = [json.loads(line)["step"] for line in (out / LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_stop_at_ends_the_run_early_on_the_long_schedule(dataset, tmp_path):
    short = Trainer(_cfg(dataset, tmp_path / "stop", steps=10, stop_at=2, save_every=5))
    records = short.run()
    assert short.step == 2 and (tmp_path / "stop" / "checkpoint-0000002").is_dir()
    # the learning rate followed the 10-step schedule, not a 2-step one
    assert (
        [r["lr"] for r in records]
        == [short.lr_at(s) for s in (0, 1)]
        != [Trainer(_cfg(dataset, tmp_path / "two", steps=2)).lr_at(s) for s in (0, 1)]
    )
    with pytest.raises(ConfigError, match="stop_at"):
        Trainer(_cfg(dataset, tmp_path / "bad", steps=3, stop_at=4))


def test_cli_runs_and_reports(dataset, tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["--dataset", str(dataset), "--out", str(out), "--steps", "1", "--batch-size", "1", "--blocks", "1"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["step"] == 1 and report["last"]["loss"] > 0
    # the options of our own reach the run's config (kept in the checkpoint's trainer state)
    extra = ["--action-loss-weight", "3", "--start-stride", "12", "--cache-encodings", "--save-every", "1"]
    assert main([*args[:3], str(tmp_path / "cli2"), *args[4:], *extra]) == 0
    ckpt = tmp_path / "cli2" / "checkpoint-0000001"
    config = torch.load(ckpt / STATE_FILE, weights_only=False)["config"]
    assert (config["action_loss_weight"], config["start_stride"], config["cache_encodings"]) == (3.0, 12, True)


def test_action_bounds_reach_the_checkpoint_metadata(dataset, tmp_path):
    out = tmp_path / "wide"
    args = ["--dataset", str(dataset), "--out", str(out), "--steps", "1", "--batch-size", "1", "--blocks", "1"]
    assert main([*args, "--action-bounds", "min_max", "--save-every", "1"]) == 0
    saved = json.loads((out / "checkpoint-0000001" / "experiment_cfg" / "metadata.json").read_text())
    assert saved["oxe_droid"]["normalisation_bounds"] == {"action": "min_max"}
    trainer = Trainer(_cfg(dataset, tmp_path / "plain"))
    assert trainer.embodiment.metadata.bounds["action"] == "q01_q99"  # unset: the metadata's own choice
    wide = Trainer(_cfg(dataset, tmp_path / "wide2", action_bounds="min_max")).embodiment
    joints = wide.metadata.stats("action.joint_position")
    assert wide.action_normalisers["action.joint_position"].q99.tolist() == joints.max.tolist()
    with pytest.raises(ConfigError, match=r"action_bounds: expected one of \['min_max', 'q01_q99'\]"):
        Trainer(_cfg(dataset, tmp_path / "bad", action_bounds="q5"))


def test_state_noise_perturbs_each_batch_and_is_validated(dataset, tmp_path):
    trainer = Trainer(_cfg(dataset, tmp_path / "noisy", state_noise=0.05, cache_encodings=True, start_stride=24))
    trainer.sampler.rng = np.random.default_rng(0)
    first = trainer.next_batch()
    trainer.sampler.rng = np.random.default_rng(0)
    second = trainer.next_batch()  # the same clips from the cache, new noise
    assert not torch.equal(first.state, second.state) and not torch.equal(first.actions, second.actions)
    assert torch.equal(first.block_latents, second.block_latents)
    plain = Trainer(_cfg(dataset, tmp_path / "plain2", cache_encodings=True, start_stride=24))
    plain.sampler.rng = np.random.default_rng(0)
    clean = plain.next_batch()
    # only the relative joints moved (the gripper and the padding did not)
    moved = (first.state - clean.state).abs().amax(dim=(0, 1, 2))
    assert (moved[:7] > 0).all() and (moved[7:] == 0).all()
    assert trainer.train_step(first)["loss"] > 0
    with pytest.raises(ConfigError, match="state_noise"):
        Trainer(_cfg(dataset, tmp_path / "bad", state_noise=-0.1))


def test_bad_settings_name_the_field(dataset, tmp_path):
    with pytest.raises(ConfigError, match="dtype"):
        Trainer(_cfg(dataset, tmp_path / "a", dtype="float8"))
    with pytest.raises(ConfigError, match="blocks"):
        Trainer(_cfg(dataset, tmp_path / "b", blocks=9))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_same_loop_runs_on_a_gpu_in_bfloat16(dataset, tmp_path):
    trainer = Trainer(_cfg(dataset, tmp_path / "gpu", device="cuda", dtype="bfloat16", steps=2, save_every=2))
    records = trainer.run()
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
    assert next(trainer.model.model.parameters()).dtype == torch.float32  # autocast only; fp32 master weights
    resumed = Trainer(_cfg(dataset, tmp_path / "gpu", device="cuda", dtype="bfloat16", steps=3))
    assert resumed.step == 2


def test_cached_encodings_match_fresh_ones_and_are_reused(dataset, tmp_path, monkeypatch):
    trainer = Trainer(_cfg(dataset, tmp_path / "run", start_stride=12, cache_encodings=True, batch_size=3))
    for _ in range(6):
        batch = trainer.next_batch()
    keys = list(trainer.encoded)
    assert keys and all(t0 % 12 == 0 for _, t0 in keys)
    fresh = encode_clips(trainer.model, [trainer.sampler.clip(k) for k in keys])
    cached = EncodedBatch.cat([trainer.encoded[k] for k in keys])
    for name in ("text", "clip_feature", "y", "anchor_latent", "block_latents", "state", "actions"):
        torch.testing.assert_close(getattr(cached, name), getattr(fresh, name), atol=1e-5, rtol=1e-4, msg=name)
    assert batch.block_latents.shape[0] == 3
    # every start is cached now (2 episodes x starts 0, 12, 24 of 36): no more encoder calls
    for _ in range(20):
        trainer.next_batch()
    calls = []
    monkeypatch.setattr("dreamzero.train.trainer.encode_clips", lambda *a: calls.append(a))
    for _ in range(5):
        trainer.next_batch()
    assert len(trainer.encoded) == 6 and calls == []


def test_action_loss_weight_scales_the_action_term(dataset, tmp_path):
    plain = Trainer(_cfg(dataset, tmp_path / "a"))
    weighted = Trainer(_cfg(dataset, tmp_path / "b", action_loss_weight=10.0))
    batch = encode_clips(plain.model, plain.sampler.sample(2))
    a, b = plain.evaluate(batch, seed=3), weighted.evaluate(batch, seed=3)
    assert a["action_loss"] == pytest.approx(b["action_loss"]) and a["video_loss"] == pytest.approx(b["video_loss"])
    assert b["loss"] == pytest.approx(b["video_loss"] + 10.0 * b["action_loss"], rel=1e-5)
    with pytest.raises(ConfigError, match="action_loss_weight"):
        Trainer(_cfg(dataset, tmp_path / "c", action_loss_weight=-1.0))
