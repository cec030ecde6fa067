"""`dreamzero-eval`: run the DROID simulation evaluation against a policy server (or the embedded policy).

Defaults: the local MuJoCo scene, scenes 1-3, 1 episode each, the OpenPI WebSocket at 127.0.0.1:8000, open-loop
horizon 8. Writes videos, per-step JSON, summary.json / summary.md and report.html under --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dreamzero.cli_help import DefaultsHelpFormatter
from dreamzero.embedded_default import SHIPPED_DEFAULT as DEFAULT_MODEL
from dreamzero.errors import ConfigError, DreamZeroError, MissingDependency


@dataclass
class CliArgs:
    sim: str
    scenes: list[int]
    episodes: int
    policy: str
    host: str
    port: int
    path: str
    url: str | None
    api_key: str | None
    ca_bundle: str | None
    timeout_s: float
    model_path: str | None
    open_loop_horizon: int
    rtc: bool
    rtc_delay_steps: int | None
    predicted_video: bool
    record_dataset: Path | None
    max_steps: int | None
    out: Path
    seed: int
    render: str
    image_size: list[int]
    layouts: str | None
    instruction: str | None
    no_video: bool
    no_progress: bool
    no_report: bool
    isaac_layout: str
    isaac_device: str
    isaac_asset_root: str | None
    isaac_object_names: list[str] | None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dreamzero-eval", description=__doc__, formatter_class=DefaultsHelpFormatter)
    g = p.add_argument_group("simulation")
    g.add_argument(
        "--sim",
        choices=("mujoco", "isaac", "libero"),
        default="mujoco",
        help="simulator: the MuJoCo DROID scene, Isaac Lab sim-evals, or LIBERO (docs/libero.md)",
    )
    g.add_argument(
        "--scenes",
        type=int,
        nargs="+",
        choices=(1, 2, 3, 4),
        default=[1, 2, 3],
        help="DROID scenes to run; 4 (MuJoCo only): two objects, two targets, four instructions (docs/evaluation.md)",
    )
    g.add_argument("--episodes", type=int, default=1, help="episodes per scene")
    g.add_argument("--max-steps", type=int, default=None, help="step limit per episode (default: the env's, 450)")
    g.add_argument("--seed", type=int, default=0, help="base seed (object placement jitter)")
    g.add_argument(
        "--render",
        choices=("quality", "fast"),
        default="quality",
        help="MuJoCo rendering: meshes, or collision geometry only (fast, for CI)",
    )
    g.add_argument(
        "--image-size",
        type=int,
        nargs=2,
        default=[180, 320],
        metavar=("H", "W"),
        help="MuJoCo camera resolution (the policy always gets resize_with_pad to 180x320)",
    )
    g.add_argument(
        "--layouts",
        choices=("wide", "compact"),
        default=None,
        help="scene 1 only: draw the cube / bowl placement from this demonstration distribution "
        "(dreamzero-record-demos --layouts) with the episode seed, instead of the scene's fixed positions + jitter; "
        "use a --seed far from the recording seeds (e.g. 100000) for held-out layouts",
    )
    g.add_argument(
        "--instruction",
        "--instructions",
        dest="instruction",
        default=None,
        metavar="TEXT",
        help="scene 4 only: one of its four instructions ('put the cube in the bowl', 'put the cube in the mug', "
        "'put the can in the bowl', 'put the can in the mug'), or 'all' for one per episode from its seed, every "
        "four consecutive episodes asking each once (default: all)",
    )
    g = p.add_argument_group("policy")
    g.add_argument("--policy", choices=("openpi", "http", "embedded"), default="openpi", help="how to reach the policy")
    g.add_argument("--host", default="127.0.0.1", help="host name, or a ws:// / wss:// URL for --policy openpi")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--path", default="/", help="OpenPI WebSocket path (e.g. /v1/realtime/robot/openpi)")
    g.add_argument("--url", default=None, help="HTTP base URL, http:// or https:// (default http://HOST:PORT)")
    g.add_argument("--api-key", default=None)
    g.add_argument(
        "--ca-bundle",
        default=None,
        metavar="PATH",
        help="PEM of the CA certificate(s) a wss:// / https:// server's certificate must chain to (default: the "
        "system trust store)",
    )
    g.add_argument("--timeout-s", type=float, default=120.0, help="per-call timeout")
    g.add_argument(
        "--model-path",
        default=DEFAULT_MODEL,
        help="--policy embedded: a checkpoint or embedded:<name> (default: %(default)s, the shipped trained model "
        "serve_config.yaml serves)",
    )
    g.add_argument("--open-loop-horizon", type=int, default=8, help="chunk rows executed before the next query")
    g.add_argument(
        "--rtc",
        action="store_true",
        help="real-time chunking: query while the chunk still runs, switch d steps later to row d (docs/rtc.md)",
    )
    g.add_argument(
        "--rtc-delay-steps",
        type=int,
        default=None,
        metavar="D",
        help="with --rtc: the emulated inference delay in control steps (default: the measured round trip)",
    )
    g = p.add_argument_group("outputs")
    g.add_argument(
        "--predicted-video",
        action="store_true",
        help="ask for each chunk's predicted video: every episode gets an imagined-vs-real video and a per-chunk "
        "error curve in the report (docs/evaluation.md)",
    )
    g.add_argument(
        "--record-dataset",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write every episode (frames the policy saw, state, actions executed, instruction, success) into "
        "this LeRobot v3.0 dataset, appending if it exists; dreamzero-make-metadata and dreamzero-train read it",
    )
    g.add_argument("--out", type=Path, default=None, help="run directory (default runs/droid-eval-<time>)")
    g.add_argument("--no-video", action="store_true", help="skip the mp4s")
    g.add_argument("--no-report", action="store_true", help="skip report.html")
    g.add_argument(
        "--no-progress", action="store_true", help="no progress (a bar on a terminal, a plain line every 30 s in a log)"
    )
    g = p.add_argument_group("isaac lab (sim-evals)")
    g.add_argument(
        "--isaac-layout",
        choices=("auto", "legacy", "per_scene"),
        default="auto",
        help="'legacy': DROID + set_scene; 'per_scene': DROID-CubeInBowl, ...",
    )
    g.add_argument("--isaac-device", default="cuda:0")
    g.add_argument("--isaac-asset-root", default=None, help="sets SIM_EVALS_ASSET_ROOT")
    g.add_argument(
        "--isaac-object-names",
        nargs=2,
        default=None,
        metavar=("OBJECT", "TARGET"),
        help="rigid-object names in the Isaac scene used by the success rule",
    )
    from eval.libero.cli import add_libero_arguments  # --suite, --tasks, --init-states, --num-envs, --form, ...

    add_libero_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> CliArgs:
    return droid_args(build_parser().parse_args(argv))


def droid_args(ns: argparse.Namespace) -> CliArgs:
    """The DROID options out of a parsed namespace (the LIBERO options, used only with `--sim libero`, are dropped)."""
    args = CliArgs(**{k: v for k, v in vars(ns).items() if k in CliArgs.__dataclass_fields__})
    if args.out is None:
        args.out = Path("runs") / time.strftime("droid-eval-%Y%m%d-%H%M%S")
    for name in ("episodes", "open_loop_horizon"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max-steps: expected >= 1, got {args.max_steps}")
    if args.layouts is not None and (args.sim != "mujoco" or args.scenes != [1]):
        raise ConfigError(
            f"--layouts: the sampled layouts are MuJoCo scene 1's; got --sim {args.sim} --scenes {args.scenes}"
        )
    if 4 in args.scenes and args.sim != "mujoco":
        raise ConfigError(f"--scenes: scene 4 (two objects, two targets) is MuJoCo's; got --sim {args.sim}")
    if args.instruction is not None:
        from eval.mujoco_droid.table2 import check_instruction_choice

        if args.scenes != [4]:
            raise ConfigError(f"--instruction: the instructions are scene 4's; got --scenes {args.scenes}")
        try:
            args.instruction = check_instruction_choice(args.instruction)
        except ConfigError as exc:
            raise ConfigError(f"--{exc}") from None
    if args.rtc_delay_steps is not None and (not args.rtc or args.rtc_delay_steps < 1):
        raise ConfigError(f"--rtc-delay-steps: expected >= 1 together with --rtc, got {args.rtc_delay_steps}")
    if args.ca_bundle is not None and args.policy == "embedded":
        raise ConfigError("--ca-bundle: the embedded policy runs in this process; use it with --policy openpi or http")
    return args


def make_env_factory(args: CliArgs):
    if args.sim == "mujoco":
        from eval.mujoco_droid.env import MujocoDroidEnv

        def factory(scene: int):
            return MujocoDroidEnv(
                scene,
                image_size=tuple(args.image_size),
                render_quality=args.render,
                max_episode_steps=args.max_steps or 450,
                layouts=args.layouts,
                instruction=args.instruction if scene == 4 else None,
            )

        return factory
    from eval.isaac_sim_evals import make_isaac_env

    def isaac_factory(scene: int):
        names = tuple(args.isaac_object_names) if args.isaac_object_names else None
        return make_isaac_env(
            scene,
            layout=args.isaac_layout,
            device=args.isaac_device,
            asset_root=args.isaac_asset_root,
            max_episode_steps=args.max_steps or 450,
            object_names=names,
        )

    return isaac_factory


def server_tls(url: str, ca_bundle: str | None, url_option: str) -> dict:
    """The links' TLS keyword (`ca_bundle`), checked here so a bad one names the option, before anything connects."""
    from dreamzero_client.tls import check_scheme, client_context

    if ca_bundle is None:
        return {}
    check_scheme(url.split("://", 1)[0], ca_bundle, f"--ca-bundle with {url_option} {url}")
    client_context(ca_bundle, field="--ca-bundle")
    return {"ca_bundle": ca_bundle}


def make_policy(args: CliArgs):
    from dreamzero_client.openpi_client import build_uri
    from eval.policy_links import make_policy

    if args.policy == "openpi":
        url = build_uri(args.host, args.port, args.path)
        tls = server_tls(url, args.ca_bundle, "--host")
        return make_policy("openpi", url=url, api_key=args.api_key, timeout_s=args.timeout_s, **tls)
    if args.policy == "http":
        url = args.url or f"http://{args.host}:{args.port}"
        tls = server_tls(url, args.ca_bundle, "--url")
        return make_policy("http", base_url=url, api_key=args.api_key, timeout_s=args.timeout_s, **tls)
    print(f"dreamzero-eval: --policy embedded runs {args.model_path} in this process", file=sys.stderr)
    return make_policy("embedded", model_path=args.model_path)


def asking_for_video(policy, on: bool):
    """`--predicted-video`: the link asks for the predicted frames with every chunk."""
    if on:
        policy.link.return_video = True
    return policy


def main(argv: list[str] | None = None) -> int:
    from eval.runner import EvalConfig, run_evaluation

    ns = build_parser().parse_args(argv)
    if ns.sim == "libero":  # B environments per request, RLinf's way (eval/libero)
        from eval.libero.cli import run_from_args

        return run_from_args(ns)
    try:
        args = droid_args(ns)
        policy = asking_for_video(make_policy(args), args.predicted_video)
    except DreamZeroError as exc:  # a configuration error (or a checkpoint that does not load): one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = EvalConfig(
        out_dir=args.out,
        scenes=tuple(args.scenes),
        episodes_per_scene=args.episodes,
        open_loop_horizon=args.open_loop_horizon,
        rtc=args.rtc,
        rtc_delay_steps=args.rtc_delay_steps,
        predicted_video=args.predicted_video,
        record_dataset=args.record_dataset,
        max_steps=args.max_steps,
        seed=args.seed,
        record_video=not args.no_video,
        extra={
            "simulator": args.sim,
            "policy": args.policy,
            "render": args.render,
            **({"layouts": args.layouts} if args.layouts else {}),
            **({"instruction": args.instruction or "all"} if 4 in args.scenes else {}),
        },
    )
    try:
        # a bar on a terminal; in a log file, where \r redraws would pile up, a plain line every 30 s
        show_progress = not args.no_progress
        summary = run_evaluation(make_env_factory(args), policy, config, show_progress=show_progress)
    except (ConfigError, MissingDependency) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        policy.close()
    from eval.summary import summary_markdown

    print(summary_markdown(summary))
    if not args.no_report:
        from eval.report import write_report

        print(f"report: {write_report(args.out)}")
    print(f"outputs: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
