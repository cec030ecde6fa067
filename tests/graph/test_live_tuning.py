"""A Policy replica's live knobs (Serve `user_config` -> `reconfigure`), on the real PolicyDeployment in-process.

The cluster test (`tests/cluster/test_live_operations.py`) shows Serve delivering them without a restart; here: what
each knob changes, that a `user_config` is the whole live state (absent = the args value), and that start-time knobs
are refused naming the field and where they go instead, leaving the replica as it was.
"""

from __future__ import annotations

import pytest

from deployments.live_tuning import parse_live_tuning
from deployments.policy import PolicyDeployment
from dreamzero.errors import ConfigError
from serve_graph.builder import policy_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model

ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 16, "ttl_s": 900},
    "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.005},
}


@pytest.fixture(scope="module")
def policy():
    cfg = parse_app_args(ARGS)
    return PolicyDeployment(policy_settings(cfg, resolve_model(cfg)))


def test_reconfigure_sets_each_knob_and_an_absent_one_goes_back_to_args(policy):
    before = policy.tuning_in_effect()
    assert before["sessions"] == {"ttl_s": 900, "max_sessions": 16}
    policy.reconfigure(
        {
            "sessions": {"ttl_s": 30, "max_sessions": 4},
            "batching": {"max_batch_size": 2, "batch_wait_timeout_s": 0.05, "rows_per_request": 3},
            "pipeline": {"num_inference_steps": 3},
        }
    )
    store, batcher = policy.pipeline.store, policy.batcher
    assert (store.ttl_s, store.max_sessions) == (30, 4)
    assert (batcher.max_batch_size, batcher.wait_s, policy.admission.rows_per_request) == (2, 0.05, 3)
    assert policy.pipeline.config.num_inference_steps == 3 and policy.tuning["pipeline"]["num_inference_steps"] == 3
    policy.reconfigure({"sessions": {"ttl_s": 60}})  # the whole live state: the rest is the args value again
    assert (store.ttl_s, store.max_sessions, batcher.max_batch_size) == (60, 16, 8)
    assert policy.pipeline.config.num_inference_steps == 2 and policy.admission.rows_per_request is None
    policy.reconfigure({})
    assert policy.tuning_in_effect() == before


@pytest.mark.parametrize(
    "config, field",
    [
        ({"sessions": {"max_bytes": "1GiB"}}, "user_config.sessions.max_bytes: not live"),
        ({"batching": {"max_batch_rows": 4}}, "user_config.batching.max_batch_rows: not live"),
        ({"pipeline": {"cfg_scale": 1.0}}, "user_config.pipeline.cfg_scale: not live"),
        ({"model_path": "/x"}, "user_config.model_path: unknown field"),
        ({"sessions": {"ttl_s": -1}}, "user_config.sessions.ttl_s"),
        ({"sessions": {"max_sessions": 17}}, "above the start value 16"),
        ({"pipeline": {"num_inference_steps": 3, "dit_step_mask": [True]}}, "user_config.pipeline"),
    ],
)
def test_a_start_time_or_bad_knob_is_refused_naming_it_and_nothing_changes(policy, config, field):
    policy.reconfigure({"sessions": {"ttl_s": 45}})
    before = policy.tuning_in_effect()
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        policy.reconfigure(config)
    assert policy.tuning_in_effect() == before and policy.pipeline.store.ttl_s == 45


def test_parse_names_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        parse_live_tuning({"sessions": {"max_bytes": 1}, "pipeline": {"model_input_hw": [1, 2]}})
    assert "sessions.max_bytes" in str(info.value) and "pipeline.model_input_hw" in str(info.value)


def test_replica_counts_under_args_are_found_and_the_shipped_config_has_none():
    import yaml

    from serve_graph.builder import replica_counts_in_args
    from tests.support.serve_process import ROOT

    args = {"policy": {"num_replicas": 2}, "ingress": {"num_replicas": 1, "num_cpus": 0}}
    assert replica_counts_in_args(parse_app_args(args)) == ["ingress.num_replicas", "policy.num_replicas"]
    assert replica_counts_in_args(parse_app_args({"policy": {"autoscaling": {"max_replicas": 3}}})) == [
        "policy.autoscaling"
    ]
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    assert replica_counts_in_args(parse_app_args(shipped["args"])) == []
    assert {d["name"] for d in shipped["deployments"]} == {"Ingress", "Preprocess", "Postprocess", "Policy"}
