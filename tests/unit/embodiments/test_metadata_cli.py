"""The metadata generator on small datasets written in the real LeRobot v2.1 / v3.0 layouts, against numpy."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dreamzero.embodiments import get_embodiment
from dreamzero.errors import ConfigError
from dreamzero.lerobot_dataset import ColumnSlice, LeRobotDataset, get_preset
from dreamzero.metadata_cli import compute_metadata, main, relative_deltas
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2, write_v3

STATS = ("min", "max", "mean", "std", "q01", "q99")


def numpy_stats(x: np.ndarray) -> dict:
    x = np.asarray(x, np.float64)
    q01, q99 = np.quantile(x, 0.01, axis=0, method="linear"), np.quantile(x, 0.99, axis=0, method="linear")
    return {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0, ddof=0), "q01": q01, "q99": q99}


def assert_stats(entry: dict, x: np.ndarray):
    expected = numpy_stats(x)
    for name in STATS:
        np.testing.assert_allclose(entry[name], expected[name], rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("writer", [write_v2, write_v3])
def test_libero_preset_matches_numpy(tmp_path, writer):
    episodes = random_episodes(5, {"state": 8, "actions": 7}, seed=1)
    root = writer(tmp_path / "ds", episodes, videos={"image": (256, 256), "wrist_image": (256, 256)})
    out = compute_metadata(LeRobotDataset(root), get_preset("libero_sim"), progress=False)
    entry = out["libero_sim"]
    assert_stats(entry["statistics"]["state"]["state"], np.concatenate([e["state"] for e in episodes]))
    assert_stats(entry["statistics"]["action"]["actions"], np.concatenate([e["actions"] for e in episodes]))
    assert entry["modalities"]["video"]["image"] == {"resolution": [256, 256], "channels": 3, "fps": 15.0}
    assert entry["modalities"]["state"]["state"]["shape"] == [8]
    get_embodiment("libero_sim", out)  # the result is loadable by the embodiment


@pytest.mark.parametrize("writer", [write_v2, write_v3])
def test_droid_preset_splits_by_modality_json_and_uses_chunk_deltas(tmp_path, writer):
    episodes = random_episodes(4, {"observation.state": 8, "action": 8}, seed=2, lengths=[30, 5, 26, 40])
    videos = {"observation.images.exterior_image_1_left": (180, 320)}
    root = writer(tmp_path / "ds", episodes, videos=videos, modality=DROID_MODALITY)
    out = compute_metadata(LeRobotDataset(root), get_preset("oxe_droid"), progress=False)["oxe_droid"]
    states = np.concatenate([e["observation.state"] for e in episodes]).astype(np.float64)
    actions = np.concatenate([e["action"] for e in episodes]).astype(np.float64)
    assert_stats(out["statistics"]["state"]["joint_position"], states[:, :7])
    assert_stats(out["statistics"]["state"]["gripper_position"], states[:, 7:8])
    assert_stats(out["statistics"]["action"]["gripper_position"], actions[:, 7:8])
    # joint actions: every action[t + k] - state[t], k < 24, within an episode (loops, not the vectorised code)
    deltas = []
    for e in episodes:
        a, s = e["action"][:, :7].astype(np.float64), e["observation.state"][:, :7].astype(np.float64)
        deltas += [a[t + k] - s[t] for t in range(len(a)) for k in range(24) if t + k < len(a)]
    assert_stats(out["statistics"]["action"]["joint_position"], np.array(deltas))
    assert out["modalities"]["action"]["joint_position"]["absolute"] is False
    assert out["modalities"]["video"]["exterior_image_1_left"]["resolution"] == [320, 180]  # [width, height]


def test_relative_deltas_small_case():
    a = np.array([[1.0], [2.0], [4.0]])
    s = np.array([[0.0], [1.0], [3.0]])
    # k=0: 1-0, 2-1, 4-3; k=1: 2-0, 4-1
    np.testing.assert_array_equal(relative_deltas(a, s, 2).ravel(), [1, 1, 1, 2, 3])


def test_manual_flags_and_merge_through_main(tmp_path, capsys):
    episodes = random_episodes(3, {"observation.state": 7, "action": 7}, seed=3)
    root = write_v3(tmp_path / "ds", episodes, videos={"observation.images.front": (480, 640)})
    out = tmp_path / "metadata.json"
    argv = ["generate", str(root), "--tag", "my_arm", "--state", "arm=observation.state[0:6]",
            "--state", "gripper=observation.state[6:7]", "--action", "arm=action[:6]", "--action", "gripper=action[6:]",
            "--video", "front=observation.images.front", "-o", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    libero_root = write_v2(tmp_path / "libero", random_episodes(2, {"state": 8, "actions": 7}, seed=4))
    assert main(["generate", str(libero_root), "--preset", "libero_sim", "-o", str(out), "--no-progress"]) == 2
    assert "exists; pass --merge" in capsys.readouterr().err
    assert (
        main(["generate", str(libero_root), "--preset", "libero_sim", "-o", str(out), "--merge", "--no-progress"]) == 0
    )
    written = json.loads(out.read_text())
    assert sorted(written) == ["libero_sim", "my_arm"]
    states = np.concatenate([e["observation.state"] for e in episodes])
    assert_stats(written["my_arm"]["statistics"]["state"]["arm"], states[:, :6])
    assert_stats(
        written["my_arm"]["statistics"]["action"]["gripper"], np.concatenate([e["action"] for e in episodes])[:, 6:]
    )
    assert written["my_arm"]["modalities"]["video"]["front"]["resolution"] == [640, 480]


def test_merge_subcommand(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    for path, tag in ((a, "libero_sim"), (b, "franka_pnp")):
        root = write_v2(tmp_path / tag, random_episodes(2, {"state": 8, "actions": 7}, seed=5))
        assert main(["generate", str(root), "--preset", tag, "-o", str(path), "--no-progress"]) == 0
    assert main(["merge", str(tmp_path / "all.json"), str(a), str(b)]) == 0
    assert sorted(json.loads((tmp_path / "all.json").read_text())) == ["franka_pnp", "libero_sim"]
    assert main(["merge", str(tmp_path / "twice.json"), str(a), str(a)]) == 0  # identical entries merge quietly


def test_column_slice_parsing():
    assert ColumnSlice.parse("arm=observation.state[0:6]") == ColumnSlice("arm", "observation.state", 0, 6)
    assert ColumnSlice.parse("g=action") == ColumnSlice("g", "action")
    with pytest.raises(ConfigError, match="NAME=COLUMN"):
        ColumnSlice.parse("arm:observation.state")


# ---------------------------------------------------------------------------------------------------------------------
# malformed datasets
# ---------------------------------------------------------------------------------------------------------------------


def test_missing_column_names_the_features(tmp_path):
    root = write_v2(tmp_path / "ds", random_episodes(2, {"observation.state": 8, "action": 7}))
    with pytest.raises(
        ConfigError, match=r"columns \['actions', 'state'\] are not features.*observation\.state.*--state"
    ):
        compute_metadata(LeRobotDataset(root), get_preset("libero_sim"), progress=False)


def test_rows_disagreeing_with_info_json_shape(tmp_path):
    root = write_v2(tmp_path / "ds", random_episodes(2, {"state": 8, "actions": 7}))
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["state"]["shape"] = [9]
    (root / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match=r"column 'state' rows have 8 values, meta/info.json declares shape \[9\]"):
        compute_metadata(LeRobotDataset(root), get_preset("libero_sim"), progress=False)


def test_ragged_rows_fail(tmp_path):
    root = write_v2(tmp_path / "ds", random_episodes(1, {"state": 8, "actions": 7}))
    path = root / "data" / "chunk-000" / "episode_000000.parquet"
    table = pq.read_table(path)
    rows = table.column("state").to_pylist()
    rows[3] = rows[3][:5]
    table = table.set_column(table.column_names.index("state"), "state", pa.array(rows, pa.list_(pa.float32())))
    pq.write_table(table, path)
    with pytest.raises(ConfigError, match="rows have different lengths"):
        compute_metadata(LeRobotDataset(root), get_preset("libero_sim"), progress=False)


def test_layout_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a LeRobot dataset"):
        LeRobotDataset(tmp_path)
    root = write_v3(tmp_path / "v3", random_episodes(2, {"state": 8, "actions": 7}))
    (root / "meta" / "episodes" / "chunk-000" / "file-000.parquet").unlink()
    with pytest.raises(ConfigError, match="without meta/episodes"):
        LeRobotDataset(root)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["codebase_version"] = "v1.6"
    (root / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="'v1.6' is not supported"):
        LeRobotDataset(root)


def test_droid_preset_without_modality_json_says_what_to_pass(tmp_path):
    root = write_v2(tmp_path / "ds", random_episodes(1, {"observation.state": 8, "action": 8}))
    with pytest.raises(ConfigError, match=r"meta/modality.json, which is missing; pass --state"):
        compute_metadata(LeRobotDataset(root), get_preset("oxe_droid"), progress=False)


def test_frame_stride_and_progress_bar(tmp_path, capsys):
    episodes = random_episodes(2, {"observation.state": 8, "action": 8}, seed=12, lengths=[25, 31])
    root = write_v2(tmp_path / "ds", episodes, modality=DROID_MODALITY)
    out = tmp_path / "m.json"
    assert main(["generate", str(root), "--preset", "oxe_droid", "--frame-stride", "3", "-o", str(out)]) == 0
    assert "oxe_droid: episodes" not in capsys.readouterr().err  # stderr is no terminal here: no tqdm \r lines
    entry = json.loads(out.read_text())["oxe_droid"]["statistics"]
    states = np.concatenate([e["observation.state"][::3] for e in episodes])
    assert_stats(entry["state"]["joint_position"], states[:, :7])
    deltas = []
    for e in episodes:
        a, s = e["action"][:, :7].astype(np.float64), e["observation.state"][:, :7].astype(np.float64)
        deltas += [a[t + k] - s[t] for k in range(24) for t in range(0, len(a), 3) if t + k < len(a)]
    assert_stats(entry["action"]["joint_position"], np.array(deltas))


def test_action_bounds_flag_writes_min_max_and_the_embodiment_uses_it(tmp_path):
    episodes = random_episodes(2, {"observation.state": 8, "action": 8}, seed=13, lengths=[30, 28])
    root = write_v3(tmp_path / "ds", episodes, modality=DROID_MODALITY)
    plain, wide = tmp_path / "plain.json", tmp_path / "wide.json"
    assert main(["generate", str(root), "--preset", "oxe_droid", "--no-progress", "-o", str(plain)]) == 0
    argv = ["generate", str(root), "--preset", "oxe_droid", "--no-progress", "--action-bounds", "min_max"]
    assert main([*argv, "-o", str(wide)]) == 0
    plain_raw, wide_raw = json.loads(plain.read_text()), json.loads(wide.read_text())
    assert "normalisation_bounds" not in plain_raw["oxe_droid"]
    assert wide_raw["oxe_droid"]["normalisation_bounds"] == {"action": "min_max"}
    assert wide_raw["oxe_droid"]["statistics"] == plain_raw["oxe_droid"]["statistics"]
    # the largest recorded joint delta reaches +1 exactly, where the percentile bounds clamp it
    joints = wide_raw["oxe_droid"]["statistics"]["action"]["joint_position"]
    top = np.asarray(joints["max"])
    wide_joints = get_embodiment("oxe_droid", wide_raw).action_normalisers["action.joint_position"]
    assert wide_joints.normalise(top).tolist() == [1.0] * 7
    clamped = get_embodiment("oxe_droid", plain_raw).action_normalisers["action.joint_position"]
    np.testing.assert_allclose(clamped.unnormalise(clamped.normalise(top)), joints["q99"])
    with pytest.raises(ConfigError, match=r"action_bounds is 'q5'"):
        compute_metadata(LeRobotDataset(root), get_preset("oxe_droid"), progress=False, action_bounds="q5")
