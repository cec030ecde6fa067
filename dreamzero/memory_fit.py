"""The arithmetic of fitting sessions to a device, shared by the planner (`dreamzero.planner`, from the configs) and
a replica's sizing (`dreamzero.pipeline.budget`, with what its device measures): the margin kept free, the warm-up
canvas, the activation estimate, the batch cache copies and the rows that fit (docs/model.md, "Memory and
admission")."""

from __future__ import annotations

import math
from dataclasses import dataclass

G = 2**30


def margin_bytes(total: int, margin_fraction: float = 0.05) -> int:
    """Fragmentation and allocator slack kept free: 5 % of the device, at least 1 GiB on devices over 8 GiB."""
    return max(int(margin_fraction * total), 1 << 30 if total > 8 << 30 else 0)


def canvas_for(cfg, pipeline_cfg, sf: int) -> tuple[int, int]:
    """The frame size a warm-up sends, from the configs alone (DiTConfig, PipelineConfig, the VAE's spatial factor):
    the model's input size when it resizes, else the canvas whose latent grid gives `frame_seqlen` tokens, the
    factorisation closest to the 1:2 canvases of the shipped embodiments (DROID 352x640)."""
    if pipeline_cfg.model_input_hw is not None:
        return tuple(pipeline_cfg.model_input_hw)
    pairs = [(a, cfg.frame_seqlen // a) for a in range(1, cfg.frame_seqlen + 1) if cfg.frame_seqlen % a == 0]
    gh, gw = min(pairs, key=lambda p: abs(math.log(p[1] / p[0]) - math.log(2)))
    return gh * cfg.patch_size[1] * sf, gw * cfg.patch_size[2] * sf


def activation_estimate(dit, pipeline_cfg, rows: int, element_size: int) -> int:
    """Bytes a DiT forward of `rows` sessions holds while it runs, by the accounting (what a declared device counts for
    a warm-up; CUDA measures it): per CFG row and query token the hidden states, q / k / v, attention output,
    residual and modulation copies (~8 x dim) and the FFN's hidden layer; the keys and values over the cache plus the
    new tokens; the cross-attention keys and values of the text and image context."""
    branches = 1 if pipeline_cfg.cfg_scale == 1.0 else 2
    tokens = dit.num_frame_per_block * dit.frame_seqlen + dit.num_action_per_block + dit.num_state_per_block
    kv_tokens = dit.max_attention_frames * dit.frame_seqlen + tokens
    context = dit.text_len + (257 if dit.has_image_input else 0)
    per_row = tokens * (8 * dit.dim + dit.ffn_dim) + 2 * kv_tokens * dit.dim + 2 * context * dit.dim
    return rows * branches * per_row * element_size


def kv_transient(rows: int, kv_per_session: int, num_layers: int) -> int:
    """Extra bytes a model call of `rows` sessions' caches holds beyond the sessions' own (`batch_kv_transient`)."""
    from dreamzero.pipeline.batch_cache import batch_kv_transient

    return batch_kv_transient(rows, kv_per_session, num_layers)


@dataclass(frozen=True)
class RowFit:
    """Rows per model call and what is left for sessions, all bytes."""

    rows: int
    sessions: int  # full-window sessions the budget holds (before any max_sessions cap)
    budget: int  # what sessions may reserve
    activation: int  # the rows' activation peak
    transient: int  # the rows' batch cache copies
    margin: int

    def describe(self) -> str:
        return (
            f"session budget {self.budget / G:.2f} GiB = free - activations {self.activation / G:.2f} GiB - batch "
            f"cache copies {self.transient / G:.2f} GiB - margin {self.margin / G:.2f} GiB"
        )


def fit_rows(
    free: int,
    total: int,
    session_peak: int,
    kv_peak: int,
    activation_per_row: int,
    num_layers: int,
    max_rows: int,
    rows: int | None = None,
    extra_transient: int = 0,
) -> RowFit | None:
    """The largest number of rows (<= `max_rows`) whose activations, cache copies and own full-window sessions fit in
    `free` bytes with the margin (`rows` given: that number, checked). None when not even one row fits.
    `extra_transient`: device bytes something else needs while a call runs (an offloaded encoder's layers)."""
    margin = margin_bytes(total)

    def fit(r: int) -> RowFit:
        act, copies = r * activation_per_row, kv_transient(r, kv_peak, num_layers)
        budget = free - margin - act - copies - extra_transient
        return RowFit(r, max(0, budget) // max(1, session_peak), budget, act, copies, margin)

    if rows is not None:
        got = fit(rows)
        return got if got.sessions >= rows else None
    per_row = max(1, session_peak + activation_per_row)
    r = max(1, min(max_rows, (free - margin - extra_transient) // per_row))
    while r >= 1:  # the copies grow with the rows: step down until the rows' own sessions fit
        got = fit(r)
        if got.sessions >= r:
            return got
        r = min(r - 1, got.sessions) if got.sessions >= 1 else r - 1
    return None
