"""What each batching-related change buys, model only, measured side by side in one run.

Eight sessions sit at four different frame positions (as closed-loop clients drift apart, so every call also holds
the window-full restarts of two of them); a whole window of chunks for all of them is timed, per row, with:

- everything on (the shipped pipeline);
- rows grouped by frame position, one model call per group (what the pipeline did before rows at different positions
  could share a forward);
- the T5 padding not folded (cross-attention over all 512 text rows);
- diffusers' own VAE norms (`F.normalize`) and contiguous VAE input instead of ours;
- a lone session (batch 1, its restart once per window too), the reference a batch is compared with.

    python benchmarks/batching_gains.py                 # print
    python benchmarks/batching_gains.py --write-docs    # also write docs/benchmarks.md "Batching gains (model only)"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving_common import machine_line, normalised_observation, write_section

from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.types import ModelBatch

SESSIONS = 8
POSITIONS = 4  # distinct frame positions among the sessions (DROID's window holds 4 chunks)


def _batch(ids: list[str], t: int, seed: int) -> ModelBatch:
    o = normalised_observation(t, seed=seed)
    n = len(ids)
    return ModelBatch(
        images=np.repeat(o["images"], n, 0), state=np.repeat(o["state"], n, 0),
        state_mask=np.repeat(o["state_mask"], n, 0), prompts=["pick up the cup"] * n, session_ids=ids,
    )  # fmt: skip


class Variant:
    """A pipeline whose sessions are staggered over POSITIONS frame positions, timed chunk by chunk."""

    def __init__(self, name: str, pipeline: DreamZeroPipeline, rows: int, grouped: bool = False):
        self.name, self.pipeline, self.grouped = name, pipeline, grouped
        self.ids = [f"{name}-{i}" for i in range(rows)]
        self.step = 0
        for k, sid in enumerate(self.ids):  # session k starts k % POSITIONS chunks late
            for j in range(1 + (POSITIONS - 1 - k % POSITIONS)):
                self.pipeline.generate(_batch([sid], 1 if j == 0 else 4, seed=j))

    def cycle_ms_per_row(self) -> float:
        """ms per row and chunk over POSITIONS consecutive calls: one full window, so every session restarts once
        (staggered sessions restart in different calls, as in a fleet: window-full restarts are part of the cost)."""
        t0 = time.perf_counter()
        for _ in range(POSITIONS):
            self.step += 1
            batch = _batch(self.ids, 4, seed=100 + self.step)
            if self.grouped:
                groups: dict[int, list[int]] = {}
                for i, sid in enumerate(self.ids):
                    state, _ = self.pipeline.store.lookup(sid)
                    groups.setdefault(state.current_start_frame if state else -1, []).append(i)
                for idx in groups.values():
                    self.pipeline.generate(_rows(batch, idx))
            else:
                self.pipeline.generate(batch)
        return (time.perf_counter() - t0) * 1e3 / (POSITIONS * len(self.ids))


def _rows(batch: ModelBatch, idx: list[int]) -> ModelBatch:
    return ModelBatch(
        images=batch.images[idx], state=batch.state[idx], state_mask=batch.state_mask[idx],
        prompts=[batch.prompts[i] for i in idx], session_ids=[batch.session_ids[i] for i in idx],
    )  # fmt: skip


def stock_vae_norms(pipeline: DreamZeroPipeline) -> None:
    """Back to diffusers' WanRMS_norm forward (F.normalize); the VAE input stays as diffusers takes it."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    for m in pipeline.model.vae.modules():
        if isinstance(m, WanRMS_norm):
            m.__class__ = WanRMS_norm
    vae = pipeline.model.vae

    def contiguous_encode(video: torch.Tensor) -> torch.Tensor:
        weight = vae.autoencoder.encoder.conv_in.weight
        mu = vae.autoencoder.encode(video.to(weight.device, weight.dtype).contiguous()).latent_dist.mode()
        mean, inv_std = vae._stats(mu)
        return (mu - mean) * inv_std

    vae.encode = contiguous_encode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed window cycles (4 chunks each) per variant")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a CPU policy replica: 1, or 2 at 8 rows)")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the section into this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    def load() -> DreamZeroPipeline:
        return DreamZeroPipeline.load(None, device="cpu", max_sessions=4 * SESSIONS)

    unfolded = load()
    unfolded.dit.fold_text_padding = False
    stock = load()
    stock_vae_norms(stock)
    variants = [
        Variant("everything on", load(), SESSIONS),
        Variant("grouped by frame position", load(), SESSIONS, grouped=True),
        Variant("T5 padding not folded", unfolded, SESSIONS),
        Variant("stock VAE norms and layout", stock, SESSIONS),
        Variant("one session alone", load(), 1),
    ]
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:  # round robin: a busy machine slows every variant alike
            times[v.name].append(v.cycle_ms_per_row())
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["everything on"]
    lines = [
        f"Tiny embedded model, {SESSIONS} sessions at {POSITIONS} different frame positions (each call holds the "
        f"window-full restarts of two), ms per row and chunk over a full {POSITIONS}-chunk window, median of "
        f"{args.repeats} windows per variant, variants interleaved; {machine_line()}.",
        "",
        "| variant | ms per row | vs everything on |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {ms:.1f} | {ms / base:.2f}x |" for name, ms in med.items()]
    lines += [
        "",
        "`one session alone` is a batch of 1: its ratio is what batching 8 staggered sessions gains per row in the "
        "model.",
        "",
        f"Reproduce: `python benchmarks/batching_gains.py --threads {args.threads} --write-docs`.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        body = "Written by `benchmarks/batching_gains.py`.\n\n" + text
        write_section(Path(args.write_docs), "Batching gains (model only)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
