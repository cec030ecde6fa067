"""`dreamzero-plan`: print the memory plan of a checkpoint on a card (docs/model.md, "Fitting a card").

    dreamzero-plan --model /models/DreamZero-DROID --gpu-memory 80GiB
    dreamzero-plan --model libero_5b --gpu-memory 24GiB --json
    dreamzero-plan --model droid_14b --gpu-memory 24GiB --cfg-parallel 2
    dreamzero-plan --table                   # both released checkpoints on the five usual cards (markdown)
    dreamzero-plan --table --write-docs docs/model.md   # regenerate the docs' table

Nothing is loaded: the checkpoint's config is read (any of the three layouts, a preset name or `embedded:<name>`).
A plan that does not fit exits 1 and says what would; a mistake in the arguments exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from dreamzero.cli_help import DefaultsHelpFormatter
from dreamzero.errors import CheckpointError, ConfigError
from dreamzero.planner import CARDS, Plan, describe, model_config_for, plan_serving
from dreamzero.sizes import parse_bytes

G = 2**30

#: the released checkpoints of the docs' table, by preset (full depth, sized on the meta device)
TABLE_CHECKPOINTS = {"RLinf 5B LIBERO": "libero_5b", "DROID 14B": "droid_14b"}


@dataclass
class CardTable:
    """Checkpoint x card -> plan (docs/model.md's generated table)."""

    plans: dict[str, dict[str, Plan]] = field(default_factory=dict)

    def markdown(self) -> str:
        cards = list(CARDS)
        lines = ["| checkpoint | " + " | ".join(cards) + " |", "|---|" + "---|" * len(cards)]
        for name, row in self.plans.items():
            lines.append(f"| {name} | " + " | ".join(_cell(row[card]) for card in cards) + " |")
        return "\n".join(lines)


def _cell(p: Plan) -> str:
    if not p.fits:
        return "does not fit; what would: " + "; or ".join(p.suggestions)
    cost = "" if p.new_prompt_extra_s == 0 else f"; a new prompt +{p.new_prompt_extra_s:.2f} s"
    return f"{describe(p.placement)}; {p.rows} rows, {p.sessions} sessions{cost}"


def card_table(configs: dict | None = None, max_sessions: int = 128) -> CardTable:
    """Every checkpoint of `configs` (name -> DreamZeroConfig; default: TABLE_CHECKPOINTS) on every card of CARDS."""
    from dreamzero.config import preset

    configs = configs or {name: preset(p) for name, p in TABLE_CHECKPOINTS.items()}
    table = CardTable()
    for name, cfg in configs.items():
        table.plans[name] = {
            card: plan_serving(cfg, size, max_sessions=max_sessions, name=name) for card, size in CARDS.items()
        }
    return table


#: the generated table's place in docs/model.md
TABLE_START, TABLE_END = "<!-- card table: dreamzero-plan --table -->", "<!-- end of card table -->"


def write_table(path: str, text: str) -> None:
    from pathlib import Path

    doc = Path(path)
    if not doc.is_file():
        raise ConfigError(f"--write-docs {path}: no such file")
    body = doc.read_text()
    if TABLE_START not in body or TABLE_END not in body:
        raise ConfigError(f"--write-docs {path}: the markers {TABLE_START!r} and {TABLE_END!r} are not there")
    head, rest = body.split(TABLE_START, 1)
    doc.write_text(head + TABLE_START + "\n" + text + "\n" + TABLE_END + rest.split(TABLE_END, 1)[1])


def format_plan(plan: Plan) -> str:
    """The plan as a person reads it."""
    lines = [f"{plan.checkpoint} on {plan.gpu_memory / G:.1f} GiB per GPU (cfg_parallel {plan.cfg_parallel})"]
    lines.append(f"  {'component':<14} {'where':<8} {'dtype':<9} {'on GPU':>10} {'in host':>10}")
    for c in plan.components:
        lines.append(
            f"  {c.name:<14} {c.where:<8} {c.dtype:<9} {c.device_bytes / G:>6.2f} GiB {c.host_bytes / G:>6.2f} GiB"
        )
    if plan.fits:
        lines.append(f"  rows per model call: {plan.rows}; full-window sessions held: {plan.sessions}")
        lines.append(
            f"  session budget {plan.session_budget / G:.2f} GiB; one session {plan.session_bytes / G:.2f} GiB; "
            f"activations per row {plan.activation_per_row / G:.2f} GiB; batch cache copies "
            f"{plan.kv_transient / G:.2f} GiB; margin {plan.margin / G:.2f} GiB"
        )
        extra = (
            "none" if plan.new_prompt_extra_s == 0 else f"+{plan.new_prompt_extra_s:.2f} s ({plan.new_prompt_basis})"
        )
        lines.append(f"  first chunk of a prompt not in the prompt cache: {extra}")
    else:
        lines.append("  DOES NOT FIT")
    lines += [f"  why: {w}" for w in plan.why]
    lines += [f"  what would fit: {s}" for s in plan.suggestions]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dreamzero-plan", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    ap.add_argument(
        "--model", help="checkpoint path (any layout), a preset name (droid_14b, libero_5b) or embedded:NAME"
    )
    ap.add_argument("--gpu-memory", help="usable memory of one GPU, e.g. 80GiB (CUDA's figure: 78GiB on an H100)")
    ap.add_argument("--checkpoint-config", help="a preset that replaces the checkpoint's config (as in serve_config)")
    ap.add_argument("--cfg-parallel", type=int, choices=(1, 2), default=1, help="GPUs per replica for CFG (default 1)")
    ap.add_argument("--max-sessions", type=int, default=128, help="sessions.max_sessions (default: 128, as shipped)")
    ap.add_argument("--rows", default="auto", help="batching.max_batch_rows: auto (default) or a number")
    ap.add_argument("--max-bytes", default="auto", help="sessions.max_bytes: auto (default) or bytes such as 40GiB")
    ap.add_argument("--dtype", default="bfloat16", help="the model dtype (default bfloat16)")
    for name, allowed in (
        ("text-encoder", "gpu|cpu|offload"),
        ("image-encoder", "gpu|cpu"),
        ("dit-weights", "model|fp8"),
    ):
        key = name.replace("-", "_")
        ap.add_argument(f"--{name}", default="auto", help=f"policy.placement.{key}: auto|{allowed} (default auto)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--table", action="store_true", help="the released checkpoints on the five usual cards (markdown)")
    ap.add_argument("--write-docs", metavar="MD", help="with --table: replace the table between its markers in MD")
    return ap


def _plan(args) -> Plan:
    from dreamzero.device import parse_dtype

    if not args.model or not args.gpu_memory:
        raise ConfigError("give --model and --gpu-memory (or --table)")
    memory = parse_bytes(args.gpu_memory, field="--gpu-memory")
    if not isinstance(memory, int):
        raise ConfigError("--gpu-memory: give the GPU's memory, e.g. 80GiB")
    rows = args.rows if args.rows == "auto" else _positive(args.rows, "--rows")
    max_bytes = parse_bytes(args.max_bytes, field="--max-bytes")
    placement = {
        "text_encoder": args.text_encoder, "image_encoder": args.image_encoder, "dit_weights": args.dit_weights
    }  # fmt: skip
    cfg = model_config_for(args.model, checkpoint_config=args.checkpoint_config)
    return plan_serving(
        cfg, memory, dtype=parse_dtype(args.dtype, "--dtype"), cfg_parallel=args.cfg_parallel,
        max_sessions=_positive(args.max_sessions, "--max-sessions"), rows=rows, max_bytes=max_bytes,
        placement=placement, name=args.model,
    )  # fmt: skip


def _positive(value, flag: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{flag}={value!r}: give a whole number") from None
    if n < 1:
        raise ConfigError(f"{flag}={value!r}: give a number >= 1")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.table:
            text = card_table(max_sessions=_positive(args.max_sessions, "--max-sessions")).markdown()
            if args.write_docs:
                write_table(args.write_docs, text)
            print(text)
            return 0
        plan = _plan(args)
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict(), indent=2, default=str) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
