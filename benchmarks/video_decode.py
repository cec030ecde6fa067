"""Predicted video: what `return_video` costs per chunk, and how well the trained default imagines its own scene.

1. Cost (`--cost`): one continuing session's chunk on CPU, with and without `return_video`, interleaved in one run
   (tiny and small presets, random weights: decode cost does not depend on them); the `video` stage is the decode
   alone. Without the option the loop runs no decode at all, so the two "off" columns are the same code path.
2. Quality (`--quality`): `dreamzero-eval --predicted-video` episodes in the MuJoCo DROID scene 1 on held-out
   layouts (the compact distribution at seed 100000, as docs/eval/small-scene1) through the embedded policy, for the
   shipped trained default (`embedded:small-scene1`) and for random weights of the same preset (`small`): PSNR and
   mean abs error of each chunk's predicted frames against the camera canvas that followed (eval/imagined.py), and
   the predicted latents against the VAE encoding of that canvas (the small preset's VAE is random: its pixels
   bound every pixel figure, see the section's text).

    python benchmarks/video_decode.py --cost --quality --write-docs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving_common import machine_line, write_section
from dreamzero.types import ModelBatch

SECTION = "Predicted video (return_video)"


def _batch(sid: str, t: int, hw, seed: int, video: bool) -> ModelBatch:
    rng = np.random.default_rng(seed)
    return ModelBatch(
        images=rng.integers(0, 256, (1, t, *hw, 3), dtype=np.uint8),
        state=np.zeros((1, 1, 64), np.float32),
        state_mask=np.ones((1, 1, 64), bool),
        prompts=["put the cube in the bowl"],
        session_ids=[sid],
        return_video=[True] if video else None,
    )


def cost(preset_name: str, chunks: int) -> dict:
    """Median ms per continuing chunk, off / on, and the decode stage alone."""
    from dreamzero.embedded_default import build_default_model
    from dreamzero.pipeline import DreamZeroPipeline

    with tempfile.TemporaryDirectory() as tmp:
        build_default_model(Path(tmp) / "m", preset_name)
        pipe = DreamZeroPipeline.load(Path(tmp) / "m", device="cpu", dtype="float32", max_sessions=8)
    hw = tuple(pipe.config.model_input_hw)
    times = {False: [], True: []}
    decode = []
    for video in (False, True):
        pipe.generate(_batch(f"s{video}", 1, hw, 0, video))  # start both sessions
    for k in range(chunks + 1):  # the first round warms up; the window restarts sessions now and then: skipped
        for video in (False, True) if k % 2 else (True, False):
            t0 = time.perf_counter()
            res = pipe.generate(_batch(f"s{video}", 4, hw, k + 1, video))
            ms = (time.perf_counter() - t0) * 1e3
            if k == 0 or res.sessions[0].restarted:
                continue
            times[video].append(ms)
            if video:
                decode.append(res.timings_ms["video"])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {
        "preset": preset_name,
        "canvas": hw,
        "frames": 4 * pipe.dit_cfg.num_frame_per_block,
        "off_ms": off,
        "on_ms": on,
        "decode_ms": statistics.median(decode),
        "chunks": len(decode),
        "state_mib": pipe.video_state_bytes(hw) / 2**20,
    }


def quality(model: str, episodes: int, out: Path) -> dict:
    """Eval episodes of `model` with --predicted-video; pixel errors from the records, latent errors from the
    chunks' predicted latents against the VAE encoding of the frames that followed (what the DiT is trained on)."""
    import json

    import eval.runner as runner
    from dreamzero.embedded_default import resolve_model_path
    from dreamzero.pipeline.inputs import model_frames
    from eval.mujoco_droid.env import MujocoDroidEnv
    from eval.policy_links import make_policy

    policy = make_policy("embedded", model_path=resolve_model_path(model))
    policy.link.return_video = True
    pipe = policy.link._policy.pipeline
    captured: dict[str, list] = {}  # session -> per chunk (predicted latents [z, F, h, w], the session's anchor)
    generate = pipe.generate

    def generate_keeping_latents(batch, return_latents=False, noise=None):
        res = generate(batch, return_latents=True, noise=noise)
        for i, sid in enumerate(batch.session_ids):
            state, _ = pipe.store.lookup(sid)
            captured.setdefault(sid, []).append((torch.from_numpy(res.video_latents[i]), state.first_frame.clone()))
        return res

    pipe.generate = generate_keeping_latents
    tracks = []
    make_track = runner.imagined_track

    def keep_track():
        tracks.append(make_track())
        return tracks[-1]

    runner.imagined_track = keep_track
    config = runner.EvalConfig(out_dir=out, scenes=(1,), episodes_per_scene=episodes, open_loop_horizon=24,
                               max_steps=200, seed=100000, predicted_video=True)  # fmt: skip
    try:
        runner.run_evaluation(
            lambda scene: MujocoDroidEnv(scene, max_episode_steps=200, layouts="compact"), policy, config
        )
    finally:
        runner.imagined_track = make_track
    vae, nfpb = pipe.model.vae, pipe.dit_cfg.num_frame_per_block
    hw = tuple(pipe.config.model_input_hw)

    def block_latents(first: torch.Tensor, canvases: np.ndarray) -> torch.Tensor:
        """VAE latents of a block as the pipeline encodes an observed one: [first frame, each frame twice]."""
        frames = model_frames(canvases[None], torch.device("cpu"), hw)[0]  # [4, 3, h, w] in [-1, 1]
        video = torch.cat([first[None].float(), frames.repeat_interleave(2, 0)]).permute(1, 0, 2, 3)[None]
        return vae.encode(video)[0, :, -nfpb:]

    pixel, latent, still = [], [], []
    for record, track in zip(sorted((out / "episodes").glob("*.json")), tracks):
        rec = json.loads(record.read_text())
        pixel += [c for c in rec["imagined"]["chunks"] if c["psnr_db"] is not None]
        for chunk, (pred, first) in zip(track.chunks, captured[rec["session_id"]]):
            steps = [chunk.step + track.block_steps + off for off in track.offsets]
            if not all(s in track.frames for s in steps):
                continue  # the block ran past the episode's end
            real = block_latents(first, track.canvas([track.frames[s] for s in steps]))
            sent = [max(0, chunk.step + off) for off in track.offsets]  # the block this query sent
            if all(s in track.frames for s in sent):
                still.append(
                    float(((block_latents(first, track.canvas([track.frames[s] for s in sent])) - real) ** 2).mean())
                )
            latent.append(float(((pred - real) ** 2).mean()))
    policy.close()
    psnr = [c["psnr_db"] for c in pixel]
    mae = [c["mae"] for c in pixel]
    return {"chunks": len(pixel), "psnr": float(np.mean(psnr)), "psnr_sd": float(np.std(psnr)),
            "mae": float(np.mean(mae)), "mae_sd": float(np.std(mae)), "latent_chunks": len(latent),
            "latent_mse": float(np.mean(latent)), "latent_sd": float(np.std(latent)),
            "still_mse": float(np.mean(still)) if still else None, "still_chunks": len(still)}  # fmt: skip


def vae_round_trip(model: str) -> float:
    """PSNR of the preset's VAE on its own: decode(encode(x)) against x for MuJoCo canvases (the pixel ceiling)."""
    from dreamzero.embedded_default import resolve_model_path
    from dreamzero.embodiments import get_embodiment
    from dreamzero.pipeline import DreamZeroPipeline
    from dreamzero.pipeline.inputs import model_frames
    from eval.imagined import droid_canvas, psnr
    from eval.mujoco_droid.env import MujocoDroidEnv

    pipe = DreamZeroPipeline.load(resolve_model_path(model), device="cpu", dtype="float32")
    env = MujocoDroidEnv(1, max_episode_steps=200, layouts="compact")
    try:
        obs, _ = env.reset(seed=100000)
        from dreamzero_droid import droid

        frames = [droid.make_frame(obs)]
        for _ in range(8):
            obs, *_ = env.step(np.concatenate([obs["joint_position"], [0.0]]))
            frames.append(droid.make_frame(obs))
    finally:
        env.close()
    canvas = droid_canvas(get_embodiment("oxe_droid"))(frames)  # [9, H, W, 3]
    x = model_frames(canvas[None], torch.device("cpu"), tuple(pipe.config.model_input_hw))[0].permute(1, 0, 2, 3)[None]
    y = pipe.model.vae.decode(pipe.model.vae.encode(x))
    to8 = lambda v: ((v.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()  # noqa: E731
    return psnr(to8(y), to8(x))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--chunks", type=int, default=12, help="timed chunks per mode and preset")
    ap.add_argument("--episodes", type=int, default=3, help="quality: episodes per model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = []
    if args.cost:
        rows = [cost(p, args.chunks) for p in ("tiny", "small")]
        head = "| preset | canvas | frames per chunk | chunk, off (ms) | chunk, return_video (ms) | decode alone (ms) "
        lines = [head + "| overhead | decoder state per session |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r['preset']} | {r['canvas'][0]}x{r['canvas'][1]} | {r['frames']} | {r['off_ms']:.1f} | "
                f"{r['on_ms']:.1f} | {r['decode_ms']:.1f} | {r['on_ms'] / r['off_ms']:.2f}x | "
                f"{r['state_mib']:.1f} MiB |"
            )
            print(lines[-1])
        parts.append(
            "Decode cost per chunk on CPU (fp32, random weights; medians of "
            f"{rows[0]['chunks']} continuing chunks per mode, the modes interleaved in one run). Without "
            "`return_video` no decode runs at all. The decoder state is what admission adds per session asking "
            "for video.\n\n" + "\n".join(lines)
        )
    if args.quality:
        with tempfile.TemporaryDirectory() as tmp:
            from dreamzero.embedded_default import build_default_model

            random_small = build_default_model(Path(tmp) / "random-small", "small")
            res = {
                "trained (embedded:small-scene1)": quality("embedded:small-scene1", args.episodes, Path(tmp) / "t"),
                "random weights, small preset": quality(str(random_small), args.episodes, Path(tmp) / "r"),
            }
        ceiling = vae_round_trip("embedded:small-scene1")
        lines = ["| model | chunks | pixels: PSNR (dB) | pixels: mean abs error | latents: MSE to the real block "
                 "| latents: MSE of 'no change' |", "|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in res.items():
            still = "-" if r["still_mse"] is None else f"{r['still_mse']:.3f}"
            lines.append(f"| {name} | {r['chunks']} ({r['latent_chunks']} whole blocks) | {r['psnr']:.2f} +- "
                         f"{r['psnr_sd']:.2f} | {r['mae']:.1f} +- {r['mae_sd']:.1f} | {r['latent_mse']:.3f} +- "
                         f"{r['latent_sd']:.3f} | {still} |")  # fmt: skip
            print(lines[-1])
        parts.append(
            f"Imagined vs real, {args.episodes} held-out episodes per model (MuJoCo DROID scene 1, compact layouts "
            "from "
            "seed 100000, 200 steps, 24-step chunks, the embedded policy; each model acts in its own episodes). "
            "Pixels: each chunk's decoded frames against the camera canvas that followed (eval/imagined.py). "
            "Latents: the chunk's predicted latents against the VAE encoding of the block that followed, encoded as "
            "the pipeline encodes an observed block (what the DiT is trained to predict), over the chunks whose "
            "block ended inside the episode; 'no change' is the block the query itself sent, as a prediction. "
            f"The small preset's VAE is random and frozen (docs/training.md): its own round trip, "
            f"decode(encode(canvas)), is {ceiling:.1f} dB PSNR on these canvases, the ceiling of every pixel figure "
            "here, so the pixel columns say little and the latent columns carry the comparison.\n\n" + "\n".join(lines)
        )
    if args.write_docs and parts:
        body = "Written by `benchmarks/video_decode.py` (" + machine_line() + ").\n\n" + "\n\n".join(parts)
        write_section(Path(args.write_docs), SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
