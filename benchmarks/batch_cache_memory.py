"""What a multi-row model call's KV cache copies cost, measured on CPU, before and after they moved one layer at a time.

A model call used to stack its sessions' whole caches, keep the prefill's new caches of every layer until the forward
ended, clone each session's rows back, and keep a denoise step's `cat(cache, new)` of every layer until the step
ended: the budget priced that as 3 x rows x a session's KV for a multi-row call, 1 x for one row. Now the caches are
stacked when the DiT reaches a layer and a prefill's new layer goes back to the sessions at once
(dreamzero/pipeline/batch_cache.py), so the copies are a few layers' worth (`batch_kv_transient`).

The measure (tests/support/kv_memory.py): the live bytes that the call's operators allocate, tracked per storage
under a `TorchDispatchMode`, peak above the larger of the sessions' own bytes before and after the call, on the
last chunk before the window is full of `rows` sessions of a KV-dominated model (tiny DiT, 8 layers, dim 256, a
17-frame window of 32 tokens, fp32). "KV copies" counts the K/V-shaped tensors only (the caches, their stacked rows,
the new caches, the attention's keys and values); "all" every tensor the call makes (activations, input frames).
The figures before the change were measured with this same measure at the commit before it (cbea843) and are
recorded below; the figures after are measured by this run.

    python benchmarks/batch_cache_memory.py                # print
    python benchmarks/batch_cache_memory.py --write-docs   # also write docs/benchmarks.md "Batch KV cache copies"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving_common import machine_line, write_section

from dreamzero.config import preset
from dreamzero.pipeline.batch_cache import batch_kv_transient
from dreamzero.sessions import session_footprint
from tests.support.kv_memory import kv_dominated_model, last_chunk_transient

MB = 1e6
GIB = 2**30
#: (rows, staggered) -> (KV copies, all bytes) measured at cbea843 (whole caches stacked, prefilled, cloned)
BEFORE = {
    (1, False): (20_156_416, 25_360_848),
    (2, False): (71_770_112, 82_132_736),
    (4, False): (143_540_224, 164_219_232),
    (4, True): (143_540_224, 164_542_760),
}


def old_accounting(rows: int, kv: int) -> int:
    """The budget's price before the change: 3 copies of the rows' caches for a multi-row call, 1 for one row."""
    return (3 if rows > 1 else 1) * rows * kv


def measured_table() -> str:
    model = kv_dominated_model()
    lines = [
        "| rows | KV per session | old accounting (3 x rows x KV; 1 x for one row) | KV copies before (measured) "
        "| KV copies now (measured) | `batch_kv_transient` | all bytes before / now (measured) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rows, stagger in BEFORE:
        kv_now = last_chunk_transient(model, rows, stagger=stagger)
        all_now = last_chunk_transient(model, rows, stagger=stagger, kv_only=False)
        kv, layers = kv_now["kv_per_session"], kv_now["num_layers"]
        kv_before, all_before = BEFORE[(rows, stagger)]
        label = f"{rows}" + (" (staggered positions)" if stagger else "")
        bound = batch_kv_transient(rows, kv, layers)
        lines.append(
            f"| {label} | {kv / MB:.1f} MB | {old_accounting(rows, kv) / MB:.1f} MB | {kv_before / MB:.1f} MB "
            f"({kv_before / (rows * kv):.2f} x rows x KV) | {kv_now['transient'] / MB:.1f} MB "
            f"({kv_now['transient'] / (rows * kv):.2f} x rows x KV) | {bound / MB:.1f} MB "
            f"| {all_before / MB:.1f} / {all_now['transient'] / MB:.1f} MB |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


def planning_table() -> str:
    """What the two priced a full-window session's copies at for the shipped checkpoints (bf16, CFG)."""
    lines = [
        "| checkpoint | KV of a full-window session | rows | old accounting | `batch_kv_transient` |",
        "|---|---|---|---|---|",
    ]
    for name, canvas in (("droid_14b", (352, 640)), ("libero_5b", None)):
        cfg = preset(name)
        hw = canvas or cfg.pipeline.model_input_hw
        factor = 16 if cfg.vae.kind == "wan2.2" else 8
        fp = session_footprint(cfg.dit, cfg.pipeline, hw, 2, spatial_factor=factor)
        kv = max(p["kv_cache"] for p in fp.parts)
        for rows in (1, 2, 4, 8):
            lines.append(
                f"| {name} | {kv / GIB:.2f} GiB | {rows} | {old_accounting(rows, kv) / GIB:.1f} GiB "
                f"| {batch_kv_transient(rows, kv, cfg.dit.num_layers) / GIB:.2f} GiB |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the section into this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    measured = measured_table()
    planning = planning_table()
    print(planning)
    body = "\n\n".join(
        [
            "A model call's KV cache copies: the most bytes live at once beyond the sessions' own caches, on the last "
            "chunk before the window is full, measured on CPU per storage (tests/support/kv_memory.py) on a "
            "KV-dominated model (tiny DiT, 8 layers, dim 256, a 17-frame window of 32 tokens, fp32). Before: whole "
            "caches stacked, prefilled and cloned per call, measured at the commit before the change; now: one layer "
            "at a time (dreamzero/pipeline/batch_cache.py).",
            measured,
            "With 8 layers one layer is 1/8 of a session's KV, so the copies went from 1.3 x (one row) and 2.3 x "
            "rows x KV (more rows) to about 2.3 and 3.3 layers per row; the model's other activations and the "
            'input frames are the rest of "all bytes". At full depth the same count is a few layers of 40 (14B) '
            "or 30 (5B):",
            planning,
            f"Reproduce: `python benchmarks/batch_cache_memory.py --write-docs` ({machine_line()}).",
        ]
    )
    if args.write_docs:
        write_section(Path(args.write_docs), "Batch KV cache copies", body)


if __name__ == "__main__":
    main()
