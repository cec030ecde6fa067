"""The device-memory probe, `batching.max_batch_rows: auto` and the fit checks at `serve run` (dreamzero.device_memory,
dreamzero.pipeline.budget, serve_graph.builder.check_gpu_fit), on a simulated GPU: the same code a GPU runs, with a
declared capacity and the byte accounting standing in for the allocator."""

from __future__ import annotations

import pytest
import torch

from dreamzero.device import SIMULATED_GPU_ENV, select_device, simulated_gpu_bytes
from dreamzero.device_checks import device_facts
from dreamzero.device_memory import DeclaredMemory
from dreamzero.errors import ConfigError
from dreamzero.pipeline.budget import (
    CPU_AUTO_ROWS,
    accounted_warmup_peak,
    margin_bytes,
    resolve_serving_memory,
    warmup_canvas_hw,
)

G = 2**30


@pytest.fixture(scope="module")
def pipe():
    from dreamzero.pipeline import DreamZeroPipeline

    return DreamZeroPipeline.load(None, device="cpu", max_sessions=128)


def _declared(pipe, capacity: int) -> DeclaredMemory:
    weights = sum(t.numel() * t.element_size() for t in list(pipe.model.parameters()) + list(pipe.model.buffers()))
    return DeclaredMemory(capacity, lambda: weights + pipe.store.nbytes(), "test device")


def test_a_simulated_gpu_is_the_cpu_in_bf16_with_the_declared_memory(monkeypatch):
    monkeypatch.delenv(SIMULATED_GPU_ENV, raising=False)
    assert simulated_gpu_bytes() is None and device_facts().cuda is False
    monkeypatch.setenv(SIMULATED_GPU_ENV, "141GiB")
    assert select_device("cuda") == (torch.device("cpu"), torch.bfloat16)
    assert select_device("cpu") == (torch.device("cpu"), torch.float32)
    facts = device_facts()
    assert facts.cuda and facts.bf16 and facts.total_bytes == 141 * G and "simulated GPU of 141 GiB" == facts.name
    monkeypatch.setenv(SIMULATED_GPU_ENV, "a big one")
    with pytest.raises(ConfigError, match=SIMULATED_GPU_ENV):
        simulated_gpu_bytes()


def test_declared_memory_counts_what_the_accounting_holds():
    held = [100]
    probe = DeclaredMemory(1000, lambda: held[0])
    assert probe.mem_info() == (900, 1000) and not probe.measures
    held[0] = 1200
    assert probe.mem_info() == (0, 1000)  # never negative


def test_auto_rows_are_the_largest_batch_whose_sessions_fit_the_budget(pipe):
    one = pipe.footprint(pipe.canvas_hw(warmup_canvas_hw(pipe))).peak
    weights = _declared(pipe, 10 * G).allocated()
    capacity = weights + 40 * one + (1 << 20)
    memory = resolve_serving_memory(pipe, "auto", "auto", 128, print, probe=_declared(pipe, capacity))
    assert 1 < memory.rows < 40 and memory.budget >= memory.rows * one  # a whole batch of sessions is admitted
    bigger = resolve_serving_memory(pipe, "auto", "auto", 128, print, probe=_declared(pipe, 2 * capacity))
    assert bigger.rows > memory.rows and bigger.device == "test device"
    capped = resolve_serving_memory(pipe, "auto", "auto", 8, print, probe=_declared(pipe, 10 * G))
    assert capped.rows == 8  # sessions.max_sessions caps the batch
    by_bytes = resolve_serving_memory(pipe, "auto", 3 * one, 128, print, probe=_declared(pipe, 10 * G))
    assert (by_bytes.rows, by_bytes.budget) == (3, 3 * one)  # an explicit budget caps the rows it can hold
    assert pipe.store.stats()["live"] == 0 and sum(pipe.store.restarts.values()) == 0  # no warm-up session left


def test_auto_rows_on_a_plain_cpu_and_with_no_room(pipe):
    plain = resolve_serving_memory(pipe, "auto", "auto", 128, print)
    assert (plain.rows, plain.budget, plain.device) == (CPU_AUTO_ROWS, None, None)
    assert resolve_serving_memory(pipe, None, "auto", 64, print).rows == 64  # null: sessions.max_sessions
    weights = _declared(pipe, G).allocated()
    with pytest.raises(ConfigError, match="batching.max_batch_rows=auto: not one full-window session fits"):
        resolve_serving_memory(pipe, "auto", "auto", 128, print, probe=_declared(pipe, weights + 1024))
    with pytest.raises(ConfigError, match="batching.max_batch_rows=64: .*lower it or set it to auto"):
        resolve_serving_memory(pipe, 64, "auto", 128, print, probe=_declared(pipe, weights + 4 * (1 << 20)))


def test_the_accounted_warmup_grows_with_the_rows(pipe):
    canvas = warmup_canvas_hw(pipe)
    one, four = accounted_warmup_peak(pipe, 1, canvas), accounted_warmup_peak(pipe, 4, canvas)
    kv = pipe.footprint(pipe.canvas_hw(canvas)).parts[1]["kv_cache"]
    assert 4 * one - 4 * kv <= four <= 4 * one + 4 * kv  # the batch cache copies are a layer's worth per row


def _footprint_14b():
    from dreamzero.config import preset
    from dreamzero.model.vae import spatial_factor
    from dreamzero.pipeline.budget import canvas_for
    from dreamzero.sessions import footprint_for

    cfg = preset("droid_14b")
    canvas = canvas_for(cfg.dit, cfg.pipeline, spatial_factor(cfg.vae))
    assert canvas == (352, 640)
    return cfg, footprint_for(cfg.dit, cfg.pipeline, cfg.vae, cfg.image_encoder, canvas, torch.bfloat16)


def test_fit_checks_say_what_to_change_for_the_14b_on_an_h200():
    from dreamzero.config import preset
    from dreamzero.planner import check_fits, plan_serving

    cfg = preset("droid_14b")
    for rows in ("auto", 2):
        assert plan_serving(cfg, 139 * G, rows=rows).fits
    null = plan_serving(cfg, 139 * G, rows=128)
    with pytest.raises(ConfigError, match=r"batching.max_batch_rows=128: .*what would: .*1 row does"):
        check_fits(null, 128, "auto", {})
    too_big = plan_serving(cfg, 139 * G, rows=2, max_bytes=200 * G)
    with pytest.raises(ConfigError, match=r"batching.max_batch_rows=2: "):
        check_fits(too_big, 2, 200 * G, {})
    with pytest.raises(ConfigError, match=r"sessions.max_bytes=1.0GiB: "):
        check_fits(plan_serving(cfg, 139 * G, max_bytes=G), "auto", G, {})
    with pytest.raises(ConfigError, match=r"model_path: .* does not fit 20.0 GiB"):
        check_fits(plan_serving(cfg, 20 * G), "auto", "auto", {})
    assert margin_bytes(141 * 10**9) == int(0.05 * 141 * 10**9)


def test_serve_run_fails_before_any_replica_on_rows_that_cannot_fit(monkeypatch):
    """Defect 1 of the first GPU run: `max_batch_rows: null` (128 rows) used to pass the start checks and fail in every
    replica after the weights loaded; now `serve run` refuses it at once, and the shipped `auto` starts."""
    from dreamzero.embedded_default import resolve_model_path
    from serve_graph.builder import check_gpu_fit
    from serve_graph.config import parse_app_args

    monkeypatch.setenv(SIMULATED_GPU_ENV, "141GiB")
    base = {"model_path": resolve_model_path("embedded:small-scene1"), "checkpoint_config": "droid_14b"}
    base["policy"] = {"num_gpus": 1}
    check_gpu_fit(parse_app_args(base))  # the shipped default: batching.max_batch_rows auto
    with pytest.raises(ConfigError, match=r"batching.max_batch_rows=null \(sessions.max_sessions=128\): .*not fit"):
        check_gpu_fit(parse_app_args({**base, "batching": {"max_batch_rows": None}}))
    monkeypatch.delenv(SIMULATED_GPU_ENV)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        check_gpu_fit(parse_app_args(base))


def test_a_build_on_a_node_without_gpus_leaves_the_fit_to_the_replicas(monkeypatch):
    """KubeRay builds the app in a Serve task, usually on the GPU-less head: there the checks cannot see the GPU."""
    import serve_graph.builder as builder
    from serve_graph.config import parse_app_args

    monkeypatch.delenv(SIMULATED_GPU_ENV, raising=False)
    cfg = parse_app_args({"policy": {"num_gpus": 1}})
    with pytest.raises(ConfigError, match="CUDA is not available"):
        builder.check_gpu_fit(cfg)
    monkeypatch.setattr(builder, "_cluster_has_gpus", lambda: True)
    builder.check_gpu_fit(cfg)  # logged, not raised: each Policy replica sizes itself on its own GPU


@pytest.fixture(scope="module")
def tiny_layouts(tmp_path_factory):
    from tests.support.checkpoints import write_tiny_layouts

    return write_tiny_layouts(tmp_path_factory.mktemp("layouts"))


@pytest.mark.parametrize("layout", ["hf", "full_weights", "diffusers"])
def test_serve_run_checks_every_layout_before_any_replica_loads(tiny_layouts, layout, monkeypatch):
    """The fit checks read the weights' size from the model's config, so RLinf's `full_weights.pt` and a
    `-Diffusers` folder are checked at `serve run` as the HF layout is: weights against device memory, then the
    session budget against what is left, each error naming the field to change."""
    from dreamzero.checkpoint import model_nbytes
    from serve_graph.builder import build_app, check_gpu_fit
    from serve_graph.config import parse_app_args
    from serve_graph.model_source import model_config

    args = {"model_path": str(tiny_layouts[layout]), "policy": {"num_gpus": 1}}
    if layout == "full_weights":
        args["checkpoint_config"] = "tiny"  # the .pt stores no config
    weights = model_nbytes(model_config(parse_app_args(args)), torch.bfloat16)
    assert 1 << 20 < weights < 4 << 20  # the tiny model in bf16, whatever the layout

    monkeypatch.setenv(SIMULATED_GPU_ENV, "1MiB")
    with pytest.raises(ConfigError, match="model_path: .* does not fit 0.0 GiB per GPU"):
        build_app(args)  # the first thing build_app does: nothing was bound, no replica started
    monkeypatch.setenv(SIMULATED_GPU_ENV, "1536MiB")
    check_gpu_fit(parse_app_args(args))  # fits: weights, one full-window session and the 5 % margin
    with pytest.raises(ConfigError, match=r"sessions.max_bytes=1.5GiB: .* does not fit"):
        build_app({**args, "sessions": {"max_bytes": "1500MiB"}})  # with the weights and the margin: over 1.5 GiB
