"""The shipped trained default with fp8 DiT weights against full precision, in the MuJoCo DROID evaluation.

Both arms run in this process, one after the other, on the same episode seeds and with the settings of the served
evaluation in docs/training.md (scene 1, `--layouts compact`, `--seed 100000`: episode seeds 101000-101019,
`--image-size 90 160`, `--open-loop-horizon 24`, `--max-steps 200`): the embedded policy as `dreamzero-eval --policy
embedded` builds it, and for the fp8 arm the same policy with its DiT's block linears converted by
`dreamzero.model.fp8.convert_linears_to_fp8_` (the small model runs in fp32 on the CPU: its weights are quantised to
fp8 and dequantised to fp32 before each matmul).

    python benchmarks/fp8_eval.py --out runs/fp8-eval                 # 20 episodes per arm, print
    python benchmarks/fp8_eval.py --out runs/fp8-eval --write-docs    # also docs/benchmarks.md "fp8 DiT weights: DROID"
    python benchmarks/fp8_eval.py --out runs/fp8-eval --arm fp8       # one arm per process, the two in parallel
    python benchmarks/fp8_eval.py --out runs/fp8-eval --write-docs --records-only   # docs from the arms' episodes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving_common import machine_line, write_section

MODEL = "embedded:small-scene1"
ARMS = ("full precision", "fp8 DiT weights")
SECTION = "fp8 DiT weights: DROID evaluation"


def build_policy(arm: str):
    from dreamzero.embedded_default import resolve_model_path
    from dreamzero.model.fp8 import convert_linears_to_fp8_
    from dreamzero.policy import EmbeddedPolicy
    from dreamzero_droid.policy import DroidPolicy
    from eval.policy_links import EmbeddedLink

    embedded = EmbeddedPolicy.load(model_path=resolve_model_path(MODEL), embodiment="oxe_droid")
    converted = 0
    if arm == ARMS[1]:
        converted = convert_linears_to_fp8_(embedded.pipeline.model.model)
    return DroidPolicy(EmbeddedLink(policy=embedded), session_prefix=f"fp8-eval-{arm.split()[0]}"), converted


def run_arm(arm: str, args) -> dict:
    from eval.mujoco_droid.env import MujocoDroidEnv
    from eval.runner import EvalConfig, run_evaluation

    policy, converted = build_policy(arm)
    config = EvalConfig(
        out_dir=args.out / arm.split()[0],
        scenes=(1,),
        episodes_per_scene=args.episodes,
        open_loop_horizon=24,
        max_steps=200,
        seed=100000,
        record_video=False,
        extra={"simulator": "mujoco", "policy": "embedded", "layouts": "compact", "arm": arm, "fp8_linears": converted},
    )

    def env(scene: int):
        return MujocoDroidEnv(
            scene, image_size=(90, 160), render_quality="quality", max_episode_steps=200, layouts="compact"
        )

    start = time.monotonic()
    try:
        summary = run_evaluation(env, policy, config)
    finally:
        policy.close()
    print(f"{arm}: {summary['successes']}/{summary['episodes']} in {time.monotonic() - start:.0f} s", flush=True)
    return summary


def episode_records(out: Path) -> dict[int, dict]:
    """An arm's finished episodes (the runner writes each one's JSON as it ends): episode index -> record."""
    records = {}
    for path in sorted((out / "episodes").glob("scene1_ep*.json")):
        rec = json.loads(path.read_text())
        records[int(rec["episode"])] = {"success": bool(rec["success"]), "seed": rec.get("seed")}
    return records


def section(records: dict[str, dict[int, dict]], planned: int) -> str:
    """The side-by-side table over the episodes both arms finished (all `planned` of them in a complete run)."""
    from eval.summary import wilson_interval

    common = sorted(set.intersection(*(set(r) for r in records.values())))
    if not common:
        raise SystemExit("no episode finished in both arms yet")
    seeds = [records[ARMS[0]][i]["seed"] for i in common]
    cut = "" if len(common) == planned else f" (cut at {len(common)} of the {planned} planned episodes per arm)"
    lines = [
        f"The shipped trained default (`{MODEL}`, fp32 on the CPU) in process, MuJoCo scene 1, `--layouts compact`, "
        f"episode seeds {min(seeds)}-{max(seeds)}{cut}, `--image-size 90 160 --open-loop-horizon 24 --max-steps 200` "
        "(the served evaluation's settings, docs/training.md), the same episodes in both arms; the fp8 arm's DiT "
        'block linears hold float8_e4m3fn weights with per-output-channel scales (docs/model.md, "Reduced '
        f'precision"), dequantised to fp32 before each matmul. {machine_line()}.',
        "",
        "| DiT weights | success | 95% Wilson interval | episodes failed in this arm only |",
        "|---|---|---|---|",
    ]
    for arm in ARMS:
        other = records[ARMS[1] if arm == ARMS[0] else ARMS[0]]
        wins = sum(records[arm][i]["success"] for i in common)
        only = [str(i) for i in common if not records[arm][i]["success"] and other[i]["success"]]
        lo, hi = wilson_interval(wins, len(common))
        lines.append(
            f"| {arm} | {wins} / {len(common)} ({wins / len(common):.0%}) | {lo:.0%}-{hi:.0%} | "
            f"{', '.join(only) or 'none'} |"
        )
    lines += [
        "",
        "Reproduce: `python benchmarks/fp8_eval.py --out runs/fp8-eval --write-docs` (both arms in turn), or one arm "
        "per process (`--arm full`, `--arm fp8`, in parallel), then `--records-only --write-docs`.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/fp8-eval"), help="each arm's eval outputs go below")
    ap.add_argument("--episodes", type=int, default=20, help="episodes per arm (seeds 101000 on)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the section into this file")
    ap.add_argument("--records-only", action="store_true", help="tabulate the episodes finished under --out, run none")
    ap.add_argument("--arm", choices=("both", "full", "fp8"), default="both", help="run one arm only (two processes)")
    args = ap.parse_args(argv)
    if args.episodes < 1:
        ap.error(f"--episodes: expected >= 1, got {args.episodes}")
    import torch

    torch.set_num_threads(args.threads)
    if args.arm != "both":  # one arm in this process (the other in a second one, or already run): no docs
        run_arm(ARMS[0] if args.arm == "full" else ARMS[1], args)
        return 0
    if not args.records_only:
        for arm in ARMS:
            run_arm(arm, args)
    text = section({arm: episode_records(args.out / arm.split()[0]) for arm in ARMS}, args.episodes)
    print(text)
    if args.write_docs:
        write_section(Path(args.write_docs), SECTION, "Written by `benchmarks/fp8_eval.py`.\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
