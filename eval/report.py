"""The page a person opens first: `report.html` with PNG plots (matplotlib, Agg) and the episode videos.

Built only from files the runner wrote (`summary.json`, `episodes/*.json`), so it can be rebuilt for an old run.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt
import numpy as np


def _plot_success(summary: dict, path: Path) -> None:
    scenes = list(summary["per_scene"].items())
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = np.arange(len(scenes))
    rates = [s["success_rate"] for _, s in scenes]
    # clamped: at 0/N or N/N the rounded Wilson bound can sit a hair inside the rate
    lo = [max(0.0, s["success_rate"] - s["ci95"][0]) for _, s in scenes]
    hi = [max(0.0, s["ci95"][1] - s["success_rate"]) for _, s in scenes]
    ax.bar(xs, rates, yerr=[lo, hi], capsize=6, color="#4c72b0")
    ax.set_xticks(xs, [f"scene {k}\n({s['successes']}/{s['episodes']})" for k, s in scenes])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success rate (95% Wilson CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_per_instruction(summary: dict, path: Path) -> None:
    """The two-object scene: success per instruction (Wilson 95%) beside its wrong-object and wrong-target rates."""
    rows = list(summary["per_instruction"].items())
    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs = np.arange(len(rows))
    rates = [s["success_rate"] for _, s in rows]
    lo = [max(0.0, s["success_rate"] - s["ci95"][0]) for _, s in rows]
    hi = [max(0.0, s["ci95"][1] - s["success_rate"]) for _, s in rows]
    ax.bar(xs - 0.25, rates, 0.25, yerr=[lo, hi], capsize=4, color="#4c72b0", label="success")
    ax.bar(xs, [s["wrong_object"] / s["episodes"] for _, s in rows], 0.25, color="#c44e52", label="wrong object")
    ax.bar(xs + 0.25, [s["wrong_target"] / s["episodes"] for _, s in rows], 0.25, color="#dd8452", label="wrong target")
    ax.set_xticks(
        xs, [f"{k.removeprefix('put the ')}\n({s['successes']}/{s['episodes']})" for k, s in rows], fontsize=8
    )
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("rate (success: 95% Wilson CI)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _per_instruction_html(summary: dict, plots: Path, esc) -> str:
    if not summary.get("per_instruction"):
        return ""
    _plot_per_instruction(summary, plots / "success_per_instruction.png")
    rows = "".join(
        f"<tr><td>{esc(k)}</td><td>{s['successes']}/{s['episodes']} ({s['success_rate']:.0%})</td>"
        f"<td>{s['ci95'][0]:.2f} - {s['ci95'][1]:.2f}</td><td>{s['wrong_object']}</td><td>{s['wrong_target']}</td>"
        f"<td>{s['failed']}</td></tr>"
        for k, s in summary["per_instruction"].items()
    )
    either = summary["wrong_object_or_target"]
    return (
        "<h2>Per instruction</h2><table><tr><th>instruction</th><th>success</th><th>95% CI</th><th>wrong object</th>"
        f"<th>wrong target</th><th>failed</th></tr>{rows}</table>"
        f"<p>Wrong object or wrong target: {either['count']}/{either['episodes']} "
        f"({either['rate']:.0%}, 95% CI {either['ci95'][0]:.2f} - {either['ci95'][1]:.2f}).</p>"
        '<img src="plots/success_per_instruction.png">'
    )


def _plot_latency(latencies_ms: list[float], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    if latencies_ms:
        ax.hist(latencies_ms, bins=min(30, max(5, len(latencies_ms) // 2)), color="#55a868")
        for q, style in ((50, "-"), (90, "--"), (99, ":")):
            v = float(np.percentile(latencies_ms, q))
            ax.axvline(v, color="k", linestyle=style, label=f"p{q} {v:.0f} ms")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no server calls", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("latency per chunk call (ms)")
    ax.set_ylabel("calls")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_joints(steps: list[dict], title: str, path: Path) -> None:
    fig, (ax_j, ax_g) = plt.subplots(2, 1, figsize=(7, 4.2), sharex=True, height_ratios=[3, 1])
    if steps:
        t = [s["step"] for s in steps]
        joints = np.array([s["joint_position"] for s in steps])
        # joint-target actions (DROID) are drawn over the joints; other action spaces (LIBERO's eef deltas) are not
        targets = np.array([s["action"][:-1] for s in steps])
        for j in range(joints.shape[1]):
            (line,) = ax_j.plot(t, joints[:, j], label=f"q{j + 1}")
            if targets.shape[1] == joints.shape[1]:
                ax_j.plot(t, targets[:, j], color=line.get_color(), linestyle=":", linewidth=0.8)
        ax_g.plot(t, [s["gripper_position"][0] for s in steps], label="gripper state")
        ax_g.plot(t, [s["action"][-1] for s in steps], linestyle=":", label="command")
        queried = [s["step"] for s in steps if s["queried"]]
        for ax in (ax_j, ax_g):
            for q in queried:
                ax.axvline(q, color="0.85", linewidth=0.6, zorder=0)
        ax_j.legend(ncol=7, fontsize=7, loc="upper center")
        ax_g.legend(fontsize=7)
    ax_j.set_title(f"{title}: joints (solid) vs targets (dotted); grey lines = server calls", fontsize=9)
    ax_j.set_ylabel("rad")
    ax_g.set_ylabel("gripper")
    ax_g.set_xlabel("control step (15 Hz)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_imagined(imagined: dict, title: str, path: Path) -> None:
    """Per-chunk error of the predicted frames against the real ones that followed: PSNR (dB) and mean abs error."""
    chunks = [c for c in imagined["chunks"] if c["psnr_db"] is not None]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    if chunks:
        steps = [c["step"] for c in chunks]
        ax.plot(steps, [min(c["psnr_db"], 60.0) for c in chunks], "o-", color="#4c72b0", label="PSNR (dB)")
        ax.set_ylabel("PSNR (dB)", color="#4c72b0")
        twin = ax.twinx()
        twin.plot(steps, [c["mae"] for c in chunks], "s--", color="#c44e52", label="mean abs error")
        twin.set_ylabel("mean abs error (0-255)", color="#c44e52")
    else:
        ax.text(0.5, 0.5, "no chunk had real frames after it", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("control step of the query")
    ax.set_title(f"{title}: imagined vs real, per chunk", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _imagined_html(ep: dict, plots: Path, esc) -> str:
    imagined = ep.get("imagined")
    if not imagined:
        return ""
    plot = plots / f"imagined_{ep['name']}.png"
    _plot_imagined(imagined, ep["name"], plot)
    src = esc(imagined["video"])
    h, w = imagined["frame_hw"]
    mean = imagined["mean_psnr_db"]
    line = (
        "no chunk had real frames after it"
        if mean is None
        else (
            f"mean PSNR {mean:.1f} dB, mean abs error {imagined['mean_mae']:.1f} over {len(imagined['chunks'])} chunks"
        )
    )
    return (
        f"<p><b>Imagined vs real</b> (left: the model's predicted frames of each chunk; right: the camera canvas "
        f"that followed, {h}x{w}): {esc(line)}</p>"
        f'<video src="{src}" controls muted loop width="{min(960, 4 * 2 * w)}"></video><br><a href="{src}">mp4</a><br>'
        f'<img src="plots/{plot.name}">'
    )


def write_report(run_dir: Path) -> Path:
    """Write `<run_dir>/report.html` (+ `<run_dir>/plots/*.png`) and return its path."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    records = summary["episode_records"]
    episodes = [json.loads((run_dir / ep["record"]).read_text()) for ep in records]
    _plot_success(summary, plots / "success_per_scene.png")
    _plot_latency([ms for ep in episodes for ms in ep["latencies_ms"]], plots / "latency_hist.png")

    esc = html.escape
    lat = summary["latency_ms"]
    lat_line = (
        f"p50 {lat['p50']:.1f} ms, p90 {lat['p90']:.1f} ms, p99 {lat['p99']:.1f} ms over {lat['count']} calls"
        if lat["count"]
        else "no server calls"
    )
    rows = "".join(
        f"<tr><td>{k}</td><td>{esc(str(s['instruction']))}</td><td>{s['successes']}/{s['episodes']} "
        f"({s['success_rate']:.0%})</td><td>{s['ci95'][0]:.2f} - {s['ci95'][1]:.2f}</td><td>{s['failed']}</td></tr>"
        for k, s in summary["per_scene"].items()
    )
    failures = "".join(
        f"<li>scene {f['scene_id']} episode {f['episode']}: <b>{esc(f['reason'])}</b> at step {f['step']}: "
        f"{esc(f['message'])}</li>"
        for f in summary["failures"]
    )
    sections = []
    for ep, index in zip(episodes, records):
        plot = plots / f"joints_{ep['name']}.png"
        _plot_joints(ep["steps"], ep["name"], plot)
        verdict = "success" if ep["success"] else ("FAILED: " + ep["failure"]["reason"] if ep["failure"] else "fail")
        src = esc(ep["video"]) if ep.get("video") else None
        video = f'<video src="{src}" controls muted width="960"></video><br><a href="{src}">mp4</a>' if src else ""
        sections.append(
            f"<h3>{esc(ep['name'])}: {esc(verdict)}</h3><p>{ep['num_steps']} steps, {ep['server_calls']} server calls, "
            f'session <code>{esc(ep["session_id"])}</code>, <a href="{esc(index["record"])}">step record (JSON)</a></p>'
            f'{video}<br><img src="plots/{plot.name}">{_imagined_html(ep, plots, esc)}'
        )
    simulator = str(summary["config"].get("extra", {}).get("simulator", "?"))
    benchmark = esc(str(summary["config"].get("extra", {}).get("benchmark", "DROID")))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{benchmark} evaluation</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}</style></head><body>
<h1>{benchmark} evaluation: {summary["successes"]}/{summary["episodes"]} successful</h1>
<p>Policy link: <b>{esc(str(summary.get("policy_link")))}</b>; simulator: {esc(simulator)};
open-loop horizon {summary["config"]["open_loop_horizon"]}; {summary["steps"]} steps; {summary["server_calls"]} server
calls; latency {lat_line}. Failed episodes: {summary["failed_episodes"]}.</p>
<table><tr><th>scene</th><th>instruction</th><th>success</th><th>95% CI</th><th>failed</th></tr>{rows}</table>
<img src="plots/success_per_scene.png"> <img src="plots/latency_hist.png">
{_per_instruction_html(summary, plots, esc)}
<h2>Failures</h2><ul>{failures or "<li>none</li>"}</ul>
<h2>Episodes</h2>{"".join(sections)}
<p><a href="summary.json">summary.json</a></p>
</body></html>
"""
    path = run_dir / "report.html"
    path.write_text(page)
    return path
