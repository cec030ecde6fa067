"""The GPU tier's figures: one JSON line per figure, appended to the file `$GPU_CHECK_FIGURES` names (nothing is
written when it is unset). Standard library only, so `scripts/gpu_check.py` can read what this writes anywhere.

Each line: `{"figure": <name>, "value": <number>, "unit": <str>, "tier": "cuda" | "rehearsal", "preset": <str>,
"note": <str, optional>, "stage", "card": <gpu-check's stage and simulated card, where set>}`.
`tier` says where the figure was measured: "cuda" on a real GPU, "rehearsal" on a CPU
simulating one (`DREAMZERO_SIMULATED_GPU`), where speed figures are CPU times (meaningless as GPU figures) and memory
figures come from the byte accounting, not from an allocator. A name may appear more than once (its `note` and
`preset` tell the lines apart: the admission test and the serve run both report `rows_chosen`).

Names (`NAMES`; `BATCH_NAMES` with the batch size in place of `{rows}`), their unit and the test that writes them:
- `bf16_drift_max_abs`, `bf16_drift_rel_l2` (1; tiny bf16 drift): the worst max absolute difference and relative L2
  error of the tiny model's bf16 actions from fp32 over the loop's chunks;
- `chunk_ms_8_steps`, `chunk_ms_16_steps` (ms; 14B chunk): one chunk with the 8-step DiT mask of 16 scheduler steps,
  and with the DiT on all 16 (the rehearsal: the mask's path and the unmasked one at 2 scheduler steps);
- `chunk_ms_p50_batch_{rows}`, `chunk_ms_p95_batch_{rows}` (ms; batched chunks): median and 95th percentile of one
  call's chunk with `rows` sessions batched in it;
- `batch_fits_{rows}` (1; batched chunks): 1 where the planner (`dreamzero.planner`, through
  benchmarks/gpu_sizing.py) says a batch of `rows` full-window sessions fits the device and the tier timed it, 0 where
  it does not fit (the note says why) or the rehearsal's CPU cannot afford it (the note says so): the batch sizes are
  chosen from the device's memory, never a fixed list;
- `robots_per_gpu` (robots; batched chunks): an estimate from the batched calls, `rows x floor(1600 ms / p95)` at
  the best size measured; the measured figure is benchmarks/robots_per_gpu.py's (gpu-check's robots stages);
- `weights_gib` (GiB; every model the in-process tests build): the weights in device memory;
- `session_peak_gib` (GiB; session memory): a session's peak footprint by its accounting (its fullest window);
  `session_peak_allocated_gib`, CUDA only: the allocator's largest growth over that session's chunks;
- `session_budget_gib` (GiB; admission, serve run): the session budget `sessions.max_bytes: auto` measured, in-process
  as a replica sizes itself, and from GET /v1/models;
- `rows_chosen` (rows; admission, serve run): the rows `batching.max_batch_rows: auto` chose, the same two ways;
- `sessions_admitted` (sessions; admission, serve run admission): full-window sessions admitted before the next one
  was refused.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

FIGURES_ENV = "GPU_CHECK_FIGURES"
TIERS = ("cuda", "rehearsal")

#: figure -> unit
NAMES = {
    "bf16_drift_max_abs": "1",
    "bf16_drift_rel_l2": "1",
    "chunk_ms_8_steps": "ms",
    "chunk_ms_16_steps": "ms",
    "robots_per_gpu": "robots",
    "weights_gib": "GiB",
    "session_peak_gib": "GiB",
    "session_peak_allocated_gib": "GiB",
    "session_budget_gib": "GiB",
    "rows_chosen": "rows",
    "sessions_admitted": "sessions",
}
#: per batch size: name pattern -> unit
BATCH_NAMES = {"chunk_ms_p50_batch_{rows}": "ms", "chunk_ms_p95_batch_{rows}": "ms", "batch_fits_{rows}": "1"}


def unit_of(name: str) -> str:
    """The unit of a known figure name; ValueError for any other name (a typo must not go unnoticed)."""
    if name in NAMES:
        return NAMES[name]
    for pattern, unit in BATCH_NAMES.items():
        head, tail = pattern.split("{rows}")
        rows = name[len(head) : len(name) - len(tail)] if name.startswith(head) and name.endswith(tail) else ""
        if rows.isdigit():
            return unit
    raise ValueError(f"unknown GPU tier figure {name!r}; known: {sorted(NAMES) + sorted(BATCH_NAMES)}")


def record(name: str, value: float, *, tier: str, preset: str, note: str | None = None) -> dict | None:
    """Append one figure to `$GPU_CHECK_FIGURES` (when set) and return the line written (None: not written)."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"figure {name!r}: {value} is not a finite number")
    line = {"figure": name, "value": value, "unit": unit_of(name), "tier": tier, "preset": preset}
    # which gpu-check stage and (rehearsing) which simulated card wrote it, where gpu-check runs the tier
    line |= {
        k: os.environ[v] for k, v in (("stage", "GPU_CHECK_STAGE"), ("card", "GPU_CHECK_CARD")) if os.environ.get(v)
    }
    if note:
        line["note"] = note
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
    return line


def read(path: str | os.PathLike) -> list[dict]:
    """Every figure line of a file `record` wrote (none when it does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
