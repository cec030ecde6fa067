"""Fakes for the evaluation and DROID runtime tests: a tiny OpenPI WebSocket server, scripted links, a fake Isaac env.

`FakeOpenPIServer` speaks the DROID OpenPI protocol (handshake, infer, reset) on 127.0.0.1 with failures that a test
can inject: an error frame, a bad (non-finite) chunk, or the whole server stopping after N calls.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import serve

from deployments.requests import openpi as openpi_frames
from dreamzero_client.errors import BadRequestError
from dreamzero_client.wire import openpi
from dreamzero_droid.policy import DroidPolicy, LinkReply, PolicyCallError

IMAGE_KEYS = ("observation/exterior_image_0_left", "observation/exterior_image_1_left", "observation/wrist_image_left")


def drift_chunk(joints: np.ndarray, horizon: int = 24, step_rad: float = 0.01, gripper: float = 0.8) -> np.ndarray:
    """A chunk that moves every joint by `step_rad` per row from `joints` (so tests can see it was executed)."""
    rows = np.arange(1, horizon + 1)[:, None] * step_rad
    return np.concatenate([joints[None, :7] + rows, np.full((horizon, 1), gripper)], axis=1).astype(np.float32)


class FakeOpenPIServer:
    """OpenPI WebSocket server on a free loopback port, run in a background thread.

    error_at / bad_chunk_at: 1-based infer call numbers answered with an error frame / a NaN chunk.
    stop_after: stop the whole server (close connections, stop listening) right after answering that many infers.
    """

    def __init__(
        self,
        error_at: tuple[int, ...] = (),
        bad_chunk_at: tuple[int, ...] = (),
        stop_after: int | None = None,
        reply_as_dict: bool = True,
    ):
        self.error_at, self.bad_chunk_at, self.stop_after = set(error_at), set(bad_chunk_at), stop_after
        self.reply_as_dict = reply_as_dict
        self.infer_calls = 0
        self.resets: list[str | None] = []
        self.requests: list[dict] = []
        self.frame_counts: list[int] = []  # camera frames per infer: 1 on a session's first query, then 4
        self._lock = threading.Lock()
        self._server = serve(self._handle, "127.0.0.1", 0, compression=None, max_size=64 * 2**20, close_timeout=1)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.stopped = threading.Event()

    def _handle(self, ws) -> None:
        ws.send(openpi.pack_frame({**openpi_frames.handshake_config(), "action_horizon": 24, "action_dim": 8}))
        try:
            for raw in ws:
                msg, _ = openpi.unpack_frame(raw)
                if msg.get("endpoint") == "reset":
                    self.resets.append(msg.get("session_id"))
                    ws.send(openpi.pack_frame({"status": "reset successful"}))
                    continue
                with self._lock:
                    self.infer_calls += 1
                    n = self.infer_calls
                    self.requests.append({k: v for k, v in msg.items() if k not in IMAGE_KEYS})
                self.frame_counts.append(1 if np.asarray(msg[IMAGE_KEYS[0]]).ndim == 3 else len(msg[IMAGE_KEYS[0]]))
                for key in IMAGE_KEYS:  # the DROID wire size after resize_with_pad: one frame or a stack
                    assert np.asarray(msg[key]).shape[-3:] == (180, 320, 3), (key, np.asarray(msg[key]).shape)
                if n in self.error_at:
                    ws.send(
                        openpi.pack_frame(openpi_frames.error_frame("Internal inference error", code="internal_error"))
                    )
                    continue
                chunk = drift_chunk(np.asarray(msg["observation/joint_position"], dtype=np.float64))
                if n in self.bad_chunk_at:
                    chunk[3, 2] = np.nan
                report = {"session_id": msg.get("session_id"), "step": n, "incarnation": "fake-1", "restarted": n == 1}
                ws.send(openpi.pack_frame(openpi_frames.infer_reply(chunk, self.reply_as_dict, {"session": report})))
                if self.stop_after is not None and n >= self.stop_after:
                    threading.Thread(target=self.stop, daemon=True).start()
                    return
        except ConnectionClosed:
            return

    def stop(self) -> None:
        if not self.stopped.is_set():
            self.stopped.set()
            self._server.shutdown()  # closes the listening socket and every open connection

    def close(self) -> None:
        self.stop()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ScriptedLink:
    """In-process Link: drift chunks from the current joints; `fail_at` maps call number -> failure reason."""

    name = "scripted"

    def __init__(self, fail_at: dict[int, str] | None = None, horizon: int = 24):
        self.fail_at = fail_at or {}
        self.horizon = horizon
        self.calls: list[tuple[int, str, str]] = []  # (frames sent, prompt, session id)
        self.resets: list[str] = []

    def send(self, query):
        self.calls.append((len(query.frames), query.prompt, query.session_id))
        n = len(self.calls)
        if n in self.fail_at:
            raise PolicyCallError(self.fail_at[n], f"injected at call {n}")
        joints = query.frames[-1].joint_position.astype(np.float64)
        return LinkReply(drift_chunk(joints, self.horizon).astype(np.float64))

    def reset(self, session_id):
        self.resets.append(session_id)

    def close(self):
        pass


class RecordingLink:
    """A Link that answers zeros and a session report; `reports` script the report of each call."""

    name = "recording"

    def __init__(self, reports=None, actions=None):
        self.queries, self.resets, self.reports, self.actions = [], [], list(reports or []), actions

    def send(self, query):
        self.queries.append(query)
        report = self.reports.pop(0) if self.reports else None
        actions = np.zeros((24, 8), np.float32) if self.actions is None else self.actions
        return LinkReply(actions, report, {"total": 1.0})

    def reset(self, session_id):
        self.resets.append(session_id)

    def close(self):
        pass


class RtcScriptedLink(ScriptedLink):
    """Drift chunks from the observed joints; with RTC and a client prefix the chunk continues the prefix (its first
    d rows are the prefix, then 0.01 rad a row on), as the server's clamp would. `refuse` answers 422 naming it."""

    def __init__(self, refuse: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.refuse, self.queries = refuse, []

    def send(self, query):
        self.queries.append(query)
        rtc = query.rtc
        if rtc is not None and self.refuse:
            raise BadRequestError(
                f"unknown field {self.refuse}", 422, "invalid_observation", f"parameters.{self.refuse}"
            )
        reply = super().send(query)
        actions, session = np.array(reply.actions), {"session_id": query.session_id, "step": len(self.calls)}
        if rtc is not None:
            d = rtc.prefix_len
            actions[:d, :7] = rtc.action_prefix[:d, :7]
            actions[d:, :7] = actions[d - 1, :7] + 0.01 * np.arange(1, self.horizon - d + 1)[:, None]
            session["rtc"] = "client_prefix"
        return LinkReply(actions, session)


def scripted_policy(**kwargs) -> tuple[DroidPolicy, ScriptedLink]:
    link = ScriptedLink(**kwargs)
    return DroidPolicy(link, session_prefix="droid-eval"), link


def mujoco_env(scene):
    """The MuJoCo DROID scene at a small image size and fast rendering: what the runner tests evaluate on."""
    from eval.mujoco_droid import MujocoDroidEnv

    return MujocoDroidEnv(scene, image_size=(90, 160), render_quality="fast")


class FakeIsaacEnv:
    """Mimics a sim-evals DROID env (num_envs = 1, torch tensors, `obs["policy"]`, `unwrapped.scene[name].data`)."""

    def __init__(self, new_layout: bool = True, image_shape=(720, 1280, 3), names=("cube", "bowl")):
        self.new_layout = new_layout
        self.image_shape = image_shape
        self.device = "cpu"
        self.unwrapped = self
        self.actions: list[torch.Tensor] = []
        self.reset_calls = 0
        self.closed = False
        self.joints = torch.zeros(1, 7)
        obj, tgt = names
        self.scene = {
            obj: SimpleNamespace(
                data=SimpleNamespace(
                    root_pos_w=torch.tensor([[0.5, 0.2, 0.02]]), root_quat_w=torch.tensor([[1.0, 0, 0, 0]])
                )
            ),
            tgt: SimpleNamespace(
                data=SimpleNamespace(
                    root_pos_w=torch.tensor([[0.5, -0.2, 0.0]]), root_quat_w=torch.tensor([[1.0, 0, 0, 0]])
                )
            ),
        }

    def _obs(self):
        img = torch.randint(0, 255, (1, *self.image_shape), dtype=torch.uint8)
        policy = {
            "external_cam": img,
            "wrist_cam": img.clone(),
            "arm_joint_pos": self.joints.clone(),
            "gripper_pos": torch.tensor([[0.0]]),
        }
        if self.new_layout:
            policy["external_cam_2"] = img.clone()
        return {"policy": policy}

    def reset(self, seed=None):
        self.reset_calls += 1
        return self._obs(), {}

    def step(self, action):
        assert isinstance(action, torch.Tensor) and tuple(action.shape) == (1, 8), action
        self.actions.append(action)
        self.joints = action[:, :7].clone()
        false = torch.tensor([False])
        return self._obs(), torch.tensor([0.0]), false, false, {}

    def close(self):
        self.closed = True
