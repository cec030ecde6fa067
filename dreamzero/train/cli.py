"""`dreamzero-train`: fine-tune a DreamZero checkpoint on a LeRobot v3.0 dataset (see docs/training.md).

    dreamzero-train --dataset demos/ --out runs/tiny --steps 2000          # the embedded tiny model, CPU
    dreamzero-train --dataset demos/ --out runs/14b --init /ckpt/DreamZero-DROID --device cuda --dtype bfloat16

Running it again with the same --out resumes from `<out>/latest` (weights, optimizer, step, random states).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dreamzero.cli_help import DefaultsHelpFormatter
from dreamzero.errors import ConfigError, DreamZeroError
from dreamzero.metadata import BOUNDS
from dreamzero.train.mixture import DatasetSpec, parse_dataset_arg, read_mixture_spec
from dreamzero.train.trainer import DTYPES, TrainConfig, Trainer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dreamzero-train", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    d = TrainConfig(dataset="", out="")
    p.add_argument(
        "--dataset",
        action="append",
        default=None,
        metavar="PATH[:WEIGHT[:EMBODIMENT]]",
        help="LeRobot v3.0 dataset directory; repeat for a mixture drawn by weight, each with its own embodiment "
        "(default: --embodiment)",
    )
    p.add_argument("--dataset-spec", default=None, help="YAML list of mixture datasets (see docs/training.md)")
    p.add_argument("--out", required=True, help="run directory (checkpoints, train_log.jsonl); resumed if it has one")
    p.add_argument(
        "--init", default=None, help="checkpoint to start from (default: the embedded tiny model, random weights)"
    )
    p.add_argument(
        "--preset",
        default=None,
        help="start from this preset with seeded random weights (e.g. small), not --init",
    )
    p.add_argument(
        "--embodiment",
        default=d.embodiment,
        help="embodiment tag: columns, normalisation, canvas (default: %(default)s)",
    )
    p.add_argument(
        "--metadata",
        default=None,
        help="metadata.json to normalise with (default: computed from the datasets, all of one embodiment together); "
        "a mixture of one embodiment takes it for every dataset",
    )
    p.add_argument(
        "--action-bounds",
        choices=sorted(BOUNDS),
        default=None,
        help="statistics the actions are normalised between (default: as the metadata says; q01_q99 if unset)",
    )
    p.add_argument(
        "--state-noise",
        type=float,
        default=0.0,
        help="std, in the state's units (radians on DROID), of noise added to the states that relative actions are "
        "taken from; targets are relabelled to the same absolute joints (closed-loop recovery; default 0: off)",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="total optimizer steps (default: %(default)s)")
    p.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="end the run after this step; the learning-rate schedule still runs to --steps (resume to go on)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="global batch: clips per optimizer step (default: %(default)s)",
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=1,
        help="training workers on Ray Train (one per GPU with --device cuda, else CPU processes); 1: this process "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--strategy",
        choices=["auto", "ddp", "fsdp"],
        default=d.strategy,
        help="with several workers: ddp (a whole model per worker), fsdp (FSDP2: the DiT, its gradients and optimizer "
        "state sharded), auto (fsdp when ddp would take over half a device's memory) (default: %(default)s)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="clips per forward pass on a worker; batch-size = workers x this x accumulation "
        "(default: batch-size / workers, no accumulation)",
    )
    p.add_argument(
        "--blocks", type=int, default=d.blocks, help="action chunks per training clip (default: %(default)s)"
    )
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate of AdamW (default: %(default)s)")
    p.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (default: %(default)s)"
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=d.warmup_steps,
        help="linear learning-rate warm-up steps (default: %(default)s)",
    )
    p.add_argument(
        "--grad-clip",
        type=float,
        default=d.grad_clip,
        help="gradient norm clip; 0 disables clipping (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="random seed of the run (default: %(default)s)")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=d.dtype,
        help="compute dtype of the DiT (autocast; with fsdp also the gathered parameters); weights, optimizer state "
        "and gradient reduction stay float32 (default: %(default)s)",
    )
    p.add_argument(
        "--log-every", type=int, default=d.log_every, help="steps between train_log.jsonl lines (default: %(default)s)"
    )
    p.add_argument(
        "--save-every", type=int, default=d.save_every, help="steps between checkpoints (default: %(default)s)"
    )
    p.add_argument(
        "--max-episodes", type=int, default=None, help="read at most this many episodes (default: all of them)"
    )
    p.add_argument(
        "--action-loss-weight",
        type=float,
        default=d.action_loss_weight,
        help="weight of the action flow-matching term in the total loss (upstream: 1; default: %(default)s)",
    )
    p.add_argument(
        "--start-stride",
        type=int,
        default=d.start_stride,
        help="clips start only at frames that are multiples of this (1: any frame; default: %(default)s)",
    )
    p.add_argument(
        "--cache-encodings",
        action="store_true",
        help="encode each distinct clip once and keep it in memory (pair with --start-stride)",
    )
    p.add_argument(
        "--cpu-threads", type=int, default=None, help="torch CPU threads (of each worker; default: torch's choice)"
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank on the DiT's attention and FFN projections, the rest frozen "
        "(checkpoints hold the adapters; the ship step merges them); 0: full fine-tune (default: %(default)s)",
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale alpha / rank (default: alpha = rank)")
    p.add_argument("--no-resume", action="store_true", help="start fresh even if --out holds a checkpoint")
    return p


def _random_preset_model(out: str, name: str) -> Path:
    """`<out>/init-<name>`: the preset with the embedded default's seeded random weights (built once per run dir)."""
    from dreamzero.config import preset
    from dreamzero.embedded_default import build_default_model

    preset(name)  # an unknown name fails here, listing the known ones
    path = Path(out) / f"init-{name}"
    if not (path / "config.json").is_file():
        build_default_model(path, name)
    return path


def _dataset_specs(args) -> list[DatasetSpec]:
    if (args.dataset is None) == (args.dataset_spec is None):
        raise ConfigError("dataset: give --dataset (repeatable) or --dataset-spec, one of them")
    specs = read_mixture_spec(args.dataset_spec) if args.dataset_spec else [parse_dataset_arg(d) for d in args.dataset]
    if len(specs) > 1 and args.metadata is not None:
        tags = {s.embodiment or args.embodiment for s in specs}
        if len(tags) > 1:
            raise ConfigError(
                f"metadata: this mixture has {len(tags)} embodiment tags; give one metadata file per dataset "
                "(--dataset-spec `metadata:`)"
            )
        specs = [dataclasses.replace(s, metadata=s.metadata or args.metadata) for s in specs]  # one tag: one file
    return specs


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        return _run(args)
    except DreamZeroError as exc:  # a configuration or checkpoint error: one line, as argparse's own, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if args.preset is not None and args.init is not None:
        raise ConfigError("--preset and --init both name the starting model; give one")
    init = args.init if args.preset is None else str(_random_preset_model(args.out, args.preset))
    specs = _dataset_specs(args)
    mixture = [dataclasses.asdict(s) for s in specs] if len(specs) > 1 else None
    if len(specs) == 1 and specs[0].embodiment is not None:
        args.embodiment = specs[0].embodiment
    cfg = TrainConfig(
        dataset=specs[0].path, out=args.out, mixture=mixture, init=init, embodiment=args.embodiment,
        metadata=args.metadata or specs[0].metadata,
        steps=args.steps, batch_size=args.batch_size, blocks=args.blocks, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, seed=args.seed, device=args.device,
        dtype=args.dtype, log_every=args.log_every, save_every=args.save_every, max_episodes=args.max_episodes,
        action_loss_weight=args.action_loss_weight, start_stride=args.start_stride,
        cache_encodings=args.cache_encodings, stop_at=args.stop_at, action_bounds=args.action_bounds,
        state_noise=args.state_noise, micro_batch_size=args.micro_batch_size, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, strategy=args.strategy,
    )  # fmt: skip
    if args.num_workers > 1:
        from dreamzero.train.distributed import run_distributed

        records = run_distributed(cfg, args.num_workers, resume=not args.no_resume, threads_per_worker=args.cpu_threads)
        step, out = (records[-1]["step"] if records else None), cfg.out
    else:
        trainer = Trainer(cfg, resume=not args.no_resume)
        records = trainer.run()
        step, out = trainer.step, str(trainer.out)
    last = records[-1] if records else {"step": step}
    print(json.dumps({"step": step, "last": last, "out": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
