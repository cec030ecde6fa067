"""Action drift of each reduced-precision or off-GPU option against fp32 and bf16, in normalised action units.

Options (tests/support/precision.py): the bf16 model; fp8 DiT weights (`dreamzero.model.fp8`, the default rule: the
Linear layers of the transformer blocks) with fp32 or bf16 activations; fp8 on every Linear of the DiT (to check the
rule); the text encoder as the CPU placement runs it (unpadded, bf16). Measured on:

- the whole inference loop, 4 chunks of one session (a restart and 3 continuing chunks over the KV cache, the
  default plan), of the tiny preset (random weights, several seeds) and of the shipped trained default
  `embedded:small-scene1` (its 8 DROID action dimensions);
- one denoise forward of the first chunk of the 14B-shaped and 5B-shaped slices' DiT (`droid_14b_slice`,
  `libero_5b_slice`: the real widths and token counts, one block; bf16 weights as a release stores them, T5 rows
  from the slice's own text encoder).

    python benchmarks/precision_drift.py                 # print
    python benchmarks/precision_drift.py --write-docs    # also docs/benchmarks.md "Reduced precision: action drift"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving_common import machine_line, write_section

from tests.support.precision import (
    BF16,
    OPTIONS,
    Diff,
    action_diff,
    session_drift,
    shipped_model,
    slice_forward_actions,
    tiny_model,
)

SECTION = "Reduced precision: action drift"
ALL = (BF16, *OPTIONS)


def _cell(d: Diff | None) -> str:
    return "-" if d is None else f"{d.max_abs:.4f} / {d.mean_abs:.4f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny-seeds", type=int, default=5, help="seeds of the tiny model's session loop")
    ap.add_argument("--slice-seeds", type=int, default=2, help="seeds (weights and inputs) per slice preset")
    ap.add_argument("--chunks", type=int, default=4, help="chunks of each session")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--parts", default="tiny,shipped,slices", help="which measurements, comma-separated")
    ap.add_argument("--save", type=Path, help="also write the rows measured here to this JSON file")
    ap.add_argument("--merge", type=Path, nargs="+", help="tabulate rows saved by earlier runs (--save); measure none")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the section into this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    if args.merge:
        saved = [json.loads(path.read_text()) for path in args.merge]
        rows = [row for data in saved for row in _rows(data)]
        machine = "runs: " + " | ".join(dict.fromkeys(data["machine"] for data in saved))
    else:
        rows = measure(args, {p.strip() for p in args.parts.split(",")}, start)
        machine = f"{machine_line()}; {time.monotonic() - start:.0f} s"
        if args.save:
            args.save.write_text(json.dumps({"rows": _plain(rows), "machine": machine}, indent=1))
    text = table(rows, machine)
    print(text)
    if args.write_docs:
        write_section(Path(args.write_docs), SECTION, "Written by `benchmarks/precision_drift.py`.\n\n" + text)
    return 0


def _plain(rows) -> list:
    return [
        (w, s, {o: {r: [d.max_abs, d.mean_abs] for r, d in refs.items()} for o, refs in t.items()}) for w, s, t in rows
    ]


def _rows(data: dict) -> list:
    return [(w, s, {o: {r: Diff(*d) for r, d in refs.items()} for o, refs in t.items()}) for w, s, t in data["rows"]]


def measure(args, parts: set[str], start: float) -> list[tuple[str, str, dict]]:
    rows: list[tuple[str, str, dict]] = []  # (what, scale, {option: {ref: Diff}})
    if "tiny" in parts:
        rows.append(_tiny_row(args, start))
    if "shipped" in parts:
        r = session_drift(shipped_model(), ALL, chunks=args.chunks, seed=0, dims=8)
        what = f"shipped `small-scene1`, {args.chunks}-chunk session (8 DROID dims)"
        rows.append((what, f"{r.pop('fp32')['scale']:.2f}", r))
        print(f"shipped model done, {time.monotonic() - start:.0f} s", flush=True)
    if "slices" in parts:
        rows += [_slice_row(args, name, start) for name in ("droid_14b_slice", "libero_5b_slice")]
    return rows


def _tiny_row(args, start: float):

    worst: dict[str, dict] = {}
    scales = []
    for seed in range(args.tiny_seeds):
        r = session_drift(tiny_model(seed), ALL, chunks=args.chunks, seed=seed)
        scales.append(r.pop("fp32")["scale"])
        for name, refs in r.items():
            for ref, d in refs.items():
                prev = worst.setdefault(name, {}).get(ref)
                worst[name][ref] = d if prev is None else prev.worst(d)
        print(f"tiny seed {seed} done, {time.monotonic() - start:.0f} s", flush=True)
    what = f"tiny, {args.chunks}-chunk session, {_seeds(args.tiny_seeds)}"
    return what, f"{sum(scales) / len(scales):.2f}", worst


def _slice_row(args, preset_name: str, start: float):
    worst: dict[str, dict] = {}
    scale = []
    for seed in range(args.slice_seeds):
        acts = slice_forward_actions(preset_name, OPTIONS, seed=seed)
        scale.append(float(acts["fp32"].abs().mean()))
        for option in ALL:
            for ref in ("fp32", "bf16"):
                if option.name == ref:
                    continue
                d = action_diff(acts[ref], acts[option.name])
                prev = worst.setdefault(option.name, {}).get(ref)
                worst[option.name][ref] = d if prev is None else prev.worst(d)
        print(f"{preset_name} seed {seed} done, {time.monotonic() - start:.0f} s", flush=True)
    what = f"`{preset_name}` DiT, one denoise forward, {_seeds(args.slice_seeds)}"
    return what, f"{sum(scale) / len(scale):.2f}", worst


def _seeds(n: int) -> str:
    return "seed 0" if n == 1 else f"worst of seeds 0-{n - 1}"


def table(rows, machine: str) -> str:
    lines = [
        "Max abs / mean abs difference of a chunk's normalised actions (all 32 dimensions unless said; `mean |a|`: "
        "the fp32 actions' mean magnitude, for scale). The session rows compare every chunk of a 4-chunk session "
        "(a restart, then 3 chunks over the KV cache, the default plan) from the same inputs and noise; the slice "
        "rows one denoise forward of the first chunk (a full chunk at those widths costs minutes per option on "
        f"this CPU). {machine}.",
        "",
        "| model, measurement | mean \\|a\\| | option | vs fp32 (max / mean) | vs bf16 (max / mean) |",
        "|---|---|---|---|---|",
    ]
    for what, scale, table in rows:
        for option in ALL:
            refs = table.get(option.name, {})
            lines.append(
                f"| {what} | {scale} | {option.name} | {_cell(refs.get('fp32'))} | {_cell(refs.get('bf16'))} |"
            )
    lines += [
        "",
        "Reproduce: `python benchmarks/precision_drift.py --write-docs` (all parts in one process), or the parts in "
        "parallel processes (`--parts tiny,shipped --save a.json`, `--parts slices --save b.json`), then "
        "`--merge a.json b.json --write-docs`, as here.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
