"""A tiny sglang-like action server for the robot client's HTTP tests (127.0.0.1, stops itself), with the real codec,
per-session steps and a script of failures; and the small observation and the quick client those tests send with.
Imports only the robot client package and numpy, so the robot client's tests can take it in a virtualenv holding
only that package (tests/support/robot_client.py)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from dreamzero_client.errors import DreamZeroError
from dreamzero_client.http_client import ActionClient
from dreamzero_client.wire import codec, replies, routes

H, D = 4, 8


def _read_body(obj: dict) -> dict:
    """What the fake server needs of a request body, read the way a client writes it (`build_request_body`): no server
    parser, so these tests run with the robot's client package alone. A body it cannot read is the client's bug."""
    inp, params, runtime = obj["input"], obj.get("parameters", {}), obj.get("runtime", {})
    b = len(params["session_ids"])
    observation = inp["observation"]
    return {
        "session_ids": params["session_ids"],
        "reset_mask": params.get("reset_mask") or [False] * b,
        "expected_steps": params.get("expected_steps"),
        "form": inp.get("form") or ("normalised" if "images" in observation else "raw"),
        "response_format": runtime.get("response_format", "envelope"),
        "output_format": runtime.get("output_format", "numpy"),
    }


def _reply(req: dict, actions: np.ndarray, sessions: list[dict], timings: dict) -> dict:
    """A 200 reply as the server writes it (docs/wire-protocol.md): the sglang envelope or the raw form."""
    values = actions if req["output_format"] == "numpy" else actions.tolist()
    extras = {"sessions": sessions, "timings": timings, "form": req["form"]}
    if req["response_format"] == "raw":
        params = {"session_ids": req["session_ids"], "reset_mask": req["reset_mask"]}
        return {"request_id": "req-1", "actions": values, "parameters": params, **extras}
    b, h, d = actions.shape
    action = {"type": "continuous", "dtype": "float32", "shape": [b, h, d], "values": values}
    return {"id": "gen-1", "object": "action.generation", "created": 0, "model": "dreamzero", **extras,
            "data": [{"index": 0, "input_index": 0, "candidate_index": 0, "action": action}]}  # fmt: skip


class FakeActionServer:
    """A tiny sglang-like action server: the real codec, per-session steps, and a script of failures.

    `script` holds replies to hand out before behaving normally: (status, headers, body_dict) or ("sleep", seconds).
    `check(decoded_body, flavour)`, when set, runs first and may raise a `DreamZeroError` (a 422 naming its field).
    """

    def __init__(self, check=None):
        self.check = check
        self.script: list = []
        self.requests: list[dict] = []
        self.steps: dict[str, int] = {}
        self.health_script: list[int] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, status, body, headers=None, flavour=codec.JSON):
                data, ctype = codec.encode_body(body, flavour)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append({"path": self.path, "headers": dict(self.headers)})
                if self.path == routes.HEALTH_PATH:
                    status = fake.health_script.pop(0) if fake.health_script else 200
                    self._send(status, {"status": "ok" if status == 200 else "loading"})
                elif self.path == routes.METADATA_PATH:
                    self._send(200, {"policy": "dreamzero", "action_horizon": H, "action_dim": D})
                elif self.path == routes.MODELS_PATH:
                    self._send(200, {"object": "list", "data": [{"id": "dreamzero"}]})
                else:
                    self._send(404, replies.error_body("not_found", f"no route {self.path}"))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if fake.script:
                    step = fake.script.pop(0)
                    if step[0] == "sleep":
                        time.sleep(step[1])
                    else:
                        status, headers, reply = step
                        return self._send(status, reply, headers)
                try:
                    obj, flavour = codec.decode_body(body, self.headers.get("Content-Type"))
                    if fake.check is not None:
                        fake.check(obj, flavour)
                except DreamZeroError as e:
                    return self._send(422, replies.error_body(e.code, str(e), getattr(e, "field", None)))
                req = _read_body(obj)
                b = len(req["session_ids"])
                reports = [fake._advance(req, i) for i in range(b)]
                actions = np.arange(b * H * D, dtype=np.float32).reshape(b, H, D)
                self._send(200, _reply(req, actions, reports, {"denoise": 1.0}), flavour=flavour)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def _advance(self, req: dict, i: int) -> dict:
        sid = req["session_ids"][i]
        expected = req["expected_steps"][i] if req["expected_steps"] else None
        reason = None
        if sid not in self.steps:
            reason = "new_session"
        elif req["reset_mask"][i]:
            reason = "reset_requested"
        elif expected is not None and expected != self.steps[sid]:
            reason = "step_mismatch"
        self.steps[sid] = 1 if reason else self.steps[sid] + 1
        restarted = reason is not None
        return {"session_id": sid, "step": self.steps[sid], "restarted": restarted, "restart_reason": reason,
                "frame_position": 2, "incarnation": None}  # fmt: skip

    def posts(self) -> list[dict]:
        return [r for r in self.requests if "body" in r]

    def decoded(self, i: int) -> dict:
        r = self.posts()[i]
        return codec.decode_body(r["body"], r["headers"]["Content-Type"])[0]

    def stop(self):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def small_observation(b=1):
    """A raw observation of `b` rows with one tiny camera and the joints: enough for the fake server."""
    return {
        "video.exterior_image_1_left": np.zeros((b, 1, 4, 4, 3), np.uint8),
        "state.joint_position": np.ones((b, 1, 7)),
    }


def action_client(server, **kw) -> ActionClient:
    """An `ActionClient` of `server` with short timeouts and backoff (tests never wait long)."""
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("backoff_s", 0.01)
    return ActionClient(server.url, **kw)
