"""The chunk executor alone: delayed chunks skip the rows whose ticks passed, stale chunks are dropped, a chunk is
never executed twice nor after a newer one, and nothing from before a reconnect / restart is executed."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero_client.errors import ConfigError
from dreamzero_droid.executor import ChunkExecutor

HZ = 15.0
DT = 1.0 / HZ


def chunk(tag: float, rows: int = 24) -> np.ndarray:
    """Row r of chunk `tag` holds tag + r / 100 in every column, so an executed action names its chunk and row."""
    return np.full((rows, 8), tag) + (np.arange(rows) / 100.0)[:, None]


def run(executor: ChunkExecutor, ticks: int, t: float) -> tuple[list, float]:
    out = []
    for _ in range(ticks):
        out.append(executor.next_action(t))
        t += DT
    return out, t


def test_blocking_query_starts_at_row_zero_and_ages_are_recorded():
    ex = ChunkExecutor(HZ, max_observation_age_s=2.0)
    mark = ex.mark(0.0)
    offer = ex.offer(chunk(1), mark, 0.3)  # the arm held during the query: nothing executed since the observation
    assert offer.accepted and offer.row == 0 and offer.age_s == pytest.approx(0.3)
    done, _ = run(ex, 8, 0.3)
    assert [row for row, _ in done] == list(range(8))
    np.testing.assert_allclose(done[3][1], chunk(1)[3])
    stats = ex.stats()
    assert stats["executed"] == 8 and stats["skipped_actions"] == 0 and stats["stalls"] == 0
    assert stats["observation_age_s"]["max"] == pytest.approx(0.3 + 7 * DT)
    assert stats["observation_age_s"]["p50"] < stats["observation_age_s"]["max"]


def test_delayed_chunk_skips_the_rows_whose_ticks_passed():
    ex = ChunkExecutor(HZ)
    ex.offer(chunk(1), ex.mark(0.0), 0.0)
    _, t = run(ex, 5, 0.0)
    mark = ex.mark(t)  # a prefetch: the query leaves while chunk 1 keeps executing
    _, t = run(ex, 3, t)
    offer = ex.offer(chunk(2), mark, t)
    assert offer.accepted and offer.row == 3
    ((row, action),) = run(ex, 1, t)[0]
    assert row == 3 and action[0] == pytest.approx(2.03)
    assert ex.stats()["skipped_actions"] == 3


def test_chunk_with_no_row_left_or_too_old_is_dropped_and_the_arm_stalls():
    ex = ChunkExecutor(HZ, max_observation_age_s=3.0)
    ex.offer(chunk(1, rows=30), ex.mark(0.0), 0.0)
    mark = ex.mark(0.0)
    _, t = run(ex, 24, 0.0)  # 24 actions executed since `mark`: a 24-row chunk has nothing left
    offer = ex.offer(chunk(2), mark, t)
    assert not offer.accepted and offer.reason == "no_rows_left" and offer.row == 24
    late = ex.mark(t)
    offer = ex.offer(chunk(3), late, t + 3.5)  # the arm held 3.5 s waiting: the wall bound drops it
    assert not offer.accepted and offer.reason == "too_old" and offer.row == 0
    assert ex.stats()["dropped_stale"] == 2
    # chunk 1 goes on with its last 6 rows, then runs out: ticks with nothing to execute are stalls
    done, _ = run(ex, 8, t)
    assert [row for row, _ in done[:6]] == list(range(24, 30)) and done[6:] == [None, None]
    assert ex.stats()["stalls"] == 2 and ex.stats()["skipped_actions"] == 0


def test_executing_chunk_expires_at_the_wall_bound():
    ex = ChunkExecutor(HZ, max_observation_age_s=0.5)
    ex.offer(chunk(1), ex.mark(0.0), 0.2)
    done, _ = run(ex, 10, 0.2)
    executed = [d for d in done if d is not None]
    assert len(executed) == 5  # ages 0.2 .. 0.4667; the sixth (0.533 s) is over the bound
    assert max(ex.ages_s) <= 0.5 and ex.stalls == 5 and ex.dropped_stale == 1


def test_duplicate_and_older_chunks_are_refused():
    ex = ChunkExecutor(HZ)
    first, second = ex.mark(0.0), ex.mark(0.0)
    assert ex.offer(chunk(2), second, 0.1).accepted
    dup = ex.offer(chunk(2), second, 0.1)
    assert not dup.accepted and dup.reason == "duplicate"
    older = ex.offer(chunk(1), first, 0.2)  # the reply of an earlier query arrives after a newer one
    assert not older.accepted and older.reason == "older"
    ((row, action),) = run(ex, 1, 0.2)[0]
    assert row == 0 and action[0] == pytest.approx(2.0)
    run(ex, 30, 0.3)  # chunk 2 runs out; its reply offered again is still a duplicate
    assert ex.offer(chunk(2), second, 2.0).reason == "duplicate"
    stats = ex.stats()
    assert stats["duplicates"] == 2 and stats["refused_older"] == 1


@pytest.mark.parametrize("cause", ["reconnect", "restarted_session", "new_episode"])
def test_nothing_from_before_an_invalidation_is_executed(cause):
    ex = ChunkExecutor(HZ)
    ex.offer(chunk(1), ex.mark(0.0), 0.0)
    in_flight = ex.mark(0.1)  # a query in flight when the link reconnects / the server restarts the session
    run(ex, 2, 0.1)
    if cause == "new_episode":
        ex.reset()
        assert ex.next_action(0.3) is None  # a new episode starts with nothing to execute
    else:
        ex.invalidate()
        assert ex.next_action(0.3)[0] == 2  # the executing chunk goes on: it was fresh when it came
    refused = ex.offer(chunk(9), in_flight, 0.4)  # its reply arrives late
    assert not refused.accepted and refused.reason == "invalidated"
    fresh = ex.mark(0.5)
    assert ex.offer(chunk(3), fresh, 0.6).accepted
    ((row, action),) = run(ex, 1, 0.6)[0]
    assert action[0] == pytest.approx(3.0) and row == 0
    assert ex.dropped_invalidated == 1


def test_holds_do_not_count_as_executed_actions():
    ex = ChunkExecutor(HZ)
    ex.offer(chunk(1), ex.mark(0.0), 0.0)
    mark = ex.mark(0.0)
    run(ex, 2, 0.0)
    for _ in range(5):
        ex.hold()
    assert ex.offer(chunk(2), mark, 0.5).row == 2
    assert ex.holds == 5 and ex.executed == 2


def test_sim_clock_that_stands_still_during_a_lockstep_query():
    ex = ChunkExecutor(10.0, max_observation_age_s=None)
    t = 0.0
    for n in range(3):
        offer = ex.offer(chunk(n), ex.mark(t), t)  # the query took no sim time
        assert offer.accepted and offer.row == 0 and offer.age_s == 0.0
        _, t = run(ex, 16, t)
    assert ex.stats()["observation_age_s"]["max"] == pytest.approx(15 * DT)


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError, match="control_hz"):
        ChunkExecutor(0.0)
    with pytest.raises(ConfigError, match="max_observation_age_s"):
        ChunkExecutor(HZ, max_observation_age_s=0.0)
