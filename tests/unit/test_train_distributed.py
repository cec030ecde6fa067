"""`dreamzero-train --num-workers 2` on Ray Train (2 gloo CPU workers, DDP) on the tiny preset.

One 2-worker run of 3 steps, checked against one process training the same global batch from the same seeds: the
losses and the weights agree to float round-off (DDP averages the gradients of the workers' rows of the one global
batch). Its checkpoint serves (the pipeline loads it and acts) and resumes on 1 worker, where step 4 is the step an
uninterrupted single-process run takes. The loss of a fixed batch is lower after the 2-worker run than before it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("imageio_ffmpeg")
pytest.importorskip("ray.train.torch")

from dreamzero.errors import ConfigError
from dreamzero.pipeline.core import DreamZeroPipeline
from dreamzero.train.distributed import run_distributed
from dreamzero.train.objective import encode_clips
from dreamzero.train.trainer import LATEST_FILE, TrainConfig, Trainer
from dreamzero.types import ModelBatch
from tests.unit.train_fixtures import write_synthetic_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("train_dist") / "ds", length=60)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray for the workers; in a whole-suite run the cluster tests' session cluster is already up (2 CPUs,
    every replica at num_cpus 0), and the workers run on it, as `run_distributed` does with a connected driver."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(dataset, out, **kw) -> TrainConfig:
    base = dict(dataset=str(dataset), out=str(out), steps=4, stop_at=3, batch_size=2, blocks=2, lr=1e-3,
                warmup_steps=0, save_every=3, seed=3)  # fmt: skip
    return TrainConfig(**(base | kw))


def _dit_params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.model.state_dict().items()}


def _assert_round_off(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    """Equal to float round-off after a few AdamW steps of lr 1e-3: Adam divides by sqrt(v), so an element whose
    gradient is near zero turns the round-off of the all-reduce into up to a few percent of one step (~1e-3)."""
    diff = (a - b).abs().max().item()
    assert diff < 1e-4, (name, diff)


def test_two_workers_take_the_single_process_steps_serve_and_resume_on_one(dataset, ray_cluster, tmp_path):
    records = run_distributed(_cfg(dataset, tmp_path / "ddp"), num_workers=2, threads_per_worker=1)
    assert [r["step"] for r in records] == [1, 2, 3] and {r["workers"] for r in records} == {2}

    single = Trainer(_cfg(dataset, tmp_path / "one"))
    start = _dit_params(single.model)
    fixed = encode_clips(single.model, single.sampler.sample(2))  # drawn after the run's batches: not trained on
    single.sampler.rng = np.random.default_rng(3)  # back to the run's draws
    before = single.evaluate(fixed, seed=11)
    reference = single.run()
    for a, b in zip(records, reference):
        for key in ("loss", "video_loss", "action_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a, b)

    ckpt = tmp_path / "ddp" / (tmp_path / "ddp" / LATEST_FILE).read_text().strip()
    assert ckpt.name == "checkpoint-0000003"
    resumed = Trainer(_cfg(dataset, tmp_path / "ddp", stop_at=None))  # the same run, on one worker now
    assert resumed.step == 3 and resumed.world == 1
    trained = _dit_params(resumed.model)
    for name, p in _dit_params(single.model).items():
        _assert_round_off(trained[name], p, name)
    assert max((trained[n] - start[n]).abs().max().item() for n in start) > 2e-3  # 3 steps of lr 1e-3 moved them
    after = resumed.evaluate(fixed, seed=11)
    assert after["loss"] < before["loss"], (before, after)

    # the 2-worker run's checkpoint serves as it is: the pipeline loads it and returns finite actions
    pipe = DreamZeroPipeline.load(ckpt, device="cpu", overrides={"num_inference_steps": 2, "dit_step_mask": None})
    rng = np.random.default_rng(0)
    h, w = 64, 112
    res = pipe.generate(
        ModelBatch(
            images=rng.integers(0, 256, (1, 1, h, w, 3), dtype=np.uint8),
            state=np.zeros((1, 1, 64), np.float32),
            state_mask=np.ones((1, 1, 64), bool),
            prompts=["put the cube in the bowl"],
            session_ids=["s"],
        )
    )
    assert res.actions.shape[0] == 1 and np.isfinite(res.actions).all()

    # step 4 on one worker is the step the uninterrupted single process takes
    resumed.run()
    single_next = Trainer(_cfg(dataset, tmp_path / "one", stop_at=None))
    single_next.run()
    final = _dit_params(resumed.model)
    for name, p in _dit_params(single_next.model).items():
        _assert_round_off(final[name], p, name)


def test_a_global_batch_the_workers_cannot_split_names_the_field(dataset, tmp_path):
    with pytest.raises(ConfigError, match="batch_size"):
        run_distributed(_cfg(dataset, tmp_path / "bad", batch_size=3), num_workers=2)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        _cfg(dataset, tmp_path / "bad", batch_size=4, micro_batch_size=3).accumulation(1)


def test_accumulation_takes_the_step_of_the_whole_batch(dataset, tmp_path):
    """One process, batch 2 in two passes of 1, equals batch 2 in one pass (same seeds, same clips and noise)."""
    whole = Trainer(_cfg(dataset, tmp_path / "whole", stop_at=2, save_every=10))
    split = Trainer(_cfg(dataset, tmp_path / "split", stop_at=2, save_every=10, micro_batch_size=1))
    assert split.accum == 2 and whole.accum == 1
    for a, b in zip(whole.run(), split.run()):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    b_params = _dit_params(split.model)
    for name, p in _dit_params(whole.model).items():
        _assert_round_off(b_params[name], p, name)
