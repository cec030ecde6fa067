"""Camera frames -> model canvas in one pass per camera: crop, antialiased bilinear resize, truncation to uint8, and
the write into the camera's place on a preallocated canvas, straight from the uint8 wire image.

The bytes are those of `CropResize` + the embodiment's stitch (the training transform): the kernel repeats torch's
float arithmetic step for step. Torch's CPU kernel resizes the width first, then the height; each output is
`w0 x0 + w1 x1 + ...` accumulated left to right in float32, either with fused multiply-adds or with separate
products, depending on how torch was built for this CPU. So the weights are read out of torch itself (resizing an
identity matrix gives them exactly), `x / 255` comes from a 256-entry table torch computed, and once per input size
a probe on random frames against torch picks the accumulation that reproduces it bit for bit. A size neither
reproduces (wide downscales, where torch's loop orders its many taps differently), float frames, or a machine
without numba go through `CropResize` and are stitched by copy: same bytes, the old speed.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dreamzero.embodiments.transforms import CropResize

log = logging.getLogger("dreamzero.embodiments.canvas")

try:  # numba compiles the per-pixel loop; without it every camera takes the torch path
    import numba
    from numba.core import types as _nb_types
    from numba.extending import intrinsic as _nb_intrinsic
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install serving
    numba = None

#: "0" turns the kernel off (every camera through CropResize + stitch): an A/B switch for benchmarks and a way out
KERNEL_ENV = "DREAMZERO_IMAGE_KERNEL"
#: input sizes remembered per writer (clients send one fixed size per camera; more means a misbehaving client)
MAX_PLANS = 32
_PROBE_FRAMES = 2


@dataclass(frozen=True)
class Slot:
    """Where one camera lands on the canvas: top-left corner, and how often each pixel repeats along the width."""

    row: int
    col: int
    width_repeat: int = 1


# ---------------------------------------------------------------------------------------------------------------------
# 1. What torch computes: weights per axis and the x / 255 table
# ---------------------------------------------------------------------------------------------------------------------


def axis_weights(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Torch's antialiased bilinear weights along one axis: first tap int64 [n_out], weights float32 [n_out, taps].

    Resizing the rows of an identity matrix makes torch write out each weight unchanged (1 * w, plus exact zeros).
    Rows are padded with zero weights to a common tap count (a zero tap adds exactly nothing in either accumulation).
    """
    eye = torch.eye(n_in, dtype=torch.float32)[:, None, None, :]  # n_in one-hot rows of width n_in
    dense = F.interpolate(eye, size=(1, n_out), mode="bilinear", align_corners=False, antialias=True)
    dense = dense[:, 0, 0, :].T.numpy()  # [n_out, n_in]
    nonzero = dense != 0
    first = np.argmax(nonzero, axis=1)
    last = n_in - np.argmax(nonzero[:, ::-1], axis=1)
    taps = int((last - first).max())
    lo = np.minimum(first, n_in - taps).astype(np.int64)  # keep every padded tap inside the image
    weights = np.stack([dense[np.arange(n_out), lo + k] for k in range(taps)], axis=1).astype(np.float32)
    return lo, np.ascontiguousarray(weights)


def unit_table() -> np.ndarray:
    """float32 [256]: `uint8 / 255` exactly as `CropResize` computes it (same torch op on a full-size tensor)."""
    values = torch.arange(256, dtype=torch.uint8).repeat(64)  # long enough for the vectorised loop, as on frames
    table = (values.float() / 255.0).numpy()
    return table[:256].copy()


# ---------------------------------------------------------------------------------------------------------------------
# 2. The kernel
# ---------------------------------------------------------------------------------------------------------------------

if numba is not None:

    @_nb_intrinsic
    def _fma32(typingctx, a, b, c):
        """float32 a * b + c with one rounding (llvm.fma), whatever the compiler would have contracted."""
        sig = _nb_types.float32(_nb_types.float32, _nb_types.float32, _nb_types.float32)

        def codegen(context, builder, signature, args):
            return builder.fma(*args)

        return sig, codegen

    # the two accumulations as separate loops, so no branch sits inside a vectorisable loop
    @numba.njit(nogil=True)
    def _taps_fused(acc, src, weights):
        for m in range(acc.shape[0]):
            acc[m] = _fma32(src[m], weights[m], acc[m])

    @numba.njit(nogil=True)
    def _taps_plain(acc, src, weights):
        for m in range(acc.shape[0]):
            acc[m] = acc[m] + src[m] * weights[m]

    @numba.njit(nogil=True)
    def _tap_fused(acc, src, weight):
        for m in range(acc.shape[0]):
            acc[m] = _fma32(src[m], weight, acc[m])

    @numba.njit(nogil=True)
    def _tap_plain(acc, src, weight):
        for m in range(acc.shape[0]):
            acc[m] = acc[m] + src[m] * weight

    @numba.njit(nogil=True, cache=True)
    def _resize_into(src, top, left, crop_h, h_idx, h_w, v_lo, v_w, table, fused, out, row0, col0, repeat, out_float):
        """src uint8 [N, H, W, 3] -> out uint8 [N, CH, CW, 3] (the canvas) at (row0, col0), each pixel `repeat` times
        along the width. h_idx / h_w: [taps, ow * 3] flat source index within the cropped row and weight of every
        output value; out_float [N, oh, ow * 3] receives the values before clamping when it has N rows (the probe)."""
        n_frames = src.shape[0]
        taps_h, width = h_w.shape
        oh, taps_v = v_w.shape
        want_float = out_float.shape[0] == n_frames
        gathered = np.empty(width, np.float32)  # the row's values (x / 255) under one tap of every output value
        rows = np.empty((crop_h, width), np.float32)  # the width pass of every cropped row
        acc = np.empty(width, np.float32)
        values = np.empty(width, np.uint8)
        start = left * 3
        zero, one, full = np.float32(0.0), np.float32(1.0), np.float32(255.0)
        for n in range(n_frames):
            for y in range(crop_h):
                pixels = src[n, top + y].reshape(-1)
                row = rows[y]
                for m in range(width):
                    row[m] = table[pixels[start + h_idx[0, m]]] * h_w[0, m]
                for k in range(1, taps_h):
                    for m in range(width):
                        gathered[m] = table[pixels[start + h_idx[k, m]]]
                    if fused:
                        _taps_fused(row, gathered, h_w[k])
                    else:
                        _taps_plain(row, gathered, h_w[k])
            for i in range(oh):
                first, w0 = rows[v_lo[i]], v_w[i, 0]
                for m in range(width):
                    acc[m] = first[m] * w0
                for k in range(1, taps_v):
                    if fused:
                        _tap_fused(acc, rows[v_lo[i] + k], v_w[i, k])
                    else:
                        _tap_plain(acc, rows[v_lo[i] + k], v_w[i, k])
                if want_float:
                    out_float[n, i] = acc
                for m in range(width):  # clamp, * 255, truncation (the float -> uint8 cast), as in training
                    values[m] = np.uint8(min(max(acc[m], zero), one) * full)
                dest = out[n, row0 + i].reshape(-1)
                for j in range(width // 3):
                    for r in range(repeat):
                        at = (col0 + j * repeat + r) * 3
                        dest[at] = values[3 * j]
                        dest[at + 1] = values[3 * j + 1]
                        dest[at + 2] = values[3 * j + 2]


_NO_FLOAT = np.empty((0, 1, 3), np.float32)


# ---------------------------------------------------------------------------------------------------------------------
# 3. Plans per input size, and the canvas writer
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """The crop window and weights for one input size, and the accumulation that matched torch on the probe."""

    top: int
    left: int
    crop_h: int
    h_idx: np.ndarray  # int64 [taps, ow * 3]: flat index of each output value's tap within the cropped row
    h_w: np.ndarray  # float32 [taps, ow * 3]
    v_lo: np.ndarray  # int64 [oh]: first row of each output row's taps
    v_w: np.ndarray  # float32 [oh, taps]
    fused: bool

    @classmethod
    def build(cls, top: int, left: int, crop_hw: tuple[int, int], out_hw: tuple[int, int], fused: bool) -> _Plan:
        (ch, cw), (oh, ow) = crop_hw, out_hw
        h_lo, h_w = axis_weights(cw, ow)
        v_lo, v_w = axis_weights(ch, oh)
        taps = np.arange(h_w.shape[1])
        # channel-interleaved: value m = 3 j + c reads pixel (h_lo[j] + k) channel c with weight h_w[j, k]
        idx = (h_lo[None, :, None] + taps[:, None, None]) * 3 + np.arange(3)[None, None, :]  # [taps, ow, 3]
        weights = np.repeat(h_w.T[:, :, None], 3, axis=2)
        return cls(
            top, left, ch, np.ascontiguousarray(idx.reshape(len(taps), -1)),
            np.ascontiguousarray(weights.reshape(len(taps), -1)), v_lo, v_w, fused,
        )  # fmt: skip

    def run(
        self, frames: np.ndarray, canvas: np.ndarray, row0: int, col0: int, repeat: int, table: np.ndarray,
        out_float: np.ndarray = _NO_FLOAT,
    ) -> None:  # fmt: skip
        """frames uint8 [N, H, W, 3] -> canvas uint8 [N, CH, CW, 3] (C-contiguous) at (row0, col0)."""
        _resize_into(
            np.ascontiguousarray(frames), self.top, self.left, self.crop_h, self.h_idx, self.h_w, self.v_lo,
            self.v_w, table, self.fused, canvas, row0, col0, repeat, out_float,
        )  # fmt: skip


def _reference_floats(frames: np.ndarray, crop: CropResize) -> np.ndarray:
    """`CropResize`'s values before the clamp, channel-last float32 (what the probe compares against)."""
    x = torch.from_numpy(np.ascontiguousarray(frames))
    h, w = x.shape[1:3]
    ch, cw = int(crop.scale * h), int(crop.scale * w)
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    x = x[:, top : top + ch, left : left + cw].permute(0, 3, 1, 2).contiguous().float() / 255.0
    if (ch, cw) != tuple(crop.out_hw):
        x = F.interpolate(x, size=tuple(crop.out_hw), mode="bilinear", align_corners=False, antialias=True)
    return x.permute(0, 2, 3, 1).numpy()


_UNPLANNED = object()  # marks a size not planned yet (None is a plan: "use the torch path")


class CanvasWriter:
    """Renders the views of one embodiment onto its canvas: `render({key: [B, T, H, W, 3]}) -> [B, T, *canvas, 3]`.

    `slots` must tile the canvas exactly (checked here), so the canvas needs no clearing.
    """

    def __init__(self, crop: CropResize, slots: dict[str, Slot], canvas_hw: tuple[int, int]):
        self.crop, self.slots, self.canvas_hw = crop, dict(slots), tuple(canvas_hw)
        vh, vw = crop.out_hw
        cover = np.zeros(self.canvas_hw, np.int32)
        for key, slot in self.slots.items():
            cover[slot.row : slot.row + vh, slot.col : slot.col + vw * slot.width_repeat] += 1
            if slot.row + vh > self.canvas_hw[0] or slot.col + vw * slot.width_repeat > self.canvas_hw[1]:
                raise ValueError(f"canvas slot of {key}: {slot} with a {vh}x{vw} view leaves the {canvas_hw} canvas")
        if (cover != 1).any():
            raise ValueError(f"canvas slots {self.slots} do not tile the {canvas_hw} canvas exactly once")
        self.table = unit_table()
        self._plans: dict[tuple[int, int], _Plan | None] = {}
        self._planning = threading.Lock()

    @property
    def enabled(self) -> bool:
        return numba is not None and os.environ.get(KERNEL_ENV, "1") != "0"

    def plan(self, hw: tuple[int, int]) -> _Plan | None:
        """The one-pass plan for this input size, or None when only the torch path gives `CropResize`'s bytes."""
        plan = self._plans.get(hw, _UNPLANNED)
        if plan is not _UNPLANNED:
            return plan
        with self._planning:  # the front door renders on several threads; a new size is planned once
            if hw not in self._plans:
                if len(self._plans) >= MAX_PLANS:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[hw] = self._make_plan(hw) if self.enabled else None
            return self._plans[hw]

    def _make_plan(self, hw: tuple[int, int]) -> _Plan | None:
        h, w = hw
        ch, cw = int(self.crop.scale * h), int(self.crop.scale * w)
        if ch < 1 or cw < 1:
            return None  # CropResize reports the error
        top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        probe = np.random.default_rng(h * 100003 + w).integers(0, 256, (_PROBE_FRAMES, h, w, 3), dtype=np.uint8)
        want_float = _reference_floats(probe, self.crop)
        want = self.crop(probe)
        for fused in (True, False):
            plan = _Plan.build(top, left, (ch, cw), self.crop.out_hw, fused)
            got = np.empty_like(want)
            got_float = np.empty((len(probe), want.shape[1], want.shape[2] * 3), np.float32)
            plan.run(probe, got, 0, 0, 1, self.table, got_float)
            if np.array_equal(got_float.reshape(want.shape), want_float) and np.array_equal(got, want):
                return plan
        log.warning("input %sx%s: the one-pass kernel does not reproduce torch's resize here; using CropResize", h, w)
        return None

    def render(self, views: dict[str, np.ndarray]) -> np.ndarray:
        """views: key -> [B, T, H, W, 3] (uint8, or float in [0, 1]); all with the same B and T."""
        first = next(iter(views.values()))
        b, t = first.shape[:2]
        canvas = np.empty((b * t, *self.canvas_hw, 3), np.uint8)
        vh, vw = self.crop.out_hw
        for key, slot in self.slots.items():
            frames = views[key]
            frames = frames.reshape(b * t, *frames.shape[2:])
            plan = self.plan(tuple(frames.shape[1:3])) if frames.dtype == np.uint8 else None
            if plan is not None:
                plan.run(frames, canvas, slot.row, slot.col, slot.width_repeat, self.table)
                continue
            dest = canvas[:, slot.row : slot.row + vh, slot.col : slot.col + vw * slot.width_repeat]
            resized = self.crop(frames)  # the torch path: float frames, sizes the kernel does not reproduce
            for r in range(slot.width_repeat):
                dest[:, :, r :: slot.width_repeat] = resized
        return canvas.reshape(b, t, *self.canvas_hw, 3)

    def warm_up(self, wire_hw: tuple[int, int] | None = None) -> None:
        """Compile the kernel (writable and read-only inputs) and plan the size clients are told to send."""
        if not self.enabled:
            return
        hw = tuple(wire_hw) if wire_hw is not None else tuple(self.crop.out_hw)
        frames = np.zeros((1, 1, *hw, 3), np.uint8)
        readonly = frames.copy()
        readonly.flags.writeable = False
        for f in (frames, readonly):
            self.render({key: f for key in self.slots})
