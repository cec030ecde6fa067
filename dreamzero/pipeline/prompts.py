"""The prompt cache: prompt -> T5 rows [1, text_len, text_dim], least recently used first out.

New sessions mostly reuse a few prompts (and every guided row the same negative prompt), so T5 runs once per prompt
rather than once per session; `pipeline.prompt_cache_size` bounds it (0: no cache, sessions still keep their rows).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from dreamzero.pipeline.rows import Row


def encode_prompts(
    rows: list[Row],
    cache: OrderedDict[str, torch.Tensor],
    cache_size: int,
    text_encoder,
    branches: tuple[str, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Fill each row's session text cache ("cond": prompt, "uncond": negative prompt) for `branches`: from the
    session's own rows, else from `cache`, else by one `text_encoder.encode` call for the prompts not seen yet."""
    todo: list[tuple[Row, str, str]] = []
    for r in rows:
        for branch, text in (("cond", r.state.prompt), ("uncond", r.state.negative_prompt)):
            if branch not in r.state.text_cache:
                todo.append((r, branch, text))
    todo = [t for t in todo if t[1] in branches]
    if not todo:
        return
    lookup = {}
    for text in dict.fromkeys(text for _, _, text in todo):
        if text in cache:
            cache.move_to_end(text)
            lookup[text] = cache[text]
    unique = sorted({text for _, _, text in todo} - lookup.keys())
    if unique:
        emb = text_encoder.encode(unique).to(device, dtype)  # [U, 512, text_dim]
        for j, text in enumerate(unique):
            lookup[text] = emb[j : j + 1].clone()  # own storage: neither a session nor the cache pins the batch
            if cache_size:
                cache[text] = lookup[text]
        while len(cache) > cache_size:
            cache.popitem(last=False)
    for r, branch, text in todo:
        r.state.text_cache[branch] = lookup[text]  # read-only: sessions share the rows of one prompt
