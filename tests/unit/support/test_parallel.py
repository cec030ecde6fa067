"""tests/support/parallel.py: the groups pytest-xdist keeps on one worker, and the longest-first order of a worker."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from tests.support.parallel import TIMELINE_ENV, assign_groups, group_of, own_ray_tmpdir, record_timeline


class FakeItem:
    def __init__(self, nodeid: str):
        self.nodeid, self.groups = nodeid, []

    def add_marker(self, mark) -> None:
        assert mark.name == "xdist_group"
        self.groups.append(mark.args[0])


SUITE = [
    "tests/cluster/test_faults.py::test_a",
    "tests/cluster/test_zmq_door.py::test_b[x]",
    "tests/e2e/test_card_matrix.py::test_c",
    "tests/e2e/test_gpu_rehearsal.py::test_d",
    "tests/e2e/test_gpu_rehearsal.py::test_e",
    "tests/graph/test_graph.py::test_f",
    "tests/unit/model/test_config.py::test_g",
    "tests/unit/model/test_config.py::Checks::test_h",
]


def test_the_cluster_folder_is_one_group_and_any_other_test_is_grouped_by_its_module():
    assert group_of("tests/cluster/test_faults.py::test_a") == group_of("tests/cluster/test_zmq_door.py::t[1]")
    assert group_of("tests/unit/model/test_config.py::Checks::test_h") == "tests/unit/model/test_config.py"
    assert group_of("tests/unit/model/test_config.py::test_g") != group_of("tests/unit/client/test_codec.py::test_g")
    sibling = "tests/cluster" + "ish/test_x.py"  # a made-up folder beside tests/cluster (joined: no file to name)
    assert group_of(f"{sibling}::t") == sibling  # tests/cluster is a folder, not a name prefix
    # the tests sharing the e2e tier's `serve run` of the shipped config run on one worker, whatever their module
    rehearsal = "tests/e2e/test_gpu_" + "rehearsal.py"  # one group: its runs share the slices (joined: a path)
    assert group_of(f"{rehearsal}::test_a") == group_of(f"{rehearsal}::test_b") == rehearsal
    a, b = ("tests/e2e/" + name + ".py::t" for name in ("test_a", "test_b"))  # made-up modules (joined: no file)
    shared = [group_of(m, ("tmp_path", "shipped_server")) for m in (a, b)]
    assert shared[0] == shared[1] != group_of(a, ("tmp_path",))


def test_a_serial_run_keeps_its_order_and_a_worker_runs_the_longest_groups_first(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = [FakeItem(n) for n in SUITE]
    assign_groups(items)
    assert [i.nodeid for i in items] == SUITE and all(len(i.groups) == 1 for i in items)
    assert items[0].groups == items[1].groups and items[6].groups == items[7].groups != items[5].groups

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    items = [FakeItem(n) for n in SUITE]
    assign_groups(items)
    assert [i.nodeid for i in items] == [SUITE[3], SUITE[4], SUITE[0], SUITE[1], SUITE[2], *SUITE[5:]]


def test_each_worker_gets_a_ray_tmpdir_of_its_own(monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", "/tmp/shared")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    own_ray_tmpdir()
    assert os.environ["RAY_TMPDIR"] == "/tmp/shared"  # serial: the one scripts/test.sh made
    made = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        own_ray_tmpdir()
        made.append(os.environ["RAY_TMPDIR"])
        os.rmdir(made[-1])
    assert made[0] != made[1] and all(os.path.basename(d).startswith("raygw") for d in made)
    assert all(len(d) < 40 for d in made)  # Ray's socket paths under it must stay under 108 bytes


def test_a_test_process_runs_torch_on_one_thread_unless_told(monkeypatch):
    import torch

    from tests.support.parallel import TORCH_THREADS_ENV, torch_threads

    before = torch.get_num_threads()
    try:
        assert before == 1  # tests/conftest.py set it at import
        monkeypatch.setenv(TORCH_THREADS_ENV, "2")
        torch_threads()
        assert torch.get_num_threads() == 2
        monkeypatch.setenv(TORCH_THREADS_ENV, "0")  # torch's own default: left as it is
        torch_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_timeline_holds_each_phase_once_and_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    test = "tests/unit/" + "made_up.py::t"  # (joined: no file to name)
    report = SimpleNamespace(nodeid=test, when="call", start=10.0, stop=12.5, outcome="passed")
    monkeypatch.delenv(TIMELINE_ENV, raising=False)
    record_timeline(report)
    assert not path.exists()  # not asked
    monkeypatch.setenv(TIMELINE_ENV, str(path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    record_timeline(report)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    record_timeline(SimpleNamespace(**vars(report), node="gw1"))  # the controller's copy of gw1's report
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["worker"] == "gw1" and row["test"] == test and row["phase"] == "call"
    assert row["stop"] - row["start"] == 2.5 and row["outcome"] == "passed" and row["load"] >= 0
