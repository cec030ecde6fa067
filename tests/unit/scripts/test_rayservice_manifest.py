"""scripts/render_rayservice.py: the KubeRay RayService it renders from the shipped serve_config.yaml carries exactly
that Serve config (its args valid for the project's own config model), only the checkpoint and GPU settings change
with --model-path, the cluster has a GPU-less head and GPU workers sized for the Policy replicas, the committed
example (docs/kubernetes/rayservice.yaml) is current, and bad input fails with `error: ...` and exit status 2.
No cluster here: the manifest is checked as data; KubeRay itself never runs in CI."""

from __future__ import annotations

import ast
import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.config.sections import AutoscalingArgs, PolicyArgs
from dreamzero.embedded_default import resolve_model_path
from serve_graph.config import parse_app_args

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "render_rayservice.py"
EXAMPLE = ROOT / "docs" / "kubernetes" / "rayservice.yaml"
IMAGE = "registry.example.com/dreamzero-serve:gpu"
MODEL = "/models/DreamZero-DROID"
EXAMPLE_ARGS = ["--image", IMAGE, "--model-path", MODEL]
SHIPPED = yaml.safe_load((ROOT / "serve_config.yaml").read_text())

_spec = importlib.util.spec_from_file_location("render_rayservice", SCRIPT)
render_rayservice = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_rayservice)


def render(capsys, *argv) -> dict:
    assert render_rayservice.main([str(a) for a in argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def serve_config(manifest: dict) -> dict:
    text = manifest["spec"]["serveConfigV2"]
    assert isinstance(text, str), "KubeRay takes serveConfigV2 as a YAML string"
    return yaml.safe_load(text)


def pods(manifest: dict) -> tuple[dict, dict]:
    cluster = manifest["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    return cluster["headGroupSpec"], workers


def container(group: dict) -> dict:
    (c,) = group["template"]["spec"]["containers"]
    return c


def test_serve_config_v2_is_the_shipped_config(capsys):
    manifest = render(capsys)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    served = serve_config(manifest)
    assert served == SHIPPED  # applications (import path, route prefix, args) and proxy / HTTP / logging options
    (app,) = served["applications"]
    # validated as `serve run` would: embedded:small-scene1 is in the package, here and in the image alike
    assert parse_app_args(app["args"]).model_path == resolve_model_path("embedded:small-scene1")


def test_model_path_changes_only_the_checkpoint_and_the_gpus(capsys, tmp_path):
    served = serve_config(render(capsys, *EXAMPLE_ARGS))
    expected = copy.deepcopy(SHIPPED)
    expected["applications"][0]["args"]["model_path"] = MODEL
    expected["applications"][0]["args"]["policy"]["num_gpus"] = 1  # README: "policy: num_gpus: 1  # per replica"
    assert served == expected

    # Validate the args the cluster gets with the project's own model. MODEL is a path inside the pods, so the honest
    # check is the same args with the volume's mount point (/models) mapped to a local folder that holds a checkpoint
    # under the same name: the embedded default, a real hf-layout checkpoint with its tokenizer and statistics
    # beside it. Everything else (num_gpus: 1 included) is validated as rendered.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "DreamZero-DROID").symlink_to(resolve_model_path("embedded:small-scene1"))
    args = copy.deepcopy(served["applications"][0]["args"])
    args["model_path"] = str(tmp_path) + args["model_path"]
    cfg = parse_app_args(args)
    assert (cfg.policy.num_gpus, cfg.resolved_device, cfg.resolved_layout) == (1, "cuda", "hf")


def test_tokenizer_path_is_the_other_change(capsys):
    served = serve_config(render(capsys, *EXAMPLE_ARGS, "--tokenizer-path", "/models/umt5-xxl"))
    assert served["applications"][0]["args"]["tokenizer_path"] == "/models/umt5-xxl"


def test_the_cluster_has_a_gpu_less_head_and_one_gpu_per_policy_replica(capsys):
    manifest = render(capsys, *EXAMPLE_ARGS)
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == render_rayservice.RAY_VERSION
    assert cluster["enableInTreeAutoscaling"] is False  # the shipped config does not autoscale the Policy
    head, workers = pods(manifest)
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in container(head)["resources"]["limits"]
    assert container(workers)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (1, 1, 1)  # 1 replica x 1 GPU
    for group in (head, workers):  # every pod sees the checkpoints: Serve may build the app on any node
        c = container(group)
        assert c["image"] == IMAGE
        assert {"name": "serve", "containerPort": 8000} in c["ports"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        (volume,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "models"]
        assert volume["persistentVolumeClaim"] == {"claimName": "dreamzero-models", "readOnly": True}
        assert shm_of(group)["medium"] == "Memory"  # NCCL and Ray's object store need more than Kubernetes' 64 MiB
    assert {p["name"] for p in container(head)["ports"]} >= {"gcs-server", "dashboard", "client"}


def test_without_a_checkpoint_nothing_is_mounted_and_the_idle_gpus_are_named(capsys):
    assert render_rayservice.main([]) == 0
    captured = capsys.readouterr()
    head, workers = pods(yaml.safe_load(captured.out))  # the embedded default is in the image
    for group in (head, workers):  # /dev/shm only
        assert [v["name"] for v in group["template"]["spec"]["volumes"]] == ["dshm"]
    assert "policy.num_gpus is 0" in captured.err and "--model-path sets policy.num_gpus: 1" in captured.err


def shm_of(group: dict) -> dict:
    """The emptyDir mounted at /dev/shm in a group's pod."""
    (mount,) = [m for m in container(group)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume["emptyDir"]


def test_a_cfg_parallel_replica_fits_one_worker_pod_with_a_memory_backed_shm(capsys, tmp_path):
    """`cfg_parallel: 2` asks Ray for a STRICT_PACK placement group of two bundles (serve_graph/builder.py): the
    worker pod must hold both, or the replica stays pending forever."""
    from serve_graph.builder import policy_options

    config = with_policy(tmp_path, {"num_gpus": 1, "cfg_parallel": 2})
    manifest = render(capsys, config, *EXAMPLE_ARGS)
    _, workers = pods(manifest)
    limits = container(workers)["resources"]["limits"]
    args = copy.deepcopy(serve_config(manifest)["applications"][0]["args"])
    args["model_path"] = resolve_model_path("embedded:small-scene1")  # a path that exists here, nothing else changed
    opts = policy_options(parse_app_args(args))
    bundles = opts["placement_group_bundles"]
    assert opts["placement_group_strategy"] == "STRICT_PACK" and len(bundles) == 2
    assert sum(b.get("GPU", 0) for b in bundles) <= int(limits["nvidia.com/gpu"]) == 2
    assert sum(b.get("CPU", 0) for b in bundles) <= float(limits["cpu"])
    assert shm_of(workers) == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert workers["replicas"] == 1  # one replica, both of its ranks in one pod
    # a pod too small for both ranks is refused, naming the knob
    assert render_rayservice.main([str(config), *EXAMPLE_ARGS, "--gpus-per-worker", "1"]) == 2
    assert "policy.num_gpus x policy.cfg_parallel" in capsys.readouterr().err


def with_policy(tmp_path: Path, policy: dict, deployments: list | None = None) -> Path:
    config = copy.deepcopy(SHIPPED)
    app = config["applications"][0]
    app["args"]["policy"].update(policy)
    if deployments is not None:
        app["deployments"] = deployments
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_an_autoscaled_policy_gets_worker_bounds_and_the_ray_autoscaler(capsys, tmp_path):
    # autoscaling where the shipped config keeps replica counts: its `deployments:` section
    scaled = [{"name": "Policy", "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}]
    config = with_policy(tmp_path, {}, deployments=scaled)
    manifest = render(capsys, config, *EXAMPLE_ARGS)
    _, workers = pods(manifest)
    assert manifest["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (1, 1, 4)
    assert serve_config(manifest)["applications"][0]["deployments"][0]["autoscaling_config"]["max_replicas"] == 4

    _, workers = pods(render(capsys, config, *EXAMPLE_ARGS, "--gpus-per-worker", "2"))
    assert (workers["minReplicas"], workers["maxReplicas"]) == (1, 2)  # two 1-GPU replicas per 2-GPU pod
    assert container(workers)["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_worker_count_follows_replicas_and_deployment_overrides(capsys, tmp_path):
    _, workers = pods(render(capsys, *EXAMPLE_ARGS, "--gpu-workers", "3"))  # spare capacity is allowed
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (3, 3, 3)

    config = with_policy(tmp_path, {"num_gpus": 1}, deployments=[{"name": "Policy", "num_replicas": 3}])
    manifest = render(capsys, config, "--image", IMAGE)
    assert pods(manifest)[1]["replicas"] == 3
    assert serve_config(manifest)["applications"][0]["deployments"] == [{"name": "Policy", "num_replicas": 3}]


def test_the_renderer_reads_the_defaults_the_config_model_has():
    assert render_rayservice.POLICY_DEFAULTS == {
        f: getattr(PolicyArgs(), f) for f in ("num_replicas", "num_gpus", "cfg_parallel")
    }
    bounds = AutoscalingArgs()
    assert render_rayservice.AUTOSCALING_DEFAULTS == {
        f: getattr(bounds, f) for f in render_rayservice.AUTOSCALING_DEFAULTS
    }
    # the Policy deployment's name, read from the builder's source (importing it would import Ray Serve)
    tree = ast.parse((ROOT / "serve_graph" / "builder.py").read_text())
    names = {
        target.id: value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
        for target, value in zip(node.targets[0].elts, node.value.elts)
    }
    assert names["POLICY"] == render_rayservice.POLICY


def test_the_committed_example_is_current(capsys, tmp_path):
    out = tmp_path / "rayservice.yaml"
    assert render_rayservice.main([*EXAMPLE_ARGS, "-o", str(out)]) == 0
    assert out.read_text() == EXAMPLE.read_text(), (
        f"{EXAMPLE.relative_to(ROOT)} is stale: python scripts/render_rayservice.py {' '.join(EXAMPLE_ARGS)} "
        f"-o {EXAMPLE.relative_to(ROOT)}"
    )
    assert " ".join(EXAMPLE_ARGS) in EXAMPLE.read_text().splitlines()[1]  # its header says how it was rendered


def run_script(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.fixture
def bad_configs(tmp_path) -> dict[str, Path]:
    texts = {
        "no_applications": "proxy_location: EveryNode\nhttp_options: {port: 8000}\n",
        "empty_applications": "applications: []\n",
        "not_yaml": "applications: [\n",
        "other_app": "applications:\n  - name: x\n    import_path: other.module:app\n",
    }
    for name, text in texts.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    return {name: tmp_path / f"{name}.yaml" for name in texts}


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no_applications", "has no applications"),
        ("empty_applications", "has no applications"),
        ("not_yaml", "is not valid YAML"),
        ("other_app", "expected one application with import_path serve_graph.builder:build_app"),
        ("missing", "cannot read the Serve config"),
    ],
)
def test_a_bad_config_fails_with_a_message_naming_it(bad_configs, tmp_path, case, expected):
    path = bad_configs.get(case, tmp_path / "missing.yaml")
    result = run_script(path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and expected in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--gpu-workers", "two"], "invalid int value: 'two'"),
        (["--model-path", "/data/DreamZero-DROID"], "args.model_path '/data/DreamZero-DROID' is not under"),
        (["--model-path", MODEL, "--gpu-workers", "0"], "must be at least 1"),
        (["--name", "Dream_Zero"], "is no Kubernetes name"),
    ],
)
def test_bad_options_exit_2_without_a_traceback(argv, expected):
    result = run_script(*argv)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr and result.stdout == ""


def test_impossible_sizes_fail_with_what_to_change(capsys, tmp_path):
    config = with_policy(tmp_path, {}, deployments=[{"name": "Policy", "num_replicas": 2}])
    assert render_rayservice.main([str(config), *EXAMPLE_ARGS, "--gpu-workers", "1"]) == 2
    assert "they need 2 pod(s)" in capsys.readouterr().err
    config = with_policy(tmp_path, {"num_gpus": 2})
    assert render_rayservice.main([str(config), *EXAMPLE_ARGS, "--gpus-per-worker", "1"]) == 2
    assert "raise --gpus-per-worker" in capsys.readouterr().err
    config = with_policy(tmp_path, {}, deployments=[{"name": "Policy", "autoscaling_config": {"max_replicas": 2}}])
    assert render_rayservice.main([str(config), *EXAMPLE_ARGS, "--gpu-workers", "2"]) == 2
    assert "drop --gpu-workers" in capsys.readouterr().err


def test_help_works():
    result = run_script("--help")
    assert result.returncode == 0 and "serveConfigV2" in result.stdout and "--model-path" in result.stdout
