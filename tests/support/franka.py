"""Fakes for the Franka client tests: a scripted in-process link, a small OpenPI WebSocket server, a scripted
operator, and the DROID episode runner on simulated devices (`make_runner`).

The WebSocket server speaks the OpenPI wire format (msgpack with the `__ndarray__` marker, metadata frame on connect,
`{"endpoint": "reset"}`) and answers DROID-shaped (24, 8) chunks near the pose it is sent (as a franka_pnp server:
(24, 7) rows of `pnp_chunk`). It records every reset and every session id it sees, so tests can check session
handling from the server's side.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgpack
import numpy as np

DROID_METADATA = {
    "image_resolution": [180, 320],
    "n_external_cameras": 2,
    "needs_wrist_camera": True,
    "needs_stereo_camera": False,
    "needs_session_id": True,
    "action_space": "joint_position",
}
#: what a franka_pnp DreamZero server sends on connect (its embodiment's `openpi_server_config`)
PNP_METADATA = {
    "image_resolution": [256, 256],
    "n_external_cameras": 1,
    "needs_wrist_camera": True,
    "needs_stereo_camera": False,
    "needs_session_id": True,
    "action_space": "eef_delta",
    "action_horizon": 24,
    "action_dim": 7,
    "embodiment": "franka_pnp",
}


# 1. OpenPI msgpack codec (the `__ndarray__` marker) --------------------------------------------------------------
def _encode(obj):
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _decode(obj):
    if b"__ndarray__" in obj or "__ndarray__" in obj:
        get = lambda k: obj.get(k.encode(), obj.get(k))  # noqa: E731
        return np.frombuffer(get("data"), dtype=np.dtype(get("dtype"))).reshape(get("shape"))
    if b"__npgeneric__" in obj or "__npgeneric__" in obj:
        get = lambda k: obj.get(k.encode(), obj.get(k))  # noqa: E731
        return np.dtype(get("dtype")).type(get("data"))
    return obj


def packb(obj) -> bytes:
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def unpackb(data: bytes):
    return msgpack.unpackb(data, object_hook=_decode, raw=False)


# 2. chunks near the current pose ---------------------------------------------------------------------------------
def chunk_near(joints: np.ndarray, call_index: int, horizon: int = 24, amplitude: float = 0.05) -> np.ndarray:
    """(horizon, 8): a gentle sway of joint 0 and 6 around `joints`; the gripper closes on odd calls."""
    t = np.arange(horizon) / horizon
    chunk = np.repeat(np.asarray(joints, np.float32).reshape(1, 7), horizon, axis=0)
    chunk[:, 0] += amplitude * np.sin(2 * np.pi * t + call_index)
    chunk[:, 6] += amplitude * np.cos(2 * np.pi * t + call_index)
    gripper = np.full((horizon, 1), 0.9 if call_index % 2 else 0.1, np.float32)
    return np.concatenate([chunk, gripper], axis=1).astype(np.float32)


def pnp_chunk(call_index: int, horizon: int = 24, amplitude: float = 0.3) -> np.ndarray:
    """(horizon, 7) franka_pnp rows: a slow circle in x / y (TCP frame), a small yaw; the gripper (+1 open) closes
    on odd calls."""
    t = 2 * np.pi * (np.arange(horizon) / horizon + 0.25 * call_index)
    chunk = np.zeros((horizon, 7), np.float32)
    chunk[:, 0], chunk[:, 1], chunk[:, 5] = amplitude * np.cos(t), amplitude * np.sin(t), 0.2 * np.sin(t)
    chunk[:, 6] = -1.0 if call_index % 2 else 1.0
    return chunk


# 3. in-process scripted link -------------------------------------------------------------------------------------
class ScriptedTransport:
    """A `dreamzero_droid.policy.Link`: `reply(msg, call_index)` decides each answer from the OpenPI message the
    query would be on the wire; `fail_from` makes every call from that index raise."""

    name = "scripted"

    def __init__(
        self,
        reply: Callable[[dict, int], object] | None = None,
        fail_from: int | None = None,
        delay_s: float = 0.0,
    ):
        self.reply = reply or (lambda msg, i: {"actions": chunk_near(msg["observation/joint_position"], i)})
        self.fail_from = fail_from
        self.delay_s = delay_s
        self.calls: list[dict] = []  # the OpenPI messages of the queries
        self.resets: list[str] = []
        self.closed = False

    def send(self, query):
        from dreamzero_droid.links import OpenPILink
        from dreamzero_droid.policy import LinkReply

        index = len(self.calls)
        msg = OpenPILink().message(query)
        self.calls.append(msg)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_from is not None and index >= self.fail_from:
            raise ConnectionError("connection refused (server killed)")
        reply = self.reply(msg, index)
        return LinkReply(reply.get("actions") if isinstance(reply, dict) else reply)

    def reset(self, session_id: str) -> None:
        if self.fail_from is not None and len(self.calls) >= self.fail_from:
            raise ConnectionError("connection refused (server killed)")
        self.resets.append(session_id)

    def close(self) -> None:
        self.closed = True


# 4. a fake OpenPI WebSocket server -------------------------------------------------------------------------------
class FakeOpenPIServer:
    """Serves on 127.0.0.1:<free port> from a thread. `events` holds ("reset" | "infer", session_id) tuples."""

    def __init__(self, latency_s: float = 0.0, kill_after_infers: int | None = None, embodiment: str = "oxe_droid"):
        from websockets.sync.server import serve

        self.embodiment = embodiment  # "oxe_droid" (DROID chunks) | "franka_pnp" (pnp_chunk) | "eef_delta" (no tag)
        self.latency_s = latency_s
        self.kill_after_infers = kill_after_infers  # die (without answering) on this infer request
        self.events: list[tuple] = []
        self.killed = threading.Event()
        self._lock = threading.Lock()
        self._server = serve(self._handle, "127.0.0.1", 0, max_size=64 * 2**20)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openpi", daemon=True)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _record(self, *event) -> None:
        with self._lock:
            self.events.append(event)

    def _handle(self, ws) -> None:
        from websockets.exceptions import ConnectionClosed

        if self.killed.is_set():
            ws.close()
            return
        if self.embodiment == "oxe_droid":
            ws.send(packb(DROID_METADATA))
        else:  # "eef_delta": a LIBERO-like handshake that names no embodiment
            meta = PNP_METADATA if self.embodiment == "franka_pnp" else {**PNP_METADATA, "embodiment": None}
            ws.send(packb({k: v for k, v in meta.items() if v is not None}))
        calls = 0
        try:
            for message in ws:
                if self.killed.is_set():  # a dead server: drop the connection without answering
                    ws.close()
                    return
                request = unpackb(message)
                if request.get("endpoint") == "reset":
                    self._record("reset", request.get("session_id"))
                    ws.send(packb({"status": "reset successful"}))
                    continue
                session_id = request.get("session_id", "default")
                if self.embodiment == "oxe_droid":
                    joints = np.asarray(request["observation/joint_position"], np.float32)
                    for key in ("exterior_image_0_left", "exterior_image_1_left", "wrist_image_left"):
                        image = request[f"observation/{key}"]  # one frame, or a 4-frame stack after the first query
                        assert image.shape[-3:] == (180, 320, 3) and image.dtype == np.uint8, (key, image.shape)
                else:
                    block = () if session_id not in self.sessions() else (4,)  # 1 frame, then 4-frame blocks
                    for key in ("observation/image", "observation/wrist_image"):
                        assert request[key].shape[-3:] == (128, 128, 3) and request[key].dtype == np.uint8, key
                        assert request[key].shape[:-3] == block, (key, request[key].shape)
                    assert np.asarray(request["observation/state"]).shape == (19,)
                self._record("infer", session_id)
                if self.kill_after_infers is not None and self.infers() >= self.kill_after_infers:
                    threading.Thread(target=self.kill, daemon=True).start()  # shutdown() waits for this handler
                    return
                time.sleep(self.latency_s)
                chunk = chunk_near(joints, calls) if self.embodiment == "oxe_droid" else pnp_chunk(calls)
                ws.send(packb({"actions": chunk}))
                calls += 1
        except ConnectionClosed:
            pass

    def infers(self) -> int:
        return sum(1 for event in self.events if event[0] == "infer")

    def sessions(self) -> list[str]:
        """Distinct session ids in order of first use."""
        seen: list[str] = []
        for event in self.events:
            if event[0] == "infer" and event[1] not in seen:
                seen.append(event[1])
        return seen

    def kill(self) -> None:
        """Behave like a killed server: drop open connections at their next message, refuse new ones."""
        self.killed.set()
        self._server.shutdown()

    def start(self) -> FakeOpenPIServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.killed.set()
        self._server.shutdown()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenPIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# 5. a scripted operator ------------------------------------------------------------------------------------------
class ScriptedOperator:
    """Operator double: `at_poll` maps the n-th poll (0-based, one per control tick) to the commands it returns;
    `waits` answers successive `wait` calls (default: START / NEXT, i.e. unattended)."""

    def __init__(self, at_poll: dict | None = None, waits: list | None = None):
        from dreamzero_franka.common.operator import Operator

        self._base = Operator()
        self.at_poll = at_poll or {}
        self.waits = list(waits or [])
        self.polls = 0
        self.prompts: list[str] = []

    def poll(self):
        cmds = list(self.at_poll.get(self.polls, []))
        self.polls += 1
        return cmds

    def wait(self, accepted, prompt, timeout_s=None):
        self.prompts.append(prompt)
        if self.waits:
            return self.waits.pop(0)
        return self._base.wait(accepted, prompt, timeout_s)

    def say(self, message: str) -> None:
        self.prompts.append(message)

    def close(self) -> None:
        pass


# 6. the DROID episode runner on simulated devices ---------------------------------------------------------------
HZ = 50.0  # faster than 15 Hz so the tests take well under a second per episode


def make_runner(transport, operator=None, safety=None, robot=None, cameras=None, **loop):
    """(runner, robot, gripper): a `DroidEpisodeRunner` at `HZ` on simulated devices (three synthetic cameras, one of
    them at another size), its DROID policy over `transport`; `loop` overrides `LoopConfig`'s fields."""
    from dreamzero_droid.policy import DroidPolicy
    from dreamzero_franka.common.loop import LoopConfig
    from dreamzero_franka.common.sim_backends import SimGripper, SimRobot, SyntheticCamera
    from dreamzero_franka.droid.loop import DroidEpisodeRunner
    from dreamzero_franka.droid.safety import SafetyConfig, SafetyFilter

    loop = {"control_hz": HZ, "max_steps": 40, "watchdog_timeout_s": 0.3, "record_video": False, **loop}
    robot = robot or SimRobot()
    gripper = SimGripper()
    cameras = cameras or {
        "exterior_image_0_left": SyntheticCamera("ext0", 180, 320),
        "exterior_image_1_left": SyntheticCamera("ext1", 480, 640),  # resized + padded by the policy
        "wrist_image_left": SyntheticCamera("wrist", 180, 320),
    }
    for device in (robot, gripper, *cameras.values()):
        device.connect()
    policy = DroidPolicy(transport, prompt="put the cube in the bowl", session_prefix="franka")
    runner = DroidEpisodeRunner(
        robot,
        gripper,
        cameras,
        policy,
        safety or SafetyFilter(SafetyConfig(control_hz=15.0)),
        LoopConfig(**loop),
        operator or ScriptedOperator(),
    )
    return runner, robot, gripper
