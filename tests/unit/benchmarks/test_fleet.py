"""benchmarks/fleet.py: simulated robots on the client runtime, the pace rule, the sweep, and one in-process run
through the Policy's batcher on the tiny preset (CPU, CI)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fleet  # noqa: E402
import fleet_sim  # noqa: E402

from dreamzero_droid import droid  # noqa: E402
from dreamzero_droid.policy import DroidPolicy, LinkReply  # noqa: E402


class TimedLink:
    """Answers every query after `delay_s` with a chunk of `horizon` rows (what the robot side needs, no model)."""

    name = "timed"

    def __init__(self, delay_s: float, horizon: int = 24):
        self.delay_s, self.horizon, self.sent = delay_s, horizon, []

    def send(self, query):
        self.sent.append(fleet_sim.fleet_fields(query))
        time.sleep(self.delay_s)
        return LinkReply(np.zeros((self.horizon, 8)), {"step": len(self.sent)})

    def reset(self, session_id):
        pass

    def close(self):
        pass


def robot(delay_s: float, pace: fleet_sim.Pace, seconds: float = 1.5) -> tuple[fleet_sim.RobotStats, TimedLink]:
    link = TimedLink(delay_s)
    (stats,) = fleet_sim.run_fleet([DroidPolicy(link, prompt="pick")], pace, seconds)
    return stats, link


def test_a_robot_served_within_its_chunk_keeps_pace_and_says_how_old_each_action_is():
    pace = fleet_sim.Pace(control_hz=30.0, open_loop_horizon=8, schedule="rtc")
    stats, link = robot(0.05, pace)
    assert not stats.errors and stats.stalls == 0 and stats.chunks >= 3, stats
    assert stats.at_pace() and stats.p99_ms() < min(stats.budgets_ms)
    assert len(stats.ages_ms) == stats.ticks and min(stats.ages_ms) >= 0  # every tick executed one action
    assert stats.skipped > 0  # the rows of the ticks its query took were skipped, not executed late
    # the fleet's fields went with every query: realtime, the time the executing chunk had left, the observation time
    assert {f["traffic_class"] for f in link.sent} == {"realtime"}
    assert "deadline_ms" not in link.sent[0]  # the first query blocks: no deadline, as the Franka loop's
    assert link.sent[1]["deadline_ms"] == pytest.approx(16 / 30 * 1e3) and link.sent[1]["observed_at"] > 0


def test_a_robot_whose_chunks_come_after_its_actions_run_out_stalls_and_misses_its_pace():
    pace = fleet_sim.Pace(control_hz=30.0, open_loop_horizon=4, schedule="prefetch", prefetch_lead_steps=2)
    stats, _ = robot(0.2, pace)  # 2 ticks of lead at 30 Hz: 67 ms, well under the 200 ms a chunk takes
    assert stats.stalls > 0 and not stats.at_pace() and not stats.errors, stats
    sync, _ = robot(0.05, fleet_sim.Pace(control_hz=30.0, open_loop_horizon=4, schedule="sync"))
    assert sync.stalls > 0 and set(sync.budgets_ms) == {0.0} and not sync.at_pace()  # a blocking query always stalls


def test_the_sweep_stops_each_way_at_its_first_miss_and_reports_the_largest_fleet_at_pace(monkeypatch):
    kept = {"batched": 4, "reference": 1}
    tried = []

    def fake_fleet(way, n, args, pace, shared):
        tried.append((way, n))
        return {"way": way, "robots": n, "at_pace": n <= kept[way]}

    monkeypatch.setattr(fleet, "fleet_of", fake_fleet)
    rows, best = fleet.sweep([1, 2, 4, 8], fleet.WAYS, None, fleet_sim.Pace(), None, on_row=lambda r: None)
    assert best == kept
    assert tried == [("batched", 1), ("reference", 1), ("batched", 2), ("reference", 2), ("batched", 4),
                     ("batched", 8)]  # fmt: skip
    assert [r["at_pace"] for r in rows] == [True, True, True, False, True, False]


def test_a_summary_counts_every_robot_and_a_stall_anywhere_misses_the_fleet():
    pace = fleet_sim.Pace()
    good = fleet_sim.RobotStats(0, ticks=10, latencies_ms=[100.0, 120.0], budgets_ms=[500.0, 500.0], chunks=3)
    stalled = fleet_sim.RobotStats(1, ticks=10, stalls=2, latencies_ms=[100.0], budgets_ms=[500.0], chunks=2)
    row = fleet.summarize("batched", 2, [good, stalled], pace, [1, 2])
    assert row["robots_at_pace"] == 1 and not row["at_pace"] and row["stalls"] == 2 and row["ticks"] == 20
    assert row["hold_s"] == pytest.approx(2 / 15) and row["rows_per_call"] == 1.5 and row["chunks"] == 5
    assert "| batched | 2 | no | 2 (20) |" in fleet.fleet_table([row])


def test_the_zeromq_link_sends_one_droid_row_with_the_query_fields_and_reads_the_split_actions_back():
    sent = []

    class Door:  # the ZeroMQ client's one call the link makes, answered as the door answers (split actions)
        def get_action(self, observation, options, **fields):
            sent.append((observation, options, fields))
            actions = {"action.joint_position": np.zeros((1, 24, 7)), "action.gripper_position": np.ones((1, 24, 1))}
            return actions, {"sessions": [{"step": 3, "observed_at": 1.5}]}

    link = fleet_sim.ZmqLink.__new__(fleet_sim.ZmqLink)
    link.client = Door()
    policy = DroidPolicy(link, prompt="pick")
    obs = fleet_sim.observation(0, np.random.default_rng(0))
    query = policy.request(obs, observed_at=1.5, traffic_class="realtime", deadline_ms=400.0)
    reply = link.send(query)
    assert reply.actions.shape == (24, 8) and reply.actions[0, 7] == 1 and reply.session["step"] == 3
    observation, options, fields = sent[0]
    assert options == {"session_ids": [query.session_id]}  # a session start: no expected step
    assert fields == {"traffic_class": "realtime", "deadline_ms": 400.0, "observed_at": 1.5}
    assert observation["annotation.language.language_instruction"] == ["pick"]
    videos = [v for k, v in observation.items() if k.startswith("video.")]
    assert len(videos) == 3 and all(v.shape == (1, 1, 180, 320, 3) for v in videos)


def test_the_docs_reproduce_line_leaves_out_this_machine_s_files():
    assert fleet.reproduce(["--farm", "--json", "/tmp/x.json", "--write-docs"]) == ["--farm", "--write-docs"]
    assert fleet.reproduce(["--json=/tmp/x.json", "--robots", "1,2"]) == ["--robots", "1,2"]


def test_bad_options_are_refused_naming_them():
    with pytest.raises(SystemExit):
        fleet.parse_args(["--robots", "0"])
    with pytest.raises(SystemExit):
        fleet.parse_args(["--schedule", "prefetch", "--lead", "8"])
    with pytest.raises(SystemExit):
        fleet.parse_args(["--farm", "--url", "http://127.0.0.1:8000"])
    with pytest.raises(SystemExit):
        fleet.parse_args(["--preset", "nope"])


def test_an_in_process_fleet_through_the_policy_batcher_on_the_tiny_preset(tmp_path):
    """The GPU check's way (a preset with random weights, the reference as one session per call on the same model,
    every fleet appended to the results file), here on this CPU."""
    out, results = tmp_path / "fleet.json", tmp_path / "results.jsonl"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--robots", "1,2", "--seconds", "2",
            "--reference", "one-at-a-time", "--json", str(out), "--results", str(results)]  # fmt: skip
    assert fleet.main(argv) == 0
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert {r["way"] for r in rows} == {"batched", "reference"} and "tiny (random weights)" in record["setting"]
    assert "one session per model call" in record["setting"]
    for r in rows:  # a loaded CPU may miss even one robot's pace: the figures are still all there
        assert not r["errors"] and r["chunks"] >= r["robots"] and r["ticks"] > 0, r
        assert r["rows_per_call"] >= 1 and r["age_p99_ms"] >= r["age_p50_ms"] >= 0
        if r["way"] == "reference":
            assert r["rows_per_call"] == 1  # one session per model call
    for way in ("batched", "reference"):
        at_pace = [r["robots"] for r in rows if r["way"] == way and r["at_pace"]]
        assert record["largest_at_pace"][way] == max(at_pace, default=0)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["figure"] for line in lines] == ["fleet"] * len(rows) + ["fleet_at_pace"]
    assert lines[-1]["batched"] == record["largest_at_pace"]["batched"] and lines[0]["model"].startswith("tiny")


def test_droid_robots_can_query_a_model_of_another_embodiment():
    """The GPU check's 5B is LIBERO's: a DROID robot's observation goes in its cameras and state width, the actions
    come back in DROID's 8 columns, and the real-time chunking prefix in the model's."""
    from types import SimpleNamespace

    from dreamzero.embodiments import get_embodiment

    libero = SimpleNamespace(embodiment=get_embodiment("libero_sim"))
    frames = [droid.make_frame(fleet_sim.observation(0, np.random.default_rng(k))) for k in range(4)]
    raw = droid.raw_observation(frames)
    obs = fleet_sim.embodiment_observation(libero, raw)
    assert set(obs) == {*libero.embodiment.video_keys, *libero.embodiment.state_widths}
    assert obs["state.state"].shape == (1, 8) and obs["video.image"].shape == (1, 4, 180, 320, 3)
    batch, _ = libero.embodiment.preprocess(obs, ["pick"])  # the served embodiment accepts it
    assert len(batch) == 1
    assert fleet_sim.droid_actions(np.ones((1, 16, 7))).shape == (1, 16, 8)
    prefix = fleet_sim.embodiment_options(libero, {"action_prefix": [np.ones((4, 8)), None]})["action_prefix"]
    assert prefix[0].shape == (4, libero.embodiment.action_dim) and prefix[1] is None
    tiny = SimpleNamespace(embodiment=get_embodiment("oxe_droid"))
    assert fleet_sim.embodiment_observation(tiny, raw) is raw  # DROID's own: as sent
