"""Per-episode records: one JSON line per control step, a summary, and an mp4 of the three views side by side.

Layout: `<log_dir>/episode_<NNNN>/{steps.jsonl, summary.json, video.mp4}`. Video needs the `imageio-ffmpeg`
package (in the `sim` extra); without it the episode is still logged and the summary says why there is no video.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return [round(float(x), 6) for x in value.ravel()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class VideoWriter:
    """Streams RGB frames to an mp4 through imageio-ffmpeg (frames are not kept in memory)."""

    def __init__(self, path: Path, fps: float):
        self.path = path
        self.fps = fps
        self._gen = None
        self._size: tuple[int, int] | None = None
        self.frames = 0

    def write(self, frame: np.ndarray) -> None:
        if self._gen is None:
            import imageio_ffmpeg  # imported here: optional, and only needed when recording

            self._size = (frame.shape[1], frame.shape[0])
            self._gen = imageio_ffmpeg.write_frames(
                str(self.path), self._size, fps=self.fps, macro_block_size=1, quality=6, ffmpeg_log_level="error"
            )
            self._gen.send(None)
        self._gen.send(np.ascontiguousarray(frame))
        self.frames += 1

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
            self._gen = None


class EpisodeLog:
    def __init__(self, root: Path | str, episode_index: int, fps: float, record_video: bool = True):
        self.dir = Path(root) / f"episode_{episode_index:04d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._steps = open(self.dir / "steps.jsonl", "w")  # closed in close()
        self.video: VideoWriter | None = None
        self.video_note = "disabled"
        if record_video:
            try:
                import imageio_ffmpeg  # noqa: F401

                self.video = VideoWriter(self.dir / "video.mp4", fps)
                self.video_note = "video.mp4"
            except ImportError:
                self.video_note = "skipped: install imageio-ffmpeg (pip install 'dreamzero-serve[sim]') for video"
                logger.warning("episode video %s", self.video_note)

    def step(self, record: dict, frames: list[np.ndarray] | None = None) -> None:
        self._steps.write(json.dumps(_jsonable(record)) + "\n")
        if self.video is not None and frames:
            height = min(f.shape[0] for f in frames)
            self.video.write(np.concatenate([f[:height] for f in frames], axis=1))

    def close(self, summary: dict) -> None:
        self._steps.close()
        if self.video is not None:
            self.video.close()
        summary = {**summary, "video": self.video_note}
        (self.dir / "summary.json").write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
