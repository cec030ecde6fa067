"""Supervised fine-tuning loop: clips -> frozen encoders -> teacher-forced loss -> AdamW on the DiT.

What trains: the DiT (`model.model`, every parameter, as upstream's full fine-tune); the T5, CLIP and VAE stay frozen.
Checkpoints (`<out>/checkpoint-<step>/`): the model in our HF release layout (`dreamzero.checkpoint.save_model`, so
`load_model` / serving read it as is), `experiment_cfg/metadata.json` (the statistics the data was normalised with,
which serving needs), and `trainer_state.pt` (optimizer, step, sampler and noise generator states) for resuming.
`<out>/latest` names the newest checkpoint; `<out>/train_log.jsonl` gets one line per logged step.
The same code runs on CPU and GPU: `device` and `dtype` only choose where the tensors live and the autocast type.
Under torch.distributed (`distributed.py`) the DiT is replicated (DDP) or sharded (FSDP2): see `sharding.py`.
"""

# Longer than ~400 lines on purpose: one run's life read top to bottom (config, model placement, step, loop,
# checkpoints); each concern with a life of its own (objective, data, sharding, LoRA, mixtures, logs) has its module.

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dreamzero.errors import ConfigError
from dreamzero.train import sharding
from dreamzero.train.augment import draw_state_noise, perturb_states, state_noise_plan
from dreamzero.train.data import ClipSampler, load_episodes
from dreamzero.train.mixture import DatasetSpec, MixtureSampler
from dreamzero.train.objective import DrawnNoise, EncodedBatch, draw_noise, encode_clips, teacher_forced_loss
from dreamzero.train.schedule import TrainingSchedule

log = logging.getLogger(__name__)

DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
LATEST_FILE = "latest"


@dataclass
class TrainConfig:
    """One training run. `init`: a checkpoint directory (any layout `load_model` reads); None: the embedded default."""

    dataset: str
    out: str
    init: str | None = None
    embodiment: str = "oxe_droid"
    metadata: str | None = None  # None: computed from the dataset (`dreamzero-make-metadata`'s statistics)
    steps: int = 100
    batch_size: int = 2
    blocks: int = 2  # action chunks per clip (<= dit.max_chunk_size)
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 10
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"  # autocast dtype of the DiT; parameters and optimizer stay float32
    log_every: int = 1
    save_every: int = 50
    max_episodes: int | None = None
    action_loss_weight: float = 1.0  # weight of the action term in the total (upstream: 1)
    start_stride: int = 1  # clips start at multiples of this frame (1: any frame)
    cache_encodings: bool = False  # encode each distinct clip once and keep it (encoders are frozen)
    stop_at: int | None = None  # end this run at this step; the lr schedule still runs to `steps`
    action_bounds: str | None = None  # "q01_q99" / "min_max": set the metadata's action bounds (None: keep them)
    state_noise: float = 0.0  # std (raw units) of the noise on relative-action states, targets relabelled (augment.py)
    # clips per forward pass on one worker; batch_size (the global batch) = workers x micro_batch_size x accumulation
    micro_batch_size: int | None = None  # None: batch_size / workers (no accumulation)
    # several datasets drawn by weight (dicts of mixture.DatasetSpec's fields); None: `dataset` alone
    mixture: list[dict] | None = None
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank on the DiT's attention / FFN layers, the rest frozen
    lora_alpha: float | None = None  # the adapters' scale is alpha / rank (None: alpha = rank)
    strategy: str = "auto"  # several workers: "ddp" (replicas), "fsdp" (FSDP2 shards), "auto" (sharding.py's rule)

    def dataset_specs(self) -> list[DatasetSpec]:
        if not self.mixture:
            return [DatasetSpec(self.dataset, 1.0, self.embodiment, self.metadata)]
        return [DatasetSpec(**{**m, "embodiment": m.get("embodiment") or self.embodiment}) for m in self.mixture]

    @property
    def last_step(self) -> int:
        return self.steps if self.stop_at is None else self.stop_at

    def accumulation(self, workers: int) -> int:
        """Forward passes per worker per optimizer step for the global batch on `workers` workers."""
        micro = self.micro_batch_size or self.batch_size // workers
        if micro < 1 or self.batch_size % (workers * micro):
            raise ConfigError(
                f"batch_size: the global batch ({self.batch_size}) must be a multiple of workers ({workers}) x "
                f"micro_batch_size ({micro})"
            )
        return self.batch_size // (workers * micro)

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        from dreamzero.train.sharding import STRATEGIES

        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy: expected one of {list(STRATEGIES)}, got {self.strategy!r}")
        for name in ("steps", "batch_size", "blocks", "log_every", "save_every", "start_stride"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr: expected a positive number, got {self.lr}")
        if not (self.action_loss_weight >= 0 and math.isfinite(self.action_loss_weight)):
            raise ConfigError(f"action_loss_weight: expected a number >= 0, got {self.action_loss_weight}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ConfigError(f"stop_at: expected 1..steps ({self.steps}), got {self.stop_at}")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank: expected >= 0 (0: full fine-tune), got {self.lora_rank}")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("warmup_steps and grad_clip must be >= 0")
        from dreamzero.metadata import BOUNDS

        if not (self.state_noise >= 0 and math.isfinite(self.state_noise)):
            raise ConfigError(f"state_noise: expected a number >= 0, got {self.state_noise}")
        if self.action_bounds is not None and self.action_bounds not in BOUNDS:
            raise ConfigError(f"action_bounds: expected one of {sorted(BOUNDS)}, got {self.action_bounds!r}")


def _metadata_for(cfg: TrainConfig) -> dict:
    """The statistics of every embodiment the run trains: per tag the metadata file of its first dataset that names
    one, else computed over all its datasets together (a mixture of several recordings of one robot is normalised by
    the range of all of them: the first's alone clamps what the others reach beyond it)."""
    from dreamzero.lerobot_dataset import LeRobotDataset, get_preset
    from dreamzero.metadata import read_metadata_file
    from dreamzero.metadata_cli import compute_metadata

    specs = cfg.dataset_specs()
    if len(specs) == 1 and specs[0].metadata is not None:  # one dataset: its file as it is, every tag it holds
        metadata = read_metadata_file(specs[0].metadata)
    else:
        metadata = {}
        for tag in dict.fromkeys(s.embodiment for s in specs):
            of_tag = [s for s in specs if s.embodiment == tag]
            named = next((s.metadata for s in of_tag if s.metadata is not None), None)
            if named is not None:
                found = read_metadata_file(named)
                if tag not in found:
                    raise ConfigError(f"metadata {named} has no embodiment tag {tag!r}")
                metadata[tag] = found[tag]
            else:
                datasets = [LeRobotDataset(s.path) for s in of_tag]
                metadata.update(compute_metadata(datasets, get_preset(tag), progress=False))
    if cfg.action_bounds is not None:
        for tag in dict.fromkeys(s.embodiment for s in specs):
            entry = metadata.get(tag)
            if not isinstance(entry, dict):
                raise ConfigError(f"metadata has no embodiment tag {tag!r} to set action_bounds on")
            entry["normalisation_bounds"] = {**(entry.get("normalisation_bounds") or {}), "action": cfg.action_bounds}
    return metadata


def _load_model(path: str | None, device: str):
    from dreamzero.checkpoint import load_model
    from dreamzero.embedded_default import default_model_dir

    model = load_model(path or default_model_dir(), device=device, dtype=torch.float32)
    model.requires_grad_(False)
    model.model.requires_grad_(True)
    model.model.train()
    return model


def _load_trained_model(cfg: TrainConfig, resume_from: Path | None, device: str):
    """The model to train, on `device`: the checkpoint resumed from, else cfg.init; with LoRA, the frozen base plus
    adapters (a LoRA checkpoint holds only the adapters: the base comes from its adapter_config.json)."""
    from dreamzero.train import lora

    adapters = resume_from is not None and (resume_from / lora.ADAPTER_CONFIG).is_file()
    if adapters != (cfg.lora_rank > 0) and resume_from is not None:
        raise ConfigError(f"lora_rank: {resume_from} was trained {'with' if adapters else 'without'} LoRA; match it")
    if cfg.lora_rank == 0:
        return _load_model(str(resume_from) if resume_from else cfg.init, device)
    if adapters:
        saved = lora.read_adapter_config(resume_from)
        if int(saved["rank"]) != cfg.lora_rank:
            raise ConfigError(f"lora_rank: {resume_from} holds rank {saved['rank']} adapters, got {cfg.lora_rank}")
        model = _load_model(saved.get("base_model"), device)
    else:
        model = _load_model(cfg.init, device)
    lora.apply_lora(model.model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
    if adapters:
        lora.load_adapter(model.model, resume_from)
    return model


def latest_checkpoint(out: str | Path) -> Path | None:
    pointer = Path(out) / LATEST_FILE
    if not pointer.is_file():
        return None
    path = Path(out) / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"{pointer} names {path}, which has no {STATE_FILE}; remove {pointer} or fix it")
    return path


class Trainer:
    """Holds the model, data, optimizer and step; `run()` trains to cfg.steps (resuming from `out` if it holds one)."""

    def __init__(self, cfg: TrainConfig, resume: bool = True):
        from dreamzero.embodiments import get_embodiment

        cfg.validate()
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        resume_from = latest_checkpoint(self.out) if resume else None
        self.metadata = _metadata_for(cfg) if resume_from is None else _read_json(resume_from / _META_PATH)
        specs = cfg.dataset_specs()
        self.embodiments = [get_embodiment(spec.embodiment, self.metadata) for spec in specs]
        self.embodiment = self.embodiments[0]
        self.world, self.rank = _world()
        self.model, self.strategy = _placed_model(cfg, resume_from, self.world)
        dit_cfg = self.model.config.dit
        if cfg.blocks > dit_cfg.max_chunk_size:
            raise ConfigError(f"blocks: the model's window holds {dit_cfg.max_chunk_size} blocks, got {cfg.blocks}")
        for spec, emb in zip(specs, self.embodiments):
            if emb.action_horizon != dit_cfg.num_action_per_block:
                raise ConfigError(
                    f"embodiment {emb.tag} (dataset {spec.path}) has action_horizon {emb.action_horizon}, the model "
                    f"predicts {dit_cfg.num_action_per_block} actions per block"
                )
        samplers = [
            ClipSampler(load_episodes(spec.path, emb, cfg.max_episodes), emb, cfg.blocks, seed=cfg.seed,
                        start_stride=cfg.start_stride)
            for spec, emb in zip(specs, self.embodiments)
        ]  # fmt: skip
        if len(specs) == 1:
            self.sampler = samplers[0]
        else:
            if cfg.state_noise > 0:
                raise ConfigError("state_noise: not available with a mixture of datasets (one embodiment's columns)")
            self.sampler = MixtureSampler(samplers, [s.weight for s in specs], seed=cfg.seed)
        self.encoded: dict[tuple[int, int], EncodedBatch] = {}  # (episode, t0) -> that clip's encodings
        self.schedule = TrainingSchedule(device=cfg.device)
        self.generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
        self.noise_plan = state_noise_plan(self.embodiment) if cfg.state_noise > 0 else None
        self.accum = cfg.accumulation(self.world)
        self.loss_module = _LossModule(self.model.model, self.schedule, DTYPES[cfg.dtype], cfg.action_loss_weight)
        if self.strategy == "ddp":
            self.loss_module = _wrap_data_parallel(self.loss_module, cfg.device)
        params = [p for p in self.model.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
        self.step = 0
        if resume_from is not None:
            self._load_state(resume_from)
            log.info("resumed from %s at step %d", resume_from, self.step)

    # -- one step ----------------------------------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of lr at cfg.steps."""
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def next_batch(self) -> EncodedBatch:
        """A random batch, its clips encoded by the frozen encoders (once per clip with cache_encodings)."""
        batch = self._encode(self.sampler.sample_keys(self.cfg.batch_size))
        if self.noise_plan is not None:
            state, actions = perturb_states(batch.state, batch.actions, self.noise_plan, self.cfg.state_noise,
                                            self.generator)  # fmt: skip
            batch = dataclasses.replace(batch, state=state, actions=actions)
        return batch

    def _encode(self, keys: list[tuple]) -> EncodedBatch:
        if not self.cfg.cache_encodings:
            batch = _encode_mixed(self.model, [self.sampler.clip(k) for k in keys])
        else:
            for k in keys:
                if k not in self.encoded:
                    self.encoded[k] = encode_clips(self.model, [self.sampler.clip(k)])
            batch = EncodedBatch.cat([self.encoded[k] for k in keys])
        return batch

    def micro_rows(self) -> list[list[int]]:
        """Rows of the global batch this worker computes, one list per forward pass: pass m of worker r takes the
        (m * workers + r)-th run of micro_batch_size rows, so any worker count covers the same global batch."""
        micro = self.cfg.batch_size // (self.world * self.accum)
        return [list(range((m * self.world + self.rank) * micro, (m * self.world + self.rank + 1) * micro))
                for m in range(self.accum)]  # fmt: skip

    def _loss(self, batch: EncodedBatch, generator: torch.Generator):
        return teacher_forced_loss(
            self.model.model, batch, self.schedule, generator, DTYPES[self.cfg.dtype], self.cfg.action_loss_weight
        )

    def train_step(self, batch: EncodedBatch | None = None) -> dict:
        """One optimizer step on the global batch `batch` (an EncodedBatch; None: a fresh random one). Every worker
        draws the same global clips and noise from the same seeds and computes its rows of them (`micro_rows`); the
        gradients are averaged across workers (DDP), so the step is the step one process takes. Returns the logged
        numbers (of the whole global batch)."""
        t0 = time.monotonic()
        cfg, g = self.cfg, self.cfg.batch_size
        keys = self.sampler.sample_keys(g) if batch is None else None
        if batch is not None and batch.block_latents.shape[0] != g:
            raise ConfigError(f"batch: expected the global batch of {g} clips, got {batch.block_latents.shape[0]}")
        passes = self.micro_rows()

        def rows_of(rows: list[int]) -> EncodedBatch:
            return self._encode([keys[i] for i in rows]) if batch is None else batch.rows(rows)

        local = [rows_of(rows) for rows in passes]
        k = local[0].block_latents.shape[1]
        state_noise = draw_state_noise(self.noise_plan, self.generator, g, k) if self.noise_plan is not None else None
        noise = draw_noise(self.schedule, self.generator, g, local[0])
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(3, dtype=torch.float64)  # loss, video, action, summed over this worker's rows
        for m, (rows, part) in enumerate(zip(passes, local)):
            if state_noise is not None:
                state, actions = perturb_states(part.state, part.actions, self.noise_plan, cfg.state_noise, None,
                                                state_noise[rows])  # fmt: skip
                part = dataclasses.replace(part, state=state, actions=actions)
            with _no_sync(self.loss_module, last=m == len(passes) - 1):
                loss, video, action = self.loss_module(part, noise.rows(rows))
                # each pass's mean weighted by its share of the global batch; DDP divides by the workers again
                (loss * (len(rows) * self.world / g)).backward()
            sums += torch.tensor([loss.item(), video.item(), action.item()], dtype=torch.float64) * len(rows)
        if self.world > 1:
            torch.distributed.all_reduce(sums)
        mean = (sums / g).tolist()
        params = [p for grp in self.optimizer.param_groups for p in grp["params"]]
        grad_norm = sharding.grad_norm_value(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf")))
        if not math.isfinite(mean[0]):
            raise FloatingPointError(f"step {self.step}: the loss is {mean[0]} (lower lr or use float32)")
        self.optimizer.step()
        self.step += 1
        seconds = time.monotonic() - t0
        return {
            "step": self.step, "loss": mean[0], "video_loss": mean[1], "action_loss": mean[2],
            "grad_norm": float(grad_norm), "lr": self.lr_at(self.step - 1), "seconds": round(seconds, 4),
            "samples_per_s": round(g / seconds, 3), "workers": self.world, "strategy": self.strategy,
        }  # fmt: skip

    @torch.no_grad()
    def evaluate(self, batch, seed: int) -> dict:
        """Loss of `batch` with the noise / timesteps of `seed` (no update): the same inputs every call."""
        self.model.model.eval()
        gen = torch.Generator(device=self.cfg.device).manual_seed(seed)
        terms = self._loss(batch, gen)
        self.model.model.train()
        return {"loss": terms.loss.item(), "video_loss": terms.video.item(), "action_loss": terms.action.item()}

    # -- loop --------------------------------------------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Train to cfg.last_step; only worker 0 writes the log and the checkpoints (all workers hold the same)."""
        from dreamzero.train.tb_log import RunLog

        records = []
        logf = (self.out / LOG_FILE).open("a") if self.rank == 0 else None
        run_log = RunLog(self.out, self.step, self.cfg.last_step) if self.rank == 0 else None
        try:
            while self.step < self.cfg.last_step:
                record = self.train_step()
                if logf and (record["step"] % self.cfg.log_every == 0 or record["step"] == self.cfg.last_step):
                    logf.write(json.dumps(record) + "\n")
                    logf.flush()
                    run_log.write(record)
                    level = logging.DEBUG if run_log.bar_shown else logging.INFO  # a log file still gets lines
                    log.log(level, "step %(step)d loss %(loss).4f (video %(video_loss).4f action %(action_loss).4f)",
                            record)  # fmt: skip
                if run_log:
                    run_log.advance(record)
                records.append(record)
                if self.step % self.cfg.save_every == 0 or self.step == self.cfg.last_step:
                    self.save()
        finally:
            if logf:
                logf.close()
                run_log.close()
        return records

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def save(self) -> Path:
        """Worker 0 writes the checkpoint; the others wait for it (so a resume on any count finds it whole). Sharded,
        every worker first takes part in gathering the full model and optimizer states to worker 0."""
        path = self.out / f"checkpoint-{self.step:07d}"
        dit_state = sharding.full_dit_state(self.model.model)
        optimizer_state = sharding.full_optimizer_state(self.model.model, self.optimizer)
        if self.rank == 0:
            self._write_checkpoint(path, dit_state, optimizer_state)
        if self.world > 1:
            torch.distributed.barrier()
        return path

    def _write_checkpoint(self, path: Path, dit_state: dict | None, optimizer_state: dict) -> None:
        self.model.model.eval()
        if self.cfg.lora_rank > 0:  # the adapters only, naming their base (the ship step merges them)
            from dreamzero.train.lora import save_adapter

            path.mkdir(parents=True, exist_ok=True)
            base = str(Path(self.cfg.init).resolve()) if self.cfg.init else None
            save_adapter(self.model.model, path, base, self.cfg.lora_alpha or self.cfg.lora_rank, state=dit_state)
        else:
            sharding.save_model_with(self.model, dit_state, path)
        self.model.model.train()
        (path / _META_PATH).parent.mkdir(parents=True, exist_ok=True)
        (path / _META_PATH).write_text(json.dumps(self.metadata, indent=1))
        torch.save(
            {
                "step": self.step,
                "optimizer": optimizer_state,  # full, keyed by parameter name: any strategy and worker count
                "generator": self.generator.get_state(),
                "sampler": self.sampler.rng.bit_generator.state,
                "config": asdict(self.cfg),
            },
            path / STATE_FILE,
        )
        (self.out / LATEST_FILE).write_text(path.name + "\n")
        log.info("saved %s", path)

    def _load_state(self, path: Path) -> None:
        # mmap: a sharded run's other workers read the small entries, not the full optimizer state worker 0 sends
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False, mmap=True)
        self.step = int(state["step"])
        broadcast = sharding.is_sharded(self.model.model) and self.rank > 0
        sharding.load_optimizer_state(self.model.model, self.optimizer, None if broadcast else state["optimizer"])
        self.generator.set_state(state["generator"].cpu() if hasattr(state["generator"], "cpu") else state["generator"])
        self.sampler.rng.bit_generator.state = state["sampler"]


_META_PATH = Path("experiment_cfg") / "metadata.json"


class _LossModule(torch.nn.Module):
    """The whole teacher-forced loss as one forward, so DDP sees one forward per backward (the loss calls the DiT
    once per block and once per clean prefill)."""

    def __init__(self, dit, schedule, autocast_dtype, action_weight: float):
        super().__init__()
        self.dit, self.schedule = dit, schedule
        self.autocast_dtype, self.action_weight = autocast_dtype, action_weight

    def forward(self, batch: EncodedBatch, noise: DrawnNoise):
        terms = teacher_forced_loss(
            self.dit, batch, self.schedule, None, self.autocast_dtype, self.action_weight, noise=noise
        )
        return terms.loss, terms.video, terms.action


def _encode_mixed(model, clips: list) -> EncodedBatch:
    """`encode_clips` of clips whose canvases may differ (a mixture's embodiments): one call per canvas size, the
    rows back in the clips' order (each encoding is at the model's input size)."""
    groups: dict[tuple, list[int]] = {}
    for i, clip in enumerate(clips):
        groups.setdefault(clip.anchor.shape, []).append(i)
    if len(groups) == 1:
        return encode_clips(model, clips)
    order = [i for rows in groups.values() for i in rows]
    parts = EncodedBatch.cat([encode_clips(model, [clips[i] for i in rows]) for rows in groups.values()])
    return parts.rows([order.index(i) for i in range(len(clips))])


def _placed_model(cfg: TrainConfig, resume_from: Path | None, world: int):
    """(model, strategy): the model to train, replicated or sharded over the workers as `cfg.strategy` says
    (`sharding.resolve_strategy`). ddp and one worker load straight onto the device; otherwise each worker reads it
    to host memory (on GPUs one worker of a node at a time), then shards the DiT or moves the model over."""
    if world == 1 or cfg.strategy == "ddp":
        strategy = sharding.resolve_strategy(cfg.strategy, world, 0, 0, 0)  # "single" or "ddp"
        return _load_trained_model(cfg, resume_from, cfg.device), strategy
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    memory = sharding.smallest_device_bytes(device)
    with sharding.one_loader_per_node(device):
        model = _load_trained_model(cfg, resume_from, "cpu")
        strategy = sharding.resolve_strategy(cfg.strategy, world, *sharding.parameter_counts(model), memory)
        if strategy == "fsdp":
            sharding.shard_dit(model.model, device, DTYPES[cfg.dtype])  # the shards move to the device
        for name, part in model.named_children():
            if not (strategy == "fsdp" and name == "model"):
                part.to(device)
    log.info("strategy %s over %d workers (%s)", strategy, world, cfg.strategy)
    return model, strategy


def _world() -> tuple[int, int]:
    """(workers, this worker's rank): from torch.distributed when a process group is up, else (1, 0)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _wrap_data_parallel(module: torch.nn.Module, device: str) -> torch.nn.Module:
    """DDP over the process group when there is one (gloo on CPU, NCCL on GPU: whichever the group was made with)."""
    if _world()[0] == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel

    dev = torch.device(device)
    ids = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else None
    # no buffer broadcast before each forward (every rank starts from the same weights and buffers); torch 2.13 names
    # that `forward_sync_buffers` and warns on the old name, which older torch (a GPU box's 2.11) still needs
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    return DistributedDataParallel(module, device_ids=ids, **no_sync)


def _no_sync(module: torch.nn.Module, last: bool):
    """Accumulating passes skip DDP's gradient all-reduce; the last pass of a step syncs them all."""
    if last or not hasattr(module, "no_sync"):
        return contextlib.nullcontext()
    return module.no_sync()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a checkpoint written by dreamzero-train carries its metadata there")
    return json.loads(path.read_text())


def seed_everything(seed: int) -> None:
    np.random.seed(seed)
    torch.manual_seed(seed)
