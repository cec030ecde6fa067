"""The GPU check's two first stages, each run by `scripts/gpu_check.py` in its own process with its own timeout:

    python scripts/gpu_stages.py env --results FILE     # GPU, driver, torch, CUDA, Triton, NCCL, free memory
    python scripts/gpu_stages.py smoke --results FILE   # a torch.compile of an SDPA attention, checked against eager

`env` costs a second and says what every later figure ran on; `smoke` costs about 10 s on a GPU and shows that
torch.compile can build here (Triton's toolchain, a C compiler, CUDA headers) before the compiled latency stage
spends minutes finding out. Each appends one JSON line to FILE (`{"stage": ..., "figure": ..., ...}`) as soon as it
has it. With `$DREAMZERO_SIMULATED_GPU` (the CPU rehearsal) the device is this CPU standing in for a GPU of that size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def append(path: str | None, line: dict) -> None:
    if not path:
        return
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - absent or broken: reported as absent
        return None
    return getattr(mod, "__version__", "present")


def _driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def env_facts() -> dict:
    """What the figures ran on."""
    import torch

    from dreamzero.device import simulated_gpu_bytes

    facts = {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "triton": _version("triton"),
        "python": sys.version.split()[0],
        "driver": _driver(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(0)
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        facts |= {
            "device": torch.cuda.get_device_name(0),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "total_gib": total / 2**30,
            "free_gib": free / 2**30,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "bf16": torch.cuda.is_bf16_supported(),
        }
    else:
        simulated = simulated_gpu_bytes()
        facts |= {
            "device": f"CPU simulating a GPU of {simulated / 2**30:.0f} GiB" if simulated else "CPU (no GPU)",
            "total_gib": simulated / 2**30 if simulated else None,
            "free_gib": None,
            "nccl": None,
        }
    return facts


def smoke(device_name: str | None = None) -> dict:
    """torch.compile of a small attention block (SDPA + a projection) on the device, compared with eager."""
    import torch
    import torch.nn.functional as F

    on_cuda = torch.cuda.is_available()
    device = torch.device(device_name or ("cuda" if on_cuda else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 8, 256, 64, generator=g).to(device, dtype) for _ in range(3))
    w = (torch.randn(512, 512, generator=g) / 512**0.5).to(device, dtype)

    def block(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(1, 256, 512) @ w

    eager = block(q, k, v)
    compiled = torch.compile(block, dynamic=False)
    t0 = time.perf_counter()
    got = compiled(q, k, v)
    if device.type == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    err = (got.float() - eager.float()).abs().max().item()
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    if not err <= tol:
        raise SystemExit(f"smoke: compiled SDPA differs from eager by {err:.3g} (> {tol})")
    backend = None
    if device.type == "cuda":
        backend = "flash" if torch.backends.cuda.flash_sdp_enabled() else "math/efficient"
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "compile_s": compile_s,
            "max_abs_diff": err, "sdpa_flash_enabled": backend}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=("env", "smoke"))
    ap.add_argument("--results", default=os.environ.get("GPU_CHECK_RESULTS"), help="JSON-lines file to append to")
    args = ap.parse_args(argv)
    if args.stage == "env":
        facts = env_facts()
        append(args.results, {"stage": "env", "figure": "environment", **facts})
        print(json.dumps(facts, indent=1))
        if facts["gpus"] == 0 and facts.get("total_gib") is None:  # neither a GPU nor a simulated one
            print(f"env: torch {facts['torch']} (CUDA build {facts['cuda_build']}) sees no GPU", flush=True)
            return 1
        return 0
    got = smoke()
    append(args.results, {"stage": "smoke", "figure": "compile_smoke", **got})
    print(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
