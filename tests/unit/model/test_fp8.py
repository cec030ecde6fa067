"""Weight-only fp8 (dreamzero/model/fp8.py): quantisation, the forward's arithmetic, meta conversion and bytes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dreamzero.config import preset
from dreamzero.model.dit import CausalWanDiT
from dreamzero.model.dreamzero import DreamZeroModel
from dreamzero.model.fp8 import (
    FP8_DTYPE,
    Fp8Linear,
    all_linears,
    convert_linears_to_fp8_,
    dequantize_rows,
    fp8_nbytes,
    module_nbytes,
    quantize_rows,
)
from tests.support.drift import drift, slice_dit_forward, slice_inputs


def _weight(out: int = 48, inp: int = 96, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (1e-3 .. 1e2), as a per-tensor scale would handle badly."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * torch.logspace(-3, 2, out).unsqueeze(1)


def _all_fp8_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, sorted (from all 256 bit patterns)."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    return values[torch.isfinite(values)].unique()


def test_scales_are_row_absmax_over_448_and_codes_span_the_range():
    w = _weight()
    codes, scale = quantize_rows(w)
    assert codes.dtype == FP8_DTYPE and codes.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    assert torch.equal(scale, w.abs().amax(dim=1) / 448.0)
    # each row's largest entry takes the largest code: the whole fp8 range is used per channel
    assert torch.equal(codes.float().abs().amax(dim=1), torch.full((w.shape[0],), 448.0))
    back = dequantize_rows(codes, scale, torch.float32)
    torch.testing.assert_close(back.abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6, atol=0)


def test_codes_are_the_nearest_fp8_value():
    w = _weight(seed=1)
    codes, scale = quantize_rows(w)
    table = _all_fp8_values()
    target = w / scale.unsqueeze(1)
    gap = (target.unsqueeze(-1) - table).abs()  # [out, in, 253]
    nearest = gap.min(dim=-1).values
    # the code is one of the nearest representable values (ties: either neighbour is as near)
    assert torch.equal((codes.float() - target).abs(), nearest)


def test_round_trip_error_within_e4m3_rounding():
    w = _weight(seed=2)
    codes, scale = quantize_rows(w)
    back = dequantize_rows(codes, scale, torch.float32)
    err = (back - w).abs()
    # normal range: half an ulp of a 3-bit mantissa (2^-4 relative); subnormal range (below 2^-6 * s): 2^-10 * s
    bound = torch.maximum(w.abs() * 2.0**-4, scale.unsqueeze(1) * 2.0**-10) * (1 + 1e-6)
    assert (err <= bound).all(), float((err / bound).max())
    rel = float(torch.linalg.norm(back - w) / torch.linalg.norm(w))
    assert 1e-3 < rel < 0.04  # ~2.5 % for Gaussian rows: fp8, not a lossless copy


def test_zero_rows_stay_zero_without_nans():
    w = _weight(seed=3)
    w[[0, 7]] = 0
    lin = nn.Linear(w.shape[1], w.shape[0]).requires_grad_(False)
    lin.weight.data.copy_(w)
    f = Fp8Linear.from_linear(lin)
    assert f.weight_scale[0] == 0 and f.weight_scale[7] == 0
    assert not f.weight[[0, 7]].float().any()
    y = f(torch.randn(3, w.shape[1]))
    assert torch.isfinite(y).all()
    assert torch.equal(y[:, [0, 7]], lin.bias.detach()[[0, 7]].expand(3, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_dequantise_then_matmul(dtype):
    lin = nn.Linear(96, 48).to(dtype).requires_grad_(False)
    lin.weight.data.copy_(_weight(seed=4))
    f = Fp8Linear.from_linear(lin)
    assert f.bias.dtype == dtype
    x = torch.randn(2, 5, 96).to(dtype)
    # the reference, computed from the stored codes and scales independently of the module's helpers
    ref_w = (f.weight.to(torch.float32) * f.weight_scale.reshape(-1, 1)).to(dtype)
    assert torch.equal(f(x), F.linear(x, ref_w, lin.bias))
    assert f(x).dtype == dtype
    # and it is fp8, not the original weight: the output moves, within fp8's rounding
    d = drift(lin(x).float(), f(x).float())
    assert 1e-4 < d.rel_l2 < 0.05


def test_dtype_moves_keep_codes_and_scales():
    lin = nn.Linear(32, 16)
    f = Fp8Linear.from_linear(lin)
    codes, scale = f.weight.clone(), f.weight_scale.clone()
    g = copy.deepcopy(f).to(torch.bfloat16)
    assert g.weight.dtype == FP8_DTYPE and g.weight_scale.dtype == torch.float32 and g.bias.dtype == torch.bfloat16
    assert torch.equal(g.weight.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(g.weight_scale, scale)
    h = copy.deepcopy(g).float().half()
    assert h.weight.dtype == FP8_DTYPE and torch.equal(h.weight_scale, scale) and h.bias.dtype == torch.float16
    assert not f.weight.requires_grad
    # the state dict keeps an nn.Linear's names and shapes (scales are derived, never saved)
    assert {k: tuple(v.shape) for k, v in f.state_dict().items()} == {"weight": (16, 32), "bias": (16,)}


def test_set_weight_on_a_meta_module_materialises_it():
    w = _weight(seed=5)
    with torch.device("meta"):
        f = Fp8Linear(w.shape[1], w.shape[0])
    assert f.weight.is_meta and f.weight.dtype == FP8_DTYPE
    f.to_empty(device="cpu")
    assert f.weight.device.type == "cpu" and f.weight.dtype == FP8_DTYPE and f.weight_scale.dtype == torch.float32
    with torch.device("meta"):
        g = Fp8Linear(w.shape[1], w.shape[0])
    g.set_weight(w)  # a streaming loader's path: no to_empty first
    codes, scale = quantize_rows(w)
    assert g.weight.device.type == "cpu" and torch.equal(g.weight_scale, scale)
    assert torch.equal(g.weight.view(torch.uint8), codes.view(torch.uint8))
    with pytest.raises(ValueError, match=r"expected a weight of shape \[48, 96\], got \[96, 48\]"):
        g.set_weight(w.T)


def test_default_rule_converts_the_block_linears_only():
    dit = DreamZeroModel.from_config(preset("tiny"), device="meta").model
    blocks = [n for n, m in dit.named_modules() if type(m) is nn.Linear and n.startswith("blocks.")]
    others = [n for n, m in dit.named_modules() if type(m) is nn.Linear and not n.startswith("blocks.")]
    per_block = 4 + 6 + 2  # self q k v o; cross q k v o k_img v_img (i2v); the FFN's two
    assert len(blocks) == per_block * dit.cfg.num_layers and others
    assert convert_linears_to_fp8_(dit) == len(blocks)
    assert all(isinstance(dit.get_submodule(n), Fp8Linear) for n in blocks)
    assert all(type(dit.get_submodule(n)) is nn.Linear for n in others)
    assert dit.get_submodule(blocks[0]).weight.is_meta  # shapes only: nothing allocated
    # the whole model: the same rule finds the DiT's blocks and leaves the encoders alone
    model = DreamZeroModel.from_config(preset("tiny"), device="meta")
    assert convert_linears_to_fp8_(model) == len(blocks)
    assert not any(isinstance(m, Fp8Linear) for m in model.text_encoder.modules())


@pytest.mark.parametrize("predicate", [None, all_linears], ids=["blocks", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_meta_byte_count_equals_a_materialised_conversion(predicate, dtype):
    cfg = preset("tiny")
    meta = DreamZeroModel.from_config(cfg, device="meta").model
    counted = fp8_nbytes(meta, dtype, predicate=predicate)
    assert not any(isinstance(m, Fp8Linear) for m in meta.modules())  # the module passed is left alone
    real = DreamZeroModel.from_config(cfg, dtype=dtype, seed=0).model
    convert_linears_to_fp8_(real, predicate=predicate)
    tensors = list(real.parameters()) + list(real.buffers())
    assert counted == sum(t.numel() * t.element_size() for t in tensors)  # the bytes really held
    assert counted == module_nbytes(real, dtype)
    assert counted < module_nbytes(DreamZeroModel.from_config(cfg, device="meta").model, dtype)
    with pytest.raises(ValueError, match="meta device"):
        fp8_nbytes(real, dtype)


def test_dit_forward_in_fp8_stays_near_full_precision():
    cfg = preset("tiny").dit
    # bf16 weights (a release checkpoint's dtype), as the drift helpers' forward casts its DiT through bf16
    full = DreamZeroModel.from_config(preset("tiny"), dtype=torch.bfloat16, seed=3).model
    fp8 = copy.deepcopy(full)
    assert convert_linears_to_fp8_(fp8) > 0
    inputs = slice_inputs(full, seed=0)
    ref = slice_dit_forward(full, inputs, dtypes=(torch.float32,))[torch.float32]
    out = slice_dit_forward(fp8, inputs, dtypes=(torch.float32,))[torch.float32]
    assert out.action.shape == (1, cfg.num_action_per_block, cfg.action_dim)
    for what in ("action", "video"):
        d = drift(getattr(ref, what), getattr(out, what))
        print(f"tiny DiT forward, fp8 blocks vs fp32, {what}: {d}")
        assert 1e-4 < d.rel_l2 < 0.05, what


def test_a_dit_built_on_meta_and_converted_loads_weights_by_set_weight():
    cfg = preset("tiny").dit
    full = DreamZeroModel.from_config(preset("tiny"), dtype=torch.bfloat16, seed=4).model
    with torch.device("meta"):
        dit = CausalWanDiT(cfg)
    convert_linears_to_fp8_(dit)
    # what a streaming loader does: fp8 layers quantise their weight, every other tensor is assigned as it is
    state = full.state_dict()
    for name, module in dit.named_modules():
        if isinstance(module, Fp8Linear):
            module.set_weight(state[f"{name}.weight"])
    rest = {k: v for k, v in state.items() if not (isinstance(_owner(dit, k), Fp8Linear) and k.endswith(".weight"))}
    dit.load_state_dict(rest, strict=False, assign=True)
    left = [n for n, t in list(dit.named_parameters()) + list(dit.named_buffers()) if t.is_meta]
    assert not left
    reference = copy.deepcopy(full)
    convert_linears_to_fp8_(reference)
    inputs = slice_inputs(full, seed=1)
    a = slice_dit_forward(dit, inputs, dtypes=(torch.float32,))[torch.float32]
    b = slice_dit_forward(reference, inputs, dtypes=(torch.float32,))[torch.float32]
    assert torch.equal(a.action, b.action) and torch.equal(a.video, b.video)


def _owner(module: nn.Module, key: str) -> nn.Module:
    return module.get_submodule(key.rpartition(".")[0])
