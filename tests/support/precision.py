"""Action drift of the reduced-precision and off-GPU options, shared by benchmarks/precision_drift.py (the figures in
docs/benchmarks.md, "Reduced precision: action drift") and tests/unit/model/test_fp8_drift.py (their bounds).

An option is a way of running one set of weights: the model dtype, the DiT's Linear weights in fp8
(`dreamzero.model.fp8`, the default rule or every Linear), the text encoder as the CPU placement runs it (unpadded,
`T5TextEncoder.trim_padding`). Two measurements:

- `session_actions`: the whole inference loop, chunk after chunk of one session (a restart, then continuing chunks
  over the KV cache), for a small model (the tiny preset's random weights, or the shipped trained default): drift
  accumulates through the cache here as it does when serving.
- `slice_forward_actions`: one denoise forward of the first chunk of a slice preset's DiT (the 14B's or the 5B's
  real widths and token counts, one block), the T5 rows from the slice's own text encoder: a full chunk at these
  sizes costs minutes per option on a CPU, so this is one forward, as tests/support/drift.py does for bf16.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from tests.support.drift import chunk_batch, slice_dit, slice_dit_forward, slice_inputs

PROMPT = "pick up the cup and put it in the bowl"


@dataclass(frozen=True)
class Option:
    name: str
    dtype: torch.dtype
    fp8: str | None = None  # None | "blocks" (the default rule) | "all" (every nn.Linear of the DiT)
    text_on_cpu: bool = False  # the text encoder as the CPU placement runs it: unpadded

    def apply(self, model) -> None:
        """Make `model` (a DreamZeroModel already in `dtype`, or a bare DiT) run this option, in place."""
        from dreamzero.model.fp8 import all_linears, convert_linears_to_fp8_

        dit = getattr(model, "model", model)
        if self.fp8 is not None:
            convert_linears_to_fp8_(dit, predicate=all_linears if self.fp8 == "all" else None)
        if self.text_on_cpu:
            model.text_encoder.trim_padding = True


FP32 = Option("fp32", torch.float32)
BF16 = Option("bf16", torch.bfloat16)
OPTIONS = (
    Option("fp8 DiT weights, fp32 activations", torch.float32, fp8="blocks"),
    Option("fp8 DiT weights + bf16", torch.bfloat16, fp8="blocks"),
    Option("fp8 every DiT Linear, fp32 activations", torch.float32, fp8="all"),
    Option("text encoder on the CPU (unpadded), bf16", torch.bfloat16, text_on_cpu=True),
)
REFERENCES = (FP32, BF16)


@dataclass(frozen=True)
class Diff:
    max_abs: float
    mean_abs: float

    def worst(self, other: Diff) -> Diff:
        return Diff(max(self.max_abs, other.max_abs), max(self.mean_abs, other.mean_abs))


def action_diff(ref, other, dims: int | None = None) -> Diff:
    """|other - ref| of normalised actions [..., action_dim], over the first `dims` action dimensions (None: all)."""
    a = np.asarray(torch.as_tensor(ref).double())[..., :dims]
    b = np.asarray(torch.as_tensor(other).double())[..., :dims]
    if not np.isfinite(b).all():
        return Diff(float("inf"), float("inf"))
    d = np.abs(b - a)
    return Diff(float(d.max()), float(d.mean()))


def session_actions(base, option: Option, chunks: int = 4, seed: int = 0, overrides=None) -> list[np.ndarray]:
    """Normalised actions [1, H, 32] of `chunks` successive calls of one session (the first a restart) with `base`
    (a fp32 DreamZeroModel with its tokenizer, left untouched) run as `option`, the same inputs and noise per seed."""
    from dreamzero.pipeline import DreamZeroPipeline

    model = copy.deepcopy(base).to(dtype=option.dtype)
    model.text_encoder.tokenizer = base.text_encoder.tokenizer
    option.apply(model)
    pipe = DreamZeroPipeline(model, model.config.pipeline.with_overrides(overrides))
    hw = model.config.pipeline.model_input_hw or (32, 64)
    return [pipe.generate(chunk_batch(k, hw=hw, input_seed=seed, seed=1140 + seed)).actions for k in range(chunks)]


def tiny_model(seed: int):
    from dreamzero.config import preset
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import build_local_tokenizer

    model = DreamZeroModel.from_config(preset("tiny"), seed=seed)
    model.text_encoder.tokenizer = build_local_tokenizer(model.config.text_encoder.vocab_size)
    return model


def shipped_model():
    """The trained default `embedded:small-scene1`, fp32 on the CPU (its release dtype)."""
    from dreamzero.checkpoint import load_model
    from dreamzero.embedded_default import resolve_model_path

    return load_model(resolve_model_path("embedded:small-scene1"), device="cpu", dtype=torch.float32)


def session_drift(base, options, chunks: int = 4, seed: int = 0, dims: int | None = None) -> dict[str, dict]:
    """Per option, the worst drift over the chunks against each reference: {option: {"fp32": Diff, "bf16": Diff}};
    also {"scale": mean |action| of the fp32 reference} under the key "fp32"."""
    refs = {r.name: session_actions(base, r, chunks, seed) for r in REFERENCES}
    out: dict[str, dict] = {"fp32": {"scale": float(np.mean([np.abs(a[..., :dims]).mean() for a in refs["fp32"]]))}}
    for option in options:
        got = refs[option.name] if option.name in refs else session_actions(base, option, chunks, seed)
        out[option.name] = {}
        for ref_name, ref in refs.items():
            if ref_name == option.name:
                continue
            worst = Diff(0.0, 0.0)
            for a, b in zip(ref, got):
                worst = worst.worst(action_diff(a, b, dims))
            out[option.name][ref_name] = worst
    return out


def _slice_text_rows(preset_name: str, seed: int, trim: bool) -> torch.Tensor:
    """T5 rows [1, 512, text_dim] of PROMPT from the slice's own text encoder (bf16, seeded random weights)."""
    from dreamzero.config import preset
    from dreamzero.model.dreamzero import _allocate, init_random_weights
    from dreamzero.model.text_encoder import T5TextEncoder
    from dreamzero.model.tokenizer import build_local_tokenizer

    cfg = preset(preset_name)
    with torch.device("meta"):
        te = T5TextEncoder(cfg.text_encoder, text_len=cfg.dit.text_len)
    _allocate(te, torch.device("cpu"), torch.bfloat16)
    init_random_weights(te, seed)
    te.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    te.eval().requires_grad_(False)
    te.trim_padding = trim
    return te.encode([PROMPT]).float()


def slice_forward_actions(preset_name: str, options, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per option name (the references included), the action prediction [1, A, action_dim] fp32 of one denoise
    forward of the slice's DiT (seeded bf16 weights, a release's dtype) on the first chunk's inputs."""
    dit = slice_dit(preset_name, seed=seed)
    inputs = slice_inputs(dit, seed=seed)
    inputs["context"] = _slice_text_rows(preset_name, seed, trim=False)
    refs = slice_dit_forward(dit, inputs, dtypes=(torch.float32, torch.bfloat16))  # leaves dit in bf16
    out = {FP32.name: refs[torch.float32].action, BF16.name: refs[torch.bfloat16].action}
    for option in options:
        if option.text_on_cpu:
            trimmed = {**inputs, "context": _slice_text_rows(preset_name, seed, trim=True)}
            out[option.name] = slice_dit_forward(dit, trimmed, dtypes=(option.dtype,))[option.dtype].action
            continue
        twin = copy.deepcopy(dit)  # quantised from the bf16 weights, as the loader quantises a release's tensors
        option.apply(twin)
        out[option.name] = slice_dit_forward(twin, inputs, dtypes=(option.dtype,))[option.dtype].action
        del twin
    return out
