"""Where raw-form preprocess / postprocess run (deployments/stages.py): the front door or the stage's replicas."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.calls import BY_REFERENCE_MIN_BYTES, Transport, arrays_bytes
from deployments.config.settings import GraphSettings
from deployments.preprocess import load_embodiment, preprocess_request
from deployments.requests.generations import GenerationRequest, parse_generation_request
from deployments.stages import RawStages, array_bytes, observation_bytes
from dreamzero.errors import ConfigError, InvalidObservation
from dreamzero_client.wire import generations
from serve_graph.config import parse_app_args
from tests.support.request_builders import droid_raw_observation


class RecordingHandle:
    """A deployment handle whose `run.remote(...)` records its arguments and answers "remote"."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.run = self

    def remote(self, *args):
        self.calls.append(args)
        done = asyncio.get_running_loop().create_future()
        done.set_result("remote")
        return done


class Counting:
    """Stands in for ServingMetrics: records raw_stage_runs.inc tags."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.raw_stage_runs = self

    def inc(self, value, tags):
        self.seen.append(tags)


def raw_request(t: int = 1, b: int = 1, obs: dict | None = None) -> GenerationRequest:
    obs = droid_raw_observation(b, t) if obs is None else obs
    body = generations.build_request_body(obs, ["pick up the cup"] * b, [f"s{i}" for i in range(b)])
    return parse_generation_request(body, "openpi")


def stages(args: dict, metrics=None) -> tuple[RawStages, RecordingHandle, RecordingHandle]:
    pre, post = RecordingHandle(), RecordingHandle()
    cfg = parse_app_args(args)
    settings = GraphSettings(preprocess=cfg.preprocess, postprocess=cfg.postprocess)
    stage = RawStages(load_embodiment("oxe_droid"), Transport(pre), post, settings, metrics)
    return stage, pre, post


def test_observation_bytes_counts_arrays_lists_and_nested_dicts():
    obs = droid_raw_observation(2, 4)
    assert observation_bytes(obs) == sum(v.nbytes for v in obs.values())
    assert array_bytes([[1, 2, 3], [4, 5, 6]]) == 6 * 8  # JSON numbers arrive as 8-byte values
    assert array_bytes([]) == 0 and array_bytes("text") == 0
    assert observation_bytes({"a": {"b": np.zeros(10, np.uint8)}, "c": [1.0]}) == 18
    assert observation_bytes(["not", "a dict"]) == 0


def test_small_requests_run_in_the_front_door_with_the_deployments_result():
    metrics = Counting()
    st, pre, post = stages({}, metrics)  # defaults: preprocess auto (8 MiB), postprocess ingress
    req = raw_request(t=4)
    assert st.preprocess_here(req)

    async def go():
        batch, ctx = await st.preprocess(req)
        actions = np.random.default_rng(0).uniform(-1, 1, (1, 24, 32)).astype(np.float32)
        return batch, ctx, actions, await st.postprocess(actions, ctx)

    batch, ctx, actions, robot = asyncio.run(go())
    assert not pre.calls and not post.calls
    want_batch, want_ctx = preprocess_request(load_embodiment("oxe_droid"), req)
    assert np.array_equal(batch.images, want_batch.images) and np.array_equal(batch.state, want_batch.state)
    assert batch.session_ids == ["s0"] and batch.prompts == want_batch.prompts
    assert np.array_equal(robot, load_embodiment("oxe_droid").postprocess(actions, want_ctx))
    assert metrics.seen == [{"stage": "preprocess", "where": "ingress"}, {"stage": "postprocess", "where": "ingress"}]
    st.close()


def test_requests_over_the_limit_and_forced_replicas_take_the_hop():
    req = raw_request(t=4)  # 3 cameras x 4 frames x 180x320x3 + state: ~2 MB
    big, pre, _ = stages({"preprocess": {"ingress_max_bytes": "1MiB"}})
    assert not big.preprocess_here(req)
    assert run(lambda: big.preprocess(req)) == "remote" and pre.calls == [(req,)]
    forced, pre, post = stages({"preprocess": {"placement": "replicas"}, "postprocess": {"placement": "replicas"}})
    assert not forced.preprocess_here(raw_request(t=1))
    assert run(lambda: forced.postprocess(np.zeros((1, 24, 32)), None)) == "remote" and len(post.calls) == 1
    always, _, _ = stages({"preprocess": {"placement": "ingress", "ingress_max_bytes": 1024}})
    assert always.preprocess_here(req)  # `ingress` ignores the size limit


def run(start):
    """Start a stage call inside an event loop (as the front doors do) and await it."""

    async def go():
        return await start()

    return asyncio.run(go())


def test_a_bad_observation_fails_in_the_front_door_naming_the_field():
    obs = droid_raw_observation(1, 1)
    obs["video.wrist_image_left"] = obs["video.wrist_image_left"][..., :2]  # two colour channels
    st, _, _ = stages({})
    with pytest.raises(InvalidObservation) as info:
        run(lambda: st.preprocess(raw_request(obs=obs)))
    assert "video.wrist_image_left" in (info.value.field or "")


@pytest.mark.parametrize(
    "args, needle",
    [
        ({"preprocess": {"placement": "gpu"}}, "preprocess.placement"),
        ({"preprocess": {"ingress_max_bytes": "auto"}}, "preprocess.ingress_max_bytes"),
        ({"preprocess": {"ingress_max_bytes": "lots"}}, "preprocess.ingress_max_bytes"),
        ({"postprocess": {"placement": "auto"}}, "postprocess.placement"),
        ({"preprocess": {"ingress_threads": 0}}, "preprocess.ingress_threads"),
    ],
)
def test_bad_placement_args_name_the_field(args, needle):
    with pytest.raises(ConfigError) as info:
        parse_app_args(args)
    assert needle in str(info.value)


class OptionsHandle:
    """A handle whose `.options(_by_reference=False)` gives a distinct gRPC view, as Serve's handles do."""

    def __init__(self, grpc: bool = False) -> None:
        self.grpc = grpc

    def options(self, _by_reference: bool = True):
        return OptionsHandle(grpc=not _by_reference)


def test_large_payloads_go_by_reference_small_ones_over_grpc():
    t = Transport(OptionsHandle())
    assert t.pick(BY_REFERENCE_MIN_BYTES - 1).grpc and not t.pick(BY_REFERENCE_MIN_BYTES).grpc
    batch, _ = preprocess_request(load_embodiment("oxe_droid"), raw_request(t=4))
    assert arrays_bytes(batch) >= batch.images.nbytes > BY_REFERENCE_MIN_BYTES  # a DROID canvas goes by reference
    plain = object()  # local testing mode's handles have no transports: both are the handle itself
    assert Transport(plain).pick(0) is plain and Transport(plain).pick(10**9) is plain
