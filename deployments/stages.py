"""Where a raw request's preprocess and postprocess run: on their own deployments, or in the front door's process.

The graph always has its four deployments. Moving a raw DROID request (~2 MB of frames) to a Preprocess replica and
its ~2.7 MB canvas back costs two gRPC hops, the pickling on both ends and a turn of three event loops: on the 2-core
development box that was ~33 ms against ~5 ms of CPU in the transforms themselves (docs/benchmarks.md). So by default
(`preprocess.placement: auto`) a request whose arrays are small enough runs the same transforms in the front door,
on a small thread pool (the image kernel releases the GIL, the event loop keeps serving), and only large requests
(720p cameras, many rows) take the hop, where Preprocess replicas add CPUs. Postprocess is microseconds of numpy on
[B, H, 32] and runs in the front door unless `postprocess.placement: replicas`.

The graph runner (`deployments.graph_runner`, behind every front door) uses this class, so the choice is made in one
place. Each call
returns an awaitable with `cancel()` (a DeploymentResponse, or an asyncio future), which the callers' deadlines use.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deployments.calls import Transport
from deployments.config.settings import GraphSettings
from deployments.metrics import ServingMetrics
from deployments.preprocess import preprocess_request
from deployments.requests.generations import GenerationRequest
from dreamzero.embodiments import Embodiment, PostprocessContext

log = logging.getLogger("dreamzero.serve.stages")

#: bytes assumed per element of a JSON (list) array: it arrives as Python ints / floats, converted on parse
LIST_ITEM_BYTES = 8


def array_bytes(value: Any) -> int:
    """Bytes of one observation value: an ndarray's buffer, a nested list's elements at LIST_ITEM_BYTES each, a dict's
    values summed."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(array_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        count, node = 1, value
        while isinstance(node, (list, tuple)):  # JSON arrays are rectangular (else parsing refuses them)
            count *= len(node)
            if not node:
                return 0
            node = node[0]
        return count * LIST_ITEM_BYTES
    return 0


def observation_bytes(observation: Any) -> int:
    """Bytes of a raw request's arrays (images dominate); a non-dict observation counts 0 (parsing refuses it)."""
    return array_bytes(observation) if isinstance(observation, dict) else 0


class RawStages:
    """Runs a raw request's preprocess and postprocess where the app's args say."""

    def __init__(
        self,
        embodiment: Embodiment,
        preprocess: Transport,
        postprocess: Any,
        settings: GraphSettings,
        metrics: ServingMetrics | None = None,
    ):
        """`preprocess`: the Preprocess deployment in both transports (large requests go by reference);
        `postprocess`: its handle; `settings`: the placements (`preprocess`, `postprocess`); `metrics`: None: not
        counted."""
        self.embodiment = embodiment
        self._metrics = metrics
        self._preprocess, self._postprocess = preprocess, postprocess
        pre = settings.preprocess
        self.pre_placement = pre.placement
        self.ingress_max_bytes = int(pre.ingress_max_bytes)
        self.post_placement = settings.postprocess.placement
        self._pool: ThreadPoolExecutor | None = None
        if self.pre_placement != "replicas":
            self._pool = ThreadPoolExecutor(pre.ingress_threads, thread_name_prefix="dreamzero-stages")
            embodiment.warm_up()  # compile the image kernel now, not on the first request
        log.info(
            "raw requests: preprocess %s (up to %d bytes here), postprocess %s",
            self.pre_placement,
            self.ingress_max_bytes,
            self.post_placement,
        )

    def preprocess_here(self, request: GenerationRequest) -> bool:
        """True when this process runs the request's transforms itself."""
        if self.pre_placement == "auto":
            return observation_bytes(request.observation) <= self.ingress_max_bytes
        return self.pre_placement == "ingress"

    def preprocess(self, request: GenerationRequest) -> Any:
        """Start preprocessing; await the result: (ModelBatch, PostprocessContext)."""
        if self.preprocess_here(request):
            self._count("preprocess", "ingress")
            loop = asyncio.get_running_loop()
            return loop.run_in_executor(self._pool, preprocess_request, self.embodiment, request)
        self._count("preprocess", "replicas")
        return self._preprocess.pick(observation_bytes(request.observation)).run.remote(request)

    def postprocess(self, actions: np.ndarray, context: PostprocessContext) -> Any:
        """Start postprocessing; await the robot actions."""
        if self.post_placement == "replicas":
            self._count("postprocess", "replicas")
            return self._postprocess.run.remote(actions, context)
        self._count("postprocess", "ingress")
        done = asyncio.get_running_loop().create_future()
        try:
            done.set_result(self.embodiment.postprocess(actions, context))
        except Exception as exc:  # noqa: BLE001 - raised where the caller awaits, as from a replica
            done.set_exception(exc)
        return done

    def _count(self, stage: str, where: str) -> None:
        if self._metrics is not None:
            self._metrics.raw_stage_runs.inc(1, tags={"stage": stage, "where": where})

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
