"""The ZeroMQ door in-process for the unit tests (no Ray): its real stages behind stand-in deployment handles
(`FakeHandle`), a replay policy, and the door serving in a thread of its own (`start_zmq_door`)."""

from __future__ import annotations

import asyncio
import inspect
import threading

from deployments.config.sections import ReplayArgs
from deployments.config.settings import PolicySettings
from deployments.doors.zmq import ZmqDoor
from deployments.graph_runner import GraphRunner
from deployments.policy import PolicyDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from serve_graph.builder import zmq_door_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.host import free_port

TOKEN = "door-token"


class _Method:
    def __init__(self, fn, delay_s: float = 0.0):
        self.fn, self.delay_s = fn, delay_s

    def remote(self, *args):
        async def run():
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            out = self.fn(*args)
            return await out if inspect.isawaitable(out) else out

        return asyncio.ensure_future(run())  # awaitable and cancellable, like a DeploymentResponse


class FakeHandle:
    """Stands in for a DeploymentHandle: `.options(...)` is ignored, `.m.remote(...)` runs on the caller's loop."""

    def __init__(self, obj, delay_s: float = 0.0):
        self.obj, self.delay_s, self.calls = obj, delay_s, []

    def options(self, **kwargs):
        return self

    def __getattr__(self, name):
        self.calls.append(name)
        return _Method(getattr(self.obj, name), self.delay_s if name == "generate" else 0.0)


def start_zmq_door(episode_dir, policy_delay_s=0.0, **zmq_args):
    """(door, loop, thread, port, handles): the ZeroMQ door with key `TOKEN` on a free loopback port, serving in a
    thread of its own over the real stages (a replay policy of `episode_dir`'s episode 1) behind `FakeHandle`s;
    `zmq_args` are the app's `zmq` options. Stop it with `loop.call_soon_threadsafe(door.killed.set)`."""
    port = free_port()
    cfg = parse_app_args({"api_key": TOKEN, "zmq": {"port": port, "host": "127.0.0.1", **zmq_args}})
    replay = ReplayArgs(dataset=str(episode_dir), episode=1, stride=8)
    policy = PolicyDeployment(PolicySettings(replay=replay))
    handles = (FakeHandle(PreprocessDeployment()), FakeHandle(policy, policy_delay_s),
               FakeHandle(PostprocessDeployment()))  # fmt: skip
    settings = zmq_door_settings(cfg, resolve_model(cfg))
    door = ZmqDoor(GraphRunner(*handles, settings.graph), settings)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        sock = door.bind()
        started.set()
        loop.run_until_complete(door.serve(sock))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    return door, loop, thread, port, handles
