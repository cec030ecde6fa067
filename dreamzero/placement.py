"""Where each component of a DreamZero model lives, and what a placement costs when a session brings a new prompt.

`Placement` is decided by the memory planner (or set in `serve_config.yaml` as `policy.placement`) and honoured by
the loader (`dreamzero.checkpoint.load_model(..., placement=)`), which streams each component straight onto its own
device:

- `text_encoder`: "gpu" (the replica's serving device), "cpu" (weights and compute on the host; only the encoded rows
  cross to the device, and the encoder runs unpadded there, see `T5TextEncoder.trim_padding`) or "offload" (weights
  in host memory, pinned on CUDA, moved onto the device one block at a time for an encode and released after).
- `image_encoder`: "gpu" or "cpu" (CLIP runs once per new session, on its first frame).
- `dit_weights`: "model" (the model dtype) or "fp8" (weight-only float8 Linear weights, quantised while they stream
  in: `dreamzero.model.fp8`).

The DiT and the VAE always sit on the serving device. Only the text encoder runs solely for a prompt no session has
brought before (the prompt cache sits in front of it), which is why it is the component worth moving off the GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dreamzero.errors import ConfigError

TEXT_ENCODER_PLACES = ("gpu", "cpu", "offload")
IMAGE_ENCODER_PLACES = ("gpu", "cpu")
DIT_WEIGHTS = ("model", "fp8")
#: the model's components, as DreamZeroModel names them
COMPONENTS = ("model", "text_encoder", "image_encoder", "vae")

_ALLOWED = {"text_encoder": TEXT_ENCODER_PLACES, "image_encoder": IMAGE_ENCODER_PLACES, "dit_weights": DIT_WEIGHTS}

#: Core-milliseconds (CPU time on one thread) one UMT5-XXL block (d_model 4096, 64 heads, d_ff 10240) takes in bf16
#: to encode one prompt, by the tokens it runs (a CPU-placed encoder runs unpadded; 512 = padded). Measured by
#: `benchmarks/text_encoder_cost.py` on the development machine's CPU (a shared 2-core AMD EPYC VM with AVX-512 BF16,
#: 2026-12-06; figures and load in docs/benchmarks.md, "Text encoder off the GPU"; four runs gave 66-79 core-ms at 20
#: tokens). Another CPU differs: the planner reports the estimate from these as an order of magnitude, with its basis.
MEASURED_CPU_CORE_MS_PER_XXL_LAYER: dict[int, float] = {20: 79.0, 32: 90.0, 512: 1288.0}
#: Core-milliseconds one CLIP ViT-H/14 block (width 1280, 257 tokens) takes in bf16 for one frame: same run, same
#: machine (docs/benchmarks.md, "Text encoder off the GPU").
MEASURED_CPU_CORE_MS_PER_VITH_LAYER = 69.0


@dataclass(frozen=True)
class Placement:
    """Where the text encoder and image encoder live, and the DiT's weight precision (module docstring)."""

    text_encoder: str = "gpu"  # "gpu" (the replica's device) | "cpu" | "offload"
    image_encoder: str = "gpu"  # "gpu" | "cpu"
    dit_weights: str = "model"  # "model" (the model dtype) | "fp8"

    def __post_init__(self):
        for name, allowed in _ALLOWED.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"placement.{name}={value!r}: use one of {list(allowed)}")

    @classmethod
    def parse(cls, value: Mapping | Placement | None, field: str = "policy.placement") -> Placement:
        """None -> the default (everything on the GPU, model dtype); a mapping of the fields above (values are
        case-insensitive strings); a Placement as it is. Anything else fails naming `field` and what is allowed."""
        if value is None:
            return cls()
        if isinstance(value, Placement):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{field} must be a mapping with keys {list(_ALLOWED)}, got {type(value).__name__} {value!r}"
            )
        unknown = sorted(str(k) for k in value if k not in _ALLOWED)
        if unknown:
            raise ConfigError(f"{field}: unknown key(s) {unknown}; known keys are {list(_ALLOWED)}")
        out = {}
        for key, raw in value.items():
            allowed = _ALLOWED[key]
            norm = raw.strip().lower() if isinstance(raw, str) else raw
            if norm not in allowed:
                raise ConfigError(f"{field}.{key}={raw!r}: use one of {list(allowed)}")
            out[key] = norm
        return cls(**out)

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @property
    def is_default(self) -> bool:
        return self == Placement()

    def component_device(self, name: str, serving_device: str | torch.device) -> torch.device:
        """The device a component's weights are stored on: the serving device, or the CPU for a component placed
        "cpu" or "offload" (an offloaded text encoder still computes on the serving device, block by block)."""
        if name not in COMPONENTS:
            raise ValueError(f"unknown component {name!r}; known: {list(COMPONENTS)}")
        serving_device = torch.device(serving_device)
        place = {"text_encoder": self.text_encoder, "image_encoder": self.image_encoder}.get(name, "gpu")
        return serving_device if place == "gpu" else torch.device("cpu")

    def devices(self, serving_device: str | torch.device) -> dict[str, torch.device]:
        """component -> the device its weights are stored on (`component_device` for each of COMPONENTS)."""
        return {name: self.component_device(name, serving_device) for name in COMPONENTS}


def text_encoder_layer_flops(text_cfg, tokens: int) -> int:
    """Multiply-adds x 2 of one UMT5 block for one prompt of `tokens` tokens: q/k/v/o projections, the attention
    scores and their weighted sum, and the gated FFN (wi_0, wi_1, wo)."""
    d, inner, ff = text_cfg.d_model, text_cfg.num_heads * text_cfg.d_kv, text_cfg.d_ff
    return 2 * tokens * (4 * d * inner + 2 * tokens * inner + 3 * d * ff)


def text_encoder_layer_nbytes(text_cfg, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one UMT5 block's weights in `dtype` (what the offload path moves onto the device per block)."""
    d, inner, ff = text_cfg.d_model, text_cfg.num_heads * text_cfg.d_kv, text_cfg.d_ff
    values = 4 * d * inner + 3 * d * ff + 2 * d + text_cfg.relative_attention_num_buckets * text_cfg.num_heads
    return values * dtype.itemsize


def text_encoder_cost(
    cfg,
    where: str,
    tokens: int = 20,
    dtype: torch.dtype = torch.bfloat16,
    text_len: int = 512,
    cpu_cores: int = 1,
) -> dict[str, float | int | None]:
    """The cost of encoding one new prompt with the text encoder placed `where` ("gpu" | "cpu" | "offload").

    cfg: a DreamZeroConfig (its `dit.text_len` replaces `text_len`) or its TextEncoderConfig. tokens: the prompt's
    token count (a robot instruction is ~20-30). Returns:
      flops: the encode's (padded to `text_len` on the device, unpadded on the CPU);
      tokens_run: the tokens it runs;
      host_to_device_bytes: what crosses to the device per encode (the offload path's block weights and input rows,
        the CPU path's output rows, nothing for "gpu");
      device_weight_bytes / host_weight_bytes: the encoder's weights resident on the device / in host memory;
      device_transient_bytes: device memory held only during an encode (the offload path's two blocks);
      cpu_ms: for "cpu" with a UMT5-XXL-wide encoder, the time estimated from MEASURED_CPU_CORE_MS_PER_XXL_LAYER
        (the measured token count nearest `tokens`, scaled by flops, divided by `cpu_cores`, which is optimistic:
        threads do not scale perfectly); None otherwise or while nothing is measured.
    """
    if where not in TEXT_ENCODER_PLACES:
        raise ConfigError(f"placement.text_encoder={where!r}: use one of {list(TEXT_ENCODER_PLACES)}")
    text_cfg = getattr(cfg, "text_encoder", cfg)
    if hasattr(cfg, "dit"):
        text_len = cfg.dit.text_len
    layers, d = text_cfg.num_layers, text_cfg.d_model
    run_tokens = min(tokens, text_len) if where == "cpu" else text_len
    layer_bytes = text_encoder_layer_nbytes(text_cfg, dtype)
    embed_bytes = text_cfg.vocab_size * d * dtype.itemsize
    all_bytes = layers * layer_bytes + embed_bytes + d * dtype.itemsize  # + the final layer norm
    rows_bytes = text_len * d * dtype.itemsize
    out: dict[str, float | int | None] = {
        "flops": layers * text_encoder_layer_flops(text_cfg, run_tokens),
        "tokens_run": run_tokens,
        "host_to_device_bytes": 0,
        "device_weight_bytes": all_bytes,
        "device_transient_bytes": 0,
        "host_weight_bytes": 0,
        "cpu_ms": None,
    }
    if where == "cpu":
        out.update(host_to_device_bytes=rows_bytes, device_weight_bytes=0, host_weight_bytes=all_bytes)
        xxl = (d, text_cfg.num_heads * text_cfg.d_kv, text_cfg.d_ff) == (4096, 4096, 10240)
        if xxl and MEASURED_CPU_CORE_MS_PER_XXL_LAYER:
            near = min(MEASURED_CPU_CORE_MS_PER_XXL_LAYER, key=lambda n: abs(n - run_tokens))
            scale = text_encoder_layer_flops(text_cfg, run_tokens) / text_encoder_layer_flops(text_cfg, near)
            out["cpu_ms"] = layers * MEASURED_CPU_CORE_MS_PER_XXL_LAYER[near] * scale / max(cpu_cores, 1)
    elif where == "offload":
        # every block and the final norm cross per encode, and the input rows; the token embedding stays on the host
        moved = layers * layer_bytes + d * dtype.itemsize
        out.update(
            host_to_device_bytes=moved + rows_bytes,
            device_weight_bytes=0,
            device_transient_bytes=2 * layer_bytes,
            host_weight_bytes=all_bytes,
        )
    return out


def image_encoder_cost(cfg, where: str, dtype: torch.dtype = torch.bfloat16, cpu_cores: int = 1) -> dict:
    """The cost of CLIP encoding one new session's first frame placed `where` ("gpu" | "cpu"): flops (every block
    runs), host_to_device_bytes (the CPU path's [257, width] features) and cpu_ms for "cpu" with a ViT-H/14-wide
    encoder (MEASURED_CPU_CORE_MS_PER_VITH_LAYER x blocks / `cpu_cores`, optimistic), else None. cfg: a
    DreamZeroConfig (None without an image encoder: no cost) or its ImageEncoderConfig."""
    if where not in IMAGE_ENCODER_PLACES:
        raise ConfigError(f"placement.image_encoder={where!r}: use one of {list(IMAGE_ENCODER_PLACES)}")
    img = getattr(cfg, "image_encoder", cfg)
    if img is None:
        return {"flops": 0, "host_to_device_bytes": 0, "cpu_ms": None}
    tokens = (img.image_size // img.patch_size) ** 2 + 1
    w, ff, layers = img.hidden_size, img.intermediate_size, img.num_hidden_layers
    flops = layers * 2 * tokens * (4 * w * w + 2 * w * ff + 2 * tokens * w)
    out = {"flops": flops, "host_to_device_bytes": 0, "cpu_ms": None}
    if where == "cpu":
        out["host_to_device_bytes"] = tokens * w * dtype.itemsize
        if (w, ff, img.num_attention_heads) == (1280, 5120, 16):
            out["cpu_ms"] = layers * MEASURED_CPU_CORE_MS_PER_VITH_LAYER / max(cpu_cores, 1)
    return out
