"""Model latency: one steady-state DreamZero chunk, 16 DiT steps vs the upstream 8-step mask vs dynamic skipping.

Everything is measured in one run on one model, so the ratios compare like with like. A "chunk" is a continuing
session's call (4 new frames: VAE, prefill of the observed block, denoising), timed after warm-up chunks; the
restart chunk (anchor conditioning) is reported separately.

    python benchmarks/model_latency.py                                  # tiny preset, this machine's device
    python benchmarks/model_latency.py --preset droid_14b --device cuda --dtype bfloat16   # random 14B weights
    python benchmarks/model_latency.py --model-path /ckpt/DreamZero-DROID --write-docs
    python benchmarks/model_latency.py --preset droid_14b --device cuda --compile none,dit --write-docs --section GPU

`--compile none,dit` repeats every mode with the `pipeline.compile` override (where this tree's PipelineConfig has
that knob; otherwise the compiled modes are skipped with a note). `--section` names the docs section written.

All modes share one model (a second copy of the 14B's 46 GB would not fit beside the sessions), and a compiled
pipeline compiles that model's DiT blocks in place. So each chunk runs inside `compiled_only(model, pipe.compiled)`:
exactly what its own mode compiled runs compiled, every other compiled part eager (its compiled callable set aside,
not rebuilt: switching back builds no graph). Each row's `compiled` column says what ran compiled in that mode.
"""

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


def measure_all(model, args, hw, modes: dict[str, dict] = MODES) -> dict[str, dict]:
    """Per mode: one restart chunk, `warmup` continuing chunks, then `repeats` timed continuing chunks.

    Modes take turns chunk by chunk, so a busy machine slows them alike and the ratios stay meaningful. Sessions
    restart when the attention window fills (every 4 chunks on DROID); restart chunks are not timed as steady state.
    """
    pipes = build_pipelines(model, modes, args.batch + 1)
    device = next(iter(pipes.values())).device
    out = {name: {"totals": [], "denoise": [], "steps": [], "peak_mb": 0.0, "compiled": set()} for name in pipes}
    calls = dict.fromkeys(pipes, 0)

    def run(name: str, frames: int):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        res, ran_compiled = run_chunk(pipes[name], make_batch(args.batch, frames, hw, calls[name]))
        calls[name] += 1
        out[name]["peak_mb"] = max(out[name]["peak_mb"], peak_memory_mb(device))
        out[name]["compiled"].add(", ".join(ran_compiled) or "none")
        return res

    # one throwaway restart + chunk first, so the first mode does not pay for lazy initialisation
    warm = DreamZeroPipeline(
        model, apply_overrides(model.config.pipeline, {"compile": "none"}), SessionStore(args.batch + 1)
    )
    run_chunk(warm, make_batch(args.batch, 1, hw, 0))
    run_chunk(warm, make_batch(args.batch, 4, hw, 1))
    for name in pipes:
        out[name]["restart_ms"] = run(name, 1).timings_ms["total"]
    for round_ in range(args.warmup + args.repeats):
        for name in pipes:
            res = run(name, 4)
            while res.sessions[0].restarted:  # window full: a restart chunk, not a steady-state one
                res = run(name, 4)
            if round_ >= args.warmup:
                out[name]["totals"].append(res.timings_ms["total"])
                out[name]["denoise"].append(res.timings_ms.get("denoise", 0.0))
                out[name]["steps"].append(res.dit_steps)
    first = next(iter(pipes.values()))
    session_peak = first.footprint(first.canvas_hw(hw)).peak  # the formula (docs/model.md 7.1); same in every mode
    return {
        name: {
            "restart_ms": r["restart_ms"],
            "chunk_ms": statistics.median(r["totals"]),
            "denoise_ms": statistics.median(r["denoise"]),
            "dit_steps": statistics.mean(r["steps"]),
            "peak_mb": r["peak_mb"],
            "session_mb": pipes[name].stats()["bytes"] / 2**20 / args.batch,
            "session_peak_mb": session_peak / 2**20,
            "compiled": " / ".join(sorted(r["compiled"])),
        }
        for name, r in out.items()
    }


def render(results: dict[str, dict], args, model, device_name: str, notes: list[str] = ()) -> str:
    base = results["16 steps"]["chunk_ms"]
    cfg = model.config
    lines = [
        f"{'Checkpoint' if args.model_path else 'Preset'} `{args.model_path or args.preset}` "
        f"({cfg.dit.num_layers} layers, dim {cfg.dit.dim}{'' if args.model_path else ', random weights'}), "
        f"batch {args.batch}, device {device_name}, dtype {str(model.dtype).removeprefix('torch.')}, "
        f"median of {args.repeats} steady-state chunks after {args.warmup} warm-up; "
        f"run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| mode | compiled | DiT steps | chunk ms | denoise ms | chunk vs 16 steps | restart chunk ms | "
        "peak memory MiB | session state MiB | session peak MiB (formula) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['compiled']} | {r['dit_steps']:.1f} | {r['chunk_ms']:.1f} | {r['denoise_ms']:.1f} | "
            f"{r['chunk_ms'] / base:.2f}x | {r['restart_ms']:.1f} | {r['peak_mb']:.0f} | {r['session_mb']:.2f} | "
            f"{r['session_peak_mb']:.1f} |"
        )
    lines += [f"\n{note}" for note in notes]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(CANVAS))
    ap.add_argument("--model-path", help="checkpoint directory (default: the preset with random weights)")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--canvas", help="HxW of the canvas sent (default per preset)")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the table into this file")
    ap.add_argument("--compile", default="none", help="comma-separated pipeline.compile values, e.g. none,dit")
    ap.add_argument("--section", help="docs section title to write (default: Model latency)")
    ap.add_argument("--json", help="also write the rows and the table to this JSON file (gpu-check reads it)")
    args = ap.parse_args(argv)
    modes, notes = build_modes([v.strip() for v in args.compile.split(",") if v.strip()])
    if "16 steps" not in modes:
        ap.error("--compile must include none (the 16-step baseline every ratio refers to)")

    model = build_model(args)
    hw = tuple(int(v) for v in args.canvas.split("x")) if args.canvas else CANVAS.get(args.preset, (32, 64))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = next(model.parameters()).device
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    results = measure_all(model, args, hw, modes)
    table = render(results, args, model, device_name, notes)
    print(table)
    if args.json:
        record = {"preset": args.model_path or args.preset, "device": device_name, "rows": results, "table": table}
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
