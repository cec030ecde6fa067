"""Transport between replicas: one handle call carrying N bytes of uint8 over Serve's gRPC transport vs by reference.

A caller replica sends `{"images": uint8[N]}` to a replica that only reads its size, with the graph's replica
settings (`serve_graph.builder.REPLICA_ENV`), alternating the two transports round by round so both see the same
machine. The sizes are a normalised tiny-model canvas (4 frames of 32x64), a raw DROID request (3 cameras x 4 frames
of 180x320) and its 352x640 canvas, with two sizes around the switch between them. `deployments/calls.py` picks the
transport by payload size from these figures.

    python benchmarks/transport_hop.py                  # print
    python benchmarks/transport_hop.py --write-docs     # also write docs/benchmarks.md "Transport between replicas"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
from serving_common import machine_line, percentile, start_serve, stop_serve, write_section

from deployments.calls import BY_REFERENCE_MIN_BYTES
from serve_graph.builder import REPLICA_ENV

SIZES = {
    "normalised canvas, 4 x 32x64": 4 * 32 * 64 * 3,
    "256 KiB": 256 * 1024,
    "1 MiB": 1024 * 1024,
    "raw DROID request, 3 x 4 x 180x320": 3 * 4 * 180 * 320 * 3,
    "DROID canvas, 4 x 352x640": 4 * 352 * 640 * 3,
}
OPTIONS = {"ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": dict(REPLICA_ENV)}}}


@serve.deployment(**OPTIONS)
class Reader:
    def take(self, payload: dict) -> int:
        return int(payload["images"].nbytes)


@serve.deployment(**OPTIONS)
class Sender:
    def __init__(self, reader):
        self.transports = {"grpc": reader.options(_by_reference=False), "by reference": reader}

    async def round(self, nbytes: int, calls: int) -> dict[str, list[float]]:
        """`calls` calls per transport, alternating; ms per call."""
        payload = {"images": np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)}
        out: dict[str, list[float]] = {name: [] for name in self.transports}
        for _ in range(calls):
            for name, handle in self.transports.items():
                t0 = time.perf_counter()
                assert await handle.take.remote(payload) == nbytes
                out[name].append((time.perf_counter() - t0) * 1e3)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=60, help="measured calls per transport and size")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the section into this file")
    args = ap.parse_args(argv)
    start_serve()
    try:
        sender = serve.run(Sender.bind(Reader.bind()), name="transport", route_prefix="/transport")
        rows = []
        for label, nbytes in SIZES.items():
            sender.round.remote(nbytes, 3).result(timeout_s=300)  # warm-up: channels, object store
            ms = sender.round.remote(nbytes, args.calls).result(timeout_s=600)
            rows.append((label, nbytes, {k: (percentile(v, 50), percentile(v, 99)) for k, v in ms.items()}))
    finally:
        stop_serve()
    lines = [
        f"One handle call between two replicas carrying uint8 arrays, {machine_line()}; {args.calls} calls per "
        "transport and size, alternating.",
        "",
        "| payload | bytes | gRPC p50 / p99 ms | by reference p50 / p99 ms | by reference / gRPC (p50) |",
        "|---|---|---|---|---|",
    ]
    for label, nbytes, r in rows:
        (g50, g99), (r50, r99) = r["grpc"], r["by reference"]
        lines.append(f"| {label} | {nbytes:,} | {g50:.1f} / {g99:.1f} | {r50:.1f} / {r99:.1f} | {r50 / g50:.2f} |")
    lines += [
        "",
        f"`deployments/calls.py` sends a call by reference from {BY_REFERENCE_MIN_BYTES:,} bytes of arrays on, "
        "over gRPC below. Reproduce: `python benchmarks/transport_hop.py --write-docs`.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        write_section(
            Path(args.write_docs), "Transport between replicas", "Written by `benchmarks/transport_hop.py`.\n\n" + text
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
