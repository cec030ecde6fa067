# Longer than ~400 lines on purpose: one tier, one fixture set (the models held one at a time) and one figures file;
# split, each part would rebuild the 14B (46 GB) on the GPU.
"""The GPU tier (marked `gpu`): run on a CUDA GPU, or rehearsed on a CPU that simulates one; skipped with the reason
elsewhere, collected everywhere.

`scripts/gpu-check.sh` runs it on one H200 (with the 14B latency benchmark) and `scripts/gpu-check.sh --rehearse` on
CPU with `DREAMZERO_SIMULATED_GPU=141GiB` ("cuda" resolves to the CPU in bf16; device memory is a declared capacity
with the byte accounting standing in for the allocator: dreamzero/device_memory.py). The rehearsal runs every test's
code with the same asserts, so that only kernels, speed and the real allocator are left for the GPU to show; where
this CPU cannot afford a size it uses less, and the test says so. With `GPU_CHECK_FIGURES=<file>` every test appends
its figures there (tests/gpu/figures.py names them); `GPU_CHECK_SERVE_CONFIG=<file>` serves that config instead of
the shipped serve_config.yaml; on CUDA `DREAMZERO_GPU_CHECK_MODEL=<hf folder>` is the checkpoint the 14B serve run
serves (default: the 14B slice).

Models. On CUDA: the real `droid_14b` preset with random weights, materialised on the GPU (46 GB), for every
in-process test. In the rehearsal: `libero_5b_slice` (the real widths and token counts, one DiT block, loaded from a
`full_weights.pt` with its config.json beside it) for the in-process tests and a served run of every form, and
`droid_14b_slice` (loaded from the release HF layout a fixture writes) for the 14B serve run, which starts and
reports what `auto` chose: a 14B-shaped chunk runs the whole Wan 2.1 VAE on 352x640 frames, ~70 s of this 2-core CPU
for a session start at one DiT step and minutes at the shipped eight, against seconds at the 5B slice's 160x320.

What each test shows, on CUDA / in the rehearsal:
  - the served config, first: the 14B serve run's config builds as `serve run` builds it, memory plan of this
    device included, so a config that cannot fit fails the tier in seconds, naming the field (skipped without Ray);
  - tiny bf16 drift: the tiny model's bf16 actions stay within 0.2 relative L2 of fp32 over four chunks (CUDA's bf16
    kernels / CPU's, which tests/unit/model/test_bf16_drift.py bounds tighter);
  - chunk at 8 and 16 steps: a continuing chunk with the 8-step DiT mask and with the DiT on all 16 steps, timed,
    of the 14B / of the 5B slice (the step plans run and are counted; the times are a CPU's);
  - batch sizes from the planner: the sizes the tier times for the real 14B on this device's memory (1, powers of
    two, the planner's rows, and one past them recorded as "does not fit"), each judged by `dreamzero.planner`; the
    same on CUDA and in the rehearsal (a meta-device plan: no weights), so that an 80 GiB and a 141 GiB card each
    get their own list;
  - batched chunks: p50 / p95 of calls batching the planner's batch sizes for this device (a restart, then
    continuing chunks as far as device memory allows by the accounting; a size the planner or the accounting refuses
    is recorded as "does not fit", batch_fits_<rows> = 0, not failed), and an estimate of the robots one GPU serves
    within DROID's 1.6 s chunk period / the 5B slice's sizes at 2 steps, those up to 2 rows timed: the batched path
    and the figures' arithmetic, recorded as rehearsal;
  - session memory: a 14B session chunk by chunk over its window: the allocator's growth within 5 % of its
    accounting and every part of its state equal to the formula / the 5B slice's session: every part equal to the
    formula and the declared device counting exactly the weights and what the session holds;
  - admission: the budget and rows `auto` measures on this GPU (as a replica does), sessions admitted until it is
    full (each driven to its fullest window), the next refused with CapacityError naming sessions.max_bytes while the
    others are busy, and an idle one evicted for it: no OOM / the same on a declared device sized for at least two
    5B-slice sessions (one chunk each: without an allocator, reservations are all admission counts);
  - serve run of the 14B: the shipped config changed only as the README tells a GPU user (`model_path` to an
    HF-layout checkpoint, `policy.num_gpus: 1`) starts, GET /v1/models reports the rows and the budget `auto` chose,
    and it answers the normalised and the raw form over HTTP and the OpenPI WebSocket / the 14B slice starts and
    reports (its chunks: minutes); a 5B `full_weights.pt` served the same way starts as libero_sim and answers the
    normalised and the raw form over HTTP and the OpenPI WebSocket, on both;
  - serve run admission: the shipped model on one GPU admits raw-form sessions until the budget is full; the next
    gets 503 with Retry-After naming sessions.max_bytes while the admitted ones continue / the same on a simulated GPU
    sized for four of its sessions.
The serve tests skip where Ray is not installed (the air-gapped GPU box); the rehearsal's serve step covers them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.gpu.figures import record

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
ON_CUDA = torch.cuda.is_available()
TIER = "cuda" if ON_CUDA else "rehearsal"
#: the model of the timed chunks and of the batched, memory and admission tests (module docstring: why the 5B slice
#: on CPU); the 14B slice is what the rehearsal serves
TIMED = MANY = "droid_14b" if ON_CUDA else "libero_5b_slice"
#: the batch sizes are the planner's for this device (benchmarks/gpu_sizing.py: tier_sizes), never a fixed list; the
#: rehearsal's CPU times those up to this many rows and records the larger ones as chosen but not run
REHEARSAL_MAX_ROWS = 2
#: the calls timed per batch size
BATCH_CALLS = 4 if ON_CUDA else 2
#: DROID's chunk period: 24 actions at 15 Hz
DROID_PERIOD_MS = 1600.0
#: the step count of the memory and admission tests (neither depends on it), and of the rehearsal's batched calls
TWO_STEPS = {"num_inference_steps": 2, "dit_step_mask": [True, False], "dynamic_skip": False}
SERVE_CONFIG = Path(os.environ.get("GPU_CHECK_SERVE_CONFIG") or ROOT / "serve_config.yaml")
NO_RAY = "Ray is not installed (the rehearsal's serve step covers it)"
REHEARSAL_NOTE = "CPU rehearsal: not a GPU figure"
#: rounds of the serve-run admission test whose newcomer may miss the first call's run (load-dependent timing)
ROUNDS = 6


def _note(*parts: str) -> str:
    return "; ".join(p for p in (*parts, None if ON_CUDA else REHEARSAL_NOTE) if p)


def _sync():
    if ON_CUDA:
        torch.cuda.synchronize()


def _device() -> torch.device:
    from dreamzero.device import select_device

    return select_device("cuda")[0]  # the GPU, or the CPU standing in for it


def _batch(pipe, sids, hw, step=0, frames=4, expected=None):
    from dreamzero.pipeline.budget import warmup_batch

    b = warmup_batch(pipe, len(sids), hw, step)
    b.session_ids = list(sids)
    if frames != b.images.shape[1]:
        b.images = b.images[:, -frames:]
    b.expected_steps = expected
    return b


@contextlib.contextmanager
def _overridden(pipe, overrides: dict):
    from dreamzero.config import apply_overrides

    saved = pipe.config
    pipe.config = apply_overrides(saved, overrides)
    try:
        yield pipe
    finally:
        pipe.config = saved


@contextlib.contextmanager
def _fresh_store(pipe):
    from dreamzero.sessions import SessionStore

    saved, pipe.store = pipe.store, SessionStore(max_sessions=128)
    try:
        yield pipe.store
    finally:
        pipe.store = saved
        gc.collect()
        if ON_CUDA:
            torch.cuda.empty_cache()


def _gib(n: float) -> float:
    return n / 2**30


# --- checkpoints and models ---------------------------------------------------------------------------------------
def _slice_model(name: str):
    from dreamzero.config import SLICE_VOCAB, preset
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import build_local_tokenizer

    model = DreamZeroModel.from_config(preset(name), dtype=torch.bfloat16, seed=0)  # on CPU, then saved
    model.text_encoder.tokenizer = build_local_tokenizer(SLICE_VOCAB)
    return model


def _write_metadata(folder: Path, tag: str, name: str) -> None:
    """The shipped (synthetic) statistics of `tag`, where a release checkpoint keeps its own."""
    from dreamzero.metadata import read_metadata_file

    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({tag: read_metadata_file(None)[tag]}))


def _kept(tmp_path_factory, name: str, write) -> Path:
    """`write(folder)`'s checkpoint path, written once per `$GPU_CHECK_CHECKPOINTS` when that is set (the rehearsal
    runs the tier in several processes, tests/e2e/test_gpu_rehearsal.py: each would write the same 2 GB again; the
    slices are seeded, so a kept one is the one this process would write), else into this session's temp dir."""
    kept = os.environ.get("GPU_CHECK_CHECKPOINTS")
    if not kept:
        return write(tmp_path_factory.mktemp(name))
    folder, done = Path(kept) / name, Path(kept) / f"{name}.done"  # `done` names the path, once it is all written
    if not done.is_file():
        import shutil

        shutil.rmtree(folder, ignore_errors=True)  # what a run cut short left
        folder.mkdir(parents=True)
        done.write_text(str(write(folder)))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def droid_checkpoint(tmp_path_factory) -> Path:
    """`droid_14b_slice` in the release HF layout (config.json, safetensors, tokenizer/, experiment_cfg/metadata.json):
    2.2 GB, ~20 s to build and write."""
    from dreamzero.checkpoint import save_model

    def write(folder: Path) -> Path:
        path = save_model(_slice_model("droid_14b_slice"), folder / "ckpt")
        _write_metadata(path, "oxe_droid", "experiment_cfg/metadata.json")
        gc.collect()
        return path

    return _kept(tmp_path_factory, "droid_14b_slice", write)


@pytest.fixture(scope="session")
def libero_checkpoint(tmp_path_factory) -> Path:
    """`libero_5b_slice` as RLinf's `full_weights.pt`, with config.json, tokenizer/ and metadata.json beside it (no
    preset needed: serve_graph/model_source.py reads the config.json beside the file): 2.5 GB, ~25 s."""
    return _kept(tmp_path_factory, "libero_5b_slice", _write_libero)


def _write_libero(folder: Path) -> Path:
    from dreamzero.checkpoint import save_full_weights
    from dreamzero.config import to_checkpoint_config

    model = _slice_model("libero_5b_slice")
    file = save_full_weights(model, folder / "full_weights.pt")
    (file.parent / "config.json").write_text(json.dumps(to_checkpoint_config(model.config), indent=2) + "\n")
    model.text_encoder.tokenizer.save_pretrained(str(file.parent / "tokenizer"))
    _write_metadata(file.parent, "libero_sim", "metadata.json")
    del model
    gc.collect()
    return file


class Models:
    """One pipeline in memory at a time (the 14B alone fills a third of an H200; the slices share a small host)."""

    def __init__(self, request):
        self.request, self.name, self.pipe = request, None, None

    def get(self, name: str):
        if self.name != name:
            self.clear()
            self.pipe, self.name = self._build(name), name
        return self.pipe

    def clear(self) -> None:
        self.pipe = self.name = None
        gc.collect()
        if ON_CUDA:
            torch.cuda.empty_cache()

    def _build(self, name: str):
        from dreamzero.checkpoint import load_model
        from dreamzero.config import preset
        from dreamzero.device_memory import module_nbytes
        from dreamzero.model.dreamzero import DreamZeroModel
        from dreamzero.model.tokenizer import build_local_tokenizer
        from dreamzero.pipeline import DreamZeroPipeline

        fixture = {"droid_14b_slice": "droid_checkpoint", "libero_5b_slice": "libero_checkpoint"}.get(name)
        path = None if ON_CUDA else self.request.getfixturevalue(fixture)  # written once, before the clock
        t0 = time.perf_counter()
        if ON_CUDA:
            torch.cuda.empty_cache()
            model = DreamZeroModel.from_config(preset(name), device="cuda", dtype=torch.bfloat16, seed=0)
            model.text_encoder.tokenizer = build_local_tokenizer(model.config.text_encoder.vocab_size)
            _sync()
            weights, where = torch.cuda.memory_allocated(), torch.cuda.get_device_name()
            how = "random weights materialised on the GPU"
        else:
            model = load_model(path, device=_device(), dtype=torch.bfloat16)
            weights, where = module_nbytes(model), "the CPU simulating a GPU"
            how = "random weights loaded from its checkpoint"
        took = time.perf_counter() - t0
        print(f"\n{name} on {where}: {_gib(weights):.2f} GiB of weights in {took:.1f} s ({how})")
        record("weights_gib", _gib(weights), tier=TIER, preset=name, note=_note(how))
        return DreamZeroPipeline(model)


@pytest.fixture(scope="module")
def models(request):
    held = Models(request)
    yield held
    held.clear()


# --- the served config, first ----------------------------------------------------------------------------------------
def _served_model(request) -> str:
    """The checkpoint the 14B serve run serves: $DREAMZERO_GPU_CHECK_MODEL on CUDA if set, else the 14B slice."""
    return (os.environ.get("DREAMZERO_GPU_CHECK_MODEL") if ON_CUDA else None) or str(
        request.getfixturevalue("droid_checkpoint")
    )


def test_the_served_config_builds_on_this_card_before_any_test_runs(request):
    """The serve run's config (as the 14B serve test changes it) is built as `serve run` builds it (`build_app`: its
    checks, then the memory plan of this device, `serve_graph.builder.check_gpu_fit`), before the tier's other
    tests: a config that cannot fit this card fails here in seconds, naming the field, instead of after the minutes
    the tests before its serve run take."""
    _require_ray()  # the builder binds Ray Serve deployments (no cluster is started)
    from serve_graph.builder import build_app

    build_app({**_shipped_args(), **_gpu_args(model_path=_served_model(request))})


# --- in-process tests -------------------------------------------------------------------------------------------------
def test_tiny_bf16_drift_from_fp32_is_bounded():
    # the CPU tests run the same comparison (tests/unit/model/test_bf16_drift.py, with bounds measured there)
    from tests.support.drift import drift, tiny_chunks

    out = tiny_chunks(_device(), chunks=4)  # fp32 weights built on CPU, then copied to the device at each dtype
    found = []
    for k, (a32, a16) in enumerate(zip(out[torch.float32], out[torch.bfloat16])):
        d = drift(a32, a16)
        found.append(d)
        print(f"chunk {k}: bf16 vs fp32 {d}")
        assert np.isfinite(a16).all() and d.rel_l2 < 0.2, f"chunk {k}: bf16 drift {d.rel_l2:.3f} of the fp32 actions"
    note = _note("worst of 4 chunks (restart + 3 continuing), actions", None if ON_CUDA else "CPU bf16 kernels")
    record("bf16_drift_max_abs", max(d.max_abs for d in found), tier=TIER, preset="tiny", note=note)
    record("bf16_drift_rel_l2", max(d.rel_l2 for d in found), tier=TIER, preset="tiny", note=note)


@pytest.mark.parametrize(
    "steps",
    [
        8,
        # the rehearsal proves the timed path with the served 8-step plan; the DiT on all 16 steps is the same path,
        # 16 forwards of the 5B slice at real widths (~40 s of this CPU for a figure it does not count)
        pytest.param(
            16, marks=pytest.mark.skipif(not ON_CUDA, reason="timed on a GPU only: the 8-step run rehearses it")
        ),
    ],
)
def test_chunk_at_8_and_16_steps_runs_and_is_timed(models, steps):
    """A continuing chunk with the upstream 8-step DiT mask and with the DiT on all 16 steps, timed: the 14B on CUDA,
    the 5B slice in the rehearsal (a 14B-slice chunk runs the whole Wan 2.1 VAE on 352x640 frames: minutes here)."""
    from dreamzero.pipeline.budget import warmup_canvas_hw

    pipe = models.get(TIMED)
    canvas = warmup_canvas_hw(pipe)
    # the served plan (16 scheduler steps, the DiT on 8 by the mask), or the DiT on all 16
    overrides = {"num_inference_steps": 16, "dynamic_skip": False, **({"dit_step_mask": None} if steps == 16 else {})}
    sid = f"timed-{steps}"
    with _overridden(pipe, overrides):
        try:
            with _overridden(pipe, TWO_STEPS):  # the session's start: its state is the same at any step count
                pipe.generate(_batch(pipe, [sid], canvas, 0, frames=1))
            _sync()
            t0 = time.perf_counter()
            res = pipe.generate(_batch(pipe, [sid], canvas, 1))
            _sync()
            ms = (time.perf_counter() - t0) * 1000
        finally:
            pipe.drop_sessions([sid])
    print(f"\n{TIMED} bf16, {res.dit_steps} DiT steps: one continuing chunk {ms:.0f} ms; stages {res.timings_ms}")
    assert res.dit_steps == steps and not res.sessions[0].restarted and np.isfinite(res.actions).all()
    assert 0 < ms < (120_000 if ON_CUDA else 600_000)
    note = _note(f"one continuing chunk, {steps} DiT steps, bf16, {canvas[0]}x{canvas[1]}")
    record(f"chunk_ms_{steps}_steps", ms, tier=TIER, preset=TIMED, note=note)


def _call_fits(pipe, probe, rows: int, k: int, fp) -> bool:
    """Whether a call of `rows` sessions at chunk `k` fits the device's free memory by the accounting: their states
    after it, the cache copies a batch makes, the DiT forward's activations and the margin."""
    from dreamzero.memory_fit import activation_estimate, kv_transient, margin_bytes

    probe.release_cache()
    free, total = probe.mem_info()
    element = torch.empty((), dtype=pipe.dtype).element_size()
    need = rows * fp.by_chunk[k] + kv_transient(rows, fp.parts[k]["kv_cache"], pipe.dit_cfg.num_layers)
    need += activation_estimate(pipe.dit_cfg, pipe.config, rows, element)
    return need + margin_bytes(total) <= free


def _capacity(pipe) -> int:
    from benchmarks.gpu_sizing import device_memory_bytes

    capacity = device_memory_bytes(pipe.device)
    assert capacity is not None, "no device memory: neither CUDA nor DREAMZERO_SIMULATED_GPU"
    return capacity


def test_the_14b_batch_sizes_for_this_card_come_from_the_planner():
    """The real 14B's batch sizes on this device's memory (a plan from its config alone): every size the tier would
    time fits by the planner, the largest is the planner's rows, and one past them is recorded as not fitting. An
    80 GiB card and a 141 GiB card get different lists (the rehearsal runs both); a fixed 1/2/4/8 does not fit 80."""
    from benchmarks.gpu_sizing import judge, largest_rows, tier_sizes
    from dreamzero.config import preset
    from dreamzero.planner import device_memory

    config = preset("droid_14b")
    capacity = device_memory("cuda" if ON_CUDA else "cpu")
    assert capacity is not None, "no device memory: neither CUDA nor DREAMZERO_SIMULATED_GPU"
    top, why = largest_rows(config, capacity, torch.bfloat16)
    cases = tier_sizes(config, capacity, torch.bfloat16)
    print(f"\ndroid_14b on {capacity / 2**30:.0f} GiB: {why}; sizes {[(c.rows, c.fits) for c in cases]}")
    fitting = [c.rows for c in cases if c.fits]
    assert top >= 1 and max(fitting) == top and all(judge(config, capacity, torch.bfloat16, n).fits for n in fitting)
    assert [c.fits for c in cases] == [True] * len(fitting) + [False] * (len(cases) - len(fitting)) and len(
        cases
    ) > len(fitting)
    note = _note(f"the planner on {capacity / 2**30:.0f} GiB, whole model on the device: {why}")
    for c in cases:
        record(f"batch_fits_{c.rows}", int(c.fits), tier=TIER, preset="droid_14b", note=note if c.fits else c.why)
    record("rows_chosen", top, tier=TIER, preset="droid_14b", note=note)


def test_batched_chunks_latency_and_robots_per_gpu(models):
    """p50 / p95 of one call's chunk for several sessions batched together, and the robots one GPU serves in time.

    Per batch size the sessions start (a restart chunk) and continue chunk after chunk, all calls timed; when the
    accounting says the next chunk of that many sessions would not fit the device (the 14B's cache copies: 8 sessions
    fit only restarts on an H200, 4 reach their second chunk) or their window is full, they start again. On CUDA at the
    served step plan; the rehearsal batches 1 and 2 sessions of the 5B slice at 2 steps."""
    from dreamzero.pipeline.budget import memory_probe, warmup_canvas_hw

    pipe = models.get(MANY)
    canvas = warmup_canvas_hw(pipe)
    fp = pipe.footprint(pipe.canvas_hw(canvas))
    probe = memory_probe(pipe)
    assert probe is not None, "no device-memory probe: neither CUDA nor DREAMZERO_SIMULATED_GPU"
    from benchmarks.gpu_sizing import tier_sizes

    p95 = {}
    cases = tier_sizes(pipe.model.config, _capacity(pipe), pipe.dtype)
    with _overridden(pipe, {} if ON_CUDA else TWO_STEPS), _fresh_store(pipe):
        plan = f"{pipe.config.num_inference_steps} steps"
        for case in cases:
            n = case.rows
            if not case.fits or (not ON_CUDA and n > REHEARSAL_MAX_ROWS):
                why = (
                    case.why
                    if not case.fits
                    else f"fits by the planner; not run: this CPU affords {REHEARSAL_MAX_ROWS}"
                )
                print(f"\n{n} session(s) per call: not run ({why})")
                record(f"batch_fits_{n}", 0, tier=TIER, preset=MANY, note=_note(why))
                continue
            ids = [f"batch{n}-{i}" for i in range(n)]
            times, positions, k = [], [], 0
            for call in range(BATCH_CALLS):
                if k == len(fp.by_chunk) or not _call_fits(pipe, probe, n, k, fp):
                    pipe.drop_sessions(ids)
                    k = 0
                    if not _call_fits(pipe, probe, n, 0, fp):
                        break
                t0 = time.perf_counter()
                res = pipe.generate(_batch(pipe, ids, canvas, 100 * n + call, frames=1 if k == 0 else 4))
                _sync()
                times.append((time.perf_counter() - t0) * 1000)
                assert res.actions.shape[0] == n and np.isfinite(res.actions).all()
                assert [s.restarted for s in res.sessions] == [k == 0] * n, res.sessions
                positions.append(k)
                k += 1
            pipe.drop_sessions(ids)
            if not times:  # the planner said it fits; the replica's own accounting (at this moment) does not
                why = (
                    f"a restart of {n} sessions does not fit {probe.name} by the accounting (the planner said it fits)"
                )
                print(f"\n{n} session(s) per call: {why}")
                record(f"batch_fits_{n}", 0, tier=TIER, preset=MANY, note=_note(why))
                continue
            record(f"batch_fits_{n}", 1, tier=TIER, preset=MANY, note=_note(case.why))
            p50, p95[n] = np.percentile(times, 50), np.percentile(times, 95)
            print(f"\n{n} session(s) per call: p50 {p50:.0f} ms, p95 {p95[n]:.0f} ms over chunks {positions}")
            note = _note(f"{len(times)} calls at chunks {positions}", plan)
            record(f"chunk_ms_p50_batch_{n}", p50, tier=TIER, preset=MANY, note=note)
            record(f"chunk_ms_p95_batch_{n}", p95[n], tier=TIER, preset=MANY, note=note)
            assert 0 < p50 <= p95[n]
    assert p95, f"no batch size ran: {[(c.rows, c.fits, c.why) for c in cases]}"
    # batches of n back to back: floor(period / p95) calls per period, n robots each (an estimate; the measured
    # figure is benchmarks/robots_per_gpu.py's)
    robots = max(n * math.floor(DROID_PERIOD_MS / ms) for n, ms in p95.items())
    print(f"robots served within DROID's {DROID_PERIOD_MS:.0f} ms chunk period: {robots}")
    note = _note(f"max over batch sizes {sorted(p95)} of rows x floor(1600 ms / p95); compute only")
    record("robots_per_gpu", robots, tier=TIER, preset=MANY, note=note)


def _parts_of(state) -> dict[str, int]:
    """The bytes a session's state holds, by the parts of its accounting (`SessionFootprint.parts`)."""

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    return {
        "kv_cache": nbytes(state.kv_cache),
        "text": nbytes(state.text_cache.values()),
        "clip": nbytes([state.clip_feature]),
        "y": nbytes([state.y]),
        "vae_state": nbytes(state.vae_state or ()),
        "first_frame": nbytes([state.first_frame]),
    }


def test_session_memory_matches_its_accounting(models):
    from dreamzero.device_memory import module_nbytes
    from dreamzero.pipeline.budget import memory_probe, warmup_canvas_hw

    pipe = models.get(MANY)
    canvas = warmup_canvas_hw(pipe)
    fp = pipe.footprint(pipe.canvas_hw(canvas))
    grown_max = 0
    with _overridden(pipe, TWO_STEPS), _fresh_store(pipe) as store:  # the bytes do not depend on the step count
        probe = memory_probe(pipe)
        pipe._prompt_rows.clear()  # the session's text rows are allocated by its first chunk
        if ON_CUDA:
            _sync()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
        for k in range(len(fp.by_chunk)):
            res = pipe.generate(
                _batch(pipe, ["mem"], canvas, k, frames=1 if k == 0 else 4, expected=[k] if k else None)
            )
            _sync()
            assert res.sessions[0].restarted == (k == 0), res.sessions
            state, _ = store.lookup("mem")
            held = state.nbytes()
            assert _parts_of(state) == fp.parts[k], f"chunk {k}: the session's tensors differ from the formula"
            assert held == fp.by_chunk[k]
            line = f"chunk {k}: accounted {_gib(held):.3f} GiB, formula {_gib(fp.by_chunk[k]):.3f} GiB"
            if ON_CUDA:
                grown = torch.cuda.memory_allocated() - base
                grown_max = max(grown_max, grown)
                print(f"{line}, allocated +{_gib(grown):.3f} GiB")
                assert abs(grown - held) <= 0.05 * held, f"chunk {k}: measured {grown} vs accounted {held}"
            else:  # the declared device: allocated = the weights + what the sessions hold, nothing else
                free, total = probe.mem_info()
                print(line)
                assert total - free == module_nbytes(pipe.model) + held
        pipe.drop_sessions(["mem"])
    note = _note(f"bf16, {canvas[0]}x{canvas[1]}, CFG, its fullest window of {len(fp.by_chunk)} chunks")
    record("session_peak_gib", _gib(fp.peak), tier=TIER, preset=MANY, note=note)
    if ON_CUDA:
        record("session_peak_allocated_gib", _gib(grown_max), tier=TIER, preset=MANY, note=note)


def _declared_device(pipe, sessions: int):
    """(a DeclaredMemory, the ServingMemory `auto` settles on it): the smallest device, in steps of a quarter session,
    on which `batching.max_batch_rows: auto` and `sessions.max_bytes: auto` leave room for `sessions` full-window
    sessions, with the replica's own accounting (weights + what the store holds)."""
    from dreamzero.device_memory import DeclaredMemory, module_nbytes
    from dreamzero.errors import ConfigError
    from dreamzero.pipeline.budget import resolve_serving_memory, warmup_canvas_hw

    weights = module_nbytes(pipe.model)
    peak = pipe.footprint(pipe.canvas_hw(warmup_canvas_hw(pipe))).peak
    capacity, step = weights + sessions * peak, max(1, peak // 4)
    for _ in range(10_000):
        probe = DeclaredMemory(
            capacity, lambda: weights + pipe.store.nbytes(), f"declared {capacity / 2**20:.1f} MiB device"
        )
        try:
            memory = resolve_serving_memory(pipe, "auto", "auto", 128, log=lambda *_: None, probe=probe)
        except ConfigError:
            memory = None
        if memory is not None and memory.budget // peak >= sessions:
            return probe, memory
        capacity += step
    raise AssertionError(f"no declared device up to {capacity} B holds {sessions} sessions")


def test_admission_fills_the_auto_budget_then_refuses_without_oom(models):
    from dreamzero.errors import CapacityError
    from dreamzero.pipeline.budget import memory_probe, resolve_serving_memory, warmup_canvas_hw

    pipe = models.get(MANY)
    canvas = warmup_canvas_hw(pipe)
    fp = pipe.footprint(pipe.canvas_hw(canvas))
    with _overridden(pipe, TWO_STEPS), _fresh_store(pipe) as store:  # admission does not depend on the step count
        if ON_CUDA:  # the replica's own sizing on this GPU: warm-ups measured by the allocator
            probe = memory_probe(pipe)
            memory = resolve_serving_memory(pipe, "auto", "auto", store.max_sessions, log=print, probe=probe)
        else:  # a device sized for two sessions of the 5B slice, so that filling it stays affordable here
            probe, memory = _declared_device(pipe, sessions=2)
        budget, peak = memory.budget, fp.peak
        store.max_bytes = budget
        expected = budget // peak
        print(f"{probe.name}: {memory.rows} rows, budget {_gib(budget):.2f} GiB, peak {_gib(peak):.2f} GiB: {expected}")
        assert expected >= 1
        # on CUDA each session to its fullest window, so every admitted byte is really allocated; on the declared
        # device reservations are all admission counts (no allocator to fill): one chunk each
        chunks = len(fp.by_chunk) if ON_CUDA else 1
        admitted = []
        for i in range(expected):
            sid = f"fill-{i}"
            for k in range(chunks):
                pipe.generate(_batch(pipe, [sid], canvas, k, frames=1 if k == 0 else 4))
            admitted.append(sid)
        if ON_CUDA:
            free, total = torch.cuda.mem_get_info()
            print(
                f"after {len(admitted)} full sessions: {_gib(free):.1f} GiB free of {_gib(total):.1f}, peak "
                f"allocated {_gib(torch.cuda.max_memory_allocated()):.1f} GiB"
            )
        extra = _batch(pipe, ["fill-extra"], canvas, 0, frames=1)
        # with every held session busy (in flight or queued), the next one is refused and nobody is touched
        with pytest.raises(CapacityError, match="sessions.max_bytes"):
            pipe.admit(extra, busy=admitted)
        store.release(["fill-extra"])
        assert all(sid in store for sid in admitted) and store.reserved_bytes() <= budget
        # with them idle, the least recently used one makes room, and the new session runs: still no OOM
        res = pipe.generate(extra)
        assert np.isfinite(res.actions).all() and "fill-0" not in store and "fill-extra" in store
        assert store.reserved_bytes() <= budget
    note = _note(f"as a replica sizes itself on {probe.name}", None if ON_CUDA else "declared for at least 2 sessions")
    record("session_budget_gib", _gib(budget), tier=TIER, preset=MANY, note=note)
    record("rows_chosen", memory.rows, tier=TIER, preset=MANY, note=note)
    record("sessions_admitted", expected, tier=TIER, preset=MANY, note=_note("full-window sessions, in-process"))


# --- serve run ----------------------------------------------------------------------------------------------------
def _require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.skip(NO_RAY)


def _shipped_args() -> dict:
    import yaml

    return yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["args"]


def _gpu_args(**changes) -> dict:
    """The app args to merge into the served config: `policy.num_gpus: 1` (the rest of `policy` as shipped) and
    `changes` (top-level args fields, e.g. model_path)."""
    return {"policy": {**_shipped_args().get("policy", {}), "num_gpus": 1}, **changes}


def _slice_env() -> dict[str, str]:
    # Ray pins a `num_cpus: 0` replica to one torch thread (OMP_NUM_THREADS=1); a slice's chunk is minutes of CPU
    return {} if ON_CUDA else {"OMP_NUM_THREADS": str(min(2, os.cpu_count() or 1))}


def _post(client, server, body: bytes):
    from dreamzero_client.wire import codec
    from dreamzero_client.wire.routes import GENERATIONS_PATH
    from tests.support.request_builders import content_type

    return client.post(
        server.url + GENERATIONS_PATH, content=body, headers={"content-type": content_type(codec.OPENPI)}
    )


def _reply(r, server, form: str):
    from dreamzero_client.wire.replies import parse_actions_response
    from tests.support.request_builders import decode

    assert r.status_code == 200, f"{form}: {r.status_code} {r.text[:500]}\n{server.log_tail()}"
    reply = parse_actions_response(decode(r.content))
    actions = np.asarray(reply.actions, dtype=np.float64)
    assert reply.form == form and actions.ndim == 3 and len(actions) == 1 and np.isfinite(actions).all()
    return reply


def _normalised_body(sid: str, hw: tuple[int, int]) -> bytes:
    from dreamzero_client.wire import codec, generations
    from tests.support.request_builders import normalised_observation

    body = generations.build_request_body(normalised_observation(1, 1, hw), ["a formatted prompt"], [sid])
    return codec.encode_body(body, codec.OPENPI)[0]


def _models_entry(client, server) -> dict:
    r = client.get(server.url + "/v1/models")
    assert r.status_code == 200, r.text[:500]
    return r.json()["data"][0]


def _openpi_client(port: int):
    try:  # openpi-client itself, where installed (it talks to `/`)
        from openpi_client.websocket_client_policy import WebsocketClientPolicy

        return contextlib.nullcontext(WebsocketClientPolicy(host="127.0.0.1", port=port))
    except ImportError:
        from dreamzero_client.openpi_client import OpenPIClient

        return OpenPIClient(port=port, path="/v1/realtime/robot/openpi", timeout_s=900)


def _ws_actions(reply) -> np.ndarray:
    """openpi-client hands back the reference reply (the bare array); our OpenPIClient opts into the dict form."""
    return np.asarray(reply["actions"] if isinstance(reply, dict) else reply)


def _libero_raw_body(sid: str) -> bytes:
    from dreamzero_client.wire import codec, generations

    rng = np.random.default_rng(5)
    obs = {k: rng.integers(0, 256, (1, 1, 256, 256, 3), dtype=np.uint8) for k in ("video.image", "video.wrist_image")}
    obs["state.state"] = rng.uniform(-1, 1, (1, 8)).astype(np.float32)
    body = generations.build_request_body(obs, ["put the bowl on the plate"], [sid])
    return codec.encode_body(body, codec.OPENPI)[0]


def _libero_openpi_observation(session_id: str) -> dict:
    rng = np.random.default_rng(6)
    return {
        "observation/image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
        "observation/state": rng.uniform(-1, 1, 8).astype(np.float32),
        "prompt": "put the bowl on the plate",
        "session_id": session_id,
    }


def _check_models_entry(entry: dict) -> tuple[int, int]:
    rows, budget = entry["max_batch_rows"], entry["session_budget_bytes"]
    assert isinstance(rows, int) and rows >= 1, entry  # what `batching.max_batch_rows: auto` chose
    assert isinstance(budget, int) and budget > 0 and entry["device"], entry  # `sessions.max_bytes: auto` on a GPU
    return rows, budget


@pytest.mark.timeout(1800)
@pytest.mark.filterwarnings("ignore::DeprecationWarning:openpi_client")  # its own use of websockets' old connect()
def test_serve_run_14b_on_one_gpu_starts_as_the_readme_says(request, tmp_path):
    """The config as the README tells a GPU user to change it, nothing else: `model_path` to a checkpoint in the
    release HF layout ($DREAMZERO_GPU_CHECK_MODEL on CUDA if set, else the 14B slice) and `policy.num_gpus: 1`. It
    starts, and GET /v1/models reports the rows and the budget `auto` chose. On CUDA it also answers the normalised
    and the raw form over HTTP and the OpenPI WebSocket; the rehearsal asks the 5B slice for those (next test): a
    14B-slice session start is minutes of this CPU at the shipped steps."""
    _require_ray()
    import httpx

    from tests.support.observations import openpi_droid_observation
    from tests.support.request_builders import raw_body
    from tests.support.serve_process import ServeRun

    model = _served_model(request)
    with ServeRun(tmp_path, args=_gpu_args(model_path=model), config=SERVE_CONFIG, gpus=1, env=_slice_env()) as server:
        with httpx.Client(timeout=900, trust_env=False) as client:
            entry = _models_entry(client, server)
            print(f"\n/v1/models: {entry}")
            rows, budget = _check_models_entry(entry)
            assert entry["embodiment"] == "oxe_droid" and entry["action_horizon"] == 24, entry
            if ON_CUDA:
                _reply(_post(client, server, _normalised_body("gpu-n", (352, 640))), server, "normalised")
                _reply(_post(client, server, raw_body(["gpu-r"])), server, "raw")
        if ON_CUDA:
            with _openpi_client(server.port) as ws:
                actions = _ws_actions(ws.infer(openpi_droid_observation(0, "gpu-ws")))
                assert actions.shape[0] == entry["action_horizon"] and np.isfinite(actions).all()
    preset = entry["config"]
    note = _note("serve run, GET /v1/models")
    record("rows_chosen", rows, tier=TIER, preset=preset, note=note)
    record("session_budget_gib", _gib(budget), tier=TIER, preset=preset, note=note)


@pytest.mark.timeout(1200)
@pytest.mark.filterwarnings("ignore::DeprecationWarning:openpi_client")
def test_serve_run_5b_full_weights_starts_as_libero_and_answers_every_form(tmp_path, libero_checkpoint):
    """The same change with `model_path` to a `full_weights.pt` with its config.json beside it (no preset needed);
    the embodiment comes from the checkpoint (libero_sim). Served at the shipped step plan, it answers the normalised
    and the raw form over HTTP and the OpenPI WebSocket."""
    _require_ray()
    import httpx

    from tests.support.serve_process import ServeRun

    args = _gpu_args(model_path=str(libero_checkpoint))
    with ServeRun(tmp_path, args=args, config=SERVE_CONFIG, gpus=1, env=_slice_env()) as server:
        with httpx.Client(timeout=900, trust_env=False) as client:
            entry = _models_entry(client, server)
            assert (entry["config"], entry["embodiment"], entry["action_horizon"]) == (
                "libero_5b_slice",
                "libero_sim",
                16,
            )
            _check_models_entry(entry)
            reply = _reply(_post(client, server, _normalised_body("gpu-5b", (256, 512))), server, "normalised")
            assert np.asarray(reply.actions).shape[1:] == (16, 32)
            raw = _reply(_post(client, server, _libero_raw_body("gpu-5b-raw")), server, "raw")
            assert np.asarray(raw.actions).shape[1:] == (16, 7)  # robot units: delta eef 6 + gripper
        with _openpi_client(server.port) as ws:
            actions = _ws_actions(ws.infer(_libero_openpi_observation("gpu-5b-ws")))
            assert actions.shape == (16, 7) and np.isfinite(actions).all()


def _error_message(r) -> str:
    from dreamzero_client.wire.replies import parse_error_body
    from tests.support.request_builders import decode

    try:
        body = r.json()
    except ValueError:
        body = decode(r.content)
    return parse_error_body(body)[1]


@pytest.mark.timeout(900)
def test_serve_run_admits_sessions_until_the_budget_is_full_then_503(tmp_path):
    """The shipped config with `policy.num_gpus: 1` and its own model (embedded:small-scene1), on a GPU with room for
    about four of its sessions: on CPU a simulated GPU sized so (weights, `auto`'s warm-up, cache copies and margin,
    computed with the replica's own accounting, which GET /v1/models must then report), on CUDA `sessions.max_bytes`
    of four and a half sessions. Raw-form sessions are opened over HTTP until the budget is full; then, while every
    admitted session has a call in flight or queued (sessions that are idle are evicted for a newcomer, by design), a
    new session gets 503 with Retry-After naming sessions.max_bytes and the others continue (step + 1, not
    restarted). The newcomer must reach the policy while the first call runs (a few hundred ms here): a round whose
    timing missed that is retried with new sessions, at most six times (three missed once in CI, 2026-12-07)."""
    _require_ray()
    import httpx

    from dreamzero.embedded_default import resolve_model_path
    from dreamzero.pipeline import DreamZeroPipeline
    from dreamzero.pipeline.budget import warmup_canvas_hw
    from tests.support.serve_process import ServeRun

    shipped = _shipped_args()
    pipe = DreamZeroPipeline.load(resolve_model_path(shipped["model_path"]), device="cpu", dtype=torch.bfloat16)
    peak = pipe.footprint(pipe.canvas_hw(warmup_canvas_hw(pipe))).peak
    max_sessions = shipped["sessions"]["max_sessions"]
    if ON_CUDA:
        args = _gpu_args(sessions={**shipped["sessions"], "max_bytes": int(4.5 * peak)})
        env, predicted, device = {}, None, torch.cuda.get_device_name()
    else:
        probe, predicted = _declared_device(pipe, sessions=4)
        args, env = _gpu_args(), {"DREAMZERO_SIMULATED_GPU": str(probe.capacity)}
        device = f"a simulated GPU of {probe.capacity / 2**20:.1f} MiB"
        assert predicted.rows <= max_sessions
    del pipe
    with ServeRun(tmp_path, args=args, config=SERVE_CONFIG, gpus=1, env=env) as server:
        with httpx.Client(timeout=300, trust_env=False) as client:
            entry = _models_entry(client, server)
            print(f"\n{device}: /v1/models {entry}")
            budget = entry["session_budget_bytes"]
            if predicted is not None:  # the replica sized itself exactly as its accounting says
                assert (entry["max_batch_rows"], budget) == (predicted.rows, predicted.budget), entry
            fit = budget // peak
            assert fit >= 2, f"the budget {budget} holds {fit} sessions of {peak} B"
            for attempt in range(ROUNDS):
                refused = _fill_then_refuse(client, server, [f"adm{attempt}-{i}" for i in range(fit)], attempt)
                if refused:
                    break
            else:
                pytest.fail(
                    f"in {ROUNDS} rounds the newcomer never reached the policy while the others were busy\n"
                    f"{server.log_tail()}"
                )
    note = _note(f"serve run, {shipped['model_path']} on {device}, {attempt + 1} round(s)")
    record("sessions_admitted", fit, tier=TIER, preset=entry["config"], note=note)


def _fill_then_refuse(client, server, ids: list[str], attempt: int) -> bool:
    """Open `ids` (one raw-form session per request, sequentially: the budget holds exactly these), continue each once,
    then one round: a call of ids[0], the newcomer while it runs, and a call of every id; True when the newcomer got
    503 (asserting what it and the others got), False when it was not refused (the round's timing missed)."""
    from tests.support.request_builders import decode, raw_body

    steps, rtt = {}, []
    for sid in ids:  # the budget holds them all: nobody is evicted
        s = _session(_post(client, server, raw_body([sid])), server, decode)
        assert s["restarted"] and s["restart_reason"] == "new_session", s
        steps[sid] = s["step"]
    for sid in ids:  # and they continue
        t0 = time.perf_counter()
        s = _session(_post(client, server, raw_body([sid], t=4)), server, decode)
        rtt.append(time.perf_counter() - t0)
        assert not s["restarted"] and s["step"] == steps[sid] + 1, s
        steps[sid] = s["step"]
    lead = 0.3 * float(np.median(rtt))  # the first call is in the model by then, and still running
    newcomer = f"adm{attempt}-new"
    with ThreadPoolExecutor(max_workers=len(ids) + 2) as pool:
        first = pool.submit(_post, client, server, raw_body([ids[0]], t=4))
        time.sleep(lead)
        new = pool.submit(_post, client, server, raw_body([newcomer]))
        time.sleep(0.01)
        again = {sid: pool.submit(_post, client, server, raw_body([sid], t=4)) for sid in ids}
        r_new, r_first, r_again = new.result(), first.result(), {sid: f.result() for sid, f in again.items()}
    if r_new.status_code == 200:
        print(f"round {attempt}: the newcomer was admitted (it reached the policy outside the first call); again")
        return False
    message = _error_message(r_new)
    assert r_new.status_code == 503 and "sessions.max_bytes" in message, (r_new.status_code, message)
    assert int(r_new.headers["retry-after"]) >= 1, dict(r_new.headers)
    s = _session(r_first, server, decode)
    assert not s["restarted"] and s["step"] == steps[ids[0]] + 1, s
    steps[ids[0]] += 1
    for sid, r in r_again.items():  # every admitted session continued: nobody was evicted for the newcomer
        s = _session(r, server, decode)
        assert not s["restarted"] and s["step"] == steps[sid] + 1, s
    print(f"round {attempt}: {len(ids)} sessions admitted, the newcomer refused: {message}")
    return True


def _session(r, server, decode) -> dict:
    assert r.status_code == 200, f"{r.status_code} {r.text[:500]}\n{server.log_tail()}"
    return decode(r.content)["sessions"][0]
