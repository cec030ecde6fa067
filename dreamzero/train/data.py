"""Training clips from a LeRobot dataset, laid out the way the served model sees a session.

A clip starts at frame t0 and spans `blocks` action chunks of A = action_horizon steps (24 on DROID). As served:
- the session's first query sends one frame (t0): the anchor, prefilled clean at latent frame 0;
- block k holds the actions of steps t0 + A k .. t0 + A k + A - 1, the state at step t0 + A k, and as its video the
  four frames the client sends with the next query, at the embodiment's `frame_offsets` from step e = t0 + A (k + 1)
  (DROID: -23, -16, -8, 0); the pipeline encodes them as [anchor, each frame twice] and keeps the
  last `num_frame_per_block` latents.
Steps past the end of an episode repeat its last frame / action / state (the robot holding still).

Images go through the embodiment exactly as in serving (per-view crop + resize, stitched canvas); state and actions
are normalised with the embodiment's statistics (`Embodiment.preprocess` / `action_codec` inverted), so a checkpoint
trained here is served with the same metadata.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dreamzero.embodiments.base import Embodiment
from dreamzero.errors import ConfigError
from dreamzero.lerobot_dataset import LeRobotDataset, get_preset


def read_video(path: str | Path) -> np.ndarray:
    """All frames of a video file as uint8 [N, H, W, 3] (imageio-ffmpeg's bundled ffmpeg)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    frames = [np.frombuffer(buf, np.uint8).reshape(h, w, 3) for buf in reader]
    return np.stack(frames) if frames else np.zeros((0, h, w, 3), np.uint8)


@dataclass
class EpisodeArrays:
    """One episode in memory: raw state / action per key, camera frames per embodiment video key."""

    state: dict[str, np.ndarray]  # state key -> float64 [N, D]
    action: dict[str, np.ndarray]  # action key -> float64 [N, D]
    views: dict[str, np.ndarray]  # embodiment video key -> uint8 [N, H, W, 3]
    task: str

    def __len__(self) -> int:
        return len(next(iter(self.state.values())))


@dataclass
class Clip:
    """Model-ready arrays of one clip (numpy; the trainer stacks clips into a batch)."""

    anchor: np.ndarray  # uint8 [H, W, 3] stitched canvas of frame t0
    block_frames: np.ndarray  # uint8 [K, 4, H, W, 3] canvases of each block's frames
    state: np.ndarray  # float32 [K, max_state_dim] normalised, zero padded
    actions: np.ndarray  # float32 [K, A, max_action_dim] normalised to [-1, 1], zero padded
    action_mask: np.ndarray  # float32 [max_action_dim] 1 on the robot's action dims
    prompt: str


def episode_video(dataset: LeRobotDataset, episode_index: int, feature: str) -> np.ndarray:
    """Frames of one episode from a v3.0 dataset (video file + time range from the episode table)."""
    import pyarrow.parquet as pq

    rows = []
    for f in sorted((dataset.root / "meta" / "episodes").glob("**/*.parquet")):
        rows += [r for r in pq.read_table(f).to_pylist() if int(r["episode_index"]) == episode_index]
    if not rows:
        raise ConfigError(f"episode {episode_index} is not in {dataset.root}/meta/episodes")
    row = rows[0]
    chunk, file = row.get(f"videos/{feature}/chunk_index"), row.get(f"videos/{feature}/file_index")
    if chunk is None or file is None:
        raise ConfigError(f"{dataset.root}: episode {episode_index} has no video entry for {feature!r}")
    template = dataset.info.get("video_path", "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4")
    path = dataset.root / template.format(video_key=feature, chunk_index=int(chunk), file_index=int(file))
    frames = read_video(path)
    fps = dataset.fps or 15.0
    start = int(round(float(row.get(f"videos/{feature}/from_timestamp", 0.0)) * fps))
    return frames[start : start + int(row["length"])]


def load_episodes(root: str | Path, embodiment: Embodiment, max_episodes: int | None = None) -> list[EpisodeArrays]:
    """Every episode of a LeRobot v3.0 dataset with the embodiment's preset columns (state, action, cameras)."""
    dataset = LeRobotDataset(root)
    if dataset.major != 3:
        raise ConfigError(f"dataset: training reads LeRobot v3.0 datasets, {root} is v{dataset.major}")
    preset = get_preset(embodiment.tag)
    state_slices, action_slices = dataset.resolve_slices(preset)
    video_features = {f"video.{name}": key for name, key in preset.video.items()}
    missing = [k for k in embodiment.video_keys if k not in video_features]
    if missing:
        raise ConfigError(f"dataset preset {preset.tag!r} names no camera for {missing}")
    tasks = dataset.tasks()  # as we write it or as lerobot does (the strings as the pandas index)
    columns = sorted({s.column for s in (*state_slices, *action_slices)} | {"task_index"})
    out = []
    for e in dataset.episode_indices[:max_episodes]:
        cols = dataset.episode_columns(e, columns)
        views = {key: episode_video(dataset, e, video_features[key]) for key in embodiment.video_keys}
        n = len(cols["task_index"])
        short = [k for k, v in views.items() if len(v) < n]
        if short:
            raise ConfigError(f"episode {e}: videos {short} have fewer frames than its {n} rows")
        out.append(
            EpisodeArrays(
                state={f"state.{s.name}": s.take(cols[s.column]) for s in state_slices},
                action={f"action.{s.name}": s.take(cols[s.column]) for s in action_slices},
                views={k: v[:n] for k, v in views.items()},
                task=tasks[int(cols["task_index"][0, 0])],
            )
        )
    return out


def make_clip(episode: EpisodeArrays, t0: int, blocks: int, embodiment: Embodiment) -> Clip:
    """The clip of `blocks` action chunks starting at frame t0 (see the module docstring)."""
    n, horizon = len(episode), embodiment.action_horizon
    if not 0 <= t0 < n:
        raise ConfigError(f"t0: expected 0 <= t0 < {n}, got {t0}")

    def at(i: int) -> int:
        return min(i, n - 1)

    def canvas(steps: list[int]) -> np.ndarray:
        views = {}
        for key in embodiment.video_keys:
            frames = episode.views[key][[at(s) for s in steps]]
            views[key] = embodiment.crop_resize(frames)[None]  # [1, T, h, w, 3]
        return embodiment.stitch(views)[0]  # [T, H, W, 3]

    block_steps = [t0 + horizon * k for k in range(blocks)]
    offsets = embodiment.frame_offsets  # the frames a served query sends
    frames = np.stack([canvas([t0 + horizon * (k + 1) + off for off in offsets]) for k in range(blocks)])
    # state: q99 per key, zero padded to the model width
    raw_state = {key: v[[at(s) for s in block_steps]] for key, v in episode.state.items()}  # [K, D] per key
    norm = np.concatenate([embodiment.state_normalisers[k].normalise(raw_state[k]) for k in embodiment.state_keys], -1)
    state = np.zeros((blocks, embodiment.max_state_dim), np.float32)
    state[:, : norm.shape[1]] = norm
    # actions: robot = gain * model + bias (relative keys carry the block's state in bias); invert, clip to [-1, 1]
    gain, bias = embodiment.action_codec(raw_state)  # [K, max_action_dim]
    robot = np.concatenate([episode.action[k] for k in embodiment.action_keys], -1)  # [N, action_dim]
    steps = np.array([[at(s + j) for j in range(horizon)] for s in block_steps])  # [K, A]
    padded = np.zeros((blocks, horizon, embodiment.max_action_dim))
    padded[..., : robot.shape[1]] = robot[steps]
    safe = np.where(gain > 0, gain, 1.0)[:, None]
    actions = np.where(gain[:, None] > 0, (padded - bias[:, None]) / safe, 0.0)
    mask = np.zeros(embodiment.max_action_dim, np.float32)
    mask[: embodiment.action_dim] = 1.0
    return Clip(
        anchor=canvas([t0])[0],
        block_frames=frames,
        state=state,
        actions=np.clip(actions, -1.0, 1.0).astype(np.float32),
        action_mask=mask,
        prompt=embodiment.format_prompt(episode.task),
    )


class ClipSampler:
    """Random clips (episode uniform, then t0 uniform over the episode's starts) from a seeded numpy generator.

    `start_stride` > 1 starts clips only at frames that are multiples of it: a bounded set of distinct clips, which
    is what lets the trainer encode each clip once and reuse it (`--cache-encodings`). A served session starts at
    frame 0 and restarts every `max_chunk_size` chunks, so multiples of the action horizon are the starts it sees.
    """

    def __init__(
        self, episodes: list[EpisodeArrays], embodiment: Embodiment, blocks: int, seed: int = 0, start_stride: int = 1
    ):
        if not episodes:
            raise ConfigError("dataset: no episodes to train on")
        if blocks < 1:
            raise ConfigError(f"blocks: expected >= 1, got {blocks}")
        if start_stride < 1:
            raise ConfigError(f"start_stride: expected >= 1, got {start_stride}")
        self.episodes, self.embodiment, self.blocks = episodes, embodiment, blocks
        self.start_stride = start_stride
        self.rng = np.random.default_rng(seed)

    def sample_keys(self, batch_size: int) -> list[tuple[int, int]]:
        """(episode index, t0) of `batch_size` random clips."""
        keys = []
        for _ in range(batch_size):
            e = int(self.rng.integers(len(self.episodes)))
            # keep at least one block of real motion after t0
            span = max(1, len(self.episodes[e]) - self.embodiment.action_horizon)
            keys.append((e, self.start_stride * int(self.rng.integers(-(-span // self.start_stride)))))
        return keys

    def clip(self, key: tuple[int, int]) -> Clip:
        episode, t0 = key
        return make_clip(self.episodes[episode], t0, self.blocks, self.embodiment)

    def sample(self, batch_size: int) -> list[Clip]:
        return [self.clip(k) for k in self.sample_keys(batch_size)]
