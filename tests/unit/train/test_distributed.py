"""`dreamzero-train --num-workers 2` on Ray Train (2 gloo CPU workers) on the tiny preset, DDP and FSDP2.

Each 2-worker run of 3 steps is checked against one process training the same global batches from the same seeds:
the losses and the weights agree to float round-off (both strategies average the gradients of the workers' rows of
the one global batch). A DDP run's checkpoint serves (the pipeline loads it and acts); an FSDP run's checkpoint is
the gathered full model in the HF layout with a full optimizer state keyed by parameter name, and the FSDP run
resumes on 2 workers after step 2 (the optimizer state scattered back into the shards). Both resume on 1 worker,
where step 4 is the step an uninterrupted single-process run takes. The loss of a fixed batch is lower after
the 2-worker run than before it. `--dtype bfloat16` runs on 2 DDP workers: bf16 compute (the loss moves off the fp32
one by bf16 round-off), fp32 weights and optimizer state. FSDP's mixed-precision policy (bf16 gathered parameters,
fp32 shards and gradients) is checked on a one-process group, without Ray.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("imageio_ffmpeg")
pytest.importorskip("ray.train.torch")

from dreamzero.checkpoint import load_model
from dreamzero.checkpoint.files import read_safetensors_header
from dreamzero.errors import ConfigError
from dreamzero.pipeline.core import DreamZeroPipeline
from dreamzero.train.distributed import run_distributed
from dreamzero.train.objective import encode_clips
from dreamzero.train.sharding import resolve_strategy
from dreamzero.train.trainer import LATEST_FILE, STATE_FILE, TrainConfig, Trainer
from dreamzero.types import ModelBatch
from tests.support.train_data import write_synthetic_dataset

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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
    import psutil

    from tests.support.ray_nodes import node_processes

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    session = Path(os.environ["RAY_TMPDIR"], "ray", "session_latest").resolve()
    yield
    procs = node_processes(str(session))  # the node's daemons and, as the raylet's children, every worker
    ray.shutdown()
    # a Ray Train controller has outlived its node's shutdown once (an orphan, asleep): none may outlive the module
    _, alive = psutil.wait_procs(procs, timeout=10)
    for proc in alive:
        proc.kill()


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


def _assert_same_steps(records: list[dict], reference: list[dict]) -> None:
    assert len(records) == len(reference)
    for a, b in zip(records, reference):
        for key in ("loss", "video_loss", "action_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a, b)


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    """One process taking the runs' steps: its records of steps 1-3, its DiT at the start, after step 3 and after
    step 4, and the loss of a fixed batch (drawn after the run's batches: not trained on) before training."""
    before_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("single")
    single = Trainer(_cfg(dataset, out))
    start = _dit_params(single.model)
    fixed = encode_clips(single.model, single.sampler.sample(2))
    single.sampler.rng = np.random.default_rng(3)  # back to the run's draws
    before = single.evaluate(fixed, seed=11)
    records = single.run()
    step3 = _dit_params(single.model)
    step4 = Trainer(_cfg(dataset, out, stop_at=None))
    step4.run()
    torch.set_num_threads(before_threads)
    return SimpleNamespace(records=records, start=start, step3=step3, step4=_dit_params(step4.model), fixed=fixed,
                           before=before)  # fmt: skip


def _resume_on_one_worker_and_step(dataset, out, reference) -> Trainer:
    """The run in `out` resumed on one worker: its weights are the reference's after step 3, and step 4 is the
    reference's step 4."""
    resumed = Trainer(_cfg(dataset, out, stop_at=None))
    assert resumed.step == 3 and resumed.world == 1 and resumed.strategy == "single"
    trained = _dit_params(resumed.model)
    for name, p in reference.step3.items():
        _assert_round_off(trained[name], p, name)
    assert max((trained[n] - reference.start[n]).abs().max().item() for n in trained) > 2e-3  # the steps moved them
    after = resumed.evaluate(reference.fixed, seed=11)
    assert after["loss"] < reference.before["loss"], (reference.before, after)
    resumed.run()
    final = _dit_params(resumed.model)
    for name, p in reference.step4.items():
        _assert_round_off(final[name], p, name)
    return resumed


@pytest.mark.slow  # Ray Train starts two workers (and the single-process reference runs beside them)
@pytest.mark.cluster
def test_ddp_takes_the_single_process_steps_serves_and_resumes_on_one(dataset, ray_cluster, reference, tmp_path):
    out = tmp_path / "ddp"
    records = run_distributed(_cfg(dataset, out, strategy="ddp"), num_workers=2, threads_per_worker=1)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {(r["workers"], r["strategy"]) for r in records} == {(2, "ddp")}
    _assert_same_steps(records, reference.records)

    ckpt = out / (out / LATEST_FILE).read_text().strip()
    assert ckpt.name == "checkpoint-0000003"
    # the 2-worker run's checkpoint serves as it is: the pipeline loads it and returns finite actions
    pipe = DreamZeroPipeline.load(ckpt, device="cpu", overrides={"num_inference_steps": 2, "dit_step_mask": None})
    rng = np.random.default_rng(0)
    res = pipe.generate(
        ModelBatch(
            images=rng.integers(0, 256, (1, 1, 64, 112, 3), dtype=np.uint8),
            state=np.zeros((1, 1, 64), np.float32),
            state_mask=np.ones((1, 1, 64), bool),
            prompts=["put the cube in the bowl"],
            session_ids=["s"],
        )
    )
    assert res.actions.shape[0] == 1 and np.isfinite(res.actions).all()
    _resume_on_one_worker_and_step(dataset, out, reference)


@pytest.mark.slow  # two Ray Train runs of two workers
@pytest.mark.cluster
def test_fsdp_takes_the_single_process_steps_writes_full_checkpoints_and_resumes_on_one(
    dataset, ray_cluster, reference, tmp_path
):
    out = tmp_path / "fsdp"
    first = run_distributed(_cfg(dataset, out, strategy="fsdp", stop_at=2, save_every=2), 2, threads_per_worker=1)
    # resumed on 2 workers: worker 0 reads the full optimizer state and scatters it into both workers' shards, so
    # step 3 (Adam's moments of steps 1-2 included) is the single process's step 3
    second = run_distributed(_cfg(dataset, out, strategy="fsdp"), num_workers=2, threads_per_worker=1)
    records = first + second
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {(r["workers"], r["strategy"]) for r in records} == {(2, "fsdp")}
    _assert_same_steps(records, reference.records)

    ckpt = out / "checkpoint-0000003"
    # the shards were gathered: the HF layout with the full shapes, which the serving loader reads
    loaded = load_model(ckpt, device="cpu")
    for name, p in loaded.model.state_dict().items():
        _assert_round_off(p, reference.step3[name], name)
    state = torch.load(ckpt / STATE_FILE, weights_only=False)["optimizer"]["state"]
    assert set(state) == set(dict(loaded.model.named_parameters()))  # full, keyed by name
    assert state["blocks.0.ffn.0.weight"]["exp_avg"].shape == loaded.model.blocks[0].ffn[0].weight.shape
    _resume_on_one_worker_and_step(dataset, out, reference)


@pytest.mark.slow  # Ray Train starts two workers for one step
@pytest.mark.cluster
def test_bfloat16_ddp_on_two_workers_computes_in_bf16_and_keeps_fp32_state(dataset, ray_cluster, reference, tmp_path):
    out = tmp_path / "bf16"
    cfg = _cfg(dataset, out, strategy="ddp", dtype="bfloat16", stop_at=1, save_every=1)
    (record,) = run_distributed(cfg, num_workers=2, threads_per_worker=1)
    fp32 = reference.records[0]["loss"]
    assert record["strategy"] == "ddp" and record["workers"] == 2 and np.isfinite(record["grad_norm"])
    assert 1e-6 < abs(record["loss"] - fp32) / fp32 < 2e-2, (record["loss"], fp32)  # bf16 round-off, no more
    ckpt = out / "checkpoint-0000001"
    shards = [read_safetensors_header(f) for f in ckpt.glob("*.safetensors")]
    dit = {code for header in shards for key, (code, _) in header.items() if key.startswith("action_head.model.")}
    assert dit == {"F32"}, dit  # master weights
    state = torch.load(ckpt / STATE_FILE, weights_only=False)["optimizer"]["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}


def test_fsdp_gathers_bf16_for_compute_and_keeps_fp32_shards_and_gradients(dataset, tmp_path):
    """The mixed-precision policy on a one-process gloo group: inside a block's forward its weights are bf16, the
    stored shards and the gradients they get are fp32."""
    import torch.distributed as dist

    from dreamzero.train.objective import teacher_forced_loss
    from dreamzero.train.sharding import is_sharded, shard_dit

    trainer = Trainer(_cfg(dataset, tmp_path / "run"))
    batch = encode_clips(trainer.model, trainer.sampler.sample(1))
    dit = trainer.model.model
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        shard_dit(dit, torch.device("cpu"), torch.bfloat16)
        assert is_sharded(dit) and is_sharded(dit.blocks[0])
        seen = set()
        dit.blocks[0].ffn[0].register_forward_hook(lambda m, i, o: seen.add(m.weight.dtype))
        dit.text_embedding.register_forward_hook(lambda m, i, o: seen.add(o.dtype))  # embed_context gathers too
        terms = teacher_forced_loss(dit, batch, trainer.schedule, torch.Generator().manual_seed(0), torch.bfloat16)
        terms.loss.backward()
        assert seen == {torch.bfloat16}, seen
        weight = dit.blocks[0].ffn[0].weight
        assert weight.dtype == torch.float32 and weight.grad.dtype == torch.float32
        assert weight.grad.full_tensor().abs().sum() > 0
    finally:
        dist.destroy_process_group()


def test_auto_shards_what_would_not_fit_one_device():
    gib = 2**30
    assert resolve_strategy("auto", 1, 10**9, 0, 80 * gib) == "single"
    assert resolve_strategy("auto", 8, 16_500_000_000, 6_400_000_000, 80 * gib) == "fsdp"  # 14B: 290 GB unsharded
    assert resolve_strategy("auto", 8, 5_600_000_000, 7_000_000_000, 80 * gib) == "fsdp"  # 5B: 118 GB
    assert resolve_strategy("auto", 2, 400_000, 700_000, 8 * gib) == "ddp"  # tiny
    assert resolve_strategy("auto", 8, 50_000_000, 12_600_000_000, 141 * gib) == "ddp"  # 5B LoRA on an H200
    assert resolve_strategy("ddp", 8, 16_500_000_000, 0, 80 * gib) == "ddp"  # asked for: as asked
    with pytest.raises(ConfigError, match="strategy"):
        resolve_strategy("zero3", 2, 1, 1, gib)
    with pytest.raises(ConfigError, match="strategy"):
        TrainConfig(dataset="d", out="o", strategy="zero3").validate()


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


def test_the_log_names_the_strategy(dataset, tmp_path):
    trainer = Trainer(_cfg(dataset, tmp_path / "one", stop_at=1, save_every=10, strategy="fsdp"))
    assert trainer.strategy == "single"  # one worker, no process group: nothing to shard over
    (record,) = trainer.run()
    assert json.loads((tmp_path / "one" / "train_log.jsonl").read_text())["strategy"] == record["strategy"] == "single"
