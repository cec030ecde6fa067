"""Supervised fine-tuning loop: clips -> frozen encoders -> teacher-forced loss -> AdamW on the DiT.

What trains: the DiT (`model.model`, every parameter, as upstream's full fine-tune); the T5, CLIP and VAE stay frozen.
Checkpoints (`<out>/checkpoint-<step>/`): the model in our HF release layout (`dreamzero.checkpoint.save_model`, so
`load_model` / serving read it as is), `experiment_cfg/metadata.json` (the statistics the data was normalised with,
which serving needs), and `trainer_state.pt` (optimizer, step, sampler and noise generator states) for resuming.
`<out>/latest` names the newest checkpoint; `<out>/train_log.jsonl` gets one line per logged step.
The same code runs on CPU and GPU: `device` and `dtype` only choose where the tensors live and the autocast type.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dreamzero.errors import ConfigError
from dreamzero.train.augment import perturb_states, state_noise_plan
from dreamzero.train.data import ClipSampler, load_episodes
from dreamzero.train.objective import EncodedBatch, encode_clips, teacher_forced_loss
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

    @property
    def last_step(self) -> int:
        return self.steps if self.stop_at is None else self.stop_at

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("steps", "batch_size", "blocks", "log_every", "save_every", "start_stride"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr: expected a positive number, got {self.lr}")
        if not (self.action_loss_weight >= 0 and math.isfinite(self.action_loss_weight)):
            raise ConfigError(f"action_loss_weight: expected a number >= 0, got {self.action_loss_weight}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ConfigError(f"stop_at: expected 1..steps ({self.steps}), got {self.stop_at}")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("warmup_steps and grad_clip must be >= 0")
        from dreamzero.metadata import BOUNDS

        if not (self.state_noise >= 0 and math.isfinite(self.state_noise)):
            raise ConfigError(f"state_noise: expected a number >= 0, got {self.state_noise}")
        if self.action_bounds is not None and self.action_bounds not in BOUNDS:
            raise ConfigError(f"action_bounds: expected one of {sorted(BOUNDS)}, got {self.action_bounds!r}")


def _metadata_for(cfg: TrainConfig) -> dict:
    from dreamzero.lerobot_dataset import LeRobotDataset, get_preset
    from dreamzero.metadata import read_metadata_file
    from dreamzero.metadata_cli import compute_metadata

    if cfg.metadata is not None:
        metadata = read_metadata_file(cfg.metadata)
    else:
        metadata = compute_metadata(LeRobotDataset(cfg.dataset), get_preset(cfg.embodiment), progress=False)
    if cfg.action_bounds is not None:
        entry = metadata.get(cfg.embodiment)
        if not isinstance(entry, dict):
            raise ConfigError(f"metadata has no embodiment tag {cfg.embodiment!r} to set action_bounds on")
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
        self.embodiment = get_embodiment(cfg.embodiment, self.metadata)
        self.model = _load_model(str(resume_from) if resume_from else cfg.init, cfg.device)
        dit_cfg = self.model.config.dit
        if cfg.blocks > dit_cfg.max_chunk_size:
            raise ConfigError(f"blocks: the model's window holds {dit_cfg.max_chunk_size} blocks, got {cfg.blocks}")
        if self.embodiment.action_horizon != dit_cfg.num_action_per_block:
            raise ConfigError(
                f"embodiment {cfg.embodiment} has action_horizon {self.embodiment.action_horizon}, the model "
                f"predicts {dit_cfg.num_action_per_block} actions per block"
            )
        episodes = load_episodes(cfg.dataset, self.embodiment, cfg.max_episodes)
        self.sampler = ClipSampler(episodes, self.embodiment, cfg.blocks, seed=cfg.seed, start_stride=cfg.start_stride)
        self.encoded: dict[tuple[int, int], EncodedBatch] = {}  # (episode, t0) -> that clip's encodings
        self.schedule = TrainingSchedule(device=cfg.device)
        self.generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
        self.noise_plan = state_noise_plan(self.embodiment) if cfg.state_noise > 0 else None
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
        keys = self.sampler.sample_keys(self.cfg.batch_size)
        if not self.cfg.cache_encodings:
            batch = encode_clips(self.model, [self.sampler.clip(k) for k in keys])
        else:
            for k in keys:
                if k not in self.encoded:
                    self.encoded[k] = encode_clips(self.model, [self.sampler.clip(k)])
            batch = EncodedBatch.cat([self.encoded[k] for k in keys])
        if self.noise_plan is not None:
            state, actions = perturb_states(batch.state, batch.actions, self.noise_plan, self.cfg.state_noise,
                                            self.generator)  # fmt: skip
            batch = dataclasses.replace(batch, state=state, actions=actions)
        return batch

    def _loss(self, batch: EncodedBatch, generator: torch.Generator):
        return teacher_forced_loss(
            self.model.model, batch, self.schedule, generator, DTYPES[self.cfg.dtype], self.cfg.action_loss_weight
        )

    def train_step(self, batch=None) -> dict:
        """One optimizer step on `batch` (an EncodedBatch; None: a fresh random one). Returns the logged numbers."""
        t0 = time.monotonic()
        if batch is None:
            batch = self.next_batch()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        terms = self._loss(batch, self.generator)
        self.optimizer.zero_grad(set_to_none=True)
        terms.loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip or float("inf"))
        if not torch.isfinite(terms.loss):
            raise FloatingPointError(f"step {self.step}: the loss is {terms.loss.item()} (lower lr or use float32)")
        self.optimizer.step()
        self.step += 1
        return {
            "step": self.step, "loss": terms.loss.item(), "video_loss": terms.video.item(),
            "action_loss": terms.action.item(), "grad_norm": float(grad_norm), "lr": self.lr_at(self.step - 1),
            "seconds": round(time.monotonic() - t0, 4),
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
        records = []
        with (self.out / LOG_FILE).open("a") as logf:
            while self.step < self.cfg.last_step:
                record = self.train_step()
                if record["step"] % self.cfg.log_every == 0 or record["step"] == self.cfg.last_step:
                    logf.write(json.dumps(record) + "\n")
                    logf.flush()
                    log.info("step %(step)d loss %(loss).4f (video %(video_loss).4f action %(action_loss).4f)", record)
                records.append(record)
                if self.step % self.cfg.save_every == 0 or self.step == self.cfg.last_step:
                    self.save()
        return records

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def save(self) -> Path:
        from dreamzero.checkpoint import save_model

        path = self.out / f"checkpoint-{self.step:07d}"
        self.model.model.eval()
        save_model(self.model, path)
        self.model.model.train()
        (path / _META_PATH).parent.mkdir(parents=True, exist_ok=True)
        (path / _META_PATH).write_text(json.dumps(self.metadata, indent=1))
        torch.save(
            {
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "sampler": self.sampler.rng.bit_generator.state,
                "config": asdict(self.cfg),
            },
            path / STATE_FILE,
        )
        (self.out / LATEST_FILE).write_text(path.name + "\n")
        log.info("saved %s", path)
        return path

    def _load_state(self, path: Path) -> None:
        state = torch.load(path / STATE_FILE, map_location=self.cfg.device, weights_only=False)
        self.step = int(state["step"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"].cpu() if hasattr(state["generator"], "cpu") else state["generator"])
        self.sampler.rng.bit_generator.state = state["sampler"]


_META_PATH = Path("experiment_cfg") / "metadata.json"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a checkpoint written by dreamzero-train carries its metadata there")
    return json.loads(path.read_text())


def seed_everything(seed: int) -> None:
    np.random.seed(seed)
    torch.manual_seed(seed)
