"""UMT5 text encoder: `transformers.UMT5EncoderModel` holding Wan's T5 weights after a 1:1 key remap.

Wan names (release checkpoint, under `action_head.text_encoder.`) <-> transformers names:

| Wan | transformers |
|---|---|
| `token_embedding.weight` | `shared.weight` (tied to `encoder.embed_tokens.weight`) |
| `blocks.N.attn.{q,k,v,o}.weight` | `encoder.block.N.layer.0.SelfAttention.{q,k,v,o}.weight` |
| `blocks.N.pos_embedding.embedding.weight` | `encoder.block.N.layer.0.SelfAttention.relative_attention_bias.weight` |
| `blocks.N.norm1.weight` | `encoder.block.N.layer.0.layer_norm.weight` |
| `blocks.N.ffn.gate.0.weight` / `ffn.fc1` / `ffn.fc2` | `encoder.block.N.layer.1.DenseReluDense.wi_0` / `wi_1` / `wo` |
| `blocks.N.norm2.weight` | `encoder.block.N.layer.1.layer_norm.weight` |
| `norm.weight` | `encoder.final_layer_norm.weight` |

`encode(prompts)` pads to `text_len` (512) tokens and zeroes every row past a prompt's real length, as Wan does:
the DiT's cross-attention gets no mask. Placed off the GPU (dreamzero.placement), it runs unpadded on the CPU
(`trim_padding`) or block by block from host memory (`offload_to`), with the same rows up to rounding.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dreamzero.config import TextEncoderConfig
from dreamzero.model.release import ReleaseTensor
from dreamzero.model.tokenizer import clean_prompt

# (Wan regex, transformers template); N is the block index
_BLOCK_MAP = (
    (r"attn\.(q|k|v|o)\.weight", "layer.0.SelfAttention.{0}.weight"),
    (r"pos_embedding\.embedding\.weight", "layer.0.SelfAttention.relative_attention_bias.weight"),
    (r"norm1\.weight", "layer.0.layer_norm.weight"),
    (r"ffn\.gate\.0\.weight", "layer.1.DenseReluDense.wi_0.weight"),
    (r"ffn\.fc1\.weight", "layer.1.DenseReluDense.wi_1.weight"),
    (r"ffn\.fc2\.weight", "layer.1.DenseReluDense.wo.weight"),
    (r"norm2\.weight", "layer.1.layer_norm.weight"),
)
_TOP_MAP = {"token_embedding.weight": "shared.weight", "norm.weight": "encoder.final_layer_norm.weight"}


def wan_to_hf(name: str) -> str:
    """Wan T5 parameter name -> transformers UMT5EncoderModel name."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m:
        for pattern, template in _BLOCK_MAP:
            sub = re.fullmatch(pattern, m.group(2))
            if sub:
                return f"encoder.block.{m.group(1)}." + template.format(*sub.groups())
    raise KeyError(f"not a Wan T5 encoder parameter: {name!r}")


def hf_to_wan(name: str) -> str:
    """transformers UMT5EncoderModel name -> Wan T5 parameter name."""
    for wan, hf in _TOP_MAP.items():
        if name == hf:
            return wan
    if name == "encoder.embed_tokens.weight":  # tied to shared.weight
        return "token_embedding.weight"
    m = re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", name)
    if m:
        for wan_pattern, template in _BLOCK_MAP:
            hf_pattern = re.escape(template).replace(r"\{0\}", "(q|k|v|o)")
            sub = re.fullmatch(hf_pattern, m.group(2))
            if sub:
                wan = wan_pattern.replace(r"\.", ".").replace("(q|k|v|o)", "{0}").format(*sub.groups())
                return f"blocks.{m.group(1)}.{wan}"
    raise KeyError(f"not a UMT5 encoder parameter: {name!r}")


def umt5_config(cfg: TextEncoderConfig):
    """transformers.UMT5Config for our TextEncoderConfig (gated tanh-GELU FFN, per-layer relative bias)."""
    from transformers import UMT5Config

    return UMT5Config(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        d_kv=cfg.d_kv,
        d_ff=cfg.d_ff,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        relative_attention_num_buckets=cfg.relative_attention_num_buckets,
        relative_attention_max_distance=cfg.relative_attention_max_distance,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
    )


class T5TextEncoder(nn.Module):
    """Prompts -> T5 rows [B, text_len, d_model] with the padding rows zeroed."""

    def __init__(self, cfg: TextEncoderConfig, text_len: int = 512):
        super().__init__()
        from transformers import UMT5EncoderModel

        self.cfg = cfg
        self.text_len = text_len
        self.t5 = UMT5EncoderModel(umt5_config(cfg))
        self.tokenizer = None  # attached by the checkpoint loader / embedded default (plain attribute, no weights)
        # placement (dreamzero.placement): run unpadded (a CPU-placed encoder), or compute on another device than the
        # weights' one, block by block (`offload_to`)
        self.trim_padding = False
        self.offload_device: torch.device | None = None
        self.offload_stats: dict[str, int] = {}

    def release_tensors(self) -> list[ReleaseTensor]:
        """This module's tensors under their Wan names (relative to `action_head.text_encoder.`)."""
        out = []
        for name, p in self.t5.named_parameters():  # tied embed_tokens is reported once, as shared.weight
            out.append(ReleaseTensor(hf_to_wan(name), ("t5." + name,), tuple(p.shape)))
        return out

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, mask [B, text_len] (padded with 0, truncated to text_len, `</s>` appended by the tokenizer)."""
        if self.tokenizer is None:
            raise RuntimeError("the text encoder has no tokenizer; load the model with dreamzero.checkpoint")
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of strings")
        enc = self.tokenizer(
            [clean_prompt(p) for p in prompts],
            padding="max_length",
            truncation=True,
            max_length=self.text_len,
            add_special_tokens=True,
            return_tensors="pt",
        )
        return enc["input_ids"], enc["attention_mask"]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        """list[str] -> [B, text_len, d_model]; rows past each prompt's token count are exactly zero."""
        ids, mask = self.tokenize(prompts)
        if self.trim_padding:
            # padding keys are masked out and the relative bias depends only on distances, so the real tokens' rows
            # are those of the padded run (up to the matmul's rounding) at a fraction of the flops (25x for a
            # ~20-token prompt); what matters on a CPU
            keep = max(int(mask.sum(dim=1).max()), 1)
            ids, mask = ids[:, :keep], mask[:, :keep]
        if self.offload_device is not None:
            hidden = self._encode_offloaded(ids, mask)
        else:
            device = self.t5.shared.weight.device
            ids, mask = ids.to(device), mask.to(device)
            hidden = self.t5(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, d_model]
        hidden = hidden * mask.to(hidden.device).unsqueeze(-1).to(hidden.dtype)
        if hidden.shape[1] < self.text_len:
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, self.text_len - hidden.shape[1]))
        return hidden

    # -- off the GPU -------------------------------------------------------------------------------------------------

    def offload_to(self, device: str | torch.device | None) -> None:
        """Keep the weights where they are (host memory) and run each encode on `device`, moving one block's weights
        in just before it runs and dropping them right after: the device holds one or two blocks' weights during an
        encode (the caching allocator reuses a dropped block's memory once the stream has run it) and none between.
        The token embedding (a lookup) stays on the host. On CUDA the host weights are pinned so the copies are
        asynchronous. None: run where the weights are."""
        if device is None:
            self.offload_device = None
            return
        device = torch.device(device)
        if device.type == "cuda":
            for p in self._offloaded_params():
                if not p.is_pinned():
                    p.data = p.data.pin_memory()
        self.offload_device = device
        self.offload_stats = {"bytes_moved": 0, "max_blocks_resident": 0}

    def _offloaded_modules(self) -> list[nn.Module]:
        return [*self.t5.encoder.block, self.t5.encoder.final_layer_norm]

    def _offloaded_params(self) -> list[nn.Parameter]:
        return [p for m in self._offloaded_modules() for p in m.parameters()]

    def _encode_offloaded(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # calls the stack eagerly (a compiled `t5`, pipeline.compile "all", is bypassed): the copies dominate anyway
        device = self.offload_device
        emb = self.t5.shared(ids.to(self.t5.shared.weight.device))  # host lookup: [B, L, d_model]
        emb, mask = emb.to(device, non_blocking=True), mask.to(device)
        resident: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        stats = {"bytes_moved": emb.numel() * emb.element_size(), "max_blocks_resident": 0}

        def move_in(module, _args):
            saved = []
            for p in module.parameters():
                saved.append((p, p.data))
                p.data = p.data.to(device, non_blocking=True, copy=True)  # a copy even on one device: testable
                stats["bytes_moved"] += p.numel() * p.element_size()
            resident[id(module)] = saved
            stats["max_blocks_resident"] = max(stats["max_blocks_resident"], len(resident))

        def move_out(module, _args, _output):
            for p, host in resident.pop(id(module)):
                p.data = host  # the device copy is freed here (stream-ordered: safe to reuse after this block)

        hooks = []
        try:
            for module in self._offloaded_modules():
                hooks.append(module.register_forward_pre_hook(move_in))
                hooks.append(module.register_forward_hook(move_out))
            hidden = self.t5.encoder(inputs_embeds=emb, attention_mask=mask).last_hidden_state
        finally:
            for h in hooks:
                h.remove()
            for saved in resident.values():  # an encode that failed midway leaves no weights on the device
                for p, host in saved:
                    p.data = host
        self.offload_stats = stats
        return hidden
