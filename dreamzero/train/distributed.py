"""`dreamzero-train --num-workers N`: the same Trainer on N Ray Train workers (one per GPU, or per CPU process).

Ray Train's `TorchTrainer` starts the workers (on this machine, or across a Ray cluster: `ray start` on each node,
then run the command anywhere in it), makes the torch.distributed process group (NCCL on GPU, gloo on CPU) and runs
`_worker_loop` on each. Every worker builds the same `Trainer` from the same checkpoint and seeds, draws the same
global batch of clips and noise, computes its rows of it and averages gradients (DDP, or FSDP2's reduce-scatter with
`--strategy fsdp`: `sharding.py`), so N workers take the step one process would (to float round-off). Worker 0
writes the log and the checkpoints into `--out`, which must be one folder every worker sees (a shared filesystem
across nodes); the state it saves is full and names no worker count, so a run resumes on any number of workers.

Ray is imported here only: the Trainer itself needs torch.distributed alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from dreamzero.errors import ConfigError
from dreamzero.train.trainer import LOG_FILE, TrainConfig, Trainer


def _worker_loop(config: dict) -> None:
    import torch

    threads = config.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    cfg = TrainConfig(**config["cfg"])
    if cfg.device.startswith("cuda"):
        import ray.train.torch

        cfg = dataclasses.replace(cfg, device=str(ray.train.torch.get_device()))
    torch.manual_seed(cfg.seed)
    Trainer(cfg, resume=config["resume"]).run()


def run_distributed(
    cfg: TrainConfig, num_workers: int, resume: bool = True, threads_per_worker: int | None = None
) -> list[dict]:
    """Train `cfg` on `num_workers` Ray Train workers; returns the records worker 0 logged in this run."""
    if num_workers < 1:
        raise ConfigError(f"num_workers: expected >= 1, got {num_workers}")
    cfg.validate()
    cfg.accumulation(num_workers)  # a global batch the workers cannot split fails here, before any worker starts
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, out=str(out), **_absolute_paths(cfg))
    log_path = out / LOG_FILE
    seen = len(log_path.read_text().splitlines()) if log_path.is_file() else 0
    use_gpu = cfg.device.startswith("cuda")
    per_worker = {"CPU": threads_per_worker or 1}
    if not ray.is_initialized():
        # the workers import dreamzero from this same environment; with Ray's dashboard up (its State API), Ray
        # Train's placement-group cleaner can see its controller: without it, it warns every few seconds
        ray.init(log_to_driver=True, configure_logging=False)
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"cfg": dataclasses.asdict(cfg), "resume": resume, "threads": threads_per_worker},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=per_worker),
        # the bound of every collective, also of a worker waiting while the others of its node load (sharding.py)
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=1800),
        run_config=RunConfig(name="dreamzero-train", storage_path=str(out / "ray")),
    )
    trainer.fit()
    lines = log_path.read_text().splitlines() if log_path.is_file() else []
    return [json.loads(line) for line in lines[seen:]]


def _absolute_paths(cfg: TrainConfig) -> dict:
    """Paths the workers read, made absolute (a worker's working folder need not be the driver's)."""
    fields = {}
    for name in ("dataset", "init", "metadata"):
        value = getattr(cfg, name)
        if isinstance(value, str) and value and os.path.exists(value):
            fields[name] = str(Path(value).resolve())
    if cfg.mixture:
        fields["mixture"] = [
            {**m, **{k: str(Path(m[k]).resolve()) for k in ("path", "metadata") if m.get(k)}} for m in cfg.mixture
        ]
    return fields
