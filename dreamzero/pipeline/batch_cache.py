"""The KV caches of one forward's rows, one layer at a time: the sessions' caches stacked (front-padded when their
lengths differ) when the DiT reaches a layer, and a prefill's new cache handed back to the sessions as soon as its
layer is done.

So a call never holds all layers stacked, nor all layers' new caches beside the old ones: at any moment the copies
are about one layer's worth per row (`batch_kv_transient`), instead of the rows' whole caches three times over
(stacked, the prefill's new ones, the per-session clones).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dreamzero.sessions import SessionState


@dataclass
class BatchCache:
    """Per layer [2, R, L, N, d] tensors held whole (a bare DiT's caches, as the parity test drives them).

    `lengths` (None: all L tokens valid) gives each row's own tokens, the trailing ones; rows at different frame
    positions are front-padded to the longest and the DiT masks the padding.
    """

    layers: list[torch.Tensor]
    lengths: list[int] | None = None


class SessionCaches(Sequence[torch.Tensor]):
    """The caches of sessions as one forward's rows (session-major, `branches` rows per session), layer by layer.

    Reading layer i (`self[i]`, iteration) stacks that layer of every session, front-padded to the longest
    (`lengths` then gives each row's own trailing tokens); a lone session's layer is used as is, without a copy.
    `store(i, new, lengths)` (the DiT's `kv_sink`) gives each session its rows of the new layer-i cache at once,
    without padding: cloned when batched (a session must not pin the batch), the tensor itself for a lone session.
    The DiT reads layer i before it stores it, so a prefill reads the old caches and leaves the new ones.
    """

    def __init__(self, states: list[SessionState], branches: tuple[str, ...]):
        self.states = states
        self.branches = branches
        lengths = [s.kv_cache[0].shape[2] if s.kv_cache else 0 for s in states]
        self._longest = max(lengths, default=0)
        self._padded = self._longest != min(lengths, default=0)
        nb = len(branches)
        self.lengths = [n for n in lengths for _ in range(nb)] if self._padded else None
        for s in states:
            s.branches = branches

    def __len__(self) -> int:
        return len(self.states[0].kv_cache)

    def __getitem__(self, layer):  # Sequence's contract: an int gives a layer
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(len(self)))]
        if len(self.states) == 1:
            return self.states[0].kv_cache[layer]
        parts = [s.kv_cache[layer] for s in self.states]
        if self._padded:
            parts = [F.pad(p, (0, 0, 0, 0, self._longest - p.shape[2], 0)) for p in parts]  # pad dim 2 at the front
        return torch.cat(parts, dim=1)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    @property
    def layers(self) -> SessionCaches:
        """What the DiT reads (`BatchCache.layers`' place): this sequence itself, so layers stack one at a time."""
        return self

    def store(self, layer: int, new: torch.Tensor, lengths: list[int] | None) -> None:
        """Layer `layer`'s new cache [2, R, L', N, d] of all rows -> each session's, replacing its old one."""
        nb = len(self.branches)
        lone = len(self.states) == 1 and lengths is None
        for si, state in enumerate(self.states):
            if lone:
                part = new
            else:
                keep = new.shape[2] if lengths is None else lengths[si * nb]
                part = new[:, si * nb : (si + 1) * nb, new.shape[2] - keep :].clone()
            if layer < len(state.kv_cache):
                state.kv_cache[layer] = part
            elif layer == len(state.kv_cache):  # a (re)started session's caches are made layer by layer
                state.kv_cache.append(part)
            else:
                raise IndexError(f"layer {layer} stored before layer {len(state.kv_cache)}")


def stack_caches(states: list[SessionState], branches: tuple[str, ...] | None = None) -> SessionCaches:
    """One forward's caches, read (and, in a prefill, written back) one layer at a time (`SessionCaches`); the
    branches default to the ones the sessions' caches hold."""
    return SessionCaches(states, branches if branches is not None else states[0].branches)


def split_caches(caches: BatchCache, states: list[SessionState], branches: tuple[str, ...]) -> None:
    """Give each session its rows of caches held whole (cloned when batched: a session must not pin the batch)."""
    into = SessionCaches(states, branches)
    for layer, cache in enumerate(caches.layers):
        into.store(layer, cache, caches.lengths)


def batch_kv_transient(rows: int, kv_per_session: int, num_layers: int) -> int:
    """Most extra bytes a model call of `rows` sessions' caches holds at once, beyond the sessions' own caches.

    `kv_per_session` is the most KV bytes one of the sessions holds (a full-window session's for planning), so one
    layer of one session is `kv_per_session / num_layers`. Caches move one layer at a time, so what counts is per
    row, within one layer: the attention's `cat(cache, new tokens)` and its keys and values with the registers
    (each up to ~1.3 layers at a full window, which caches all but the block being denoised), and, with more than
    one row, that layer's rows stacked (a lone session's cache is read as is) and one session's rows split off a
    prefill's new layer. That is under 3 layers per row for one row and 4 for more; the DiT's other activations are
    not counted here (`budget.activation_estimate`, which also counts one layer's keys and values).
    """
    if rows <= 0:
        return 0
    per_layer = -(-kv_per_session // max(num_layers, 1))
    return (3 if rows == 1 else 4) * rows * per_layer
