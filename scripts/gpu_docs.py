"""The "GPU" section of docs/benchmarks.md, rendered from the GPU check's results file (JSON lines) whatever stages
finished: written after every stage by `scripts/gpu_check.py`, so a stage that fails or runs out of time leaves every
figure before it in the docs, and the section says which stages did not finish ("Incomplete").

Lines of the results file: `{"stage", "event": "end", "status", "took_s", "why"}` from the check itself, and the
stages' figures as they were measured: `environment` and `compile_smoke` (scripts/gpu_stages.py), latency rows
(benchmarks/model_latency.py: a `row` key), the tier's figures (tests/gpu/figures.py: `figure`, `value`, `unit`),
`fleet` / `fleet_at_pace` (benchmarks/fleet.py), `cfg_parallel` (benchmarks/cfg_parallel.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

#: the published figures ours are compared with: (what, reference figure, its setup)
REFERENCES = {
    "one_gpu": ("vLLM-Omni, DreamZero-DROID 14B", "1095 ms/chunk", "one H200, compiled with CUDA graphs"),
    "two_gpu": ("vLLM-Omni, DreamZero-DROID 14B", "611 ms/chunk", "two H200, CFG-parallel"),
    "upstream": ("upstream DreamZero", "~3 s/chunk", "2xH100, CFG-parallel with the 8-step mask"),
}


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a killed stage: the rest still counts
            continue
    return out


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _ms(row: dict | None) -> str:
    return "not measured" if row is None else f"{row['chunk_ms']:.0f} ms"


def _latency_row(results, stage: str, mode: str) -> dict | None:
    return next((r for r in results if r.get("stage") == stage and r.get("row") == mode), None)


def comparison(results: list[dict], status: dict[str, str]) -> list[str]:
    """Ours next to the references, with what differs."""

    def why_missing(stage):
        return f"stage {stage}: {status.get(stage, 'not run')}"

    eager = _latency_row(results, "eager", "8-step mask (upstream)")
    compiled = _latency_row(results, "compiled", "8-step mask (upstream), compile dit")
    cfg2 = next((r for r in results if r.get("figure") == "cfg_parallel"), None)
    ref1, ref2, up = REFERENCES["one_gpu"], REFERENCES["two_gpu"], REFERENCES["upstream"]
    device = next((r.get("device") for r in results if r.get("figure") == "environment"), "this GPU")
    diff = f"{device}; random weights; batch 1; median of continuing chunks at steady cache positions"
    compiled_note = "ours `compile: dit` (dynamic shapes), no CUDA graphs (see the latency table's note)"
    if compiled is not None and compiled.get("fell_back_to_eager"):
        compiled_note += "; **fell back to eager** (recompile limit)"
    model = {"droid_14b": "DROID 14B"}.get((eager or compiled or {}).get("preset", "droid_14b"))
    model = model or f"`{(eager or compiled)['preset']}` (standing in for DROID 14B)"
    lines = [
        "| figure | ours | reference | what differs |",
        "|---|---|---|---|",
        f"| {model} chunk, 8-step mask, eager, one GPU | {_ms(eager) if eager else why_missing('eager')} | "
        f"{ref1[1]} ({ref1[0]}, {ref1[2]}) | {diff}; ours eager |",
        f"| {model} chunk, 8-step mask, compiled, one GPU | "
        f"{_ms(compiled) if compiled else why_missing('compiled')} | {ref1[1]} ({ref1[0]}, {ref1[2]}) | {diff}; "
        f"{compiled_note} |",
        f"| DROID 14B chunk, two GPUs, CFG-parallel | "
        f"{(_fmt(cfg2.get('chunk_ms')) + ' ms') if cfg2 else why_missing('cfg2')} | {ref2[1]} ({ref2[0]}, {ref2[2]}); "
        f"{up[1]} ({up[0]}, {up[2]}) | {diff}; ours eager, one rank per process with its own GPU visible |",
    ]
    return lines


def latency_table(results: list[dict], stages: tuple[str, ...]) -> list[str]:
    rows = [r for r in results if r.get("stage") in stages and "row" in r]
    if not rows:
        return ["(no latency row was measured)"]
    lines = [
        "| stage | preset | mode | ran compiled | batch | DiT steps | chunk ms (median) | min-max | restart ms | "
        "first chunks ms (compile) | graphs / breaks / steady recompiles | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ran = r["compiled"] + (" (fell back to eager)" if r.get("fell_back_to_eager") else "")
        first = " + ".join(f"{v:.0f}" for v in [r["first_restart_ms"], *r["first_chunks_ms"]])
        lines.append(
            f"| {r['stage']} | {r.get('preset', '')} | {r['mode']} | {ran} | {r['batch']} | {r['dit_steps']:.1f} | "
            f"{r['chunk_ms']:.1f} ({r['chunks']} at positions {r['positions']}) | {r['chunk_ms_min']:.0f}-"
            f"{r['chunk_ms_max']:.0f} | {r['restart_ms']:.1f} | {first} ({r['compile_ms']:.0f}) | {r['graphs']} / "
            f"{r['graph_breaks']} / {r['recompiles_steady']} | {r['peak_mb']:.0f} |"
        )
    notes = [r["note"] for r in results if r.get("stage") in stages and "note" in r and "row" not in r]
    return lines + [f"\n{n}" for n in notes]


def tier_table(results: list[dict]) -> list[str]:
    figs = [r for r in results if "value" in r and "unit" in r]
    if not figs:
        return ["(the tier wrote no figure)"]
    lines = ["| figure | value | unit | preset | card | tier | note |", "|---|---|---|---|---|---|---|"]
    for f in figs:
        lines.append(
            f"| {f['figure']} | {_fmt(f['value'])} | {f.get('unit', '')} | {f.get('preset', '')} | "
            f"{f.get('card', '')} | {f.get('tier', '')} | {f.get('note', '')} |"
        )
    return lines


def robots_table(results: list[dict]) -> list[str]:
    fleets = [r for r in results if r.get("figure") == "fleet"]
    if not fleets:
        return ["(no fleet was measured)"]
    lines = [
        "| model | way | robots | every robot at pace | stalls (of ticks) | chunk p50 ms | chunk p99 ms | budget ms | "
        "rows per call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in fleets:
        per_call = "" if r.get("rows_per_call") is None else f"{r['rows_per_call']:.1f}"
        lines.append(
            f"| {r['model']} | {r['way']} | {r['robots']} | {'yes' if r['at_pace'] else 'no'} | {r['stalls']} "
            f"({r['ticks']}) | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['budget_ms']:.0f} | {per_call} |"
        )
    for r in results:
        if r.get("figure") == "fleet_at_pace":
            ratio = f" ({r['batched'] / r['reference']:.1f}x)" if r.get("reference") and r.get("batched") else ""
            lines.append(
                f"\n{r['model']}: largest N at pace **batched {r.get('batched', 0)}**, one session per call "
                f"{r.get('reference', 0)}{ratio}. {r.get('setting', '')}"
            )
    return lines


def render_section(results: list[dict], planned: list[str], rehearse: bool, took_s: float) -> str:
    """The section's body from the results so far; `planned`: every stage this run meant to run, in order."""
    ends = {r["stage"]: r for r in results if r.get("event") == "end"}
    status = {s: (ends[s]["status"] + (f": {ends[s]['why']}" if ends[s].get("why") else "")) for s in ends}
    unfinished = [s for s in planned if ends.get(s, {}).get("status") not in ("ok", "skipped")]
    what = "Rehearsal on CPU (a simulated GPU, small presets): the path works; no speed figure counts." if rehearse \
        else "Run on one GPU machine."  # fmt: skip
    lines = [f"{what} Stages took {took_s:.0f} s; written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    if unfinished:
        named = ", ".join(f"{s} ({status.get(s, 'not run yet')})" for s in unfinished)
        lines += [
            f"**Incomplete**: {named}. The figures "
            "below are those the finished stages (and the unfinished ones, up to where they stopped) wrote.",
            "",
        ]
    lines += ["| stage | status | took s |", "|---|---|---|"]
    for s in planned:
        end = ends.get(s)
        lines.append(f"| {s} | {status.get(s, 'not run')} | {_fmt(end.get('took_s')) if end else ''} |")
    env = next((r for r in results if r.get("figure") == "environment"), None)
    if env is not None:
        facts = {k: v for k, v in env.items() if k not in ("stage", "figure") and v is not None}
        lines += ["", "Environment: " + ", ".join(f"{k} {_fmt(v)}" for k, v in facts.items()) + "."]
    smoke = next((r for r in results if r.get("figure") == "compile_smoke"), None)
    if smoke is not None:
        lines += [
            "",
            f"torch.compile + SDPA smoke test: built in {smoke['compile_s']:.1f} s on {smoke['device']} "
            f"({smoke['dtype']}), max difference from eager {smoke['max_abs_diff']:.3g}.",
        ]
    lines += ["", "### Against the references", "", *comparison(results, status)]
    lines += ["", "### Latency per chunk (`benchmarks/model_latency.py`)", ""]
    lines += latency_table(results, ("eager", "compiled", "latency_5b", "fp8"))
    lines += ["", "### GPU tier (`tests/gpu`)", "", *tier_table(results)]
    lines += ["", "### Robots at the control pace (`benchmarks/fleet.py`)", "", *robots_table(results)]
    return "\n".join(lines) + "\n"
