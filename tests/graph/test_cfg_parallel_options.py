"""`policy.cfg_parallel` in the config and the Policy deployment's options (no cluster: the builder's output only)."""

from __future__ import annotations

import pytest

from dreamzero import errors
from serve_graph.builder import policy_options
from serve_graph.config import parse_app_args


def test_cfg_parallel_defaults_to_one_device():
    cfg = parse_app_args({})
    assert cfg.policy.cfg_parallel == 1
    assert "placement_group_bundles" not in policy_options(cfg)


def test_two_gpus_per_replica_in_one_placement_group():
    cfg = parse_app_args({"policy": {"num_gpus": 1, "num_cpus": 2, "cfg_parallel": 2, "resources": {"gpu_node": 0.01}}})
    opts = policy_options(cfg)
    # bundle 0: the replica (rank 0) and what it asks for; bundle 1: its rank 1, on the same node
    assert opts["placement_group_bundles"] == [{"CPU": 2, "GPU": 1, "gpu_node": 0.01}, {"CPU": 2, "GPU": 1}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"]["num_gpus"] == 1


def test_cpu_pair_needs_no_placement_group():
    cfg = parse_app_args({"policy": {"cfg_parallel": 2}})
    assert "placement_group_bundles" not in policy_options(cfg)


@pytest.mark.parametrize(
    "policy, match",
    [
        ({"cfg_parallel": 3}, "cfg_parallel"),
        ({"cfg_parallel": 2, "cfg_timeout_s": 0}, "cfg_timeout_s"),
    ],
)
def test_bad_cfg_parallel_is_named(policy, match):
    with pytest.raises(errors.ConfigError, match=match):
        parse_app_args({"policy": policy})
