"""Feature statistics as LeRobot stores them (meta/stats.json and the episode table's `stats/<feature>/<name>`):
min, max, mean, std, q01, q99 per dimension and the frame count; images per channel in [0, 1], shaped [3, 1, 1]."""

from __future__ import annotations

import numpy as np


def vector_stats(x: np.ndarray) -> dict[str, list]:
    """Stats of the rows of `x` [N, D]."""
    x = np.asarray(x, np.float64)
    return {
        "min": x.min(0).tolist(), "max": x.max(0).tolist(), "mean": x.mean(0).tolist(), "std": x.std(0).tolist(),
        "count": [int(len(x))], "q01": np.quantile(x, 0.01, axis=0).tolist(),
        "q99": np.quantile(x, 0.99, axis=0).tolist(),
    }  # fmt: skip


def image_stats(frames: list[np.ndarray], count: int) -> dict[str, list]:
    """Per-channel stats of uint8 [H, W, 3] frames (a sample of an episode's `count` frames)."""
    px = np.stack(frames).reshape(-1, 3).astype(np.float64) / 255.0
    stats = vector_stats(px)
    return {**{k: [[[v]] for v in vals] for k, vals in stats.items() if k != "count"}, "count": [int(count)]}


def merge_stats(parts: list[dict[str, list]]) -> dict[str, list]:
    """Dataset stats from per-episode ones: exact min / max / mean / std, quantiles as count-weighted means."""
    counts = np.asarray([p["count"][0] for p in parts], np.float64)[:, None]
    shape = np.asarray(parts[0]["mean"]).shape
    stack = {k: np.asarray([p[k] for p in parts], np.float64).reshape(len(parts), -1) for k in parts[0] if k != "count"}
    mean = (stack["mean"] * counts).sum(0) / counts.sum()
    var = ((stack["std"] ** 2 + (stack["mean"] - mean) ** 2) * counts).sum(0) / counts.sum()
    out = {
        "min": stack["min"].min(0), "max": stack["max"].max(0), "mean": mean, "std": np.sqrt(var),
        "q01": (stack["q01"] * counts).sum(0) / counts.sum(), "q99": (stack["q99"] * counts).sum(0) / counts.sum(),
    }  # fmt: skip
    return {**{k: v.reshape(shape).tolist() for k, v in out.items()}, "count": [int(counts.sum())]}
