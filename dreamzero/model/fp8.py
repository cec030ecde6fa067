"""Weight-only float8 for the DiT: float8_e4m3fn weights with one fp32 scale per output channel.

A weight row w [in] is stored as codes q = fp8(w / s) with s = max|w| / 448 (448: e4m3's largest finite value), so
every row uses the whole fp8 range; a zero row keeps s = 0 and codes 0. Before each matmul the row is dequantised,
q * s in fp32, then cast to the activations' dtype, and the ordinary `F.linear` runs: no fp8 kernel, so the numbers
are those of a CPU and a GPU alike up to the matmul's own rounding, and the activations (and the KV caches they make)
stay in the model's dtype. The saving is memory: 1 byte per weight plus 4 per output channel instead of 2 (bf16).

What is converted (`convert_linears_to_fp8_`'s default, `in_dit_blocks`): the nn.Linear layers inside the DiT's
transformer blocks (self- and cross-attention q, k, v, o, the image k/v of i2v, both FFN matmuls), 98 % of the 14B
and 5B DiTs' weights. The embeddings, the time projection, the output head and the action / state MLPs stay in the
model dtype: about 2 % of the weights (fp8 there too would save 0.23 of 15.7 GiB on the 14B), and each feeds every
token of every block, so a rounding error there is the least diluted (docs/model.md, "Reduced precision", has the
measured drift).

A quantised model is never saved: loading always starts from a full-precision checkpoint, and `weight_scale` is a
non-persistent buffer so the state dict keeps the release layout's names and shapes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

#: predicate(qualified name inside the converted module, the nn.Linear) -> convert it or not
Predicate = Callable[[str, nn.Linear], bool]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (codes [out, in] float8_e4m3fn, scales [out] fp32), on w's device.

    s = max|w| / 448 per row in fp32; codes = round-to-nearest-even(w / s), clamped to +-448 (w / s of the largest
    entry can land one fp32 ulp past 448). A zero row gets s = 0 and zero codes."""
    if weight.ndim != 2:
        raise ValueError(f"an fp8 weight is a matrix [out, in], got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (w / safe.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * scale per row, computed in fp32 (every e4m3 value and product is exact there up to one rounding),
    then cast to `dtype`: the reference every Fp8Linear forward is equal to. In place on the fp32 copy: one
    transient fp32 matrix, not two."""
    return codes.float().mul_(scale.unsqueeze(1)).to(dtype)


class Fp8Linear(nn.Module):
    """nn.Linear with float8_e4m3fn weights and per-output-channel fp32 scales (weight-only: see the module doc).

    `weight` is a Parameter (requires_grad False) so that parameter counts and the checkpoint loader see it where an
    nn.Linear's weight is; `.to(dtype)` / `.half()` move it and its scales between devices but never change their
    dtypes (the bias follows the model dtype as usual)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=FP8_DTYPE), requires_grad=False
        )
        self.register_buffer("weight_scale", torch.ones(out_features, device=device, dtype=torch.float32), False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """The fp8 copy of `linear` on its device (its bias kept in its dtype); a meta linear gives a meta module."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, device=w.device, dtype=w.dtype)
        if linear.bias is not None:
            out.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        if not w.is_meta:
            out.set_weight(w)
        return out

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantise a full-precision weight [out, in] into this module, on `weight`'s device (what a streaming
        loader calls per tensor: the fp8 codes and scales replace whatever was there, meta included)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"Fp8Linear.set_weight: expected a weight of shape {[self.out_features, self.in_features]}, "
                f"got {list(weight.shape)}"
            )
        if weight.is_meta:
            codes = torch.empty(weight.shape, device="meta", dtype=FP8_DTYPE)
            scale = torch.empty(weight.shape[0], device="meta", dtype=torch.float32)
        else:
            codes, scale = quantize_rows(weight)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = scale

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .half() / .float() would cast the fp8 codes (is_floating_point) and round the fp32
        # scales: probe what `fn` does to an empty tensor of each one's dtype; if it changes the dtype, move the
        # tensor by device only. Device-only functions (to(device), to_empty, cuda) apply to them unchanged.
        for name in ("weight", "weight_scale"):
            t = getattr(self, name)
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            moved = fn(t) if probe.dtype == t.dtype else t.to(device=probe.device)
            if name == "weight":
                self.weight = nn.Parameter(moved, requires_grad=False)
            else:
                self.weight_scale = moved
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias), requires_grad=False)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


def in_dit_blocks(module: nn.Module) -> Predicate:
    """The default rule: the nn.Linear layers inside a DiT transformer block (`CausalWanDiT.blocks[i]`) of `module`
    (a CausalWanDiT, a DreamZeroModel or anything holding one): attention q/k/v/o (k_img/v_img) and the FFN."""
    from dreamzero.model.dit import DiTBlock

    prefixes = tuple(f"{name}." for name, m in module.named_modules() if isinstance(m, DiTBlock))
    return lambda name, linear: name.startswith(prefixes)


def all_linears(name: str, linear: nn.Linear) -> bool:
    """Every nn.Linear (embeddings, time projection and head included): measured against the default in
    benchmarks/precision_drift.py."""
    return True


def convert_linears_to_fp8_(module: nn.Module, *, predicate: Predicate | None = None) -> int:
    """Replace, in place, the nn.Linear layers of `module` that `predicate(name, linear)` selects (default
    `in_dit_blocks(module)`) by Fp8Linear, quantising their weights; returns how many were replaced. A meta-device
    module is converted by shapes alone (nothing is allocated), as a loader or the memory planner needs."""
    pick = predicate if predicate is not None else in_dit_blocks(module)
    targets = [
        (name, m) for name, m in module.named_modules() if type(m) is nn.Linear and name and pick(name, m)
    ]  # listed first: replacing while iterating named_modules would skip or revisit modules
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, Fp8Linear.from_linear(linear))
    return len(targets)


def module_nbytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes `module`'s parameters and buffers hold with its floating tensors in `dtype`, except the fp8 codes and
    their fp32 scales, which keep their own types; shared tensors counted once."""
    element = torch.empty((), dtype=dtype).element_size()
    fixed = set()
    for m in module.modules():
        if isinstance(m, Fp8Linear):
            fixed.update((id(m.weight), id(m.weight_scale)))
    tensors = list(module.parameters()) + list(module.buffers())  # both iterators skip tensors already seen
    return sum(
        t.numel() * (element if t.is_floating_point() and id(t) not in fixed else t.element_size()) for t in tensors
    )


def fp8_nbytes(module_on_meta: nn.Module, dtype: torch.dtype, *, predicate: Predicate | None = None) -> int:
    """Bytes `module_on_meta` holds once converted (`convert_linears_to_fp8_(predicate=...)`): fp8 codes, fp32
    scales and everything else in `dtype`. Converts a copy on the meta device: nothing is allocated, the module
    passed is left as it is (already converted layers are counted as they are)."""
    if any(not t.is_meta for t in list(module_on_meta.parameters()) + list(module_on_meta.buffers())):
        raise ValueError("fp8_nbytes: pass a module built on the meta device (it would be copied otherwise)")
    twin = copy.deepcopy(module_on_meta)
    if predicate is None:
        predicate = in_dit_blocks(twin)
    convert_linears_to_fp8_(twin, predicate=predicate)
    return module_nbytes(twin, dtype)
