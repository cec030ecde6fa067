"""The graph on a two-node Ray cluster (both nodes on this machine): the Policy on the node with the `gpu_node`
resource, the ingress, preprocess and postprocess on the head; one request end to end; and proof that the head's
stages never open anything under the checkpoint.

How the proof works: both nodes are started with a `sitecustomize.py` on PYTHONPATH, so every Python process Ray
starts there (every replica included) installs an audit hook (`sys.addaudithook`) on the "open" event. The hook logs
each opened path under the checkpoint's folder with its pid, and each process notes its pid once when the hook is
installed. The test then checks, by the pids of the replicas (from the GCS actor table), that the hook was running in
each head-side replica and that none of them opened a file there, while the Policy replica did (a positive control:
the hook sees Python-level opens such as config.json; files read by native code, e.g. safetensors' mmap, are not
seen, which is why the control is config.json). An audit hook is used rather than /proc/<pid>/fd, which shows only
files open at the instant it is read.

The cluster is private: a temp dir and ports per node (tests/support/ray_nodes.py); teardown kills exactly its
processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.host import free_port
from tests.support.ray_nodes import two_node_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DRIVER_TIMEOUT_S = 300
HEAD_ONLY, GPU_NODE = {"head": 0.01}, {"gpu_node": 0.01}

AUDIT_HOOK = textwrap.dedent(
    """
    import os, sys

    _root, _dir, _label = os.environ["DZ_AUDIT_ROOT"], os.environ["DZ_AUDIT_DIR"], os.environ["DZ_AUDIT_LABEL"]

    def _note(name, line):
        fd = os.open(os.path.join(_dir, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _hook(event, args):
        if event != "open" or not args or isinstance(args[0], int):
            return
        try:
            path = os.path.abspath(os.fsdecode(args[0]))
        except Exception:
            return
        if path == _root or path.startswith(_root + os.sep):
            _note("opens.log", f"{_label}\\t{os.getpid()}\\t{path}\\n")

    _note("installed.log", f"{_label}\\t{os.getpid()}\\n")
    sys.addaudithook(_hook)
    """
)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(GCS address, checkpoint folder, audit folder) of a private two-node cluster, torn down afterwards."""
    from tests.support.checkpoints import write_tiny_layouts

    work = tmp_path_factory.mktemp("two-node")
    checkpoint = write_tiny_layouts(work / "ckpt")["hf"]
    audit, hook_dir = work / "audit", work / "hook"
    audit.mkdir()
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(AUDIT_HOOK)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO), str(REPO / "clients" / "dreamzero-client")]),
        "DZ_AUDIT_ROOT": str(work / "ckpt"),
        "DZ_AUDIT_DIR": str(audit),
        "DREAMZERO_CACHE_DIR": str(work / "cache"),
    }
    head = (2, {"head": 1}, {"DZ_AUDIT_LABEL": "head"})
    node = (2, {"gpu_node": 1}, {"DZ_AUDIT_LABEL": "gpu_node"})
    with two_node_cluster(env, head, node, prefixes=("rth", "rtg")) as (address, _, _):
        yield address, checkpoint, audit


def test_policy_on_the_second_node_and_the_head_never_opens_the_checkpoint(two_nodes):
    address, checkpoint, audit = two_nodes
    out = audit.parent / "driver.json"
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'clients' / 'dreamzero-client'}",
    }
    env.pop("DZ_AUDIT_ROOT", None)
    cmd = [sys.executable, "-m", "tests.cluster.test_two_node", address, str(checkpoint), str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, timeout=DRIVER_TIMEOUT_S, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())

    # 1. one raw request through the graph, answered with DROID robot actions by the policy on the second node
    assert report["status"] == 200 and report["action_shape"] == [1, 24, 8], report
    assert report["metadata_embodiment"] == "oxe_droid"
    replicas = report["replicas"]  # deployment -> {"node": resource label, "pid": ...}
    assert replicas["Policy"]["node"] == "gpu_node"
    assert all(replicas[name]["node"] == "head" for name in ("Ingress", "Preprocess", "Postprocess")), replicas

    # 2. the audit hook ran in every replica; only the policy opened files under the checkpoint
    installed = {int(line.split("\t")[1]) for line in (audit / "installed.log").read_text().splitlines()}
    opens = [line.split("\t") for line in (audit / "opens.log").read_text().splitlines()]
    opened_by = {int(pid) for _, pid, _ in opens}
    for name, where in replicas.items():
        assert where["pid"] in installed, f"no audit hook in the {name} replica (pid {where['pid']})"
    head_stages = {replicas[name]["pid"] for name in ("Ingress", "Preprocess", "Postprocess")}
    assert not head_stages & opened_by, [o for o in opens if int(o[1]) in head_stages]
    assert not [o for o in opens if o[0] == "head"], "a head-node process opened the checkpoint"
    policy_opens = {Path(path).name for _, pid, path in opens if int(pid) == replicas["Policy"]["pid"]}
    assert "config.json" in policy_opens, opens  # the control: the hook does see the policy load the checkpoint


# ---------------------------------------------------------------------------------------------------------------------
# The driver, run in its own process (a pytest process may already be connected to another cluster)
# ---------------------------------------------------------------------------------------------------------------------


def _drive(address: str, checkpoint: str, out: str) -> None:
    import httpx
    import numpy as np
    import ray
    from ray import serve

    from dreamzero_client.wire import codec, routes
    from serve_graph.builder import build_app
    from tests.support.request_builders import content_type, decode, raw_body

    ray.init(address=address, log_to_driver=False)
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, proxy_location="HeadOnly")
    args = {
        "model_path": checkpoint,
        "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
        "sessions": {"max_sessions": 4},
        "policy": {"resources": GPU_NODE},
        **{stage: {"resources": HEAD_ONLY} for stage in ("ingress", "preprocess", "postprocess")},
    }
    serve.run(build_app(args), name="two-node", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{http_port}"
    with httpx.Client(timeout=60, trust_env=False) as client:
        deadline = time.monotonic() + 90
        while client.get(f"{url}/health").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("/health not 200 within 90 s")
            time.sleep(0.5)
        headers = {"content-type": content_type(codec.OPENPI)}
        reply = client.post(url + routes.GENERATIONS_PATH, content=raw_body(["robot-0"]), headers=headers)
        meta = client.get(url + routes.METADATA_PATH).json()
    values = decode(reply.content, codec.OPENPI)["data"][0]["action"]["values"] if reply.status_code == 200 else []
    labels = {node["NodeID"]: ("gpu_node" if "gpu_node" in node["Resources"] else "head") for node in ray.nodes()}
    replicas = {}
    for actor in ray._private.state.actors(actor_state_name="ALIVE").values():
        if actor["ActorClassName"].startswith("ServeReplica:two-node:"):
            name = actor["ActorClassName"].rsplit(":", 1)[1]
            replicas[name] = {"node": labels[actor["Address"]["NodeID"]], "pid": actor["Pid"]}
    report = {
        "status": reply.status_code,
        "action_shape": list(np.asarray(values).shape),
        "metadata_embodiment": meta.get("embodiment"),
        "replicas": replicas,
    }
    Path(out).write_text(json.dumps(report))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    _drive(*sys.argv[1:4])
