"""`dreamzero-franka`: run DreamZero episodes on a Franka arm (or the simulated one) against a policy server.

    dreamzero-franka --server ws://gpu-box:8000 --robot-ip 172.16.0.2 \\
        --exterior-0 123456789 --exterior-1 234567891 --wrist 345678912 \\
        --prompt "put the marker in the cup" --episodes 10 --log-dir runs/franka

Exit status: 0 when no episode failed, 1 when one did, 2 for a usage / configuration / connection error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from dreamzero_client import droid
from dreamzero_client.errors import ClientError, ConfigError, DreamZeroError
from dreamzero_client.franka.loop import EpisodeRunner, LoopConfig
from dreamzero_client.franka.operator import ConsoleOperator, Operator
from dreamzero_client.franka.policy import connect_policy
from dreamzero_client.franka.safety import SafetyConfig, SafetyFilter

logger = logging.getLogger("dreamzero.franka")
#: --exterior-0 / --exterior-1 / --wrist name the serials of the DROID cameras, in this order
CAMERA_FLAGS = dict(zip(("exterior_0", "exterior_1", "wrist"), droid.CAMERAS))


def _floats(text: str, n: int, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} must be {n} comma-separated numbers, got {text!r}") from None
    if len(values) != n:
        raise ConfigError(f"{flag} must be {n} comma-separated numbers, got {len(values)}: {text!r}")
    return values


def _size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--camera-size must look like 480x640 (height x width), got {text!r}") from None
    return h, w


@dataclass
class DeployArgs:
    """Typed, validated command line."""

    server: str
    prompt: str
    robot: str
    robot_ip: str | None
    realtime: bool
    dynamics: tuple[float, float, float]
    cameras: str
    serials: dict[str, str | None]
    camera_size: tuple[int, int]
    camera_fps: int
    api_key: str | None
    timeout_s: float
    episodes: int
    unattended: bool
    loop: LoopConfig
    safety: SafetyConfig

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> DeployArgs:
        if ns.robot == "franky" and not ns.robot_ip:
            raise ConfigError("--robot-ip is required with --robot franky (the FCI address, e.g. 172.16.0.2)")
        serials = {camera: getattr(ns, flag) for flag, camera in CAMERA_FLAGS.items()}
        if ns.cameras == "realsense":
            missing = [f"--{flag.replace('_', '-')}" for flag, cam in CAMERA_FLAGS.items() if not serials[cam]]
            if missing:
                raise ConfigError(f"--cameras realsense needs a serial number for {', '.join(missing)}")
        if ns.episodes < 1:
            raise ConfigError(f"--episodes must be >= 1, got {ns.episodes}")
        if ns.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be positive, got {ns.timeout_s}")
        workspace = _floats(ns.workspace, 6, "--workspace") if ns.workspace else None
        safety = SafetyConfig(
            joint_margin_rad=ns.joint_margin,
            max_step_rad=ns.max_step,
            control_hz=ns.control_hz,
            workspace_min=workspace[:3] if workspace else None,
            workspace_max=workspace[3:] if workspace else None,
        )
        loop = LoopConfig(
            control_hz=ns.control_hz,
            open_loop_horizon=ns.open_loop_horizon,
            max_steps=ns.max_steps,
            prefetch=ns.prefetch,
            prefetch_lead_steps=ns.prefetch_lead_steps,
            rtc=ns.rtc,
            rtc_max_delay_steps=ns.rtc_max_delay_steps,
            watchdog_timeout_s=ns.watchdog_timeout_s,
            chunk_wait_s=ns.timeout_s,
            log_dir=ns.log_dir,
            record_video=not ns.no_video,
        )
        return cls(
            server=ns.server,
            prompt=ns.prompt,
            robot=ns.robot,
            robot_ip=ns.robot_ip,
            realtime=not ns.no_realtime,
            dynamics=_floats(ns.dynamics, 3, "--dynamics"),
            cameras=ns.cameras,
            serials=serials,
            camera_size=_size(ns.camera_size),
            camera_fps=ns.camera_fps,
            api_key=ns.api_key,
            timeout_s=ns.timeout_s,
            episodes=ns.episodes,
            unattended=ns.unattended,
            loop=loop,
            safety=safety,
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dreamzero-franka", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("server")
    g.add_argument("--server", required=True, help="ws://host:port[/path] (OpenPI WebSocket) or http://host:port")
    g.add_argument("--api-key", default=None, help="API key, if the server requires one")
    g.add_argument("--timeout-s", type=float, default=30.0, help="per-call timeout; longer silence = server lost")
    g.add_argument("--prompt", required=True, help="the task instruction sent with every observation")

    g = p.add_argument_group("robot")
    g.add_argument("--robot", choices=("franky", "sim"), default="franky", help="franky: FR3/Panda; sim: kinematic")
    g.add_argument("--robot-ip", default=None, help="FCI address of the arm (franky)")
    g.add_argument("--no-realtime", action="store_true", help="allow a non-realtime kernel (RealtimeConfig.Ignore)")
    g.add_argument("--dynamics", default="0.5,0.1,0.1", help="velocity,acceleration,jerk factors while streaming")

    g = p.add_argument_group("cameras")
    g.add_argument("--cameras", choices=("realsense", "synthetic"), default="realsense")
    g.add_argument("--exterior-0", default=None, help="serial of the first exterior camera (left of the scene)")
    g.add_argument("--exterior-1", default=None, help="serial of the second exterior camera")
    g.add_argument("--wrist", default=None, help="serial of the wrist camera")
    g.add_argument("--camera-size", default="480x640", help="colour stream size HxW")
    g.add_argument("--camera-fps", type=int, default=30)

    g = p.add_argument_group("episodes")
    g.add_argument("--episodes", type=int, default=1)
    g.add_argument("--max-steps", type=int, default=450, help="steps per episode (450 = 30 s at 15 Hz)")
    g.add_argument("--control-hz", type=float, default=15.0)
    g.add_argument("--open-loop-horizon", type=int, default=8, help="chunk rows executed before the next query")
    g.add_argument("--prefetch", action="store_true", help="query the next chunk while executing the current one")
    g.add_argument("--prefetch-lead-steps", type=int, default=2)
    g.add_argument(
        "--rtc",
        action="store_true",
        help="real-time chunking: prefetch with the measured delay d, the server continues the executing chunk, "
        "switch to row d of the new one (docs/rtc.md); replaces --prefetch",
    )
    g.add_argument("--rtc-max-delay-steps", type=int, default=None, help="cap on the measured delay (default H // 2)")
    g.add_argument(
        "--watchdog-timeout-s", type=float, default=0.5, help="hold the arm after this long without a command"
    )
    g.add_argument("--log-dir", default="runs/franka", help="per-episode logs and videos; '' to disable")
    g.add_argument("--no-video", action="store_true")
    g.add_argument("--unattended", action="store_true", help="no operator prompts: start every episode, no labels")

    g = p.add_argument_group("safety")
    g.add_argument("--joint-margin", type=float, default=0.1, help="rad kept inside the joint limits")
    g.add_argument("--max-step", type=float, default=0.2, help="largest joint change per control step (rad)")
    g.add_argument("--workspace", default=None, help="TCP box xmin,ymin,zmin,xmax,ymax,zmax (m, base frame)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _devices(args: DeployArgs):
    if args.robot == "franky":
        from dreamzero_client.franka.franky_backend import FrankyConfig, FrankyGripper, FrankyRobot

        cfg = FrankyConfig(host=args.robot_ip, realtime=args.realtime, dynamics=args.dynamics)
        robot, gripper = FrankyRobot(cfg), FrankyGripper(cfg)
    else:
        from dreamzero_client.franka.sim_backends import SimGripper, SimRobot

        robot, gripper = SimRobot(), SimGripper()
    if args.cameras == "realsense":
        from dreamzero_client.franka.realsense import RealSenseCamera

        h, w = args.camera_size
        cameras = {
            name: RealSenseCamera(name, args.serials[name], width=w, height=h, fps=args.camera_fps)
            for name in droid.CAMERAS
        }
    else:
        from dreamzero_client.franka.sim_backends import SyntheticCamera

        cameras = {name: SyntheticCamera(name) for name in droid.CAMERAS}
    return robot, gripper, cameras


def run(args: DeployArgs, operator: Operator | None = None) -> list:
    """Connect everything, run the episodes, disconnect (the arm holds on every way out)."""
    robot, gripper, cameras = _devices(args)
    operator = operator or (Operator() if args.unattended else ConsoleOperator())
    with ExitStack() as stack:
        policy = connect_policy(args.server, args.prompt, api_key=args.api_key, timeout_s=args.timeout_s)
        stack.callback(policy.close)
        for device in (robot, gripper, *cameras.values()):
            stack.enter_context(device)
        runner = EpisodeRunner(robot, gripper, cameras, policy, SafetyFilter(args.safety), args.loop, operator)
        results = runner.run(args.episodes)
    operator.close()
    if args.loop.log_dir:
        path = Path(args.loop.log_dir) / "session_summary.json"
        path.write_text(json.dumps([r.summary() for r in results], indent=2, default=str) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.INFO, format="%(asctime)s %(message)s")
    if ns.log_dir == "":
        ns.log_dir = None
    try:
        args = DeployArgs.from_namespace(ns)
        results = run(args)
    except KeyboardInterrupt:  # outside an episode (connecting, between episodes): nothing is moving
        print("interrupted", file=sys.stderr)
        return 1
    except (DreamZeroError, ClientError, OSError, ValueError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for r in results:
        print(json.dumps({k: v for k, v in r.summary().items() if k != "latencies_ms"}, default=str))
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
