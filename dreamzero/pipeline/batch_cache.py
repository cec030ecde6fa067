"""The KV caches of one forward's rows: sessions' caches stacked (front-padded when their lengths differ) and split
back after the forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dreamzero.sessions import SessionState


@dataclass
class BatchCache:
    """The self-attention KV caches of one forward's rows: per layer [2, R, L, N, d].

    `lengths` (None: all L tokens valid) gives each row's own tokens, the trailing ones; rows at different frame
    positions are front-padded to the longest and the DiT masks the padding.
    """

    layers: list[torch.Tensor]
    lengths: list[int] | None = None


def stack_caches(states: list[SessionState]) -> BatchCache:
    """One forward's caches, session-major rows; a lone session's cache is used as is.

    Sessions at different frame positions hold caches of different lengths: shorter ones are front-padded with zeros
    (masked by the DiT) and `lengths` says how many trailing tokens are each row's own.
    """
    if len(states) == 1:
        return BatchCache(list(states[0].kv_cache))
    lengths = [s.kv_cache[0].shape[2] for s in states]
    longest = max(lengths)
    layers = []
    for layer in range(len(states[0].kv_cache)):
        parts = [s.kv_cache[layer] for s in states]
        if longest != min(lengths):
            parts = [F.pad(p, (0, 0, 0, 0, longest - p.shape[2], 0)) for p in parts]  # pad dim 2 at the front
        layers.append(torch.cat(parts, dim=1))
    if longest == min(lengths):
        return BatchCache(layers)
    rows = [n for s, n in zip(states, lengths) for _ in range(s.kv_cache[0].shape[1])]
    return BatchCache(layers, rows)


def split_caches(caches: BatchCache, states: list[SessionState], branches: tuple[str, ...]) -> None:
    """Give each session its rows of the batched caches, without padding (cloned when batched: a session must not
    pin the batch)."""
    nb = len(branches)
    for si, state in enumerate(states):
        state.branches = branches
        if len(states) == 1 and caches.lengths is None:
            state.kv_cache = list(caches.layers)
            continue
        keep = caches.layers[0].shape[2] if caches.lengths is None else caches.lengths[si * nb]
        state.kv_cache = [c[:, si * nb : (si + 1) * nb, c.shape[2] - keep :].clone() for c in caches.layers]
