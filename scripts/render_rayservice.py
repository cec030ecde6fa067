"""Render a KubeRay RayService manifest (ray.io/v1) from a Serve config: the application `serve run` serves, on a
Ray cluster on Kubernetes with a CPU head and one group of GPU workers.

    python scripts/render_rayservice.py --image REGISTRY/dreamzero-serve:gpu \\
        --model-path /models/DreamZero-DROID -o rayservice.yaml
    kubectl apply -f rayservice.yaml

What goes where (docs/serving.md, "Kubernetes"):
  spec.serveConfigV2     the Serve config itself, as a YAML string: proxy, HTTP and logging options and the
                         applications. --model-path / --tokenizer-path set those args and policy.num_gpus: 1 (if it
                         was 0), the changes serve_config.yaml asks of a GPU deployment; nothing else changes.
  headGroupSpec          Ray's head (GCS, dashboard, Serve controller, a proxy). No GPUs and no logical CPUs
                         (num-gpus / num-cpus "0"), so no Policy replica is placed there; the CPU stages
                         (num_cpus: 0) may run there.
  workerGroupSpecs[0]    the GPU workers: each pod asks Kubernetes for --gpus-per-worker GPUs (nvidia.com/gpu;
                         default: one replica's `policy.num_gpus x policy.cfg_parallel`, since a cfg_parallel: 2
                         replica's STRICT_PACK placement group needs both of its GPU bundles on one node), which
                         KubeRay hands to Ray as the node's GPUs; enough pods for the Policy replicas
                         (policy.num_replicas, or policy.autoscaling's bounds, with the Ray autoscaler on).
  /dev/shm               a memory-backed emptyDir on every pod (--shm-size on the workers): Kubernetes' own /dev/shm
                         is 64 MiB, too small for NCCL's shared-memory transport and Ray's object store.
  volumes                the checkpoints: a PersistentVolumeClaim mounted read-only at --checkpoint-mount on every
                         pod. The policy replicas load from it, and Serve builds the app (which checks model_path
                         and reads the statistics and tokenizer) on whichever node it picks.

Only pyyaml is needed. The args are not validated here (their paths exist in the cluster, not on this machine):
`serve run` validates them at start; tests/unit/scripts/test_rayservice_manifest.py validates the rendered shipped
config.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "serve_config.yaml"
BUILDER = "serve_graph.builder:build_app"  # the application rendered for the GPUs; any other passes through as is
POLICY = "Policy"  # the deployment that holds the model (serve_graph.builder.POLICY)
RAY_VERSION = "2.60.0"  # pyproject.toml pins ray[serve]==2.60.*; the Dockerfile's base image carries this Ray
# The defaults of the args read here (deployments/config/sections.py: PolicyArgs, AutoscalingArgs; a test compares them)
POLICY_DEFAULTS = {"num_replicas": 1, "num_gpus": 0, "cfg_parallel": 1}
AUTOSCALING_DEFAULTS = {"min_replicas": 1, "max_replicas": 1, "initial_replicas": None}
SERVE_PORT = 8000  # Serve's default HTTP port, and the `serve` port KubeRay's Serve service targets by default
HEAD_RESOURCES = {"cpu": "4", "memory": "16Gi"}  # GCS, dashboard, Serve controller, proxy, the CPU stages
HEAD_SHM = "4Gi"  # the head's /dev/shm: Ray's object store for the CPU stages (a worker's is --shm-size)
DEFAULT_PVC = "dreamzero-models"
NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # a Kubernetes object name (RFC 1123 label)


class RenderError(Exception):
    """A config or option that cannot be rendered: printed as `error: ...`, exit status 2."""


def load_serve_config(path: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise RenderError(f"cannot read the Serve config {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise RenderError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise RenderError(f"{path} is no Serve config: expected a mapping with `applications:`")
    apps = config.get("applications")
    if not isinstance(apps, list) or not apps or not all(isinstance(a, dict) for a in apps):
        raise RenderError(f"{path} has no applications: `applications:` must list at least one application")
    return config


def dreamzero_app(config: dict[str, Any], path: Path) -> dict[str, Any]:
    apps = [a for a in config["applications"] if a.get("import_path") == BUILDER]
    if len(apps) != 1:
        raise RenderError(f"{path}: expected one application with import_path {BUILDER}, found {len(apps)}")
    if not isinstance(apps[0].get("args") or {}, dict):
        raise RenderError(f"{path}: the application's `args:` must be a mapping")
    return apps[0]


def edit_args(args: dict[str, Any], model_path: str | None, tokenizer_path: str | None) -> dict[str, Any]:
    """The args with the checkpoint's paths set; serving a checkpoint takes one GPU per policy replica."""
    args = copy.deepcopy(args)
    if model_path is not None:
        args["model_path"] = model_path
        policy = args["policy"] = mapping(args.get("policy"), "args.policy")
        if not policy.get("num_gpus"):
            policy["num_gpus"] = 1
    if tokenizer_path is not None:
        args["tokenizer_path"] = tokenizer_path
    return args


def check_paths(args: dict[str, Any], mount: str, mounted_by_hand: bool) -> bool:
    """Whether the checkpoint volume is needed: every file the app reads must be in the image or under the mount."""
    needed = mounted_by_hand
    for field in ("model_path", "tokenizer_path", "metadata_path"):
        value = args.get(field)
        if value is None or (field == "model_path" and str(value).startswith("embedded:")):
            continue  # nothing to read, or a model shipped in the image
        if not str(value).startswith(mount.rstrip("/") + "/"):
            raise RenderError(
                f"args.{field} {value!r} is not under the checkpoint mount {mount}: the pods only see the image and "
                f"the volume; give a path under {mount} or set --checkpoint-mount"
            )
        needed = True
    return needed


def policy_shape(app: dict[str, Any]) -> tuple[float, int | None, dict[str, Any] | None]:
    """(GPUs per replica, fixed replica count or None, autoscaling bounds or None) of the Policy deployment, from
    `args.policy` and then any `deployments:` override of it (which wins, as in Serve). A `cfg_parallel: 2` replica
    holds `num_gpus` for itself and as many for its rank 1 (serve_graph/builder.py: two bundles, STRICT_PACK)."""
    policy = mapping((app.get("args") or {}).get("policy"), "args.policy")
    gpus = policy.get("num_gpus", POLICY_DEFAULTS["num_gpus"])
    ranks = policy.get("cfg_parallel", POLICY_DEFAULTS["cfg_parallel"])
    if ranks not in (1, 2):
        raise RenderError(f"policy.cfg_parallel must be 1 or 2, not {ranks!r}")
    replicas = policy.get("num_replicas", POLICY_DEFAULTS["num_replicas"])
    autoscaling = policy.get("autoscaling")
    for override in app.get("deployments") or []:
        if not isinstance(override, dict) or override.get("name") != POLICY:
            continue
        if "ray_actor_options" in override:  # Serve replaces the code's actor options with these
            gpus = mapping(override["ray_actor_options"], "deployments[Policy].ray_actor_options").get("num_gpus", 0)
        if "autoscaling_config" in override:
            autoscaling = override["autoscaling_config"]
        if "num_replicas" in override:
            replicas, autoscaling = override["num_replicas"], None
    if not isinstance(gpus, (int, float)) or not isinstance(replicas, int):
        raise RenderError(f"the Policy's num_gpus ({gpus!r}) and num_replicas ({replicas!r}) must be numbers")
    if autoscaling is not None:
        bounds = {**AUTOSCALING_DEFAULTS, **mapping(autoscaling, "policy.autoscaling")}
        if not all(isinstance(bounds[k], int) for k in ("min_replicas", "max_replicas")):
            raise RenderError(f"policy.autoscaling's min_replicas and max_replicas must be numbers: {autoscaling}")
        return float(gpus) * ranks, None, bounds
    return float(gpus) * ranks, replicas, None


def mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RenderError(f"{where} must be a mapping, not {value!r}")
    return value


def pods_for(replicas: int, gpus_per_replica: float, gpus_per_pod: int) -> int:
    """GPU worker pods that hold `replicas` Policy replicas (a replica never spans two pods)."""
    if gpus_per_replica <= 0:
        return min(replicas, 1)  # a CPU policy: one worker pod, where Ray may place it
    return math.ceil(replicas / math.floor(gpus_per_pod / gpus_per_replica))


def worker_group(opts: argparse.Namespace, app: dict[str, Any], port: int, volume: bool) -> tuple[dict, bool]:
    """The GPU worker group and whether the Ray autoscaler must run (the Serve config autoscales the Policy)."""
    gpus, replicas, autoscaling = policy_shape(app)
    if opts.gpus_per_worker is None:  # one replica's GPUs (num_gpus x cfg_parallel), at least one
        opts = argparse.Namespace(**{**vars(opts), "gpus_per_worker": max(1, math.ceil(gpus))})
    if gpus > opts.gpus_per_worker:
        raise RenderError(
            f"a Policy replica holds {gpus:g} GPU(s) (policy.num_gpus x policy.cfg_parallel) but a worker pod has "
            f"{opts.gpus_per_worker} GPU(s): a Policy replica must fit in one pod; raise --gpus-per-worker"
        )
    if gpus == 0:
        print(
            "note: policy.num_gpus is 0: the Policy runs on CPU and the GPU workers stay idle; --model-path sets "
            "policy.num_gpus: 1",
            file=sys.stderr,
        )
    if autoscaling is not None:
        if opts.gpu_workers is not None:
            raise RenderError(
                "the Serve config autoscales the Policy (policy.autoscaling): the worker pods follow its "
                "min_replicas..max_replicas; drop --gpu-workers"
            )
        initial = autoscaling["initial_replicas"]
        lo, hi = (pods_for(autoscaling[k], gpus, opts.gpus_per_worker) for k in ("min_replicas", "max_replicas"))
        start = pods_for(autoscaling["min_replicas"] if initial is None else initial, gpus, opts.gpus_per_worker)
    else:
        need = pods_for(replicas, gpus, opts.gpus_per_worker)
        if opts.gpu_workers is not None and opts.gpu_workers < need:
            raise RenderError(
                f"--gpu-workers {opts.gpu_workers} cannot hold {replicas} Policy replica(s) of {gpus:g} GPU(s) on "
                f"{opts.gpus_per_worker} GPU(s) per pod: they need {need} pod(s)"
            )
        lo = hi = start = need if opts.gpu_workers is None else opts.gpu_workers
    limits = {"cpu": opts.worker_cpu, "memory": opts.worker_memory, "nvidia.com/gpu": str(opts.gpus_per_worker)}
    group = {
        "groupName": "gpu",
        "replicas": start,
        "minReplicas": lo,
        "maxReplicas": hi,
        "rayStartParams": {},  # KubeRay passes the pod's nvidia.com/gpu and cpu limits to Ray as num-gpus / num-cpus
        "template": pod_template(
            "ray-worker", opts, limits, [{"name": "serve", "containerPort": port}], volume, opts.shm_size
        ),
    }
    return group, autoscaling is not None


def pod_template(
    name: str, opts: argparse.Namespace, limits: dict, ports: list, volume: bool, shm: str
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": opts.image,
        "ports": ports,
        "resources": {"limits": dict(limits), "requests": dict(limits)},
    }
    spec: dict[str, Any] = {"containers": [container]}
    # memory-backed /dev/shm (it counts against the pod's memory limit): NCCL's and Ray's shared memory
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    if volume:
        mounts.append({"name": "models", "mountPath": opts.checkpoint_mount, "readOnly": True})
        claim = {"claimName": opts.checkpoint_pvc or DEFAULT_PVC, "readOnly": True}
        volumes.append({"name": "models", "persistentVolumeClaim": claim})
    container["volumeMounts"], spec["volumes"] = mounts, volumes
    return {"spec": spec}


def render(opts: argparse.Namespace) -> dict[str, Any]:
    """The RayService manifest for the Serve config `opts.config`, as a dict."""
    path = Path(opts.config)
    config = load_serve_config(path)
    app = dreamzero_app(config, path)
    serve_config = copy.deepcopy(config)  # the file's own options travel unchanged; only the app's args change
    edited = next(a for a in serve_config["applications"] if a.get("import_path") == BUILDER)
    edited["args"] = edit_args(app.get("args") or {}, opts.model_path, opts.tokenizer_path)
    volume = check_paths(edited["args"], opts.checkpoint_mount, opts.checkpoint_pvc is not None)
    port = int((config.get("http_options") or {}).get("port", SERVE_PORT))
    if isinstance(edited["args"].get("zmq"), dict):
        print("note: the ZeroMQ door binds its port on the pod of its replica; no Service routes it", file=sys.stderr)

    workers, autoscale = worker_group(opts, edited, port, volume)
    head_ports = [
        {"name": "gcs-server", "containerPort": 6379},  # declaring ports replaces KubeRay's defaults: list them all
        {"name": "dashboard", "containerPort": 8265},
        {"name": "client", "containerPort": 10001},
        {"name": "serve", "containerPort": port},
    ]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": opts.name},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False, width=120),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": autoscale,  # the Ray autoscaler adds GPU pods as Serve adds replicas
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "num-gpus": "0"},
                    "template": pod_template("ray-head", opts, HEAD_RESOURCES, head_ports, volume, HEAD_SHM),
                },
                "workerGroupSpecs": [workers],
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """yaml.safe_dump's dumper, writing multi-line strings (serveConfigV2) as `|` blocks and never anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def command_line(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> str:
    """The options that differ from their defaults (not -o): the command that renders this manifest again."""
    words = ["python", "scripts/render_rayservice.py"]
    if Path(opts.config).resolve() != DEFAULT_CONFIG:
        words.append(str(opts.config))
    for dest, value in vars(opts).items():  # every option is --<dest with dashes>
        if dest not in ("config", "output") and value != parser.get_default(dest):
            words += ["--" + dest.replace("_", "-"), str(value)]
    return shlex.join(words)


def dump(manifest: dict[str, Any], command: str) -> str:
    header = (
        f'# RayService for the DreamZero policy server (docs/serving.md, "Kubernetes"). Rendered by:\n#   {command}\n'
        "# Re-render rather than edit: serveConfigV2 is the Serve config `serve run` would serve.\n"
    )
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="render_rayservice.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="Serve config YAML (serve_config.yaml)")
    parser.add_argument("-o", "--output", help="write the manifest here instead of stdout")
    parser.add_argument("--name", default="dreamzero", help="RayService name (default %(default)s)")
    parser.add_argument(
        "--image", default="dreamzero-serve:gpu", help="image built from the Dockerfile, pushed where the cluster pulls"
    )
    parser.add_argument("--model-path", help="checkpoint path inside the pods, under --checkpoint-mount")
    parser.add_argument("--tokenizer-path", help="umt5-xxl tokenizer folder in the pods (<model_path>/tokenizer)")
    parser.add_argument("--checkpoint-pvc", help=f"PersistentVolumeClaim holding the checkpoints ({DEFAULT_PVC})")
    parser.add_argument("--checkpoint-mount", default="/models", help="where the claim is mounted (%(default)s)")
    parser.add_argument(
        "--gpu-workers", type=int, help="GPU worker pods (default: what the Policy replicas need; not with autoscaling)"
    )
    parser.add_argument(
        "--gpus-per-worker",
        type=int,
        help="GPUs per worker pod (default: one Policy replica's, num_gpus x cfg_parallel)",
    )
    parser.add_argument(
        "--shm-size", default="16Gi", help="a worker pod's memory-backed /dev/shm (default %(default)s)"
    )
    parser.add_argument("--worker-cpu", default="8", help="CPUs per worker pod (default %(default)s)")
    parser.add_argument("--worker-memory", default="64Gi", help="memory per worker pod (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    try:
        if not NAME.fullmatch(opts.name):
            raise RenderError(f"--name {opts.name!r} is no Kubernetes name: lower-case letters, digits and '-'")
        if (opts.gpus_per_worker is not None and opts.gpus_per_worker < 1) or (
            opts.gpu_workers is not None and opts.gpu_workers < 1
        ):
            raise RenderError("--gpus-per-worker and --gpu-workers must be at least 1")
        if not opts.checkpoint_mount.startswith("/"):
            raise RenderError(f"--checkpoint-mount {opts.checkpoint_mount!r} must be an absolute path")
        text = dump(render(opts), command_line(parser, opts))
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if opts.output:
        Path(opts.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
