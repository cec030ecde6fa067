"""Run summary: success rate per scene with a Wilson 95% interval, server calls, latency percentiles, failures; on
the two-object scene also per instruction, with how often the arm took the wrong object or the wrong target."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

#: the checkout the `eval` package lives in; summary.json records paths relative to it
REPO_ROOT = Path(__file__).resolve().parents[1]


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (sensible at 0/n and n/n, unlike the normal approximation)."""
    if trials <= 0:
        return (0.0, 1.0)
    if not 0 <= successes <= trials:
        raise ValueError(f"successes: expected 0..{trials}, got {successes}")
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def latency_stats(latencies_ms: list[float]) -> dict:
    if not latencies_ms:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    arr = np.asarray(latencies_ms, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(arr.max()),
    }


def repo_relative(path: str | Path) -> str | None:
    """`path` relative to the repository (a relative one is taken from the working directory), or None outside it.

    summary.json files are committed (docs/eval/), so they hold no absolute path of the machine that ran the eval;
    the paths of the run's own files (`video`, `record`) are relative to the output folder.
    """
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return None


def config_record(config) -> dict:
    """An eval config dataclass as summary.json records it: its paths (`out_dir`) made `repo_relative`."""
    return {k: (repo_relative(v) if isinstance(v, Path) or k == "out_dir" else v) for k, v in asdict(config).items()}


def summarize(episodes: list[dict]) -> dict:
    """`episodes`: the runner's episode dicts (scene_id, success, failure, server_calls, latencies_ms, ...).

    A failed episode (the policy link broke) counts as an unsuccessful trial: the success rate is over every episode
    that was attempted, and `failed` says how many of those never finished.
    """
    per_scene: dict[int, dict] = {}
    for scene in sorted({ep["scene_id"] for ep in episodes}):
        eps = [ep for ep in episodes if ep["scene_id"] == scene]
        wins = sum(bool(ep["success"]) for ep in eps)
        lo, hi = wilson_interval(wins, len(eps))
        said = list(dict.fromkeys(ep.get("instruction") for ep in eps))  # scene 4 asks several (per_instruction)
        per_scene[scene] = {
            "instruction": said[0] if len(said) == 1 else f"{len(said)} instructions",
            "episodes": len(eps),
            "successes": wins,
            "success_rate": wins / len(eps),
            "ci95": [lo, hi],
            "failed": sum(ep["failure"] is not None for ep in eps),
        }
    wins = sum(bool(ep["success"]) for ep in episodes)
    latencies = [ms for ep in episodes for ms in ep.get("latencies_ms", [])]
    judged = [ep for ep in episodes if ep.get("outcome")]  # episodes of a scene with two objects and two targets
    failures = [
        {"scene_id": ep["scene_id"], "episode": ep["episode"], "session_id": ep.get("session_id"), **ep["failure"]}
        for ep in episodes
        if ep["failure"] is not None
    ]
    return {
        "episodes": len(episodes),
        "successes": wins,
        "success_rate": wins / len(episodes) if episodes else None,
        "ci95": list(wilson_interval(wins, len(episodes))),
        "per_scene": per_scene,
        "server_calls": sum(ep.get("server_calls", 0) for ep in episodes),
        "latency_ms": latency_stats(latencies),
        "failed_episodes": len(failures),
        "failure_reasons": dict(Counter(f["reason"] for f in failures)),
        "failures": failures,
        "steps": sum(ep.get("num_steps", 0) for ep in episodes),
        # only with the two-object scene, so the summaries of scenes 1-3 keep their keys
        **(per_instruction(judged) if judged else {}),
    }


def _rate(count: int, trials: int) -> dict:
    lo, hi = wilson_interval(count, trials)
    return {"count": count, "episodes": trials, "rate": count / trials, "ci95": [lo, hi]}


def per_instruction(episodes: list[dict]) -> dict:
    """Success per instruction (Wilson 95%) and the wrong-object / wrong-target rates, per instruction and over all
    `episodes` (each with an `outcome`: instruction, wrong_object, wrong_target). Success is the episode's own
    (a policy failure is no success, whatever the objects ended as)."""
    rows: dict[str, dict] = {}
    for instruction in sorted({ep["outcome"]["instruction"] for ep in episodes}):
        eps = [ep for ep in episodes if ep["outcome"]["instruction"] == instruction]
        wins = sum(bool(ep["success"]) for ep in eps)
        rows[instruction] = {
            "scene_id": eps[0]["scene_id"],
            "episodes": len(eps),
            "successes": wins,
            "success_rate": wins / len(eps),
            "ci95": list(wilson_interval(wins, len(eps))),
            "wrong_object": sum(bool(ep["outcome"]["wrong_object"]) for ep in eps),
            "wrong_target": sum(bool(ep["outcome"]["wrong_target"]) for ep in eps),
            "failed": sum(ep["failure"] is not None for ep in eps),
        }
    n = len(episodes)
    return {
        "per_instruction": rows,
        "wrong_object": _rate(sum(r["wrong_object"] for r in rows.values()), n),
        "wrong_target": _rate(sum(r["wrong_target"] for r in rows.values()), n),
        # either mistake in one episode counts once: the "wrong object or wrong target" rate
        "wrong_object_or_target": _rate(
            sum(bool(ep["outcome"]["wrong_object"] or ep["outcome"]["wrong_target"]) for ep in episodes), n
        ),
    }


def summary_markdown(summary: dict) -> str:
    """A short human-readable table of the summary (written next to summary.json)."""
    lines = ["| scene | instruction | success | 95% CI | failed |", "|---|---|---|---|---|"]
    for scene, s in summary["per_scene"].items():
        lines.append(
            f"| {scene} | {s['instruction']} | {s['successes']}/{s['episodes']} ({s['success_rate']:.0%}) "
            f"| {s['ci95'][0]:.2f}-{s['ci95'][1]:.2f} | {s['failed']} |"
        )
    if summary.get("per_instruction"):
        lines += [
            "",
            "| instruction | success | 95% CI | wrong object | wrong target | failed |",
            "|---|---|---|---|---|---|",
        ]
        for instruction, s in summary["per_instruction"].items():
            n = s["episodes"]
            lines.append(
                f"| {instruction} | {s['successes']}/{n} ({s['success_rate']:.0%}) "
                f"| {s['ci95'][0]:.2f}-{s['ci95'][1]:.2f} | {s['wrong_object']}/{n} | {s['wrong_target']}/{n} "
                f"| {s['failed']} |"
            )
        lines.append("")
        lines.append(
            "Wrong object: {}; wrong target: {}; either: {} (95% CI).".format(
                *(_rate_text(summary[k]) for k in ("wrong_object", "wrong_target", "wrong_object_or_target"))
            )
        )
    lat = summary["latency_ms"]
    lines.append("")
    lines.append(f"Server calls: {summary['server_calls']}; steps: {summary['steps']}.")
    if lat["count"]:
        lines.append(
            f"Latency per call (ms): p50 {lat['p50']:.1f}, p90 {lat['p90']:.1f}, p99 {lat['p99']:.1f}, "
            f"mean {lat['mean']:.1f}."
        )
    for f in summary["failures"]:
        lines.append(
            f"- scene {f['scene_id']} episode {f['episode']}: {f['reason']} at step {f['step']}: {f['message']}"
        )
    return "\n".join(lines) + "\n"


def _rate_text(rate: dict) -> str:
    return f"{rate['rate']:.0%} ({rate['ci95'][0]:.2f}-{rate['ci95'][1]:.2f})"
