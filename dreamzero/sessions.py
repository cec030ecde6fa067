"""Per-session model state and the bounded store that holds it on one replica.

A session is one robot / one environment slot. Everything the next chunk needs lives in its `SessionState`
(KV caches per CFG branch, text embeddings, CLIP feature, first-frame conditioning, frame position, step count), so a
server can hold many, evict idle ones and account for their memory. The store never refuses a session: when full it
evicts the least recently used idle one and remembers the id, so that session's next call reports `evicted`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from dreamzero.errors import ConfigError
from dreamzero.types import RESTART_REASONS

BRANCHES = ("cond", "uncond")  # classifier-free guidance branches, each with its own KV cache


@dataclass
class PreviousChunk:
    """The last action chunk a session returned, kept for real-time chunking (docs/rtc.md).

    `actions` [H, max_action_dim] float64 is in robot units (before the gripper rule) when the call carried an action
    codec, else in normalised model units; NaN marks dims with no robot meaning (padding, constant dims).
    """

    actions: np.ndarray
    units: str  # "robot" | "normalised": a chunk is only reused in the units it was stored in


@dataclass
class SessionState:
    """Everything one session carries between chunks (tensors stay on the model's device)."""

    session_id: str
    prompt: str
    negative_prompt: str
    # per layer [2(k, v), len(branches), L, heads, head_dim]: one row per CFG branch, so a lone session's forward
    # (cond + uncond rows) uses it as is, without a copy; only prefill passes grow it, capped at the window
    kv_cache: list[torch.Tensor] = field(default_factory=list)
    branches: tuple[str, ...] = BRANCHES  # the CFG branches the cache rows hold, in row order
    # T5 rows of the prompt ("cond") and negative prompt ("uncond"): [1, text_len, text_dim]
    text_cache: dict[str, torch.Tensor] = field(default_factory=dict)
    clip_feature: torch.Tensor | None = None  # [1, 257, image_dim] (i2v only)
    # [1, 4 + z, F, h, w] first-frame conditioning (i2v only), F growing chunk by chunk to the window's frames
    y: torch.Tensor | None = None
    # the VAE encoder's causal state after the zero frames behind `y` (None once `y` spans the window)
    vae_state: list[torch.Tensor | None] | None = None
    first_frame: torch.Tensor | None = None  # [3, H, W] in [-1, 1], model resolution: prepended to each new block
    current_start_frame: int = 0  # latent frames of the session already placed (0 = fresh)
    step: int = 0  # chunks produced since the last restart
    latent_hw: tuple[int, int] = (0, 0)  # latent grid of this session's video
    reset_pending: bool = False  # an explicit reset_sessions() call: the next call restarts ("reset_requested")
    last_used: float = 0.0  # store clock at the last access
    # the last chunk returned (host memory, a few KB); survives restarts that keep the robot's motion going
    prev_chunk: PreviousChunk | None = None
    # random id of this state, new at every (re)start: clients echo it so that stale state left on a replica
    # (after a scale-down or a routing change) is recognised even when its step count happens to match
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def kv_len(self) -> int:
        """Cached video tokens (equal in every branch and layer)."""
        return int(self.kv_cache[0].shape[2]) if self.kv_cache else 0

    def nbytes(self) -> int:
        """Bytes held by this session's tensors."""
        tensors = list(self.kv_cache)
        tensors += list(self.text_cache.values())
        tensors += [t for t in (self.clip_feature, self.y, self.first_frame) if t is not None]
        tensors += [t for t in self.vae_state or () if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class SessionStore:
    """LRU/TTL-bounded map session_id -> SessionState, with eviction memory and restart statistics.

    `max_sessions` bounds live sessions (the least recently used is evicted to make room); `max_bytes` (None = no
    limit) bounds the bytes their tensors hold (a DROID 14B session at a full window holds ~10 GB of KV cache);
    `ttl_s` (None = never) drops sessions idle for longer. Evicted ids are remembered (at most `remember_evicted`,
    oldest forgotten first) so `lookup` can tell "evicted" from "new_session". A lock makes every method atomic,
    enough for one asyncio replica that also runs the model in a worker thread.
    """

    def __init__(
        self,
        max_sessions: int = 64,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        remember_evicted: int | None = None,
        max_bytes: int | None = None,
    ):
        if max_sessions < 1:
            raise ConfigError(f"max_sessions must be >= 1, got {max_sessions}")
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"session_ttl_s must be > 0 or None, got {ttl_s}")
        if max_bytes is not None and max_bytes <= 0:
            raise ConfigError(f"session max_bytes must be > 0 or None, got {max_bytes}")
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()  # least recently used first
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_evicted or max(1024, 16 * max_sessions)
        self._lock = threading.RLock()
        self.evictions = 0
        self.restarts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    # -- lookup / insert -----------------------------------------------------------------------------------------------

    def lookup(self, session_id: str) -> tuple[SessionState | None, str | None]:
        """(state, None) for a live session (marked used), else (None, "evicted" | "new_session")."""
        with self._lock:
            self._expire()
            state = self._sessions.get(session_id)
            if state is not None:
                self._sessions.move_to_end(session_id)
                state.last_used = self._clock()
                return state, None
            return None, ("evicted" if session_id in self._evicted else "new_session")

    def put(self, state: SessionState, protect: Iterable[str] = ()) -> None:
        """Insert or replace a session; evicts least recently used sessions not in `protect` (e.g. the current batch)
        to stay within max_sessions (if every other session is protected, the oldest goes anyway)."""
        with self._lock:
            self._expire()
            state.last_used = self._clock()
            self._sessions[state.session_id] = state
            self._sessions.move_to_end(state.session_id)
            self._evicted.pop(state.session_id, None)
            keep = set(protect) | {state.session_id}
            while len(self._sessions) > self.max_sessions:
                victim = next((sid for sid in self._sessions if sid not in keep), None)
                if victim is None:
                    victim = next(sid for sid in self._sessions if sid != state.session_id)
                self._evict(victim)
            if self.max_bytes is not None:
                # only idle sessions go for bytes: the batch in flight needs its state, whatever its size
                total = sum(s.nbytes() for s in self._sessions.values())
                for sid in [sid for sid in self._sessions if sid not in keep]:
                    if total <= self.max_bytes:
                        break
                    total -= self._sessions[sid].nbytes()
                    self._evict(sid)

    def drop(self, session_ids: Iterable[str]) -> int:
        """Forget sessions on request (not an eviction: their next call is a plain new session). Returns the count."""
        with self._lock:
            n = 0
            for sid in session_ids:
                n += self._sessions.pop(sid, None) is not None
                self._evicted.pop(sid, None)
            return n

    def record_restart(self, reason: str) -> None:
        if reason not in RESTART_REASONS:
            raise ValueError(f"unknown restart reason {reason!r}; known: {RESTART_REASONS}")
        with self._lock:
            self.restarts[reason] += 1

    # -- accounting ----------------------------------------------------------------------------------------------------

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for s in self._sessions.values())

    def stats(self) -> dict:
        with self._lock:
            self._expire()
            return {
                "live": len(self._sessions),
                "max_sessions": self.max_sessions,
                "max_bytes": self.max_bytes,
                "bytes": sum(s.nbytes() for s in self._sessions.values()),
                "evictions": self.evictions,
                "restarts": {r: self.restarts.get(r, 0) for r in RESTART_REASONS},
            }

    # -- eviction ------------------------------------------------------------------------------------------------------

    def _evict(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._evicted[session_id] = None
        self._evicted.move_to_end(session_id)
        while len(self._evicted) > self._remember:
            self._evicted.popitem(last=False)
        self.evictions += 1

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        now = self._clock()
        # least recently used first: stop at the first one still fresh
        for sid in list(self._sessions):
            if now - self._sessions[sid].last_used <= self.ttl_s:
                break
            self._evict(sid)
