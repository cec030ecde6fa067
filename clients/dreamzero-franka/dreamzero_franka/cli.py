"""`dreamzero-franka`: run DreamZero episodes on a Franka arm (or the simulated one) against a policy server.

    dreamzero-franka --server ws://gpu-box:8000 --robot-ip 172.16.0.2 \\
        --exterior-0 123456789 --exterior-1 234567891 --wrist 345678912 \\
        --prompt "put the marker in the cup" --episodes 10 --log-dir runs/franka

    # a franka_pnp server (RLinf's pick-and-place): two cameras, the task's measured target pose
    dreamzero-franka --server ws://gpu-box:8000 --robot-ip 172.16.0.2 --exterior-0 123456789 --wrist 345678912 \\
        --target-ee-pose 0.5 0.0 0.12 3.1416 0 0 --prompt "put the red block in the bin"

    # a server behind TLS: wss:// (or https://) and the CA that signed its certificate
    dreamzero-franka --server wss://gpu-box:8443 --ca-bundle /etc/dreamzero/ca.pem ...

    # also write every episode into a LeRobot v3.0 dataset to fine-tune on (needs dreamzero-franka[record])
    dreamzero-franka ... --record-dataset datasets/franka-cups

The embodiment (oxe_droid / franka_pnp) is the server's (its handshake or metadata) unless --embodiment names it.
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

from dreamzero_client.errors import ClientError, ConfigError, DreamZeroError
from dreamzero_client.tls import check_scheme, client_context
from dreamzero_droid import droid
from dreamzero_franka.common.loop import LoopConfig
from dreamzero_franka.common.operator import ConsoleOperator, Operator
from dreamzero_franka.connect import EMBODIMENTS, connect_policy
from dreamzero_franka.droid.loop import DroidEpisodeRunner
from dreamzero_franka.droid.safety import SafetyConfig, SafetyFilter
from dreamzero_franka.pnp.loop import PNP_CAMERAS, PnpEpisodeRunner
from dreamzero_franka.pnp.policy import PnpPolicy
from dreamzero_franka.pnp.safety import PnpSafetyConfig, PnpSafetyFilter
from dreamzero_franka.pnp.task_poses import TaskPoses, add_task_pose_args, task_poses_from_args

logger = logging.getLogger("dreamzero.franka")
#: --exterior-0 / --exterior-1 / --wrist name the serials of the DROID cameras, in this order
CAMERA_FLAGS = dict(zip(("exterior_0", "exterior_1", "wrist"), droid.CAMERAS))
#: franka_pnp's two cameras: --exterior-0 is RLinf's first serial (the fixed exterior view), --wrist the second
PNP_CAMERA_FLAGS = dict(zip(("exterior_0", "wrist"), PNP_CAMERAS))
#: per-embodiment defaults of the timing flags: (control Hz, open-loop horizon, max steps)
TIMING_DEFAULTS = {"oxe_droid": (15.0, 8, 450), "franka_pnp": (10.0, 12, 240)}


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
    loop: LoopConfig  # oxe_droid's (also set when the embodiment is only known after the handshake)
    safety: SafetyConfig
    embodiment: str | None = None  # None: the server's
    pnp_loop: LoopConfig | None = None
    pnp_safety: PnpSafetyConfig | None = None
    task_poses: TaskPoses | None = None  # parsed and validated here, before anything connects
    joint_reset: bool = True
    record_dataset: str | None = None  # every episode also into this LeRobot v3.0 dataset (recording.py)
    ca_bundle: str | None = None  # wss:// / https://: the CA certificate(s) the server's must chain to

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> DeployArgs:
        if ns.robot == "franky" and not ns.robot_ip:
            raise ConfigError("--robot-ip is required with --robot franky (the FCI address, e.g. 172.16.0.2)")
        embodiment = None if ns.embodiment == "auto" else ns.embodiment
        candidates = EMBODIMENTS if embodiment is None else (embodiment,)
        serials = {camera: getattr(ns, flag) for flag, camera in CAMERA_FLAGS.items()}
        serials |= {camera: getattr(ns, flag) for flag, camera in PNP_CAMERA_FLAGS.items()}
        if ns.cameras == "realsense":
            try:  # the server's embodiment is not known yet: at least franka_pnp's two serials are needed
                check_serials(embodiment or "franka_pnp", serials)
            except ConfigError:
                check_serials(embodiment or "oxe_droid", serials)
                raise
        task_poses = task_poses_from_args(ns) if ns.target_ee_pose is not None else None
        if task_poses is None and embodiment == "franka_pnp":
            task_poses_from_args(ns)  # raises: names the missing flag
        if ns.episodes < 1:
            raise ConfigError(f"--episodes must be >= 1, got {ns.episodes}")
        if ns.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be positive, got {ns.timeout_s}")
        if ns.ca_bundle is not None:  # before anything connects; the message names the options
            check_scheme(ns.server.split("://", 1)[0].lower(), ns.ca_bundle, f"--ca-bundle with --server {ns.server}")
            client_context(ns.ca_bundle, field="--ca-bundle")
        if ns.record_dataset:
            from dreamzero_franka.recording import require_extra

            require_extra()  # a robot install without the extra hears it now, not after an episode
        workspace = _floats(ns.workspace, 6, "--workspace") if ns.workspace else None
        loops = {tag: _loop_config(ns, tag) for tag in candidates}  # every candidate is checked now
        loop = loops.get("oxe_droid") or _loop_config(ns, "oxe_droid")
        safety = SafetyConfig(
            joint_margin_rad=ns.joint_margin,
            max_step_rad=ns.max_step,
            control_hz=loop.control_hz,
            workspace_min=workspace[:3] if workspace else None,
            workspace_max=workspace[3:] if workspace else None,
        )
        pnp_loop = loops.get("franka_pnp")
        pnp_safety = None
        if pnp_loop is not None:
            pnp_safety = PnpSafetyConfig(
                joint_margin_rad=ns.joint_margin,
                control_hz=pnp_loop.control_hz,
                max_abs_action=ns.max_abs_action,
                max_preview_outside_m=ns.max_jump_m,
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
            embodiment=embodiment,
            pnp_loop=pnp_loop,
            pnp_safety=pnp_safety,
            task_poses=task_poses,
            joint_reset=not ns.no_joint_reset,
            record_dataset=ns.record_dataset or None,
            ca_bundle=ns.ca_bundle,
        )


def check_serials(embodiment: str, serials: dict[str, str | None]) -> None:
    flags = CAMERA_FLAGS if embodiment == "oxe_droid" else PNP_CAMERA_FLAGS
    missing = [f"--{flag.replace('_', '-')}" for flag, cam in flags.items() if not serials[cam]]
    if missing:
        raise ConfigError(f"--cameras realsense needs a serial number for {', '.join(missing)} ({embodiment})")


def _loop_config(ns: argparse.Namespace, embodiment: str) -> LoopConfig:
    hz, horizon, steps = TIMING_DEFAULTS[embodiment]
    return LoopConfig(
        control_hz=ns.control_hz if ns.control_hz is not None else hz,
        open_loop_horizon=ns.open_loop_horizon if ns.open_loop_horizon is not None else horizon,
        max_steps=ns.max_steps if ns.max_steps is not None else steps,
        prefetch=ns.prefetch,
        prefetch_lead_steps=ns.prefetch_lead_steps,
        rtc=ns.rtc,
        rtc_max_delay_steps=ns.rtc_max_delay_steps,
        watchdog_timeout_s=ns.watchdog_timeout_s,
        max_observation_age_s=ns.max_observation_age_s or None,  # 0: no wall bound
        query_retries=ns.query_retries,
        chunk_wait_s=ns.timeout_s,
        gripper_timeout_s=ns.gripper_timeout_s,
        log_dir=ns.log_dir,
        record_video=not ns.no_video,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dreamzero-franka", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("server")
    g.add_argument("--server", required=True,
                   help="ws:// or wss://host:port[/path] (OpenPI WebSocket), http:// or https://host:port")  # fmt: skip
    g.add_argument("--api-key", default=None, help="API key, if the server requires one")
    g.add_argument("--ca-bundle", default=None, metavar="PATH",
                   help="PEM of the CA certificate(s) a wss:// / https:// server's certificate must chain to "
                   "(default: the system trust store)")  # fmt: skip
    g.add_argument("--timeout-s", type=float, default=30.0, help="per-call timeout; longer silence = server lost")
    g.add_argument("--prompt", required=True, help="the task instruction sent with every observation")
    g.add_argument("--embodiment", choices=("auto", *EMBODIMENTS), default="auto",
                   help="auto: the one the server advertises (handshake / metadata)")  # fmt: skip

    g = p.add_argument_group("robot")
    g.add_argument("--robot", choices=("franky", "sim"), default="franky", help="franky: FR3/Panda; sim: kinematic")
    g.add_argument("--robot-ip", default=None, help="FCI address of the arm (franky)")
    g.add_argument("--no-realtime", action="store_true", help="allow a non-realtime kernel (RealtimeConfig.Ignore)")
    g.add_argument("--dynamics", default="0.5,0.1,0.1", help="velocity,acceleration,jerk factors while streaming")

    g = p.add_argument_group("cameras")
    g.add_argument("--cameras", choices=("realsense", "synthetic"), default="realsense")
    g.add_argument("--exterior-0", default=None,
                   help="serial of the first exterior camera (left; franka_pnp: its fixed camera)")  # fmt: skip
    g.add_argument("--exterior-1", default=None, help="serial of the second exterior camera (oxe_droid only)")
    g.add_argument("--wrist", default=None, help="serial of the wrist camera (franka_pnp: its second camera)")
    g.add_argument("--camera-size", default="480x640", help="colour stream size HxW")
    g.add_argument("--camera-fps", type=int, default=30)

    g = p.add_argument_group("episodes")
    g.add_argument("--episodes", type=int, default=1)
    g.add_argument("--max-steps", type=int, default=None, help="per episode (default 450 oxe_droid, 240 franka_pnp)")
    g.add_argument("--control-hz", type=float, default=None, help="default 15 (oxe_droid), 10 (franka_pnp)")
    g.add_argument("--open-loop-horizon", type=int, default=None,
                   help="chunk rows executed before the next query (default 8 oxe_droid, 12 franka_pnp)")  # fmt: skip
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
    g.add_argument("--gripper-timeout-s", type=float, default=5.0, help="bound of the gripper's open at episode start")
    g.add_argument("--max-observation-age-s", type=float, default=5.0,
                   help="never execute an action whose observation is older (docs/fleet.md); 0: no bound")  # fmt: skip
    g.add_argument("--query-retries", type=int, default=0, help="failed queries asked again (arm held) before failing")
    g.add_argument("--no-joint-reset", action="store_true",
                   help="franka_pnp: skip the joint home before each episode's Cartesian reset move")  # fmt: skip
    g.add_argument("--log-dir", default="runs/franka", help="per-episode logs and videos; '' to disable")
    g.add_argument("--no-video", action="store_true")
    g.add_argument("--unattended", action="store_true", help="no operator prompts: start every episode, no labels")
    g.add_argument(
        "--record-dataset",
        default=None,
        metavar="DIR",
        help="also write every episode (the views the policy saw, state, the commands executed, the prompt, the "
        "operator's label) into this LeRobot v3.0 dataset, appending if it exists; needs dreamzero-franka[record]",
    )

    g = p.add_argument_group("safety")
    g.add_argument("--joint-margin", type=float, default=0.1, help="rad kept inside the joint limits")
    g.add_argument("--max-step", type=float, default=0.2, help="largest joint change per control step (rad)")
    g.add_argument("--workspace", default=None,
                   help="oxe_droid: TCP box xmin,ymin,zmin,xmax,ymax,zmax (m, base frame)")  # fmt: skip
    g.add_argument("--max-abs-action", type=float, default=1.5,
                   help="franka_pnp: reject chunks with a value beyond this (rows are clipped to [-1, 1])")  # fmt: skip
    g.add_argument("--max-jump-m", type=float, default=0.10,
                   help="franka_pnp: reject chunks whose executed rows leave the box by more than this")  # fmt: skip
    add_task_pose_args(p, required=False)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _devices(args: DeployArgs, embodiment: str):
    pnp = embodiment == "franka_pnp"
    if args.robot == "franky":
        from dreamzero_franka.franky_backend import (
            FrankyCartesianRobot,
            FrankyConfig,
            FrankyGripper,
            FrankyRobot,
        )

        cfg = FrankyConfig(host=args.robot_ip, realtime=args.realtime, dynamics=args.dynamics)
        robot, gripper = (FrankyCartesianRobot if pnp else FrankyRobot)(cfg), FrankyGripper(cfg)
    else:
        from dreamzero_franka.common.sim_backends import SimGripper, SimRobot
        from dreamzero_franka.pnp.cartesian import SimCartesianRobot

        robot = SimCartesianRobot(initial=args.task_poses.home_joints) if pnp else SimRobot()
        gripper = SimGripper()
    names = PNP_CAMERAS if pnp else droid.CAMERAS
    if args.cameras == "realsense":
        from dreamzero_franka.common.realsense import RealSenseCamera

        h, w = args.camera_size
        cameras = {
            name: RealSenseCamera(name, args.serials[name], width=w, height=h, fps=args.camera_fps) for name in names
        }
    else:
        from dreamzero_franka.common.sim_backends import SyntheticCamera

        cameras = {name: SyntheticCamera(name) for name in names}
    return robot, gripper, cameras


def run(args: DeployArgs, operator: Operator | None = None) -> list:
    """Connect everything, run the episodes, disconnect (the arm holds on every way out)."""
    with ExitStack() as stack:
        # the server first: it decides the embodiment, and a wrong URL or server fails before any device connects
        policy = connect_policy(
            args.server,
            args.prompt,
            api_key=args.api_key,
            timeout_s=args.timeout_s,
            embodiment=args.embodiment,
            ca_bundle=args.ca_bundle,
        )
        stack.callback(policy.close)
        embodiment = "franka_pnp" if isinstance(policy, PnpPolicy) else "oxe_droid"
        logger.info("embodiment: %s", embodiment)
        loop = args.pnp_loop if embodiment == "franka_pnp" else args.loop
        if embodiment == "franka_pnp" and args.task_poses is None:
            raise ConfigError("--target-ee-pose is required: the server runs franka_pnp")
        if args.cameras == "realsense":
            check_serials(embodiment, args.serials)
        robot, gripper, cameras = _devices(args, embodiment)
        operator = operator or (Operator() if args.unattended else ConsoleOperator())
        stack.callback(operator.close)
        dataset = None
        if args.record_dataset:  # closed after the devices: an open episode is kept, marked aborted
            from dreamzero_franka.recording import open_dataset

            dataset = open_dataset(args.record_dataset, embodiment, loop.control_hz)
            stack.callback(_close_dataset, dataset)
        for device in (robot, gripper, *cameras.values()):
            stack.enter_context(device)
        if embodiment == "franka_pnp":
            safety = PnpSafetyFilter(args.task_poses, config=args.pnp_safety)
            runner = PnpEpisodeRunner(
                robot, gripper, cameras, policy, safety, loop, operator, joint_reset=args.joint_reset, dataset=dataset
            )
        else:
            runner = DroidEpisodeRunner(
                robot, gripper, cameras, policy, SafetyFilter(args.safety), loop, operator, dataset=dataset
            )
        results = runner.run(args.episodes)
    if loop.log_dir:
        path = Path(loop.log_dir) / "session_summary.json"
        path.write_text(json.dumps([r.summary() for r in results], indent=2, default=str) + "\n")
    return results


def _close_dataset(dataset) -> None:
    dataset.close()
    per_frame = dataset.loop_seconds / max(1, dataset.frames_queued) * 1e3
    logger.info("recorded %d episodes into %s (%d frames; %.3f ms per frame on the control loop, the writes beside it)",
                dataset.episodes_written, dataset.root, dataset.frames_queued, per_frame)  # fmt: skip


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
