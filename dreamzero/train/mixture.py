"""Mixture datasets: several LeRobot datasets, each with its own embodiment and statistics, drawn by weight.

    dreamzero-train --dataset libero/:4:libero_sim --dataset franka/:1:franka_pnp ...   # PATH[:WEIGHT[:EMBODIMENT]]
    dreamzero-train --dataset-spec mix.yaml ...

    # mix.yaml (the shape of RLinf's train_data_paths):
    datasets:
      - {path: libero/, weight: 4, embodiment: libero_sim}
      - {path: franka/, weight: 1, embodiment: franka_pnp, metadata: franka/meta/metadata.json}

Each clip of a batch picks its dataset with probability weight / sum(weights), then an episode and a start as one
dataset does (`ClipSampler`). Each dataset's clips go through its own embodiment (columns, normalisation, views,
canvas), and `encode_clips` resizes every canvas to the model's input size, so datasets whose canvases differ train
together. The checkpoint's metadata.json holds an entry per embodiment tag, so serving each robot reads its own.
Datasets that share a tag share one set of statistics: the metadata file of the first of them that names one, else
computed over all of them together (so no dataset's range is clamped to another's).

Action projector: the DiT's state encoder / action encoder and decoder are category-specific layers, but the
model (as upstream builds and serves it) has one category, and every sample's embodiment selects it; the padded
action dims of each embodiment are masked out of its loss (`Clip.action_mask`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dreamzero.errors import ConfigError
from dreamzero.train.data import Clip, ClipSampler


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset of a mixture. `embodiment` None: the run's --embodiment; `metadata` None: computed (with the other
    datasets of its tag)."""

    path: str
    weight: float = 1.0
    embodiment: str | None = None
    metadata: str | None = None

    def validate(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ConfigError(f"dataset {self.path}: weight must be a positive number, got {self.weight}")
        if not Path(self.path).is_dir():
            raise ConfigError(f"dataset {self.path}: no such directory")


def parse_dataset_arg(text: str) -> DatasetSpec:
    """`PATH[:WEIGHT[:EMBODIMENT]]` -> DatasetSpec."""
    parts = text.split(":")
    path, weight, embodiment = parts[0], 1.0, None
    if len(parts) > 3 or not path:
        raise ConfigError(f"--dataset {text!r}: expected PATH[:WEIGHT[:EMBODIMENT]]")
    if len(parts) >= 2 and parts[1]:
        try:
            weight = float(parts[1])
        except ValueError:
            raise ConfigError(f"--dataset {text!r}: the weight {parts[1]!r} is not a number") from None
    if len(parts) == 3 and parts[2]:
        embodiment = parts[2]
    spec = DatasetSpec(path, weight, embodiment)
    spec.validate()
    return spec


def read_mixture_spec(path: str | Path) -> list[DatasetSpec]:
    """The `datasets:` list of a YAML spec (see the module docstring); relative paths start at the spec's folder."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"dataset_spec: cannot read {path} ({exc})") from None
    entries = data.get("datasets") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"dataset_spec: {path} needs a non-empty `datasets:` list")
    base = Path(path).parent

    def resolved(p):
        return None if p is None else str(p if Path(p).is_absolute() else base / p)

    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "path" not in entry:
            raise ConfigError(f"dataset_spec: datasets[{i}] needs a `path`")
        unknown = set(entry) - {"path", "weight", "embodiment", "metadata"}
        if unknown:
            raise ConfigError(f"dataset_spec: datasets[{i}] has unknown keys {sorted(unknown)}")
        try:
            weight = float(entry.get("weight", 1.0))
        except (TypeError, ValueError):
            raise ConfigError(f"dataset_spec: datasets[{i}].weight is not a number: {entry.get('weight')!r}") from None
        spec = DatasetSpec(resolved(entry["path"]), weight, entry.get("embodiment"), resolved(entry.get("metadata")))
        spec.validate()
        specs.append(spec)
    return specs


class MixtureSampler:
    """Clips from several `ClipSampler`s: each clip's dataset drawn by weight, all draws from one seeded generator
    (so the sampler's state is one generator state, saved and restored as a single dataset's is). Keys are
    (dataset, episode, t0)."""

    def __init__(self, samplers: list[ClipSampler], weights: list[float], seed: int = 0):
        if len(samplers) != len(weights) or not samplers:
            raise ConfigError("mixture: one weight per dataset")
        self.samplers = samplers
        self.probs = np.asarray(weights, np.float64) / float(np.sum(weights))
        self.rng = np.random.default_rng(seed)
        for s in samplers:  # the datasets draw their episodes and starts from the mixture's generator
            s.rng = self.rng

    def sample_keys(self, batch_size: int) -> list[tuple[int, int, int]]:
        keys = []
        for _ in range(batch_size):
            d = int(self.rng.choice(len(self.samplers), p=self.probs))
            keys.append((d, *self.samplers[d].sample_keys(1)[0]))
        return keys

    def clip(self, key: tuple[int, int, int]) -> Clip:
        d, episode, t0 = key
        return self.samplers[d].clip((episode, t0))

    def sample(self, batch_size: int) -> list[Clip]:
        return [self.clip(k) for k in self.sample_keys(batch_size)]
