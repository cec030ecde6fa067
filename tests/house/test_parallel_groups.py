"""The suite's two workers rely on `--dist loadgroup` keeping a group on one worker (tests/support/parallel.py): the
shared Ray cluster, the shared `serve run`s and every module-scoped fixture assume it. pytest-xdist 3.8 stops
honouring groups on pytest 9 (it sends grouped tests one by one), so this runs a throwaway suite of one group and
fails if its tests land on more than one worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("xdist")

TESTS = 8


def test_a_group_runs_whole_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.hookimpl(tryfirst=True)  # before xdist's own hook tags the grouped tests (as tests/conftest.py)
            def pytest_collection_modifyitems(items):
                for item in items:
                    item.add_marker(pytest.mark.xdist_group("one"))
            """
        )
    )
    (tmp_path / "test_group.py").write_text(
        textwrap.dedent(
            f"""
            import os, pathlib, time
            import pytest

            @pytest.mark.parametrize("i", range({TESTS}))
            def test_where(i):
                time.sleep(0.05)  # long enough that an idle second worker would be sent some
                pathlib.Path(r"{tmp_path}", f"ran-{{i}}").write_text(os.environ["PYTEST_XDIST_WORKER"])
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers = {p.read_text() for p in tmp_path.glob("ran-*")}
    assert len(list(tmp_path.glob("ran-*"))) == TESTS
    assert len(workers) == 1, f"one group ran on {sorted(workers)}: this pytest / pytest-xdist pair splits groups"
