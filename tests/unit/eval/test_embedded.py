"""The runner against the in-process embedded policy (the tiny random DreamZero): raw form, frame stacks, sessions."""

import json

from dreamzero_droid.policy import DroidPolicy
from eval.mujoco_droid import MujocoDroidEnv
from eval.policy_links import EmbeddedLink
from eval.runner import EvalConfig, run_evaluation


def test_runner_with_the_embedded_tiny_model(tmp_path):
    policy = DroidPolicy(EmbeddedLink())  # builds (once, cached) the tiny model with deterministic random weights
    config = EvalConfig(out_dir=tmp_path, max_steps=9, record_video=False)
    summary = run_evaluation(lambda s: MujocoDroidEnv(s, image_size=(90, 160), render_quality="fast"), policy, config)
    assert summary["failed_episodes"] == 0 and summary["server_calls"] == 2
    record = json.loads((tmp_path / "episodes" / "scene1_ep000.json").read_text())
    first, second = record["server_sessions"]
    # 1 frame on the first call starts the session; the 4-frame stack of the second call continues it
    assert first["restarted"] and first["restart_reason"] == "new_session" and first["step"] == 1
    assert not second["restarted"] and second["step"] == 2 and record["session_restarts"] == []
    assert all(len(s["action"]) == 8 and s["action"][7] in (0.0, 1.0) for s in record["steps"])
