"""`benchmarks/model_latency.py` (the GPU check's model figures, scripts/gpu-check.sh) runs on this tree: its modes
follow PipelineConfig's knobs, and a CPU run of the tiny preset prints its table."""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # the script's sibling modules

import model_latency


def test_compile_modes_come_from_the_pipeline_config():
    modes, notes = model_latency.build_modes(["none", "dit"])
    assert not notes  # this tree has the `compile` knob
    assert set(modes) == set(model_latency.MODES) | {f"{m}, compile dit" for m in model_latency.MODES}
    assert all(m["compile"] == "none" for name, m in modes.items() if "compile dit" not in name)


def test_a_tiny_cpu_run_prints_its_table(capsys):
    assert model_latency.main(["--preset", "tiny", "--device", "cpu", "--warmup", "0", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "|" in out and "tiny" in out


def test_a_row_is_steady_chunks_with_the_restart_and_the_first_chunks_apart(tmp_path, monkeypatch):
    """Each row: at least `repeats` continuing chunks (never a restart among them), the restart chunk and the first
    chunks (the compile, in a compiled mode) timed apart, Dynamo's counters read, the row appended to the results
    file as soon as it exists, and no session left in any store between rows."""
    monkeypatch.setenv("GPU_CHECK_STAGE", "eager")
    results = tmp_path / "results.jsonl"
    argv = ["--preset", "tiny", "--device", "cpu", "--warmup", "1", "--repeats", "5",
            "--modes", "8-step mask (upstream)", "--results", str(results)]  # fmt: skip
    assert model_latency.main(argv) == 0
    import json

    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["stage"] == "eager" and row["row"] == "8-step mask (upstream)" and row["compiled"] == "none"
    assert row["chunks"] == 5 and len(row["positions"]) == 5 and row["restarts"] >= 1
    assert row["positions"] != sorted(row["positions"]) or len(set(row["positions"])) > 1  # the window turned over
    assert len(row["first_chunks_ms"]) == 1 and row["first_restart_ms"] > 0 and not row["fell_back_to_eager"]
    assert row["chunk_ms_min"] <= row["chunk_ms"] <= row["chunk_ms_max"]


def _args(**kw):
    return SimpleNamespace(**{"preset": "tiny", "model_path": None, "device": "cpu", "dtype": "float32", **kw})


def test_a_none_mode_after_a_dit_mode_runs_no_compiled_block(monkeypatch):
    """All modes share one model and a `compile: dit` pipeline compiles its blocks in place: the `none` mode built
    after it must still run eager. `torch.compile` is replaced by a recording wrapper (same call, eager body), so
    the benchmark's own path (DreamZeroPipeline -> compile_model -> compile_blocks -> Module.compile) runs without
    inductor's minutes of CPU; `test_the_benchmark_compiles_for_real` checks that path with the real torch.compile."""
    calls = collections.Counter()

    def recording_compile(fn, *args, **kwargs):
        def compiled(*a, **kw):
            calls[kwargs.get("dynamic")] += 1
            return fn(*a, **kw)

        return compiled

    monkeypatch.setattr(torch, "compile", recording_compile)
    modes, _ = model_latency.build_modes(["dit", "none"])  # the compiled modes first: their pipelines compile first
    assert list(modes)[0].endswith("compile dit") and list(modes)[-1] == "dynamic skipping"
    model = model_latency.build_model(_args())
    pipes = model_latency.build_pipelines(model, modes, max_sessions=2)
    blocks = list(model.model.blocks)
    assert all(b._compiled_call_impl is not None for b in blocks)  # compiled in place by the dit pipelines
    fast = {"num_inference_steps": 2, "dit_step_mask": None}
    batch = model_latency.make_batch(1, 1, (32, 64), 0)

    def chunk(name):
        pipe = pipes[name]
        pipe.config = pipe.config.with_overrides(fast)
        before = calls[True]
        res, ran = model_latency.run_chunk(pipe, batch)
        assert np.isfinite(res.actions).all()
        return calls[True] - before, ran

    # 2 steps: 1 prefill + 2 denoise forwards, each through every block compiled
    assert chunk("16 steps, compile dit") == (3 * len(blocks), ["dit.blocks"])
    assert chunk("16 steps") == (0, [])  # the old shared-model run went through the compiled blocks here
    assert all(b._compiled_call_impl is not None for b in blocks)  # set aside for the none mode, then put back
    assert chunk("16 steps, compile dit") == (3 * len(blocks), ["dit.blocks"])

    # and every row of the table says what ran compiled
    monkeypatch.setattr(model_latency, "MODES", {"16 steps": fast})
    modes, _ = model_latency.build_modes(["dit", "none"])
    results = model_latency.measure_all(
        model_latency.build_model(_args()), _args(batch=1, warmup=0, repeats=1), (32, 64), modes
    )
    assert all(r["graphs"] == 0 for r in results.values())  # the recording wrapper builds no Dynamo graph
    assert {name: r["compiled"] for name, r in results.items()} == {
        "16 steps, compile dit": "dit.blocks",
        "16 steps": "none",
    }
    table = model_latency.render(results, _args(batch=1, warmup=0, repeats=1), model, "cpu")
    # the recording wrapper built no Dynamo graph: the row says its "compiled" blocks ran eager
    assert "| 16 steps | none |" in table and "| 16 steps, compile dit | dit.blocks (fell back to eager) |" in table


def test_the_benchmark_compiles_for_real():
    """With the real torch.compile (lazy: nothing is built until a call), the dit pipelines of the benchmark leave
    inductor-compiled blocks on the shared model, and `run_chunk`'s scope sets them aside for an eager pipeline and
    puts the same callables back."""
    from dreamzero.pipeline.compile import compiled_only, compiled_parts

    modes, _ = model_latency.build_modes(["dit", "none"])
    model = model_latency.build_model(_args())
    pipes = model_latency.build_pipelines(model, modes, max_sessions=2)
    impls = [b._compiled_call_impl for b in model.model.blocks]
    assert all(
        getattr(i, "_torchdynamo_orig_callable", None) == b._call_impl for i, b in zip(impls, model.model.blocks)
    )
    assert compiled_parts(model) == ["dit.blocks"] == pipes["8-step mask (upstream), compile dit"].compiled
    with compiled_only(model, pipes["16 steps"].compiled):
        assert compiled_parts(model) == [] and all(b._compiled_call_impl is None for b in model.model.blocks)
    assert [b._compiled_call_impl for b in model.model.blocks] == impls
    with compiled_only(model, pipes["16 steps, compile dit"].compiled):
        assert [b._compiled_call_impl for b in model.model.blocks] == impls
