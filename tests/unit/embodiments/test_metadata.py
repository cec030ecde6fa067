"""metadata.json loading and validation: a missing tag, statistic or a dimension mismatch fails naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero.metadata import (
    compute_key_stats,
    default_metadata_path,
    load_embodiment_metadata,
    merge_metadata,
    read_metadata_file,
    save_metadata,
)
from tests.support.embodiments import droid_metadata, libero_metadata


def test_shipped_file_is_labelled_synthetic_and_holds_three_tags():
    raw = json.loads(default_metadata_path().read_text())
    assert {"oxe_droid", "libero_sim", "franka_pnp"} <= set(raw)
    for tag in raw:
        assert raw[tag]["synthetic"] is True and "SYNTHETIC" in raw[tag]["note"]
        meta = load_embodiment_metadata(None, tag)
        assert meta.synthetic
    droid = load_embodiment_metadata(None, "oxe_droid")
    # state joints span the Franka limits; q01 < q99 everywhere
    np.testing.assert_allclose(droid.stats("state.joint_position").min[0], -2.8973)
    assert (droid.stats("state.joint_position").q99 > droid.stats("state.joint_position").q01).all()


def test_load_from_path_and_checkpoint_dir(tmp_path):
    ckpt = tmp_path / "ckpt" / "experiment_cfg"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text(json.dumps(droid_metadata()))
    by_dir = load_embodiment_metadata(tmp_path / "ckpt", "oxe_droid")
    by_file = load_embodiment_metadata(ckpt / "metadata.json", "oxe_droid")
    assert by_dir.stats("action.gripper_position").q99.tolist() == by_file.stats("action.gripper_position").q99.tolist()
    assert not by_dir.synthetic


def test_missing_tag_lists_known_tags_and_closest():
    with pytest.raises(ConfigError, match=r"no embodiment tag 'oxe_droyd'; it has \['oxe_droid'\]. Did you mean"):
        load_embodiment_metadata(droid_metadata(), "oxe_droyd")


def test_missing_statistic_is_named():
    meta = droid_metadata()
    del meta["oxe_droid"]["statistics"]["action"]["gripper_position"]["q99"]
    with pytest.raises(ConfigError, match=r"statistics\.action\.gripper_position is missing the statistic 'q99'"):
        load_embodiment_metadata(meta, "oxe_droid")


def test_dimension_mismatch_between_statistics_is_named():
    meta = droid_metadata()
    meta["oxe_droid"]["statistics"]["state"]["gripper_position"]["std"] = [1.0, 2.0]
    with pytest.raises(ConfigError, match=r"state\.gripper_position: statistics have different dimensions"):
        load_embodiment_metadata(meta, "oxe_droid")


def test_modalities_shape_mismatch_is_named():
    meta = droid_metadata()
    meta["oxe_droid"]["modalities"]["state"]["joint_position"]["shape"] = [6]
    with pytest.raises(ConfigError, match=r"modalities\.state\.joint_position\.shape \[6\]"):
        load_embodiment_metadata(meta, "oxe_droid")


@pytest.mark.parametrize("bad", [[float("nan")], "abc", []])
def test_bad_values_fail(bad):
    meta = droid_metadata()
    meta["oxe_droid"]["statistics"]["state"]["gripper_position"]["mean"] = bad
    with pytest.raises(ConfigError, match=r"state\.gripper_position\.mean"):
        load_embodiment_metadata(meta, "oxe_droid")


def test_missing_group_and_bad_file(tmp_path):
    meta = droid_metadata()
    del meta["oxe_droid"]["statistics"]["action"]
    with pytest.raises(ConfigError, match=r"statistics\.action is missing"):
        load_embodiment_metadata(meta, "oxe_droid")
    (tmp_path / "m.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_metadata_file(tmp_path / "m.json")
    with pytest.raises(ConfigError, match="does not exist"):
        read_metadata_file(tmp_path / "none.json")


def test_compute_key_stats_matches_numpy():
    x = np.random.default_rng(0).normal(size=(101, 3)) * [1, 10, 100]
    s = compute_key_stats(x)
    np.testing.assert_array_equal(s.std, x.std(axis=0))
    np.testing.assert_array_equal(s.q01, np.quantile(x, 0.01, axis=0))
    # linear interpolation by hand: position 0.01 * 100 = 1.0 -> the 2nd smallest value exactly
    np.testing.assert_array_equal(s.q01, np.sort(x, axis=0)[1])


def test_merge_and_save(tmp_path):
    merged = merge_metadata(droid_metadata(), libero_metadata())
    assert sorted(merged) == ["libero_sim", "oxe_droid"]
    other = droid_metadata()
    other["oxe_droid"]["statistics"]["state"]["gripper_position"]["q99"] = [0.9]
    with pytest.raises(ConfigError, match="'oxe_droid' appears in more than one input"):
        merge_metadata(merged, other)
    replaced = merge_metadata(merged, other, overwrite=True)
    path = save_metadata(replaced, tmp_path / "out" / "metadata.json")
    assert load_embodiment_metadata(path, "oxe_droid").stats("state.gripper_position").q99.tolist() == [0.9]


def _with_wide_action_extremes(meta: dict) -> dict:
    """Action joint deltas with min / max at +-2 while q01 / q99 stay at +-1."""
    joints = meta["oxe_droid"]["statistics"]["action"]["joint_position"]
    joints["min"], joints["max"] = [-2.0] * 7, [2.0] * 7
    return meta


def test_bounds_default_to_percentiles_and_are_not_written_back():
    meta = load_embodiment_metadata(_with_wide_action_extremes(droid_metadata()), "oxe_droid")
    assert meta.bounds == {"state": "q01_q99", "action": "q01_q99"}
    assert "normalisation_bounds" not in meta.to_dict()
    low, high = meta.stats("action.joint_position").bounds(meta.bounds["action"])
    assert low.tolist() == [-1.0] * 7 and high.tolist() == [1.0] * 7


def test_min_max_bounds_normalise_actions_between_the_extremes_and_round_trip():
    raw = _with_wide_action_extremes(droid_metadata())
    raw["oxe_droid"]["normalisation_bounds"] = {"action": "min_max"}
    meta = load_embodiment_metadata(raw, "oxe_droid")
    assert meta.bounds == {"state": "q01_q99", "action": "min_max"}
    assert meta.to_dict()["normalisation_bounds"] == {"state": "q01_q99", "action": "min_max"}
    assert load_embodiment_metadata({"oxe_droid": meta.to_dict()}, "oxe_droid").bounds == meta.bounds
    from dreamzero.embodiments import get_embodiment

    emb = get_embodiment("oxe_droid", raw)
    joints = emb.action_normalisers["action.joint_position"]
    # 1.5 lies past q99 = 1 (clamped to +1 under the default) but inside max = 2: (1.5 + 2) / 4 * 2 - 1 = 0.75
    np.testing.assert_allclose(joints.normalise(np.full(7, 1.5)), np.full(7, 0.75))
    np.testing.assert_allclose(joints.unnormalise(np.full(7, 0.75)), np.full(7, 1.5))
    gain, _ = emb.action_codec({"state.joint_position": np.zeros((1, 7)), "state.gripper_position": np.zeros((1, 1))})
    np.testing.assert_allclose(gain[0, :7], 2.0)  # half the min..max span
    # the state still uses its percentiles
    assert emb.state_normalisers["state.joint_position"].q99.tolist() == [2.0] * 6 + [0.5]


@pytest.mark.parametrize(
    "bounds, message",
    [
        ("min_max", r"normalisation_bounds must be an object"),
        ({"actions": "min_max"}, r"unknown group 'actions'; the groups are \['state', 'action'\]"),
        ({"action": "q05_q95"}, r"normalisation_bounds\.action is 'q05_q95'; use one of \['min_max', 'q01_q99'\]"),
    ],
)
def test_bad_bounds_are_named(bounds, message):
    meta = droid_metadata()
    meta["oxe_droid"]["normalisation_bounds"] = bounds
    with pytest.raises(ConfigError, match=message):
        load_embodiment_metadata(meta, "oxe_droid")
