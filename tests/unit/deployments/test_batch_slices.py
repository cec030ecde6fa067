"""deployments.batch_slices and `ContinuousBatcher.slice_rows`: a farm's request is cut to the rows a robot can wait
out, every row-indexed field alike, and the slices' results join back in row order; with no robot stating a budget
nothing is cut."""

from __future__ import annotations

import numpy as np

from deployments.batch_slices import join_results, slice_batch, slices
from deployments.batcher import REALTIME_SHARE, ContinuousBatcher
from dreamzero.types import ChunkResult, ModelBatch, SessionReport


def farm_batch(n: int) -> ModelBatch:
    return ModelBatch(
        images=np.arange(n, dtype=np.uint8).reshape(n, 1, 1, 1, 1) * np.ones((1, 1, 2, 2, 3), np.uint8),
        state=np.arange(n, dtype=np.float32).reshape(n, 1, 1),
        state_mask=np.ones((n, 1, 1), bool),
        prompts=[f"p{i}" for i in range(n)],
        session_ids=[f"env-{i}" for i in range(n)],
        expected_steps=list(range(n)),
        traffic_class=["batch"] * n,
        routing_key="farm",
    )


def test_a_batch_is_cut_into_slices_with_every_row_field_alike():
    batch = farm_batch(10)
    parts = slices(batch, 4)
    assert [len(p) for p in parts] == [4, 4, 2]
    last = parts[2]
    assert last.session_ids == ["env-8", "env-9"] and last.prompts == ["p8", "p9"]
    assert last.expected_steps == [8, 9] and last.traffic_class == ["batch", "batch"]
    assert last.images.shape[0] == 2 and last.images[1, 0, 0, 0, 0] == 9 and last.state[:, 0, 0].tolist() == [8, 9]
    assert last.routing_key == "farm" and last.deadline_at is None
    assert slices(batch, None) == [batch] and slices(batch, 10) == [batch]  # nothing to cut
    assert len(slice_batch(batch, 0, 1)) == 1


def test_the_slices_results_join_back_in_row_order():
    def result(rows):
        return ChunkResult(
            actions=np.array(rows, np.float32).reshape(-1, 1, 1) * np.ones((1, 24, 32), np.float32),
            sessions=[SessionReport(f"env-{r}", r, False, None, r) for r in rows],
            timings_ms={"model": float(len(rows))},
            dit_steps=4,
        )

    joined = join_results([result([0, 1, 2]), result([3, 4])])
    assert joined.actions.shape == (5, 24, 32) and joined.actions[:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert [s.session_id for s in joined.sessions] == [f"env-{r}" for r in range(5)]
    assert joined.timings_ms == {"model": 3.0} and joined.video is None and joined.video_latents is None


def test_slice_rows_is_what_a_robot_can_wait_out():
    now = [1000.0]

    async def run(batch):
        return batch

    batcher = ContinuousBatcher(
        run, max_batch_size=8, wait_s=0.0, max_batch_rows=32, rows_of=lambda it: it[3], class_of=lambda it: it[1],
        deadline_of=lambda it: it[2], sessions_of=lambda it: [it[4]], call_ms=lambda rows: 50.0 + 100.0 * rows,
        clock=lambda: now[0],
    )  # fmt: skip
    assert batcher.slice_rows() is None  # no robot: a farm's request is not cut
    robot = ("r", "realtime", now[0] + 1.0, 1, "robot")  # a budget of 1 s
    batcher._note_cadence(_entry(batcher, robot))
    # the robot's own call is 150 ms; a slice of n rows (50 + 100 n ms) followed by it fits REALTIME_SHARE of 1 s
    rows = batcher.slice_rows()
    assert 50 + 100 * rows + 150 <= REALTIME_SHARE * 1000 < 50 + 100 * (rows + 1) + 150
    batcher.classes = False  # first come, first served: nothing is cut
    assert batcher.slice_rows() is None


def _entry(batcher, it):
    from deployments.batcher import _Entry

    return _Entry(it, None, 0, realtime=True, deadline=it[2], sessions=frozenset([it[4]]))
