"""The DreamZero causal Wan DiT: video latents + action/state register tokens, per-session KV cache.

One self-contained network file. Parameter names equal upstream's `CausalWanModel` (release checkpoints store them
under `action_head.model.`), so a state dict loads with nothing but a prefix strip.

Token sequence of one forward (B rows; a row is one session x one CFG branch):
    prefill : [video F*S]                       (clean latents, t=0; the new video K/V are the new cache)
    denoise : [video F*S | A action | 1 state]  (noisy latents + registers; the cache is read, never written)
with S = frame_seqlen tokens per latent frame and A = num_action_per_block.

Self-attention is unmasked (as upstream) unless rows at different frame positions share a forward: queries of the new
tokens attend to [cached video K/V | new video K/V | register K/V], and front-padded caches are masked (`_key_mask`).
Cross-attention reads T5 rows padded with zeros to text_len (512): with fp32 attention the identical padding keys are
folded into one key weighted by their count (`CrossContext`), which is exact and skips most of the 512 (see
`embed_context`).
The cache holds K after `norm_k` and after RoPE (absolute positions), and is truncated to the attention window
(max_attention_frames * frame_seqlen video tokens). Attention (unmasked SDPA) runs in the activations' dtype unless
`attention_dtype` says otherwise: fp32 for an fp32 model (the parity vectors were recorded with fp32 attention;
bf16 attention moves outputs by ~4e-3), bf16 for a bf16 model (what upstream's GPU kernels do).

Shapes: B rows, C latent channels, F latent frames, H x W latent grid, S = (H/2)*(W/2), D = dim, N heads, d = D/N.
"""
# Longer than ~400 lines on purpose: one network per file (as in diffusers), its numbered sections read top to bottom.

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dreamzero.config import DiTConfig

_IMAGE_TOKENS = 257  # CLIP ViT-H/14 at 224 px: 1 class token + 16x16 patches


# ----------------------------------------------------------------------------------------------------------------------
# 1. Sinusoids and rotary tables
# ----------------------------------------------------------------------------------------------------------------------


def wan_time_sinusoid(dim: int, t: torch.Tensor) -> torch.Tensor:
    """Wan's timestep sinusoid, (cos, sin), computed in float64 as upstream does. t [...] -> [..., dim] float32."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = t.to(torch.float64).unsqueeze(-1) * freqs
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).float()


def action_time_sinusoid(dim: int, t: torch.Tensor) -> torch.Tensor:
    """GR00T-style action-timestep encoding, (sin, cos) in float32. t [B, A] -> [B, A, dim]."""
    half = dim // 2
    freqs = torch.exp(-torch.arange(half, dtype=torch.float32, device=t.device) * (math.log(10000.0) / half))
    angles = t.float().unsqueeze(-1) * freqs
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Rotation angles of `dim` real channels (dim/2 complex pairs) at integer positions. [P] -> [P, dim/2] float64."""
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    return positions.to(torch.float64).unsqueeze(-1) * inv


def video_rope_angles(
    frames: int, height: int, width: int, start_frame: int, head_dim: int, theta: float, device: torch.device
) -> torch.Tensor:
    """3-D RoPE angles for a [frames, height, width] token grid; the time index is absolute (start_frame + f).

    head_dim/2 complex pairs split (t, h, w) = (c - 2*(c//3), c//3, c//3), each its own 1-D table (44/42/42 real
    channels at head_dim 128). Returns [frames*height*width, head_dim/2] float64 in (f, h, w) row-major order.
    """
    d = head_dim
    dims = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    ar = lambda n, off=0: torch.arange(off, off + n, device=device)  # noqa: E731
    at = rope_angles(ar(frames, start_frame), dims[0], theta)  # [F, ct]
    ah = rope_angles(ar(height), dims[1], theta)  # [H, ch]
    aw = rope_angles(ar(width), dims[2], theta)  # [W, cw]
    grid = torch.cat(
        [
            at[:, None, None, :].expand(frames, height, width, -1),
            ah[None, :, None, :].expand(frames, height, width, -1),
            aw[None, None, :, :].expand(frames, height, width, -1),
        ],
        dim=-1,
    )
    return grid.reshape(frames * height * width, d // 2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (x[2i], x[2i+1]) as complex numbers.

    x [B, L, N, d]; cos/sin fp32 [L, d/2] (one position table for all rows) or [B, L, d/2] (per row).
    """
    xf = x.float().unflatten(-1, (-1, 2))  # [B, L, N, d/2, 2]
    re, im = xf[..., 0], xf[..., 1]
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None], sin[:, :, None])
    out = torch.stack([re * c - im * s, re * s + im * c], dim=-1)
    return out.flatten(-2).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# 2. Norms and small layers
# ----------------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Wan RMSNorm over the last dim, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm that always normalises in fp32 (Wan's WanLayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


class CategorySpecificLinear(nn.Module):
    """`x @ W[cat] + b[cat]`: W [categories, in, out], b [categories, out]. DreamZero always uses category 0."""

    def __init__(self, num_categories: int, in_dim: int, out_dim: int):
        super().__init__()
        self.W = nn.Parameter(torch.randn(num_categories, in_dim, out_dim) * in_dim**-0.5)
        self.b = nn.Parameter(torch.zeros(num_categories, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, in] -> [B, T, out]; upstream forces category 0 (one projector), the embodiment id is ignored
        return x @ self.W[0] + self.b[0]


class CategorySpecificMLP(nn.Module):
    """layer1 -> ReLU -> layer2 (state encoder, action decoder)."""

    def __init__(self, num_categories: int, in_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, in_dim, hidden_dim)
        self.layer2 = CategorySpecificLinear(num_categories, hidden_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x)))


class ActionEncoder(nn.Module):
    """Noisy action + its timestep -> tokens: W3(swish(W2([W1(a) | sinusoid(t)])))."""

    def __init__(self, num_categories: int, action_dim: int, dim: int):
        super().__init__()
        self.dim = dim
        self.W1 = CategorySpecificLinear(num_categories, action_dim, dim)
        self.W2 = CategorySpecificLinear(num_categories, 2 * dim, dim)
        self.W3 = CategorySpecificLinear(num_categories, dim, dim)

    def forward(self, action: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        # action [B, A, action_dim], timestep [B, A] -> [B, A, D]
        a = self.W1(action)
        tau = action_time_sinusoid(self.dim, timestep).to(a.dtype)
        return self.W3(F.silu(self.W2(torch.cat([a, tau], dim=-1))))


class MLPProj(nn.Module):
    """CLIP tokens -> model width: LayerNorm -> Linear -> GELU -> Linear -> LayerNorm (upstream `img_emb`)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Sequential(
            nn.LayerNorm(in_dim),
            nn.Linear(in_dim, in_dim),
            nn.GELU(),
            nn.Linear(in_dim, out_dim),
            nn.LayerNorm(out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype | None,
    key_mask: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA. q [B, Lq, N, d], k/v [B, Lk, N, d] -> [B, Lq, N*d] in q's dtype.

    key_mask [B, Lk] bool (True = attend); key_bias [Lk] float, added to every query's logits (one or the other).
    """
    dtype = dtype or q.dtype
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if key_bias is not None:
        mask = key_bias.to(q.device, dtype)[None, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(dtype), k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype), attn_mask=mask
    )
    return out.transpose(1, 2).flatten(2).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# 3. Self-attention with the KV cache
# ----------------------------------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        video_len: int,
        kv_cache: torch.Tensor | None,
        window: int,
        attention_dtype: torch.dtype | None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, D] (first `video_len` tokens are video). Returns (out [B, L, D], new cache [2, B, Lc', N, d]).

        The new cache is `cat(kv_cache, new video K/V)` truncated to the last `window` tokens; registers never enter it.
        Rows whose caches were front-padded to a common length pass `key_mask` [B, Lc' + registers] (see `_key_mask`).
        """
        b, n, d = x.shape[0], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).unflatten(-1, (n, d))  # [B, L, N, d]
        k = self.norm_k(self.k(x)).unflatten(-1, (n, d))
        v = self.v(x).unflatten(-1, (n, d))
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        new_kv = torch.stack([k[:, :video_len], v[:, :video_len]])  # [2, B, Lv, N, d]
        if kv_cache is not None and kv_cache.shape[2] > 0:
            if kv_cache.shape[1] != b:
                raise ValueError(f"kv_cache has {kv_cache.shape[1]} rows, the batch has {b}")
            new_kv = torch.cat([kv_cache.to(new_kv.dtype), new_kv], dim=2)
        new_kv = new_kv[:, :, -window:]  # window applies to the video part only
        keys = torch.cat([new_kv[0], k[:, video_len:]], dim=1)  # [B, Lc' + Lr, N, d]
        values = torch.cat([new_kv[1], v[:, video_len:]], dim=1)
        return self.o(_attention(q, keys, values, attention_dtype, key_mask)), new_kv


# ----------------------------------------------------------------------------------------------------------------------
# 4. Cross-attention on text (+ image for i2v)
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class CrossContext:
    """The cross-attention context of a forward: [B, (257 image +) Lt text tokens, D] after the embeddings.

    T5 pads every prompt with zero rows to text_len, and zero rows embed to one and the same key and value. So the
    text part keeps every position up to the last real token of any row plus one padding token, and that token's
    attention logit gets + log(text_repeats), the number of padding positions it stands for: softmax and the weighted
    sum are then exactly those over the full 512 (to rounding), at a fraction of the cost.
    """

    emb: torch.Tensor
    text_repeats: int = 1

    def text_bias(self, text_tokens: int) -> torch.Tensor | None:
        """Per text key the logit offset (log of its multiplicity), or None when nothing was folded."""
        if self.text_repeats == 1:
            return None
        bias = torch.zeros(text_tokens, dtype=torch.float32, device=self.emb.device)
        bias[-1] = math.log(self.text_repeats)
        return bias


def as_cross_context(context: CrossContext | torch.Tensor) -> CrossContext:
    return context if isinstance(context, CrossContext) else CrossContext(context)


@dataclass
class ProjectedContext:
    """One layer's cross-attention keys/values of a context ([B, Lc, N, d] each) and the text logit offsets."""

    k: torch.Tensor
    v: torch.Tensor
    k_img: torch.Tensor | None = None
    v_img: torch.Tensor | None = None
    text_bias: torch.Tensor | None = None


class CrossAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float, image_input: bool):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.image_input = image_input
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        if image_input:
            self.k_img = nn.Linear(dim, dim)
            self.v_img = nn.Linear(dim, dim)
            self.norm_k_img = RMSNorm(dim, eps) if qk_norm else nn.Identity()

    def project_context(self, context: CrossContext | torch.Tensor) -> ProjectedContext:
        """context [B, (257 +) Lt, D] (image tokens first for i2v) -> keys and values [B, Lc, N, d].

        The context is constant over a chunk's denoising steps, so the loop projects it once per chunk
        (upstream recomputes it at every step; the numbers are identical).
        """
        n, d = self.num_heads, self.head_dim
        ctx = as_cross_context(context)
        text = ctx.emb[:, _IMAGE_TOKENS:] if self.image_input else ctx.emb
        out = ProjectedContext(
            k=self.norm_k(self.k(text)).unflatten(-1, (n, d)),
            v=self.v(text).unflatten(-1, (n, d)),
            text_bias=ctx.text_bias(text.shape[1]),
        )
        if self.image_input:
            ctx_img = ctx.emb[:, :_IMAGE_TOKENS]
            out.k_img = self.norm_k_img(self.k_img(ctx_img)).unflatten(-1, (n, d))
            out.v_img = self.v_img(ctx_img).unflatten(-1, (n, d))
        return out

    def forward(
        self,
        x: torch.Tensor,
        context: CrossContext | torch.Tensor | None,
        attention_dtype: torch.dtype | None,
        kv: ProjectedContext | None = None,
    ) -> torch.Tensor:
        """x [B, L, D]; context [B, 257 + Lt, D] (image tokens first) for i2v, [B, Lt, D] otherwise, or its `kv`."""
        q = self.norm_q(self.q(x)).unflatten(-1, (self.num_heads, self.head_dim))
        kv = kv if kv is not None else self.project_context(context)
        out = _attention(q, kv.k, kv.v, attention_dtype, key_bias=kv.text_bias)
        if self.image_input:
            out = out + _attention(q, kv.k_img, kv.v_img, attention_dtype)
        return self.o(out)


# ----------------------------------------------------------------------------------------------------------------------
# 5. Transformer block and output head (Wan modulation, per-token timesteps)
# ----------------------------------------------------------------------------------------------------------------------


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        dim, eps = cfg.dim, cfg.eps
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = CausalSelfAttention(dim, cfg.num_heads, cfg.qk_norm, eps)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.cross_attn = CrossAttention(dim, cfg.num_heads, cfg.qk_norm, eps, cfg.has_image_input)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x, e, context, rope, video_len, kv_cache, window, attention_dtype, cross_kv=None, key_mask=None):
        """x [B, L, D]; e [B, L, 6, D] fp32 per-token modulation. Returns (x, new video KV [2, B, Lc', N, d])."""
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float().unsqueeze(0) + e).unbind(2)
        h = (self.norm1(x).float() * (1 + scale1) + shift1).to(x.dtype)
        y, new_kv = self.self_attn(h, rope, video_len, kv_cache, window, attention_dtype, key_mask)
        x = (x.float() + y.float() * gate1).to(x.dtype)
        x = x + self.cross_attn(self.norm3(x), context, attention_dtype, cross_kv)
        h = (self.norm2(x).float() * (1 + scale2) + shift2).to(x.dtype)
        x = (x.float() + self.ffn(h).float() * gate2).to(x.dtype)
        return x, new_kv


class Head(nn.Module):
    def __init__(self, dim: int, out_dim: int, patch_size: tuple[int, int, int], eps: float):
        super().__init__()
        self.norm = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.head = nn.Linear(dim, out_dim * math.prod(patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        # x [B, Lv, D], e [B, Lv, D] (time embedding before the projection) -> [B, Lv, out_dim * prod(patch)]
        shift, scale = (self.modulation.float().unsqueeze(0) + e.float().unsqueeze(2)).unbind(2)
        return self.head((self.norm(x).float() * (1 + scale) + shift).to(x.dtype))


# ----------------------------------------------------------------------------------------------------------------------
# 6. The model
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class DiTOutput:
    video: torch.Tensor  # [B, out_dim, F, H, W] predicted flow (prefill: discarded by the loop)
    action: torch.Tensor | None  # [B, A, action_dim] (denoise only)
    kv_cache: list[torch.Tensor] | None  # per layer [2, B, Lc', N, d] (prefill without a kv_sink): the caches to keep
    kv_lengths: list[int] | None = None  # per row the valid (trailing) tokens of kv_cache; None: all Lc' valid


class CausalWanDiT(nn.Module):
    """Causal Wan DiT with action/state registers. See the module docstring for the token layout."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        if cfg.dim % cfg.num_heads:
            raise ValueError(f"dit.dim ({cfg.dim}) must be divisible by dit.num_heads ({cfg.num_heads})")
        self.cfg = cfg
        # None: attend in the activations' dtype (fp32 model -> fp32, as the parity vectors; bf16 model -> bf16, as
        # upstream's GPU kernels); set torch.float32 to force fp32 attention in a bf16 model (slower, closer to fp32)
        self.attention_dtype: torch.dtype | None = None
        # fold T5's zero padding into one weighted key (embed_context; fp32 attention only). False: attend to all 512
        self.fold_text_padding = True
        dim, pt = cfg.dim, tuple(cfg.patch_size)
        cats = 1  # upstream builds one projector category whatever max_num_embodiments says

        # 6.1 embeddings
        self.patch_embedding = nn.Conv3d(cfg.in_dim, dim, kernel_size=pt, stride=pt)
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        # 6.2 blocks and head
        self.blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.num_layers)])
        self.head = Head(dim, cfg.out_dim, pt, cfg.eps)
        if cfg.has_image_input:
            self.img_emb = MLPProj(cfg.image_dim, dim)
        # 6.3 DreamZero registers
        self.state_encoder = CategorySpecificMLP(cats, cfg.max_state_dim, cfg.hidden_size, dim)
        self.action_encoder = ActionEncoder(cats, cfg.action_dim, dim)
        self.action_decoder = CategorySpecificMLP(cats, dim, cfg.hidden_size, cfg.action_dim)

    # -- helpers -----------------------------------------------------------------------------------------------------

    @property
    def kv_window(self) -> int:
        """Video tokens the KV cache may hold."""
        return self.cfg.max_attention_frames * self.cfg.frame_seqlen

    def compile_blocks(self) -> None:
        """torch.compile each block in place (idempotent). Every block runs the same code, and torch inlines the
        modules' parameters as graph inputs, so one set of graphs serves all layers. `dynamic=True` makes the batch
        rows, the cached tokens (growing chunk by chunk up to the window) and the token count symbolic from the first
        call: the KV cache growing and rows at their own frame positions then reuse graphs instead of recompiling
        per length; what still makes a new graph is a change of structure (no cache / cache, key mask or not, one or
        per-row RoPE tables, registers or not), a handful in all."""
        for block in self.blocks:
            if getattr(block, "_compiled_call_impl", None) is None:
                block.compile(dynamic=True)

    def cross_kv(self, context_emb: CrossContext | torch.Tensor) -> list[ProjectedContext]:
        """Per layer the cross-attention K/V of a context [B, Lc, D]: computed once, reused by every denoise step."""
        return [block.cross_attn.project_context(context_emb) for block in self.blocks]

    def embed_context(self, context: torch.Tensor, clip_feature: torch.Tensor | None = None) -> CrossContext:
        """T5 [B, Lt, text_dim] (+ CLIP [B, 257, image_dim] for i2v) -> cross-attention context [B, (257+)Lt', D].

        With fp32 attention the trailing zero (padding) rows all rows share are folded into one (`CrossContext`);
        Lt' is the longest prompt of the batch plus one. Constant over a chunk's denoising steps: the loop calls this
        once per chunk.
        """
        dtype = self.patch_embedding.weight.dtype
        repeats = 1
        # fp32 attention only: a bf16 logit offset would round log(count) by up to ~0.016 (1.6% of the padding's
        # weight), more than upstream's bf16 kernels err; at bf16 model scale the padded keys cost little anyway
        if self.fold_text_padding and (self.attention_dtype or dtype) == torch.float32:
            real = context.ne(0).any(dim=-1).any(dim=0).nonzero()  # positions where some row has a real token
            last = int(real[-1]) + 1 if len(real) else 0  # rows [last, Lt) are zero in every row of the batch
            repeats = context.shape[1] - last
            if repeats > 1:
                context = context[:, : last + 1]
        ctx = self.text_embedding(context.to(dtype))
        if self.cfg.has_image_input:
            if clip_feature is None:
                raise ValueError("the i2v DiT needs clip_feature [B, 257, image_dim]")
            ctx = torch.cat([self.img_emb(clip_feature.to(dtype)), ctx], dim=1)
        return CrossContext(ctx, max(repeats, 1))

    def _time_modulation(self, t_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # t_tokens [B, L] -> e [B, L, D] (head), e6 [B, L, 6, D] (blocks), both fp32
        b, n = t_tokens.shape
        e = self.time_embedding(wan_time_sinusoid(self.cfg.freq_dim, t_tokens.flatten()).to(self.dtype))
        e6 = self.time_projection(e).float().unflatten(-1, (6, self.cfg.dim))
        return e.float().view(b, n, -1), e6.view(b, n, 6, -1)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    def _rope_table(self, f: int, h: int, w: int, start_frame: int, with_registers: bool, device):
        d, theta = self.cfg.head_dim, self.cfg.rope_theta
        angles = [video_rope_angles(f, h, w, start_frame, d, theta, device)]
        if with_registers:
            # registers: 1-D RoPE over the full head_dim; idx = chunk index of this block in the session
            idx = (start_frame - 1) // self.cfg.num_frame_per_block
            na, ns = self.cfg.num_action_per_block, self.cfg.num_state_per_block
            angles.append(rope_angles(torch.arange(idx * na, idx * na + na, device=device), d, theta))
            angles.append(rope_angles(torch.arange(idx * ns, idx * ns + ns, device=device), d, theta))
        a = torch.cat(angles)  # [L, d/2] float64
        return torch.cos(a).float(), torch.sin(a).float()

    def _rope(self, f: int, h: int, w: int, start_frames: list[int], with_registers: bool, device):
        """cos/sin [L, d/2] when every row sits at one frame position, else [B, L, d/2] (one table per row)."""
        tables = {sf: self._rope_table(f, h, w, sf, with_registers, device) for sf in dict.fromkeys(start_frames)}
        if len(tables) == 1:
            return next(iter(tables.values()))
        return tuple(torch.stack([tables[sf][k] for sf in start_frames]) for k in (0, 1))

    def _key_mask(
        self, kv_lengths: list[int] | None, cache_len: int, video_len: int, registers: int, device
    ) -> tuple[torch.Tensor | None, list[int] | None]:
        """Self-attention key mask for rows whose caches were front-padded to `cache_len`, and their new lengths.

        After `cat(cache, new)` and the window cut a row keeps W' = min(cache_len + video_len, window) tokens, of which
        its own are the last min(len + video_len, window); the padding in front of them is masked. None when no row
        is padded (the unmasked kernel, as upstream).
        """
        if kv_lengths is None:
            return None, None
        kept = min(cache_len + video_len, self.kv_window)
        valid = [min(n + video_len, self.kv_window) for n in kv_lengths]
        if all(v == kept for v in valid):
            return None, valid
        first = kept - torch.tensor(valid, device=device)  # first valid cache slot per row
        cache_mask = torch.arange(kept, device=device)[None, :] >= first[:, None]
        return torch.cat([cache_mask, cache_mask.new_ones(len(valid), registers)], dim=1), valid

    # -- forward -----------------------------------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        *,
        kv_cache: Sequence[torch.Tensor] | None,
        current_start_frame: int | Sequence[int],
        kv_lengths: Sequence[int] | None = None,
        context: torch.Tensor | None = None,
        clip_feature: torch.Tensor | None = None,
        context_emb: CrossContext | torch.Tensor | None = None,
        y: torch.Tensor | None = None,
        action: torch.Tensor | None = None,
        timestep_action: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        cross_kv: list[ProjectedContext] | None = None,
        kv_sink: Callable[[int, torch.Tensor, list[int] | None], None] | None = None,
    ) -> DiTOutput:
        """One prefill (action None) or denoise (action/timestep_action/state given) pass.

        x [B, C, F, H, W] latents; timestep [B, F] int per frame; context [B, 512, text_dim] T5 rows (or the
        precomputed `context_emb`); y [B, C_y, F, H, W] first-frame conditioning (i2v); action [B, A, action_dim];
        timestep_action [B, A]; state [B, 1, max_state_dim]; kv_cache per layer [2, B, Lc, N, d] (None = empty), any
        sequence: a lazy one (the pipeline's `SessionCaches`) makes each layer's only when its block runs;
        cross_kv: per layer the projected context from `cross_kv(context_emb)` (reused across denoising steps).
        kv_sink (prefill): called with (layer, its new cache, the new `kv_lengths`) as each layer finishes, instead of
        returning all layers' in the output (`kv_cache` None then): the caller keeps it and lets the old one go.

        Rows at different frame positions share one pass: `current_start_frame` per row, and `kv_lengths` the valid
        (trailing) tokens of each row's cache when the caches were front-padded to a common length; the output then
        carries the new per-row lengths.
        """
        cfg, dtype = self.cfg, self.dtype
        denoise = action is not None
        if denoise and (timestep_action is None or state is None):
            raise ValueError("a denoise pass needs action, timestep_action and state together")
        if context_emb is None and cross_kv is None:
            if context is None:
                raise ValueError("pass context (T5 rows) or context_emb")
            context_emb = self.embed_context(context, clip_feature)

        # 1. video tokens: [B, C(+Cy), F, H, W] -> conv patches [B, D, F, h, w] -> [B, F*h*w, D]
        if cfg.has_image_input and cfg.concat_first_frame_latent:
            if y is None:
                raise ValueError("the i2v DiT needs y [B, 4 + z, F, H, W] (first-frame conditioning)")
            x = torch.cat([x, y.to(x.dtype)], dim=1)
        if x.shape[1] != cfg.in_dim:
            raise ValueError(f"DiT input has {x.shape[1]} channels, dit.in_dim is {cfg.in_dim}")
        tokens = self.patch_embedding(x.to(dtype))
        b, _, f, gh, gw = tokens.shape
        # [B, Lv, D], contiguous: every block then sees one memory layout (a compiled block would recompile per layout)
        tokens = tokens.flatten(2).transpose(1, 2).contiguous()
        video_len = tokens.shape[1]

        # 2. per-token timesteps: video tokens carry their frame's t; registers carry the action t
        t_tokens = timestep.to(tokens.device).long().repeat_interleave(gh * gw, dim=1)  # [B, Lv]
        if denoise:
            ta = timestep_action.to(tokens.device).long()  # [B, A]
            action_tokens = self.action_encoder(action.to(dtype), ta)  # [B, A, D]
            state_tokens = self.state_encoder(state.to(dtype))  # [B, 1, D]
            tokens = torch.cat([tokens, action_tokens, state_tokens], dim=1)
            state_t = ta[:, :: cfg.num_action_per_block][:, : state_tokens.shape[1]]
            t_tokens = torch.cat([t_tokens, ta, state_t], dim=1)  # [B, L]
        e, e6 = self._time_modulation(t_tokens)

        # 3. blocks; rope tables and the key mask shared by all layers
        if isinstance(current_start_frame, Sequence):
            starts = [int(sf) for sf in current_start_frame]
        else:
            starts = [int(current_start_frame)] * b
        if len(starts) != b or (kv_lengths is not None and len(kv_lengths) != b):
            raise ValueError(f"{b} rows, {len(starts)} start frames, kv_lengths {kv_lengths}: pass one per row")
        rope = self._rope(f, gh, gw, starts, denoise, tokens.device)
        lengths = None if kv_lengths is None else list(kv_lengths)
        caches = kv_cache if kv_cache is not None else [None] * len(self.blocks)
        crosses = cross_kv if cross_kv is not None else [None] * len(self.blocks)
        new_caches = [] if not denoise and kv_sink is None else None
        key_mask = new_lengths = None
        h = tokens
        # one layer's cache at a time: a lazy `kv_cache` makes layer i only when its block runs, the sink takes the new
        # one at once, and neither is kept past its block (a denoise pass's `cat(cache, new)` is never kept)
        for i, block in enumerate(self.blocks):
            cache, cross = caches[i], crosses[i]  # by index, not zip: zip's reused tuple would keep the last layer's
            if i == 0:  # every layer's cache has the same length: the key mask is shared by all layers
                cache_len = cache.shape[2] if cache is not None else 0
                key_mask, new_lengths = self._key_mask(
                    lengths, cache_len, video_len, tokens.shape[1] - video_len, tokens.device
                )
            h, new_kv = block(
                h, e6, context_emb, rope, video_len, cache, self.kv_window, self.attention_dtype, cross, key_mask
            )
            if new_caches is not None:
                new_caches.append(new_kv)
            elif not denoise:
                kv_sink(i, new_kv, new_lengths)
            cache = new_kv = None  # free this layer's copies before the next layer's are made

        # 4. outputs: head + unpatchify on video tokens, decoder on action tokens
        out = self.head(h[:, :video_len], e[:, :video_len])  # [B, Lv, out*p0*p1*p2]
        p0, p1, p2 = cfg.patch_size
        out = out.view(b, f, gh, gw, p0, p1, p2, cfg.out_dim)
        video = out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, cfg.out_dim, f * p0, gh * p1, gw * p2)
        act = None
        if denoise:
            act = self.action_decoder(h[:, video_len : video_len + cfg.num_action_per_block])
        if denoise:
            return DiTOutput(video=video, action=act, kv_cache=None)
        return DiTOutput(video=video, action=act, kv_cache=new_caches, kv_lengths=new_lengths)
