"""benchmarks/cfg_parallel.py on two GPUs gives each rank's process only its own GPU (issue 44), as Ray gives each
actor of a `cfg_parallel: 2` replica one GPU: the rank-th of the GPUs the benchmark may use, seen as cuda:0."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("cfg_parallel_bench", ROOT / "benchmarks" / "cfg_parallel.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_each_rank_sees_one_gpu_of_those_the_benchmark_may_use():
    assert [bench.rank_visible_devices(r, None) for r in (0, 1)] == ["0", "1"]
    assert [bench.rank_visible_devices(r, "2,5") for r in (0, 1)] == ["2", "5"]
    assert [bench.rank_visible_devices(r, "GPU-aa, GPU-bb,") for r in (0, 1)] == ["GPU-aa", "GPU-bb"]
    with pytest.raises(ValueError, match="rank 1 needs its own"):
        bench.rank_visible_devices(1, "3")


def test_the_cuda_worker_refuses_a_process_that_sees_both_gpus():
    source = (ROOT / "benchmarks" / "cfg_parallel.py").read_text()
    assert 'torch.device("cuda", rank)' not in source  # the old layout: both GPUs visible, one picked by rank
    assert "rank_visible_devices(rank, visible)" in source and "torch.cuda.device_count() != 1" in source
