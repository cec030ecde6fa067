"""`--predicted-video`: each chunk's predicted frames ("imagined") next to the camera frames that followed ("real").

A chunk queried at step s predicts the model-input canvas of the next block: the frames the client would send at
step s + 24 (`OxeDroid.frame_offsets` after it: steps s+1, s+8, s+16, s+24), each frame twice, as the model reads every
new frame twice. So predicted frames 2i and 2i+1 are compared with the real canvas at step s + 24 + frame_offsets[i],
built from the cameras by the same embodiment transforms the server runs and resized to the prediction's size.
Steps past the episode's end have no real frame; those chunk frames are left out of the error (and black in the
video). Per chunk: PSNR (dB, peak 255) and the mean absolute error in grey levels, over the frames that have a real
counterpart. The episode's video is imagined | real side by side, chunk after chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dreamzero.embodiments.oxe_droid import OxeDroid
from dreamzero.video_recorder import resize_frames as resize_nearest
from dreamzero_droid import droid

BLOCK_STEPS = -OxeDroid.frame_offsets[0] + 1  # 24: the steps one block of frames spans


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


@dataclass
class _Chunk:
    step: int
    video: np.ndarray  # uint8 [T, H, W, 3]


def droid_canvas(embodiment):
    """frames -> the DROID canvas [T, H, W, 3] the server stitches from them."""

    def canvas(frames: list) -> np.ndarray:
        batch, _ = embodiment.preprocess(droid.raw_observation(frames))
        return np.asarray(batch.images)[0]

    return canvas


@dataclass
class ImaginedTrack:
    """Collects one episode's predicted chunks and the camera frames they will be compared with.

    `canvas(frames) -> [T, H, W, 3]`: the model-input canvas of a list of kept frames; `keep(obs)`: what to keep of
    an observation; `offsets`: the frame offsets of a query's block, `block_steps` the steps one block spans
    (DROID's by default: the embodiment's transforms after `droid.make_frame`).
    """

    embodiment: object = None  # with the DROID defaults: the oxe_droid Embodiment
    canvas: object = None
    keep: object = droid.make_frame
    offsets: tuple[int, ...] = OxeDroid.frame_offsets
    block_steps: int = BLOCK_STEPS
    chunks: list[_Chunk] = field(default_factory=list)
    frames: dict[int, object] = field(default_factory=dict)  # step -> the camera frames kept for comparison
    _wanted: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.canvas is None:
            self.canvas = droid_canvas(self.embodiment)

    def predicted(self, step: int, video: np.ndarray | None) -> None:
        """The reply to the query made at `step` (its observation being the frame after step-1's action)."""
        if video is None:
            return
        self.chunks.append(_Chunk(step, np.asarray(video, dtype=np.uint8)))
        self._wanted |= {step + self.block_steps + off for off in self.offsets}

    def observed(self, step: int, obs: dict) -> None:
        """The observation at `step` (before the action of that step); kept only when a chunk will need it."""
        if step in self._wanted:
            self.frames[step] = self.keep(obs)

    def _real(self, chunk: _Chunk) -> list[np.ndarray | None]:
        """Per predicted frame: the real canvas it is compared with (None past the episode's end)."""
        t, h, w, _ = chunk.video.shape
        steps = [chunk.step + self.block_steps + off for off in self.offsets]
        have = [self.frames.get(s) for s in steps]
        out: list[np.ndarray | None] = [None] * t
        present = [f for f in have if f is not None]
        if not present:
            return out
        filled = [f if f is not None else present[-1] for f in have]  # only to build the canvas; masked below
        canvas = resize_nearest(self.canvas(filled), (h, w))  # [4, h, w, 3]
        per_frame = t // len(steps)  # 2: every new frame is read twice
        for i, f in enumerate(have):
            if f is not None:
                for k in range(per_frame):
                    out[i * per_frame + k] = canvas[i]
        return out

    def finish(self, out_dir: Path, name: str, fps: int = 5) -> dict | None:
        """Write `<out_dir>/imagined/<name>.mp4` (imagined | real) and return the per-chunk errors."""
        if not self.chunks:
            return None
        from dreamzero.video_recorder import write_mp4

        rows, per_chunk = [], []
        for chunk in self.chunks:
            real = self._real(chunk)
            pairs = [(p, r) for p, r in zip(chunk.video, real) if r is not None]
            per_chunk.append(
                {
                    "step": chunk.step,
                    "frames_compared": len(pairs),
                    "psnr_db": None
                    if not pairs
                    else psnr(np.stack([p for p, _ in pairs]), np.stack([r for _, r in pairs])),
                    "mae": None
                    if not pairs
                    else float(np.mean([np.abs(p.astype(np.int16) - r.astype(np.int16)).mean() for p, r in pairs])),
                }
            )
            right = np.stack([r if r is not None else np.zeros_like(p) for p, r in zip(chunk.video, real)])
            rows.append(np.concatenate([chunk.video, right], axis=2))
        path = Path(out_dir) / "imagined" / f"{name}.mp4"
        write_mp4(path, np.concatenate(rows), fps)
        scored = [c for c in per_chunk if c["psnr_db"] is not None and np.isfinite(c["psnr_db"])]
        return {
            "video": str(path.relative_to(out_dir)),
            "frame_hw": list(self.chunks[0].video.shape[1:3]),
            "chunks": per_chunk,
            "mean_psnr_db": float(np.mean([c["psnr_db"] for c in scored])) if scored else None,
            "mean_mae": float(np.mean([c["mae"] for c in scored])) if scored else None,
        }
