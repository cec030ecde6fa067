"""Server-side recording of each session's predicted video (`video.save_dir` in serve_config.yaml).

One MP4 per session segment, under `<save_dir>/<session>/`: the predicted frames of every chunk and, with
`with_input`, the model-input canvas beside them, time-aligned: the frames the robot's camera really showed after
a chunk arrive with the session's next call, so a chunk's prediction is written next to the next call's input
(each input frame twice: the model reads every new frame twice). A segment is written when its session restarts
(reset, new prompt, window full, ...), when it ends (`end`: a WebSocket closed, a session dropped), every
`every_n_chunks` chunks, and for sessions idle past `idle_s`. Writing runs on a thread of its own, so a model call
never waits for the encoder; the files under `save_dir` are kept under `max_bytes`, the oldest deleted first.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(session_id: str) -> str:
    """A session id as one path component (ids are client strings: never a path of theirs)."""
    name = _UNSAFE.sub("_", session_id).strip("._") or "session"
    return name[:96]


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    """uint8 [T, H, W, 3] -> an H.264 MP4 (the ffmpeg bundled with imageio-ffmpeg; even sizes are padded)."""
    import imageio_ffmpeg

    t, h, w, _ = frames.shape
    pad_h, pad_w = h % 2, w % 2  # yuv420p needs even sides
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.mp4")
    writer = imageio_ffmpeg.write_frames(
        str(tmp), (w + pad_w, h + pad_h), fps=fps, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=1,
        output_params=["-loglevel", "error"],
    )  # fmt: skip
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()
    tmp.replace(path)  # a reader never sees half a file


def read_mp4(path: Path) -> np.ndarray:
    """An MP4 -> uint8 [T, H, W, 3] (tests and tools read recordings back with it)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    frames = [np.frombuffer(b, np.uint8).reshape(h, w, 3) for b in reader]
    return np.stack(frames) if frames else np.zeros((0, h, w, 3), np.uint8)


def resize_frames(frames: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """[T, H, W, 3] -> [T, h, w, 3] by block averaging when the sizes divide, else by nearest pixel."""
    t, h, w, _ = frames.shape
    if (h, w) == tuple(hw):
        return frames
    if h % hw[0] == 0 and w % hw[1] == 0:
        fh, fw = h // hw[0], w // hw[1]
        return frames.reshape(t, hw[0], fh, hw[1], fw, 3).mean((2, 4)).round().astype(np.uint8)
    rows = np.arange(hw[0]) * h // hw[0]
    cols = np.arange(hw[1]) * w // hw[1]
    return frames[:, rows][:, :, cols]


def side_by_side(predicted: np.ndarray, real: np.ndarray | None) -> np.ndarray:
    """[T, H, W, 3] predicted | real (resized to H x W by nearest pixel; black where nothing followed)."""
    t, h, w, _ = predicted.shape
    if real is None or len(real) == 0:
        right = np.zeros_like(predicted)
    else:
        rows = np.arange(h) * real.shape[1] // h
        cols = np.arange(w) * real.shape[2] // w
        real = real[:, rows][:, :, cols]
        idx = np.minimum(np.arange(t) * len(real) // t, len(real) - 1)  # each real frame spans T / len(real)
        right = real[idx]
    return np.concatenate([predicted, right], axis=2)


@dataclass
class _Track:
    incarnation: str | None
    frames: list[np.ndarray] = field(default_factory=list)  # chunks written so far, [T, H, W(*2), 3] each
    pending: np.ndarray | None = None  # with_input: the last prediction, waiting for the real frames after it
    chunks: int = 0
    part: int = 0
    last: float = 0.0


class VideoRecorder:
    """Collects each session's predicted frames chunk by chunk and writes them as MP4 segments (module docstring)."""

    def __init__(
        self,
        save_dir: str | Path,
        every_n_chunks: int = 10,
        max_bytes: int = 1 << 30,
        with_input: bool = False,
        fps: int = 15,
        idle_s: float = 300.0,
        clock=time.monotonic,
    ):
        self.root = Path(save_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.every_n, self.max_bytes, self.with_input, self.fps, self.idle_s = (
            every_n_chunks, max_bytes, with_input, fps, idle_s,
        )  # fmt: skip
        self.clock = clock
        self._tracks: dict[str, _Track] = {}
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dreamzero-video")
        self._futures: list[Future] = []
        self.written: list[Path] = []

    # -- what the policy replica calls ---------------------------------------------------------------------------
    def add(self, session_id: str, incarnation: str | None, predicted: np.ndarray, observed: np.ndarray) -> None:
        """One chunk of a session: its predicted frames [T, H, W, 3] and the model-input frames of this call
        [t, H', W', 3]; a new incarnation (the session restarted) first writes the segment before it."""
        with self._lock:
            track = self._tracks.get(session_id)
            if track is not None and track.incarnation != incarnation:
                self._flush(session_id, track)
                track = None
            if track is None:
                track = self._tracks[session_id] = _Track(incarnation)
            if self.with_input:
                if track.pending is not None:
                    track.frames.append(side_by_side(track.pending, observed))
                track.pending = predicted
            else:
                track.frames.append(predicted)
            track.chunks += 1
            track.last = self.clock()
            if track.chunks % self.every_n == 0:
                self._flush(session_id, track, keep=True)
            self._flush_idle()

    def end(self, session_ids) -> None:
        """Sessions that ended (dropped, connection closed): write what they hold and forget them."""
        with self._lock:
            for sid in session_ids:
                track = self._tracks.pop(sid, None)
                if track is not None:
                    self._flush(sid, track)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write every session's segment and wait (bounded) for the writer."""
        self.end(list(self._tracks))
        self.wait(timeout_s)
        self._writer.shutdown(wait=False)

    def wait(self, timeout_s: float = 60.0) -> None:
        """Wait until the segments queued so far are on disk (at most `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        for fut in list(self._futures):
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        self._futures = [f for f in self._futures if not f.done()]

    # -- internals -------------------------------------------------------------------------------------------------
    def _flush(self, session_id: str, track: _Track, keep: bool = False) -> None:
        if self.with_input and track.pending is not None and not keep:
            track.frames.append(side_by_side(track.pending, None))  # nothing followed the last prediction
            track.pending = None
        if not track.frames:
            return
        frames = np.concatenate(track.frames)
        track.frames = []
        name = f"{safe_name(session_id)}-{track.incarnation or 'x'}-{track.part:03d}.mp4"
        track.part += 1
        path = self.root / safe_name(session_id) / name
        self._futures.append(self._writer.submit(self._write, path, frames))

    def _flush_idle(self) -> None:
        now = self.clock()
        for sid in [s for s, t in self._tracks.items() if now - t.last > self.idle_s]:
            self._flush(sid, self._tracks.pop(sid))

    def _write(self, path: Path, frames: np.ndarray) -> None:
        try:
            write_mp4(path, frames, self.fps)
            self.written.append(path)
            self._enforce_cap()
        except Exception:  # a recording failure must never fail a request
            log.exception("could not write the predicted video %s", path)

    def _enforce_cap(self) -> None:
        """Delete the oldest recordings until the files under `save_dir` fit `max_bytes`."""
        files = sorted(self.root.rglob("*.mp4"), key=lambda p: (p.stat().st_mtime, p.name))
        files = [p for p in files if not p.name.endswith(".part.mp4")]
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total <= self.max_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            log.info("video.max_bytes: deleted the oldest recording %s", p)
