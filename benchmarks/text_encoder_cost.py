"""What a new prompt costs when the text encoder is off the GPU (`policy.placement.text_encoder`: cpu / offload).

The UMT5-XXL encoder (d_model 4096, 64 heads, d_ff 10240) of the 14B slice (`droid_14b_slice`: one of the real 24
blocks, the real widths) is timed on this machine's CPU, in bf16 (the model dtype a CPU-placed encoder keeps) and
fp32, for a typical robot instruction (~20 tokens, and the planner's 32) run unpadded, as a CPU-placed encoder runs,
and padded to the 512 tokens the encoder runs on the GPU. The per-block time is stated for the full depth (24
blocks). The offload path is counted rather than timed (its cost is the host-to-device copy, which this CPU-only
machine cannot show): bytes moved per encode, measured on the slice's one block and checked against
`dreamzero.placement.text_encoder_cost`, then for the full depth. CLIP on the CPU (`image_encoder: cpu`) is timed
the same way (the slice's 2 ViT-H/14 blocks, stated for 32).

    python benchmarks/text_encoder_cost.py                 # print
    python benchmarks/text_encoder_cost.py --write-docs    # also write docs/benchmarks.md "Text encoder off the GPU"

The figures are the source of `dreamzero.placement.MEASURED_CPU_MS_PER_XXL_LAYER`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving_common import machine_line, write_section

from dreamzero.config import preset
from dreamzero.model.text_encoder import T5TextEncoder
from dreamzero.model.tokenizer import build_local_tokenizer
from dreamzero.placement import text_encoder_cost

FULL_DEPTH = preset("droid_14b").text_encoder.num_layers  # 24
G = 1 << 30
# a robot instruction as DROID's prompts read; its token count is printed (the local tokenizer's pieces)
PROMPT = "pick up the red marker from the table and put it into the blue cup on the left side"


def _cpu_name() -> str:
    """The CPU model and whether it has AVX-512 BF16 (what makes bf16 matmuls fast on a CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "an unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "a CPU")
    return f"{name} ({'with' if 'avx512_bf16' in info else 'without'} AVX-512 BF16)"


def _encoder(dtype: torch.dtype) -> T5TextEncoder:
    cfg = preset("droid_14b_slice")
    torch.manual_seed(0)
    te = T5TextEncoder(cfg.text_encoder, text_len=cfg.dit.text_len).to(dtype).eval().requires_grad_(False)
    te.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    return te


def _prompt_of(te: T5TextEncoder, tokens: int) -> str:
    """A prompt of exactly `tokens` tokens (</s> included): PROMPT cut or repeated."""
    words = (PROMPT + " ") * 64
    for n in range(1, len(words.split()) + 1):
        text = " ".join(words.split()[:n])
        if int(te.tokenize([text])[1].sum()) >= tokens:
            return text
    raise ValueError(f"no prompt of {tokens} tokens")


def _time_ms(te: T5TextEncoder, prompt: str, repeats: int) -> tuple[float, float]:
    """Median (wall ms, CPU ms) of one encode. The CPU time (this process, all threads) is what the figures use: on
    a shared machine the wall time also counts the other processes' turns on the cores."""
    te.encode([prompt])  # warm-up: first-call allocations
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        te.encode([prompt])
        wall.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed encodes per case (median reported)")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # per-core figures: a server divides them by the cores it gives the encoder

    slice_cfg = preset("droid_14b_slice")
    assert slice_cfg.text_encoder.num_layers == 1, "the slice keeps one T5 block"
    rows, core_ms = [], {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        te = _encoder(dtype)
        for tokens, padded in ((20, False), (32, False), (512, True)):
            te.trim_padding = not padded  # the CPU placement's unpadded run; padded = what the GPU placement runs
            prompt = _prompt_of(te, 20 if padded else tokens)
            n_real = int(te.tokenize([prompt])[1].sum())
            wall, cpu = _time_ms(te, prompt, args.repeats if not padded else 1)
            core_ms[(name, 512 if padded else n_real)] = cpu
            how = f"{n_real} (padded to 512)" if padded else f"{n_real} (unpadded)"
            gflop = text_encoder_cost(slice_cfg, "gpu" if padded else "cpu", tokens=n_real)["flops"] / 1e9
            rows.append((name, how, cpu, wall, cpu * FULL_DEPTH / 1e3, gflop / (cpu / 1e3)))
            print(f"{name} {how}: {cpu:.0f} core-ms per block (wall {wall:.0f})", flush=True)
        del te

    # CLIP on the CPU (placement.image_encoder: cpu): once per new session, on its first frame
    from dreamzero.model.image_encoder import CLIPImageEncoder

    clip = CLIPImageEncoder(slice_cfg.image_encoder).to(torch.bfloat16).eval().requires_grad_(False)
    clip.materialize_buffers("cpu")
    frame = torch.rand(1, 3, 224, 224) * 2 - 1  # any size: CLIP resizes to 224 first
    clip.encode(frame)
    cpu_times = []
    for _ in range(args.repeats):
        c0 = time.process_time()
        with torch.no_grad():
            clip.encode(frame)
        cpu_times.append((time.process_time() - c0) * 1e3)
    clip_block_ms = statistics.median(cpu_times) / slice_cfg.image_encoder.num_hidden_layers
    clip_depth = preset("droid_14b").image_encoder.num_hidden_layers
    print(f"CLIP: {clip_block_ms:.0f} core-ms per block, {clip_block_ms * clip_depth / 1e3:.1f} core-s", flush=True)
    del clip

    # offload: bytes moved per encode, measured on the slice's block, against the cost model
    te = _encoder(torch.bfloat16)
    te.offload_to("cpu")  # on this machine the "device" is the CPU: the copies and their byte count are real
    te.encode([PROMPT])
    moved = te.offload_stats["bytes_moved"]
    slice_cost = text_encoder_cost(slice_cfg, "offload")
    assert moved == slice_cost["host_to_device_bytes"], (moved, slice_cost)
    full = {w: text_encoder_cost(preset("droid_14b"), w, tokens=20) for w in ("gpu", "cpu", "offload")}
    print(
        f"offload: {moved / 1e6:.1f} MB per encode on the slice, {full['offload']['host_to_device_bytes'] / G:.2f} GiB"
    )

    lines = [
        "The first-chunk cost of a prompt no session has brought before (the prompt cache answers every other one) "
        'when `policy.placement.text_encoder` takes the UMT5-XXL encoder off the GPU (docs/model.md, "Where '
        'components live"). Measured with `python benchmarks/text_encoder_cost.py --write-docs` on '
        f"{_cpu_name()}, {machine_line()}: one real-width block of the 14B slice (`droid_14b_slice`; d_model "
        f"4096, 64 heads, d_ff 10240) on one thread, the median of {args.repeats} encodes, stated for the full depth "
        f"of {FULL_DEPTH} blocks. The figures are CPU time (core-ms): on this shared machine the wall time also "
        "counts other processes' turns, and a server divides core-ms by the cores it gives the encoder (less than "
        "linearly). A CPU-placed encoder runs the prompt's tokens only (padding keys are masked and the position "
        "bias is relative, so the rows equal the padded run's up to rounding); the GPU placement runs padded to 512.",
        "",
        "| dtype | tokens | core-ms per block | wall ms per block (shared) | core-s for 24 blocks | GFLOP/s per core |",
        "|---|---|---|---|---|---|",
    ]
    for name, how, cpu, wall, total, rate in rows:
        lines.append(f"| {name} | {how} | {cpu:.0f} | {wall:.0f} | {total:.1f} | {rate:.1f} |")
    off, gpu, cpu_cost = full["offload"], full["gpu"], full["cpu"]
    lines += [
        "",
        f"Offload (`text_encoder: offload`): every block's weights cross to the GPU per encode: "
        f"{off['host_to_device_bytes'] / G:.2f} GiB for the full depth in bf16 (counted on the slice's block: "
        f"{moved / 1e6:.0f} MB, equal to `dreamzero.placement.text_encoder_cost`), against "
        f"{gpu['device_weight_bytes'] / G:.2f} GiB resident with `gpu`; the GPU holds at most "
        f"{off['device_transient_bytes'] / G:.2f} GiB (two blocks) during an encode and nothing between. Its time "
        "is that copy (at PCIe 4 x16's ~20 GB/s from pinned memory, about 0.5 s: an estimate, not measured here, "
        "there is no GPU) plus the GPU's own encode. `cpu` moves only the 512 output rows "
        f"({cpu_cost['host_to_device_bytes'] / 1e6:.0f} MB) and holds nothing on the GPU.",
        "",
        f"CLIP on the CPU (`image_encoder: cpu`, bf16, the slice's {slice_cfg.image_encoder.num_hidden_layers} "
        f"ViT-H/14 blocks, one frame): {clip_block_ms:.0f} core-ms per block, {clip_block_ms * clip_depth / 1e3:.1f} "
        f"core-s for the {clip_depth} blocks it runs, paid by every new session (not only new prompts).",
        "",
        "Reading it: with `cpu`, a new ~20-token prompt costs the full depth's core-seconds above divided by the "
        "cores the replica's host lends the encoder; with `offload` it costs the copy, whatever the CPU. Running "
        f"unpadded is what makes the CPU placement usable: the padded run is "
        f"{core_ms[('bf16', 512)] / core_ms[('bf16', 20)]:.0f} times the core-time of a 20-token prompt in bf16. "
        "Sessions that bring a prompt already cached pay nothing either way.",
    ]
    body = "\n".join(lines)
    print(body)
    print("MEASURED_CPU_CORE_MS_PER_XXL_LAYER (bf16) =", {k[1]: round(v) for k, v in core_ms.items() if k[0] == "bf16"})
    if args.write_docs:
        write_section(Path(args.write_docs), "Text encoder off the GPU", body)


if __name__ == "__main__":
    main()
