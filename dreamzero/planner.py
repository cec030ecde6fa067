"""The memory planner: fit a checkpoint to a card (docs/model.md, "Fitting a card").

From a checkpoint's config alone (never its weights) and the memory of one device, `plan_serving` chooses where each
component lives (on the GPU, on the CPU, or offloaded: kept in host memory and streamed in layer by layer when a new
prompt needs it) and in which precision the DiT's weights are held (the model dtype or fp8), then the rows per model
call and the full-window sessions the rest holds, and says why. The same arithmetic (`fit_rows`) sizes a running
replica (`dreamzero.pipeline.budget`, with what its device measures), checks a config at `serve run`, and prints a
plan in `dreamzero-plan`.

The order of preference, cheapest first: everything on the GPU in the model dtype; the text encoder offloaded; the
text encoder on the CPU (no device transient at all); the image encoder on the CPU as well; then the same with fp8
DiT weights, which are only chosen when no model-dtype placement holds one session. Among the model-dtype placements
the one that holds the most sessions (up to `max_sessions`) wins, the cheaper on a tie. Fields set explicitly
(`policy.placement`) are kept as given.
"""

# Longer than ~400 lines on purpose: the candidates, the sizes they are judged by, the refusal with its suggestions
# and the replica's entry read as one decision.

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dreamzero.errors import ConfigError
from dreamzero.memory_fit import activation_estimate, canvas_for, fit_rows, margin_bytes
from dreamzero.placement import Placement, text_encoder_cost

G = 2**30

#: usable memory as CUDA reports it for the cards people own (the docs' card table and the suggestions)
CARDS: dict[str, int] = {
    "24 GB (RTX 4090)": int(23.6 * G),
    "32 GB (RTX 5090)": int(31.4 * G),
    "48 GB (L40S, RTX 6000)": int(44.4 * G),
    "80 GB (H100, A100)": int(78.0 * G),
    "141 GB (H200)": int(139.0 * G),
}

#: effective host-to-device rate of pinned memory over PCIe 4.0 x16 (the offloaded text encoder's cost per new prompt;
#: an assumption stated in the plan, not a measurement)
PCIE_BYTES_PER_S = 20e9
#: dense bf16 throughput a server CPU sustains in a large matmul (the CPU text encoder's estimate; likewise stated)
CPU_FLOPS_PER_S = 1.0e12


@dataclass(frozen=True)
class ComponentPlan:
    name: str  # dit, text_encoder, image_encoder, vae
    where: str  # gpu, cpu, offload
    dtype: str  # bfloat16, float32, fp8 (weights) ...
    device_bytes: int  # held on the device for good
    host_bytes: int  # held in host memory

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Plan:
    """Where each component lives, the rows per model call, the sessions held, and why."""

    checkpoint: str
    gpu_memory: int
    cfg_parallel: int
    placement: Placement
    components: tuple[ComponentPlan, ...]
    fits: bool
    rows: int
    sessions: int  # full-window sessions held (capped by max_sessions)
    session_budget: int
    session_bytes: int  # one full-window session's peak
    activation_per_row: int
    kv_transient: int
    margin: int
    new_prompt_extra_s: float  # first-chunk cost of a prompt not in the prompt cache, beyond the GPU encoder's
    new_prompt_basis: str
    why: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()

    @property
    def device_weights(self) -> int:
        return sum(c.device_bytes for c in self.components)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["placement"] = self.placement.as_dict()
        out["components"] = [c.as_dict() for c in self.components]
        out["device_weights"] = self.device_weights
        out["why"], out["suggestions"] = list(self.why), list(self.suggestions)
        return out

    def summary(self) -> str:
        """One line: what a replica logs and a refusal quotes."""
        if not self.fits:
            return f"{self.checkpoint} does not fit {self.gpu_memory / G:.1f} GiB: " + "; ".join(self.suggestions)
        where = ", ".join(f"{c.name} {c.where} {c.dtype}" for c in self.components)
        return (
            f"{self.checkpoint} on {self.gpu_memory / G:.1f} GiB: {where}; {self.rows} rows per call, "
            f"{self.sessions} sessions ({self.session_budget / G:.2f} GiB)"
        )


@dataclass(frozen=True)
class _Sizes:
    """What the configs say, computed once per plan (bytes)."""

    dit: dict[str, int]  # dtype name -> DiT bytes
    text_encoder: int
    offload_transient: int  # device bytes an offloaded text encoder holds during an encode
    image_encoder: int
    vae: int
    session_peak: int
    kv_peak: int
    activation_per_row: int
    num_layers: int


_SIZES: dict[tuple, _Sizes] = {}


def _sizes(config, dtype: torch.dtype, cfg_parallel: int) -> _Sizes:
    """`_measure_sizes`, remembered per config (a meta-device build of the 14B takes a fraction of a second, and a
    refusal plans a few more cards)."""
    key = (repr(config), str(dtype), cfg_parallel)
    if key not in _SIZES:
        _SIZES[key] = _measure_sizes(config, dtype, cfg_parallel)
    return _SIZES[key]


def _measure_sizes(config, dtype: torch.dtype, cfg_parallel: int) -> _Sizes:
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.fp8 import fp8_nbytes
    from dreamzero.model.vae import spatial_factor
    from dreamzero.sessions import footprint_for

    model = DreamZeroModel.from_config(config, device="meta")
    element = torch.empty((), dtype=dtype).element_size()

    def nbytes(module) -> int:
        if module is None:
            return 0
        tensors = list(module.parameters()) + list(module.buffers())
        return sum(t.numel() * (element if t.is_floating_point() else t.element_size()) for t in tensors)

    branches = 1 if config.pipeline.cfg_scale == 1.0 or cfg_parallel == 2 else 2
    canvas = canvas_for(config.dit, config.pipeline, spatial_factor(config.vae))
    fp = footprint_for(config.dit, config.pipeline, config.vae, config.image_encoder, canvas, dtype, branches=branches)
    act = activation_estimate(config.dit, config.pipeline, 1, element)
    if cfg_parallel == 2 and config.pipeline.cfg_scale != 1.0:
        act //= 2  # each rank runs one guidance branch's rows
    return _Sizes(
        dit={"model": nbytes(model.model), "fp8": fp8_nbytes(model.model, dtype)},
        text_encoder=nbytes(model.text_encoder),
        offload_transient=int(text_encoder_cost(config, "offload", dtype=dtype)["device_transient_bytes"]),
        image_encoder=nbytes(model.image_encoder),
        vae=nbytes(model.vae),
        session_peak=fp.peak,
        kv_peak=max(p["kv_cache"] for p in fp.parts),
        activation_per_row=act,
        num_layers=config.dit.num_layers,
    )


#: the placements tried, cheapest first (module docstring)
CANDIDATES = (
    Placement(text_encoder="gpu", image_encoder="gpu", dit_weights="model"),
    Placement(text_encoder="offload", image_encoder="gpu", dit_weights="model"),
    Placement(text_encoder="cpu", image_encoder="gpu", dit_weights="model"),
    Placement(text_encoder="cpu", image_encoder="cpu", dit_weights="model"),
    Placement(text_encoder="offload", image_encoder="gpu", dit_weights="fp8"),
    Placement(text_encoder="cpu", image_encoder="gpu", dit_weights="fp8"),
    Placement(text_encoder="cpu", image_encoder="cpu", dit_weights="fp8"),
)

#: a costlier placement is taken only when the cheaper ones hold less than this share of the most sessions any holds
ENOUGH = 0.9

#: a typical instruction's tokens (the new-prompt estimate)
PROMPT_TOKENS = 32


def _components(sizes: _Sizes, placement: Placement, dtype: torch.dtype) -> tuple[ComponentPlan, ...]:
    dname = str(dtype).removeprefix("torch.")
    dit_bytes = sizes.dit[placement.dit_weights]
    parts = [ComponentPlan("dit", "gpu", "fp8" if placement.dit_weights == "fp8" else dname, dit_bytes, 0)]
    for name, where, nbytes in (
        ("text_encoder", placement.text_encoder, sizes.text_encoder),
        ("image_encoder", placement.image_encoder, sizes.image_encoder),
    ):
        if nbytes:
            on_gpu = where == "gpu"
            parts.append(ComponentPlan(name, where, dname, nbytes if on_gpu else 0, 0 if on_gpu else nbytes))
    parts.append(ComponentPlan("vae", "gpu", dname, sizes.vae, 0))
    return tuple(parts)


def _new_prompt_cost(config, where: str, dtype: torch.dtype) -> tuple[float, str]:
    """Seconds a prompt not in the prompt cache adds to its first chunk beyond the GPU encoder's, and the basis."""
    if where == "gpu":
        return 0.0, "text encoder on the GPU"
    cost = text_encoder_cost(config, where, tokens=PROMPT_TOKENS, dtype=dtype)
    if where == "offload":
        moved = cost["host_to_device_bytes"]
        return moved / PCIE_BYTES_PER_S, f"{moved / G:.1f} GiB moved in at an assumed {PCIE_BYTES_PER_S / 1e9:.0f} GB/s"
    if cost["cpu_ms"] is not None:
        return cost["cpu_ms"] / 1e3, f"{PROMPT_TOKENS} tokens on the CPU, as measured on the development machine"
    flops = cost["flops"]
    return flops / CPU_FLOPS_PER_S, (
        f"{flops / 1e9:.0f} GFLOP for {PROMPT_TOKENS} tokens at an assumed {CPU_FLOPS_PER_S / 1e12:.1f} TFLOP/s CPU"
    )


def describe(p: Placement) -> str:
    """`text encoder offload, image encoder gpu, DiT fp8`: how plans and refusals name a placement."""
    dit = "DiT fp8" if p.dit_weights == "fp8" else "DiT model dtype"
    return f"text encoder {p.text_encoder}, image encoder {p.image_encoder}, {dit}"


def explicit_placement(value) -> dict[str, str]:
    """The fields of `policy.placement` set explicitly (a mapping, `auto` values left to the planner; a Placement:
    every field), validated: ConfigError naming the field."""
    if value is None:
        return {}
    if isinstance(value, Placement):
        return value.as_dict()
    if not isinstance(value, Mapping):
        Placement.parse(value)  # raises, naming the field
    given = {k: v for k, v in value.items() if not (isinstance(v, str) and v.strip().lower() == "auto")}
    parsed = Placement.parse(given)
    return {k: getattr(parsed, k) for k in given}


def _try(sizes, placement, dtype, gpu_memory, max_sessions, rows, max_bytes):
    comps = _components(sizes, placement, dtype)
    weights = sum(c.device_bytes for c in comps)
    offload = sizes.offload_transient if placement.text_encoder == "offload" else 0
    free = gpu_memory - weights
    if free <= 0:
        return comps, None
    cap = max_sessions if rows is None else rows
    fit = fit_rows(free, gpu_memory, sizes.session_peak, sizes.kv_peak, sizes.activation_per_row, sizes.num_layers,
                   cap, rows, offload)  # fmt: skip
    if fit is not None and isinstance(max_bytes, int):
        if max_bytes > fit.budget or max_bytes < fit.rows * sizes.session_peak:
            return comps, None
        fit = dataclasses.replace(fit, budget=max_bytes, sessions=max_bytes // sizes.session_peak)
    return comps, fit


def plan_serving(
    config,
    gpu_memory: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    cfg_parallel: int = 1,
    max_sessions: int = 128,
    rows: int | str | None = "auto",
    max_bytes: int | str | None = "auto",
    placement: dict | Placement | None = None,
    name: str | None = None,
) -> Plan:
    """The plan for `config` (a DreamZeroConfig) on one device of `gpu_memory` usable bytes (per rank with
    `cfg_parallel: 2`). `rows`: "auto" / None / a number (`batching.max_batch_rows`); `max_bytes`: "auto" / None /
    bytes (`sessions.max_bytes`); `placement`: the fields set explicitly (`policy.placement`; "auto": the
    planner's choice)."""
    if cfg_parallel not in (1, 2):
        raise ConfigError(f"cfg_parallel={cfg_parallel}: 1 or 2")
    explicit = explicit_placement(placement)
    rows_n = None if rows in ("auto", None) else int(rows)
    sizes = _sizes(config, dtype, cfg_parallel)
    name = name or getattr(config, "name", None) or "checkpoint"
    tried = []
    for cand in CANDIDATES:
        if any(getattr(cand, k) != v for k, v in explicit.items()):
            continue
        comps, fit = _try(sizes, cand, dtype, gpu_memory, max_sessions, rows_n, max_bytes)
        tried.append((cand, comps, fit))
    if not tried:  # an explicit combination outside the list (e.g. image encoder offloaded): take it as given
        cand = Placement(**explicit)
        tried.append((cand, *_try(sizes, cand, dtype, gpu_memory, max_sessions, rows_n, max_bytes)))
    fitting = [t for t in tried if t[2] is not None]
    model_dtype = [t for t in fitting if t[0].dit_weights == "model"]
    pool = model_dtype or fitting
    if not pool:
        cand, comps, _ = tried[-1]
        return _refusal(config, sizes, name, gpu_memory, dtype, cfg_parallel, cand, comps, max_sessions, rows_n)
    best = max(min(max_sessions, t[2].sessions) for t in pool)
    cand, comps, fit = next(t for t in pool if min(max_sessions, t[2].sessions) >= math.floor(ENOUGH * best))
    cost, basis = _new_prompt_cost(config, cand.text_encoder, dtype)
    return Plan(
        name, gpu_memory, cfg_parallel, cand, comps, True, fit.rows, min(max_sessions, fit.sessions), fit.budget,
        sizes.session_peak, sizes.activation_per_row, fit.transient, fit.margin, cost, basis,
        why=_why(cand, tried, fit, sizes, max_sessions, explicit),
    )  # fmt: skip


def _why(cand, tried, fit, sizes, max_sessions, explicit) -> tuple[str, ...]:
    out = []
    first = tried[0]
    if cand != first[0]:
        held = "none" if first[2] is None else f"{min(max_sessions, first[2].sessions)} session(s)"
        rule = "" if first[2] is None else f" (a costlier placement is taken for {100 - 100 * ENOUGH:.0f} % more)"
        out.append(
            f"with {describe(first[0])} the card holds {held}; {describe(cand)} holds "
            f"{min(max_sessions, fit.sessions)}{rule}"
        )
    if explicit:
        out.append("set explicitly: " + ", ".join(f"{k}={v}" for k, v in sorted(explicit.items())))
    if fit.sessions > max_sessions:
        out.append(f"sessions capped by sessions.max_sessions={max_sessions}")
    out.append(
        f"{fit.rows} row(s) per call: each row's full-window session {sizes.session_peak / G:.2f} GiB and activations "
        f"{sizes.activation_per_row / G:.2f} GiB; {fit.describe()}"
    )
    return tuple(out)


def _refusal(config, sizes, name, gpu_memory, dtype, cfg_parallel, cand, comps, max_sessions, rows_n) -> Plan:
    """A plan that does not fit, with what would: fp8, CPU encoders, `cfg_parallel: 2`, a larger card."""
    suggestions = []
    weights = sum(c.device_bytes for c in comps)
    why = (
        f"the smallest placement tried ({describe(cand)}) holds {weights / G:.1f} GiB of weights; one full-window "
        f"session needs {sizes.session_peak / G:.2f} GiB + {sizes.activation_per_row / G:.2f} GiB of activations"
    )
    if rows_n is not None and rows_n > 1:
        one = plan_serving(config, gpu_memory, dtype=dtype, cfg_parallel=cfg_parallel, max_sessions=max_sessions,
                           rows=1, name=name)  # fmt: skip
        if one.fits:
            suggestions.append(f"batching.max_batch_rows={rows_n} does not fit; 1 row does (or set it to auto)")
    if cfg_parallel == 1 and config.pipeline.cfg_scale != 1.0:
        two = plan_serving(config, gpu_memory, dtype=dtype, cfg_parallel=2, max_sessions=max_sessions, name=name)
        if two.fits:
            suggestions.append(
                f"policy.cfg_parallel: 2 (two such GPUs per replica, each holding one guidance branch: "
                f"{two.sessions} session(s), {describe(two.placement)})"
            )
    for card, size in CARDS.items():
        if size > gpu_memory:
            bigger = plan_serving(config, size, dtype=dtype, cfg_parallel=cfg_parallel, max_sessions=max_sessions,
                                  name=name)  # fmt: skip
            if bigger.fits:
                suggestions.append(f"a {card} card ({describe(bigger.placement)}: {bigger.sessions} session(s))")
                break
    if not suggestions:
        suggestions.append("a smaller model")
    return Plan(
        name, gpu_memory, cfg_parallel, cand, comps, False, 0, 0, 0, sizes.session_peak, sizes.activation_per_row, 0,
        margin_bytes(gpu_memory), math.nan, "", why=(why,), suggestions=tuple(suggestions),
    )  # fmt: skip


def model_config_for(model: str | None, layout: str | None = None, checkpoint_config: str | None = None):
    """The DreamZeroConfig of `model` without loading it: a preset name (`droid_14b`, `libero_5b`, ...), an
    `embedded:<name>`, or a checkpoint path of any layout (its config files; `checkpoint_config` names a preset that
    replaces them); None: the embedded tiny model."""
    from pathlib import Path

    from dreamzero.checkpoint import detect_layout, read_config, read_diffusers_config
    from dreamzero.config import PRESETS, preset
    from dreamzero.embedded_default import resolve_model_path
    from dreamzero.errors import CheckpointError

    if checkpoint_config is not None:
        return preset(checkpoint_config)
    if model is None:
        return preset("tiny")
    if model in PRESETS:
        return preset(model)
    path = Path(resolve_model_path(model))
    if not path.exists():
        raise ConfigError(f"{model!r} is neither a checkpoint path nor a preset; presets: {sorted(PRESETS)}")
    layout = layout or detect_layout(path)
    if layout == "diffusers":
        return read_diffusers_config(path)
    folder = path if path.is_dir() else path.parent  # a full_weights.pt reads the config.json beside it
    try:
        return read_config(folder)
    except CheckpointError as exc:
        raise ConfigError(f"{model}: cannot read the checkpoint's config ({exc}); name a preset instead") from exc


def device_memory(device) -> int | None:
    """Usable bytes of the device a replica serves on: CUDA's total, a simulated GPU's declared size
    ($DREAMZERO_SIMULATED_GPU), or None on a plain CPU (no device memory to plan)."""
    from dreamzero.device import simulated_gpu_bytes

    simulated = simulated_gpu_bytes()
    if simulated is not None:
        return simulated
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[1])
    return None


def check_fits(plan: Plan, rows_spec, bytes_spec, placement, rows_field: str | None = None) -> None:
    """At `serve run` and at a replica's start: ConfigError naming the setting to change when `plan` does not fit
    (`rows_field`: how to name the rows when they were not given as a number, e.g. null's sessions.max_sessions)."""
    if plan.fits:
        return
    if isinstance(rows_spec, int) and rows_spec > 1:
        field = rows_field or f"batching.max_batch_rows={rows_spec}"
    elif isinstance(bytes_spec, int):
        field = f"sessions.max_bytes={bytes_spec / G:.1f}GiB"
    elif explicit_placement(placement):
        field = f"policy.placement={explicit_placement(placement)}"
    else:
        field = "model_path"
    raise ConfigError(
        f"{field}: {plan.checkpoint} does not fit {plan.gpu_memory / G:.1f} GiB per GPU ({'; '.join(plan.why)}); "
        f"what would: {'; or '.join(plan.suggestions)} (`dreamzero-plan` prints the plan)"
    )


def plan_for_replica(
    model_path, layout, checkpoint_config, overrides, device, dtype, cfg_parallel, max_sessions, rows, max_bytes,
    placement,
) -> Plan | None:  # fmt: skip
    """The plan a Policy replica loads by, from its settings, before any weight is read: None on a plain CPU (no
    device memory to fit: every component stays on the CPU). ConfigError (`check_fits`) when it does not fit."""
    from dreamzero.config import apply_overrides
    from dreamzero.device import parse_dtype

    memory = device_memory(device)
    if memory is None:
        return None
    cfg = model_config_for(model_path, layout, checkpoint_config)
    cfg = dataclasses.replace(cfg, pipeline=apply_overrides(cfg.pipeline, dict(overrides or {}) or None))
    field = f"batching.max_batch_rows=null (sessions.max_sessions={max_sessions})" if rows is None else None
    rows = max_sessions if rows is None else rows
    dt = parse_dtype(dtype) if dtype else torch.bfloat16
    plan = plan_serving(
        cfg, memory, dtype=dt, cfg_parallel=cfg_parallel, max_sessions=max_sessions, rows=rows, max_bytes=max_bytes,
        placement=placement, name=getattr(cfg, "name", None) or str(model_path),
    )  # fmt: skip
    check_fits(plan, rows, max_bytes, placement, field)
    return plan
