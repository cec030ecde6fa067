"""Model latency per chunk, comparable with the published references: 16 DiT steps vs the upstream 8-step mask vs
dynamic skipping, eager or `pipeline.compile: dit`.

A row is one mode at one batch size, measured alone (`measure_mode`: a fresh session store, dropped before the next
row, so only one is ever live: the 14B fits an 80 GB H100): the first restart chunk and `--warmup` continuing chunks
timed apart (in a compiled mode they hold the compile: the `compile` column is their excess over steady state), then
the median of `--repeats` (default 5) continuing chunks at steady cache positions (the window's restarts are timed
apart, as is a restart of fresh sessions at the end). Dynamo's counters over the row say how many graphs were built,
how many graph breaks, and how many graphs were built in steady state (recompiles); a recompile-limit hit (one code
object serves all 40 blocks) marks the row "fell back to eager".

    python benchmarks/model_latency.py                                  # tiny preset, this machine's device
    python benchmarks/model_latency.py --preset droid_14b --device cuda --dtype bfloat16   # random 14B weights
    python benchmarks/model_latency.py --preset libero_5b --device cuda --batch 1,auto     # auto: the planner's rows
    python benchmarks/model_latency.py --model-path /ckpt/DreamZero-DROID --write-docs

`scripts/gpu-check.sh` runs eager and `--compile dit` in separate processes (a compile failure or overrun then loses
no eager row) with `--results FILE`: every row is appended there as soon as it exists. `--compile none,dit` in one
process also works: all modes share one model (a second 14B would not fit), a compiled pipeline compiles its DiT
blocks in place, and each chunk runs inside `compiled_only(model, pipe.compiled)`, so each row runs exactly what its
own mode compiled (the `compiled` column says what ran compiled). `--section` names the docs section written.
"""

# Longer than ~400 lines on purpose: measuring a row, reading Dynamo and rendering it are one figure's definition.

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dreamzero.config import PipelineConfig, apply_overrides, preset
from dreamzero.device import select_device
from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.pipeline.compile import compiled_only, compiled_parts
from dreamzero.sessions import SessionStore
from dreamzero.types import ModelBatch

# canvas sent per preset (the model may resize it in-model, see PipelineConfig.model_input_hw)
CANVAS = {"tiny": (32, 64), "droid_14b": (352, 640), "libero_5b": (256, 512)}
CANVAS |= {"droid_14b_slice": CANVAS["droid_14b"], "libero_5b_slice": CANVAS["libero_5b"]}  # real shapes, 1 block
MODES = {
    "16 steps": {"dit_step_mask": None, "dynamic_skip": False},
    "8-step mask (upstream)": {"dynamic_skip": False},
    "dynamic skipping": {"dynamic_skip": True},
}
DOC_SECTION = "## Model latency"


def build_model(args):
    if args.model_path:
        from dreamzero.checkpoint import load_model

        return load_model(args.model_path, device=args.device, dtype=args.dtype)
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import build_local_tokenizer

    cfg = preset(args.preset)
    device, dtype = select_device(args.device, args.dtype)
    model = DreamZeroModel.from_config(cfg, device=device, dtype=dtype, seed=0)  # random weights
    model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    return model


def make_batch(n: int, frames: int, hw: tuple[int, int], step: int) -> ModelBatch:
    rng = np.random.default_rng(step)
    return ModelBatch(
        images=rng.integers(0, 256, (n, frames, *hw, 3), dtype=np.uint8),
        state=rng.standard_normal((n, 1, 64)).astype(np.float32) * 0.5,
        state_mask=np.ones((n, 1, 64), bool),
        prompts=["pick up the marker and put it in the cup"] * n,
        session_ids=[f"bench-{i}" for i in range(n)],
    )


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (KiB on Linux)


def build_modes(compile_values: list[str]) -> tuple[dict[str, dict], list[str]]:
    """The step modes, once per compile value; notes for values this tree cannot run."""
    has_compile = "compile" in PipelineConfig.model_fields
    modes, notes = {}, []
    for value in compile_values:
        if value != "none" and not has_compile:
            notes.append(f"`pipeline.compile: {value}` skipped: this tree's PipelineConfig has no `compile` knob.")
            continue
        for name, overrides in MODES.items():
            extra = {"compile": value} if has_compile else {}
            modes[name if value == "none" else f"{name}, compile {value}"] = {**overrides, **extra}
    return modes, notes


def build_pipelines(model, modes: dict[str, dict], max_sessions: int) -> dict[str, DreamZeroPipeline]:
    """One pipeline per mode, all on `model`; a mode with `compile` set compiles the model's parts in place (run
    each pipeline's chunks through `run_chunk`, which gives it exactly its own compilation)."""
    return {
        name: DreamZeroPipeline(model, apply_overrides(model.config.pipeline, mode), SessionStore(max_sessions))
        for name, mode in modes.items()
    }


def run_chunk(pipe: DreamZeroPipeline, batch: ModelBatch):
    """`pipe.generate(batch)` with exactly what `pipe` compiled running compiled; also returns what did."""
    with compiled_only(pipe.model, pipe.compiled):
        ran_compiled = compiled_parts(pipe.model)
        return pipe.generate(batch), ran_compiled


class DynamoWatch:
    """What torch._dynamo did over a span of chunks: graphs built, graph breaks, and the recompile-limit warnings
    after which Dynamo runs a code object eager for good (one code object serves every DiT block, so a limit hit is
    a compiled row that silently fell back to eager)."""

    def __init__(self):
        import logging

        self.limit_hits: list[str] = []
        watch = self

        class _Hits(logging.Handler):
            def emit(self, record):
                message = record.getMessage()
                if "hit config." in message or "recompile limit" in message.lower():
                    watch.limit_hits.append(message.splitlines()[0][:200])

        self._handler = _Hits(level=logging.WARNING)
        for name in ("torch._dynamo", "torch._dynamo.convert_frame"):
            logging.getLogger(name).addHandler(self._handler)

    @staticmethod
    def snapshot() -> dict:
        try:
            from torch._dynamo.utils import counters
        except ImportError:  # a torch without Dynamo: nothing compiles
            return {}
        return {
            "graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "break_reasons": sorted(counters["graph_break"], key=lambda k: -counters["graph_break"][k])[:3],
            "frames": int(counters["frames"].get("total", 0)),
        }

    def close(self) -> None:
        import logging

        for name in ("torch._dynamo", "torch._dynamo.convert_frame"):
            logging.getLogger(name).removeHandler(self._handler)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_mode(model, name: str, mode: dict, args, hw, batch: int) -> dict:
    """One row: a fresh pipeline and session store (dropped before the next row: one store live at a time, so the
    14B fits an 80 GB H100), its first restart chunk and `warmup` continuing chunks timed apart (in a compiled mode
    they hold the compile), then `repeats` continuing chunks at steady cache positions (sessions restart when their
    window fills; those restart chunks are timed apart) and one more restart of fresh sessions. Dynamo's counters are
    read over the steady span: a graph built there is a recompile, a recompile-limit hit an eager fall-back."""
    pipe = DreamZeroPipeline(model, apply_overrides(model.config.pipeline, mode), SessionStore(batch + 1))
    device = pipe.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    watch, before = DynamoWatch(), DynamoWatch.snapshot()
    calls, compiled = [0], set()

    def chunk(frames: int, ids: list[str]):
        b = make_batch(batch, frames, hw, calls[0])
        b.session_ids = ids
        calls[0] += 1
        _sync(device)
        t0 = time.perf_counter()
        res, ran = run_chunk(pipe, b)
        _sync(device)
        compiled.add(", ".join(ran) or "none")
        return res, (time.perf_counter() - t0) * 1000.0

    ids = [f"bench-{i}" for i in range(batch)]
    try:
        _, first_restart = chunk(1, ids)
        first = [chunk(4, ids)[1] for _ in range(args.warmup)]
        warmed = DynamoWatch.snapshot()
        totals, denoise, steps, positions, restarts = [], [], [], [], []
        guard = 0
        while len(totals) < args.repeats:
            guard += 1
            if guard > 4 * args.repeats + 8:
                raise RuntimeError(f"{name}: no {args.repeats} continuing chunks in {guard} calls")
            res, ms = chunk(4, ids)
            if res.sessions[0].restarted:  # the window filled: a restart chunk, timed apart
                restarts.append(ms)
                continue
            totals.append(ms)
            denoise.append(res.timings_ms.get("denoise", 0.0))
            steps.append(res.dit_steps)
            positions.append(int(res.sessions[0].frame_position))
        session_mb = pipe.stats()["bytes"] / 2**20 / batch  # at the last steady position
        pipe.drop_sessions(ids)
        fresh = [f"bench-r{i}" for i in range(batch)]
        restarts.append(chunk(1, fresh)[1])
        after = DynamoWatch.snapshot()
        pipe.drop_sessions(fresh)
    finally:
        watch.close()
        pipe.drop_sessions(list(pipe.store.ids()))
    ran = " / ".join(sorted(compiled))
    steady_graphs = after.get("graphs", 0) - warmed.get("graphs", 0)
    graphs = after.get("graphs", 0) - before.get("graphs", 0)
    fell_back = "dit.blocks" in ran and (bool(watch.limit_hits) or graphs == 0)
    row = {
        "mode": name,
        "compile": mode.get("compile", "none"),
        "compiled": ran,
        "batch": batch,
        "chunk_ms": statistics.median(totals),
        "chunk_ms_min": min(totals),
        "chunk_ms_max": max(totals),
        "chunks": len(totals),
        "positions": positions,
        "denoise_ms": statistics.median(denoise),
        "dit_steps": statistics.mean(steps),
        "restart_ms": statistics.median(restarts),
        "restarts": len(restarts),
        "first_restart_ms": first_restart,
        "first_chunks_ms": first,
        "compile_ms": max(0.0, first_restart - statistics.median(restarts))
        + sum(max(0.0, f - statistics.median(totals)) for f in first),
        "graphs": graphs,
        "recompiles_steady": steady_graphs,
        "graph_breaks": after.get("graph_breaks", 0) - before.get("graph_breaks", 0),
        "break_reasons": after.get("break_reasons", []),
        "limit_hits": watch.limit_hits[:3],
        "fell_back_to_eager": fell_back,
        "peak_mb": peak_memory_mb(device),
        "session_mb": session_mb,
        "session_peak_mb": pipe.footprint(pipe.canvas_hw(hw)).peak / 2**20,
    }
    pipe.store, pipe._prompt_rows = SessionStore(1), type(pipe._prompt_rows)()  # nothing of this row stays live
    _release(device)
    return row


def measure_all(model, args, hw, modes: dict[str, dict] = MODES, batches=None, on_row=None) -> dict[str, dict]:
    """Every mode at every batch size, one after the other (`measure_mode`), after one throwaway eager restart +
    chunk so that the first mode does not pay for lazy initialisation. `on_row(row)` is called as soon as a row
    exists (gpu-check appends it to its results file then: a stage stopped later keeps it)."""
    batches = list(batches or [args.batch])
    warm = DreamZeroPipeline(
        model, apply_overrides(model.config.pipeline, {"compile": "none"}), SessionStore(max(batches) + 1)
    )
    run_chunk(warm, make_batch(1, 1, hw, 0))
    run_chunk(warm, make_batch(1, 4, hw, 1))
    del warm  # its session with it: one store live at a time
    _release(next(model.parameters()).device)
    out = {}
    for batch in batches:
        for name, mode in modes.items():
            row = measure_mode(model, name, mode, args, hw, batch)
            key = name if len(batches) == 1 else f"{name}, batch {batch}"
            out[key] = row
            if on_row is not None:
                on_row({**row, "row": key})
    return out


def render(results: dict[str, dict], args, model, device_name: str, notes: list[str] = ()) -> str:
    cfg = model.config
    base = next((r["chunk_ms"] for n, r in results.items() if n.startswith("16 steps")), None)
    lines = [
        f"{'Checkpoint' if args.model_path else 'Preset'} `{args.model_path or args.preset}` "
        f"({cfg.dit.num_layers} layers, dim {cfg.dit.dim}{'' if args.model_path else ', random weights'}), "
        f"device {device_name}, dtype {str(model.dtype).removeprefix('torch.')}; per row: the median of "
        f"{args.repeats} continuing chunks at steady cache positions (after the first restart and {args.warmup} "
        f"continuing chunk(s), timed apart as the compile column), the restart chunk apart; "
        f"run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| mode | compiled | batch | DiT steps | chunk ms | denoise ms | chunk vs 16 steps | restart chunk ms | "
        "first chunks ms (compile) | graphs / breaks / steady recompiles | peak memory MiB | session state MiB | "
        "session peak MiB (formula) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ran = r["compiled"] + (" (fell back to eager)" if r.get("fell_back_to_eager") else "")
        first = " + ".join(f"{v:.0f}" for v in [r["first_restart_ms"], *r["first_chunks_ms"]])
        ratio = f"{r['chunk_ms'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {ran} | {r['batch']} | {r['dit_steps']:.1f} | {r['chunk_ms']:.1f} | {r['denoise_ms']:.1f} | "
            f"{ratio} | {r['restart_ms']:.1f} | {first} ({r['compile_ms']:.0f}) | {r['graphs']} / "
            f"{r['graph_breaks']} / {r['recompiles_steady']} | {r['peak_mb']:.0f} | {r['session_mb']:.2f} | "
            f"{r['session_peak_mb']:.1f} |"
        )
    lines += [f"\n{note}" for note in notes]
    lines += [
        "",
        "CUDA graphs: not offered. A chunk's KV cache grows with its cache position and the session state lives "
        "outside any graph, so a captured graph would need static cache buffers per position and batch size (the "
        "reference's static-shape engine); `pipeline.compile` compiles with dynamic shapes instead.",
    ]
    if not args.model_path:
        lines += [
            "",
            "Random weights give velocities that change a lot between steps, so the dynamic rule (cosine similarity "
            "> 0.93) rarely skips here; measure a trained checkpoint to see what it saves in practice.",
        ]
    if device_name.startswith("cpu"):
        lines += ["", "On CPU, peak memory is the process's peak RSS (cumulative across modes), not per mode."]
    return "\n".join(lines) + "\n"


def write_docs(path: Path, table: str, heading: str = DOC_SECTION, intro: str = "") -> None:
    """Replace (or append) the section `heading` of docs/benchmarks.md."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    intro = intro or "Written by `benchmarks/model_latency.py --write-docs`."
    section = f"{heading}\n\n{intro}\n\n{table}"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    path.write_text(text)


def batch_sizes(spec: str, model, device: torch.device, cap: int | None = None) -> tuple[list[int], list[str]]:
    """`--batch` ("1", "1,4", "1,auto") -> the batch sizes and notes; `auto` is the largest batch the memory planner
    allows on this device (benchmarks/gpu_sizing.py), dropped with a note where no device memory bounds it."""
    sizes, notes = [], []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        if word != "auto":
            if not word.isdigit() or int(word) < 1:
                raise SystemExit(f"--batch: {word!r} is neither a positive number nor auto")
            sizes.append(int(word))
            continue
        from benchmarks.gpu_sizing import device_memory_bytes, largest_rows

        capacity = device_memory_bytes(device)
        if capacity is None:
            notes.append("--batch auto skipped: no device memory here (no CUDA, no DREAMZERO_SIMULATED_GPU)")
            continue
        rows, why = largest_rows(model.config, capacity, model.dtype)
        notes.append(f"batch auto = {rows}: {why}")
        if cap is not None and rows > cap:
            notes.append(f"batch auto capped at {cap} (--batch-cap: what this machine affords), not {rows}")
            rows = cap
        if rows >= 1:
            sizes.append(rows)
    return list(dict.fromkeys(sizes)), notes


def append_result(path: str | None, line: dict) -> None:
    """One JSON line appended to gpu-check's results file (`--results`), flushed at once."""
    if not path:
        return
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"stage": os.environ.get("GPU_CHECK_STAGE", "model_latency"), **line}) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(CANVAS))
    ap.add_argument("--model-path", help="checkpoint directory (default: the preset with random weights)")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes; auto: the largest the planner allows")
    ap.add_argument("--batch-cap", type=int, help="the most rows `auto` may choose (a CPU rehearsal's limit)")
    ap.add_argument("--warmup", type=int, default=1, help="continuing chunks timed apart after the first restart")
    ap.add_argument("--repeats", type=int, default=5, help="continuing chunks per row (their median is reported)")
    ap.add_argument("--modes", help="comma-separated step modes to run (default: all)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--canvas", help="HxW of the canvas sent (default per preset)")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the table into this file")
    ap.add_argument("--compile", default="none", help="comma-separated pipeline.compile values, e.g. none,dit")
    ap.add_argument("--section", help="docs section title to write (default: Model latency)")
    ap.add_argument("--json", help="also write the rows and the table to this JSON file")
    ap.add_argument("--results", help="append each row to this JSON-lines file as soon as it is measured")
    ap.add_argument(
        "--dit-weights", choices=("model", "fp8"), default="model",
        help="the DiT's weights: the model dtype (default) or fp8 (weight-only, dreamzero.model.fp8)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    modes, notes = build_modes([v.strip() for v in args.compile.split(",") if v.strip()])
    if args.modes:
        wanted = {m.strip() for m in args.modes.split(",")}
        unknown = wanted - set(MODES)
        if unknown:
            ap.error(f"--modes: unknown {sorted(unknown)}; use {sorted(MODES)}")
        modes = {n: m for n, m in modes.items() if n.split(", compile")[0] in wanted}
    if args.dit_weights == "fp8":  # the rows say so in their names, so the docs and results keep them apart
        modes = {f"{n}, fp8 DiT weights": m for n, m in modes.items()}
    if not modes:
        ap.error("no mode left to run")

    model = build_model(args)
    if args.dit_weights == "fp8":
        from dreamzero.model.fp8 import convert_linears_to_fp8_

        convert_linears_to_fp8_(model.model)  # the blocks' Linear weights, quantised in place (docs/model.md 8.2)
    hw = tuple(int(v) for v in args.canvas.split("x")) if args.canvas else CANVAS.get(args.preset, (32, 64))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = next(model.parameters()).device
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    sizes, size_notes = batch_sizes(args.batch, model, device, args.batch_cap)
    notes = [*notes, *size_notes]
    for note in size_notes:
        append_result(args.results, {"note": note, "preset": args.model_path or args.preset})
    if not sizes:
        print("\n".join(notes))
        return 0
    args.batch = sizes[0]
    preset_name = args.model_path or args.preset

    def on_row(row: dict) -> None:
        append_result(args.results, {**row, "preset": preset_name, "device": device_name})

    results = measure_all(model, args, hw, modes, sizes, on_row)
    table = render(results, args, model, device_name, notes)
    print(table)
    if args.json:
        record = {"preset": preset_name, "device": device_name, "rows": results, "table": table}
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.write_docs:
        path = Path(args.write_docs)
        if not path.is_absolute():
            path = Path(__file__).resolve().parents[1] / path
        if args.section:
            intro = "Written by `scripts/gpu-check.sh` (`benchmarks/model_latency.py --section " + args.section + "`)."
            write_docs(path, table, f"## {args.section}", intro)
        else:
            write_docs(path, table)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
