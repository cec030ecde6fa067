"""Success rule, Wilson interval, latency percentiles and the run summary."""

import json
import os
import re
from pathlib import Path

import pytest

from eval.success import placed_in
from eval.summary import (
    REPO_ROOT,
    config_record,
    latency_stats,
    repo_relative,
    summarize,
    summary_markdown,
    wilson_interval,
)


@pytest.mark.parametrize(
    "obj,target,expected",
    [
        ((0.5, 0.0, 0.03), (0.5, 0.0, 0.0), True),
        ((0.619, 0.0, 0.0), (0.5, 0.0, 0.0), True),  # 11.9 cm away in the plane
        ((0.621, 0.0, 0.0), (0.5, 0.0, 0.0), False),
        ((0.5, 0.09, 0.0), (0.5, 0.0, 0.0), True),
        ((0.58, 0.09, 0.0), (0.5, 0.0, 0.0), False),  # 12.04 cm: the rule is on the xy distance, not per axis
        ((0.5, 0.0, -0.079), (0.5, 0.0, 0.0), True),
        ((0.5, 0.0, -0.081), (0.5, 0.0, 0.0), False),
    ],
)
def test_placed_in(obj, target, expected):
    assert placed_in(obj, target) is expected


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson_interval(0, 1) == (0.0, pytest.approx(0.7935, abs=1e-4))
    lo, hi = wilson_interval(20, 20)
    assert hi == 1.0 and lo == pytest.approx(0.8389, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_latency_percentiles():
    stats = latency_stats([float(v) for v in range(1, 101)])
    assert stats["count"] == 100 and stats["p50"] == pytest.approx(50.5) and stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01) and stats["max"] == 100.0
    assert latency_stats([])["p50"] is None


def _episode(scene, ep, success, failure=None, lat=(100.0,)):
    return {
        "scene_id": scene,
        "episode": ep,
        "instruction": f"task {scene}",
        "success": success,
        "failure": failure,
        "server_calls": len(lat),
        "latencies_ms": list(lat),
        "num_steps": 16,
        "session_id": f"s{scene}{ep}",
    }


def test_summary_counts_failed_episodes_as_unsuccessful():
    eps = [
        _episode(1, 0, True),
        _episode(1, 1, False),
        _episode(2, 0, False, {"reason": "server_unreachable", "message": "refused", "step": 3}, lat=()),
        _episode(2, 1, True, lat=(50.0, 150.0)),
    ]
    s = summarize(eps)
    assert (s["episodes"], s["successes"], s["server_calls"]) == (4, 2, 4)
    assert s["per_scene"][1]["success_rate"] == 0.5 and s["per_scene"][2]["failed"] == 1
    assert s["failure_reasons"] == {"server_unreachable": 1}
    assert s["failures"][0]["scene_id"] == 2 and s["failures"][0]["step"] == 3
    assert s["latency_ms"]["p50"] == 100.0
    md = summary_markdown(s)
    assert "server_unreachable at step 3" in md and "| 1 | task 1 | 1/2 (50%)" in md


def _absolute_paths(value) -> list[str]:
    """Every string in a JSON value that is an absolute path (POSIX, or a Windows drive / UNC path)."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _absolute_paths(v)]
    if isinstance(value, str) and (os.path.isabs(value) or value[1:3] in (":\\", ":/") or value.startswith("\\\\")):
        return [value]
    return []


def test_summary_config_records_no_absolute_path(monkeypatch):
    from eval.libero.runner import LiberoEvalConfig
    from eval.runner import EvalConfig

    outside = REPO_ROOT.parent / f"{REPO_ROOT.name}-runs" / "eval"  # as /srv/runs/... next to a /srv/dreamzero checkout
    assert repo_relative(REPO_ROOT / "runs" / "x" / "eval") == "runs/x/eval"
    assert repo_relative(outside) is None  # outside the repository: dropped
    monkeypatch.chdir(REPO_ROOT)
    assert repo_relative("runs/x/eval") == "runs/x/eval" and repo_relative(Path("runs")) == "runs"
    for config in (EvalConfig(out_dir=outside), LiberoEvalConfig(out_dir=outside)):
        record = config_record(config)
        assert record["out_dir"] is None and record["seed"] == 0
        assert _absolute_paths(json.loads(json.dumps(record))) == []
    assert config_record(EvalConfig(out_dir=str(REPO_ROOT / "runs" / "e")))["out_dir"] == "runs/e"
    assert _absolute_paths({"a": ["/srv/x"], "b": "C:\\runs"}) == ["/srv/x", "C:\\runs"]


@pytest.mark.parametrize(
    "path", sorted((REPO_ROOT / "docs" / "eval").glob("*/summary.json")), ids=lambda p: p.parent.name
)
def test_committed_summaries_hold_no_absolute_path(path):
    summary = json.loads(path.read_text())
    assert _absolute_paths(summary) == []
    for ep in summary["episode_records"]:  # the report's links are relative to the run folder
        assert ep["video"] is None or not Path(ep["video"]).is_absolute()


#: a POSIX absolute path of at least two parts (`/srv/runs/eval`, `/data/x/y`), not a URL's path or a closing tag
_ABSOLUTE_IN_TEXT = re.compile(r"(?<![\w.:/~<])/(?:[\w.-]+/)+[\w.-]*")


def test_no_committed_eval_file_holds_a_path_of_the_machine_that_wrote_it():
    """Every text file under docs/eval (summaries, episode records, reports) as the repository holds it."""
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", "docs/eval"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    texts = [REPO_ROOT / p for p in listed if Path(p).suffix in {".json", ".jsonl", ".md", ".html", ".txt", ".csv"}]
    assert any(p.name == "summary.json" for p in texts)
    found = {str(p.relative_to(REPO_ROOT)): _ABSOLUTE_IN_TEXT.findall(p.read_text()) for p in texts}
    assert {k: v for k, v in found.items() if v} == {}
    assert _ABSOLUTE_IN_TEXT.findall('"out_dir": "/srv/runs/x", <a href="videos/a.mp4"></a>') == ["/srv/runs/x"]
