"""Record what a robot does as a LeRobot v3.0 dataset, episode by episode, off the control loop's thread.

    recorder = DatasetRecorder("demos/", fps=15, robot_type="franka", modality=...)
    recorder.begin_episode("put the cube in the bowl")
    recorder.add_frame({"observation.images.wrist": rgb, ...}, {"observation.state": s, "action": a})  # per step
    recorder.end_episode(success=True)       # or success=False / None, outcome="failure" / "aborted"
    recorder.close()                         # ends an open episode as aborted, waits for the writes

`add_frame` checks and copies the arrays into a queue and returns; a writer thread runs a `DatasetWriter` (the files,
and why a client killed mid-episode still leaves a valid dataset: writer.py). A queue full for `put_timeout_s` (the
disk cannot keep up) raises instead of blocking the loop without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_droid.lerobot.writer import OUTCOMES, DatasetWriter, check_image

log = logging.getLogger(__name__)


class DatasetRecorder:
    """Episodes into a LeRobot v3.0 dataset at `root` from a control loop (see the module docstring): the queue's
    size, how long a put may wait, and `DatasetWriter`'s arguments (robot_type, modality, video)."""

    def __init__(
        self, root: str | Path, fps: float, max_queue: int = 256, put_timeout_s: float = 5.0, **writer_options
    ):
        self._writer = DatasetWriter(root, fps, **writer_options)
        self.root, self.put_timeout_s = self._writer.root, put_timeout_s
        self._open = False
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._error: BaseException | None = None
        self.write_seconds = 0.0  # time the writer thread spent writing (not the loop's)
        self.write_cpu_seconds = 0.0  # CPU time of the writer thread itself (the ffmpeg encoders are processes)
        self.loop_seconds, self.frames_queued = 0.0, 0  # what add_frame cost the calling loop (a copy and a put)
        self._thread = threading.Thread(target=self._run, name="dataset-recorder", daemon=True)
        self._thread.start()

    # -- the control loop's side: quick, no disk ----------------------------------------------------------------------

    def begin_episode(self, task: str) -> None:
        """Start an episode (ending an open one as aborted)."""
        if self._open:
            self.end_episode(success=None, outcome="aborted")
        self._open = True
        self._put(("begin", str(task)))

    def add_frame(self, images: dict[str, np.ndarray], vectors: dict[str, np.ndarray]) -> None:
        if not self._open:
            raise ConfigError("add_frame: no episode is open (call begin_episode first)")
        t0 = time.perf_counter()
        for key, frame in images.items():  # checked here, so the caller gets the error at its own step
            check_image(key, np.shape(frame))
        self._put(("frame", {k: np.array(v, np.uint8) for k, v in images.items()},
                   {k: np.array(v, np.float32).ravel() for k, v in vectors.items()}))  # fmt: skip
        self.loop_seconds += time.perf_counter() - t0
        self.frames_queued += 1

    def end_episode(self, success: bool | None, outcome: str | None = None, note: str | None = None) -> None:
        """Finish the open episode, marked as `DatasetWriter.end_episode` says."""
        if not self._open:
            return
        if outcome is not None and outcome not in OUTCOMES:
            raise ConfigError(f"outcome: expected one of {OUTCOMES}, got {outcome!r}")
        self._open = False
        self._put(("end", success, outcome, note))

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait (bounded) until every queued write is on disk."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self._raise()

    def close(self, timeout_s: float = 120.0) -> None:
        """End an open episode as aborted and wait (bounded) for the writer thread."""
        if self._thread.is_alive():
            if self._open:
                self.end_episode(success=None, outcome="aborted")
            self._queue.put(("close",), timeout=self.put_timeout_s)
            self._thread.join(timeout_s)
        self._raise()

    def __enter__(self) -> DatasetRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def episodes_written(self) -> int:
        return self._writer.episodes_written

    def _put(self, item) -> None:
        self._raise()
        try:
            self._queue.put(item, timeout=self.put_timeout_s)
        except queue.Full:
            raise ConfigError(f"record_dataset: the writer is {self.put_timeout_s} s behind (disk too slow?)") from None

    def _raise(self) -> None:
        if self._error is not None:
            raise ConfigError(f"record_dataset: writing {self.root} failed: {self._error}") from self._error

    # -- the writer thread ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item[0] == "close":
                    self._writer.discard_episode()
                    return
                if self._error is not None:
                    continue  # drop the rest after a failure; the loop sees the error on its next call
                t0, c0 = time.perf_counter(), time.thread_time()
                if item[0] == "begin":
                    self._writer.begin_episode(item[1])
                elif item[0] == "frame":
                    self._writer.add_frame(item[1], item[2])
                elif item[0] == "end":
                    self._writer.end_episode(*item[1:])
                self.write_seconds += time.perf_counter() - t0
                self.write_cpu_seconds += time.thread_time() - c0
            except BaseException as exc:  # kept for the loop's thread, which raises it
                self._error = exc
                self._writer.discard_episode()
                log.exception("dataset recorder: writing %s failed", self.root)
            finally:
                self._queue.task_done()
