"""Per-session model state and the bounded store that holds it on one replica.

A session is one robot / one environment slot. Everything the next chunk needs lives in its `SessionState`
(KV caches per CFG branch, text embeddings, CLIP feature, first-frame conditioning, frame position, step count), so a
server can hold many, evict idle ones and account for their memory. When the count is full the store evicts the least
recently used idle session and remembers the id, so that session's next call reports `evicted`.

Memory is admitted, not discovered: before a call, each of its sessions reserves its peak footprint (the bytes it will
hold when its window is fullest, `SessionFootprint`, computed from the configs and the canvas), so a session never
grows past what was admitted. A request whose new sessions do not fit the byte budget, even after evicting idle
sessions, gets `CapacityError` (503 + Retry-After) and nothing else is touched (docs/model.md, "Memory and admission").

Groups (a server's tenants): a store given `group_of` (session id -> group name) makes room, by count or by bytes,
fairly (`fair_victim`): a group's new rows may evict only that group's own idle sessions, or, while the group stays
within its share (capacity / groups present) with them, the idle sessions of a group over its share; never another
group's session otherwise. When neither exists the request is refused (`CapacityError`, 503 naming the budget) and
nothing is touched. `check_group_room` refuses a request whose new sessions would take its group past a session
quota. Without `group_of` every session is in one group and eviction is plain LRU.
"""

# Longer than ~400 lines on purpose: a session's state, its footprint formula and the store that admits, evicts and
# counts by them (per group too) are one contract, read together.

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from dreamzero.errors import CapacityError, ConfigError, QuotaExceeded
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
    # the VAE decoder's causal state after this session's predicted video so far (only while it asks for video)
    video_state: list | None = None
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
        tensors += [t for t in self.video_state or () if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def release_tensors(self) -> None:
        """Let go of the model-state tensors (a restart replaces them; the new state must not double the footprint)."""
        self.kv_cache, self.clip_feature, self.y, self.vae_state, self.first_frame = [], None, None, None, None
        self.video_state = None


# ----------------------------------------------------------------------------------------------------------------------
# The footprint formula
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionFootprint:
    """Bytes one session holds after each chunk of its life (chunk 0 = its (re)start), by part.

    `by_chunk[k]` = KV + text + CLIP + y + VAE state + first frame after chunk k; the session restarts (reason
    `window_full`) after the last entry, so `peak` bounds it for good. Formula: docs/model.md, "Memory and admission".
    """

    by_chunk: tuple[int, ...]
    parts: tuple[dict[str, int], ...]

    @property
    def peak(self) -> int:
        return max(self.by_chunk)


def session_footprint(
    dit,
    pipeline,
    canvas_hw: tuple[int, int],
    element_size: int,
    vae_state_bytes: int = 0,
    spatial_factor: int = 8,
    clip_tokens: int = 257,
    branches: int | None = None,
) -> SessionFootprint:
    """A session's bytes after each chunk, from `DiTConfig` `dit`, `PipelineConfig` `pipeline`, the model-input canvas
    (H, W) (after `model_input_hw`), the model dtype's element size and the VAE encoder state of one row at that canvas
    (`vae_state_nbytes`; only i2v sessions with `conditioning_by_chunk` hold one until their conditioning is complete)
    and the CLIP tokens (257 for ViT-H/14 at 224 px: 16 x 16 patches + the class token). `branches`: the CFG
    branches this process holds (None: both when guided; 1 on each rank of a CFG-parallel pair).
    """
    h, w = canvas_hw
    nb = 1 if pipeline.cfg_scale == 1.0 else len(BRANCHES)  # CFG branches, each with its own KV rows and text rows
    nb = nb if branches is None else branches
    nfpb, window = dit.num_frame_per_block, dit.max_attention_frames
    i2v = dit.has_image_input
    cond = i2v and dit.concat_first_frame_latent
    y_window = 1 + (pipeline.num_frames - 1) // 4  # latent frames of the whole conditioning window
    restart_pixels = min(1 + 4 * nfpb, pipeline.num_frames) if pipeline.conditioning_by_chunk else pipeline.num_frames
    y_frames = 1 + (restart_pixels - 1) // 4
    latent_hw = (h // spatial_factor) * (w // spatial_factor)
    by_chunk, parts = [], []
    k = 0
    while k == 0 or 1 + nfpb * k < window:  # a call at frame position >= window restarts the session instead
        if k > 0 and pipeline.conditioning_by_chunk:
            y_frames = max(y_frames, 1 + nfpb * (k + 1))  # extend_conditioning: up to the next block's frames
        kv_frames = min(1 + nfpb * k, window)  # frame 0 at the start, then one observed block per chunk
        part = {
            "kv_cache": dit.num_layers * 2 * nb * kv_frames * dit.frame_seqlen * dit.dim * element_size,
            "text": nb * dit.text_len * dit.text_dim * element_size,
            "clip": clip_tokens * dit.image_dim * element_size if i2v else 0,
            "y": (dit.in_dim - dit.out_dim) * y_frames * latent_hw * element_size if cond else 0,
            "vae_state": vae_state_bytes if cond and y_frames < y_window else 0,
            "first_frame": 3 * h * w * element_size,
        }
        parts.append(part)
        by_chunk.append(sum(part.values()))
        k += 1
    return SessionFootprint(tuple(by_chunk), tuple(parts))


def footprint_for(
    dit,
    pipeline,
    vae_cfg,
    image_encoder_cfg,
    canvas_hw: tuple[int, int],
    dtype,
    spatial: int | None = None,
    branches: int | None = None,
) -> SessionFootprint:
    """`session_footprint` from the configs alone (DiTConfig, PipelineConfig, VAEConfig or None for a stand-in VAE,
    ImageEncoderConfig or None) at the model-input `canvas_hw` and the model's dtype (`spatial`: the VAE's pixels per
    latent cell when a stand-in VAE says so): what a pipeline reports, and what `serve run` checks against the device
    before any weights load."""
    from dreamzero.model.vae import spatial_factor

    vae_bytes = 0
    if dit.has_image_input and dit.concat_first_frame_latent and vae_cfg is not None:
        vae_bytes = vae_state_nbytes(vae_cfg, canvas_hw, dtype, dit.num_frame_per_block)
    enc = image_encoder_cfg
    clip_tokens = (enc.image_size // enc.patch_size) ** 2 + 1 if enc is not None else 257
    element_size = torch.empty((), dtype=dtype).element_size()
    if spatial is None:
        spatial = spatial_factor(vae_cfg) if vae_cfg is not None else 8
    return session_footprint(dit, pipeline, canvas_hw, element_size, vae_bytes, spatial, clip_tokens, branches)


class SessionStore:
    """LRU/TTL-bounded map session_id -> SessionState, with eviction memory and restart statistics.

    `max_sessions` bounds live sessions (the least recently used is evicted to make room); `max_bytes` (None = no
    limit) bounds the bytes their tensors hold (a DROID 14B session at a full window holds ~10 GB of KV cache);
    `ttl_s` (None = never) drops sessions idle for longer. Evicted ids are remembered (at most `remember_evicted`,
    oldest forgotten first) so `lookup` can tell "evicted" from "new_session". A lock makes every method atomic,
    enough for one asyncio replica that also runs the model in a worker thread.

    Bytes are counted as reservations: `admit` reserves each session's peak footprint before its call (a session
    stored without one reserves what it holds), so the budget holds at every chunk, not only between calls.
    `retry_after_s` is the hint a refused request gets.

    A server's store is given `group_of` (session id -> group; None: one group) and `on_evict(session_id, cause)`
    (cause "lru", "ttl" or "bytes"; None: nothing), called under the store's lock, so it must be quick (a log line).
    """

    # More than ~15 methods on purpose: one lock guards lookup, admission, eviction and the per-group counts, which
    # all read and change the same maps; split, each part would need the others' lock.

    def __init__(
        self,
        max_sessions: int = 64,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        remember_evicted: int | None = None,
        max_bytes: int | None = None,
        retry_after_s: float = 5.0,
        group_of: Callable[[str], str] | None = None,
        on_evict: Callable[[str, str], None] | None = None,
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
        self.retry_after_s = retry_after_s
        self._reserved: dict[str, int] = {}  # session id -> bytes reserved (live sessions and admitted new ones)
        self._inflight: set[str] = set()  # admitted and not yet released: never evicted for room
        self.refusals = 0  # requests refused for bytes
        self.group_of = group_of
        self.on_evict = on_evict

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

    def ids(self) -> list[str]:
        """The live session ids, least recently used first (a CFG-parallel rank 1 mirrors rank 0's with them)."""
        with self._lock:
            return list(self._sessions)

    def put(self, state: SessionState, protect: Iterable[str] = ()) -> None:
        """Insert or replace a session; evicts least recently used sessions not in `protect` (e.g. the current batch)
        to stay within max_sessions (if every other session is protected, the oldest goes anyway)."""
        with self._lock:
            self._expire()
            state.last_used = self._clock()
            self._sessions[state.session_id] = state
            self._sessions.move_to_end(state.session_id)
            self._evicted.pop(state.session_id, None)
            sid = state.session_id
            self._reserved[sid] = max(self._reserved.get(sid, 0), state.nbytes())
            keep = set(protect) | {state.session_id} | self._inflight
            asking = {self._group(sid)}
            while len(self._sessions) > self.max_sessions:
                idle = [s for s in self._sessions if s not in keep]
                victim = fair_victim(idle, self._count_by_group(), self.max_sessions, asking, self._group)
                if victim is None:  # the group's own sessions only (all protected: the oldest of them goes anyway)
                    victim = next((s for s in self._sessions if s != sid and self._group(s) in asking), None)
                if victim is None:  # never another group's session: over the count until one of its own is idle
                    break
                self._evict(victim)
            if self.max_bytes is not None:
                # only idle sessions go for bytes: the batch in flight needs its state, whatever its size (a store
                # used through `admit` is already within budget; this covers sessions stored without admission)
                idle = [s for s in self._sessions if s not in keep]
                while idle and self.reserved_bytes() > self.max_bytes:
                    victim = fair_victim(idle, self._bytes_by_group(), self.max_bytes, asking, self._group)
                    if victim is None:
                        break
                    idle.remove(victim)
                    self._evict(victim, "bytes")

    def drop(self, session_ids: Iterable[str]) -> int:
        """Forget sessions on request (not an eviction: their next call is a plain new session). Returns the count."""
        with self._lock:
            n = 0
            for sid in session_ids:
                n += self._sessions.pop(sid, None) is not None
                self._evicted.pop(sid, None)
                if sid not in self._inflight:
                    self._reserved.pop(sid, None)
            return n

    # -- admission by bytes --------------------------------------------------------------------------------------------

    def admit(self, needs: dict[str, int], busy: Iterable[str] = ()) -> None:
        """Reserve `needs[sid]` bytes (the session's peak footprint) for every session of one request, all or nothing.

        Sessions already holding that much reserve nothing more. When the budget (or the count, `max_sessions`) is
        short, idle sessions (least recently used first; not in this request, not admitted and unreleased, not in
        `busy`, e.g. queued requests) make room by the fair rule (`fair_victim`: the request's own group's, or those
        of a group over its share while the request's group stays within its own); if that cannot make room,
        nothing is touched and `CapacityError` says why. Every admitted id stays protected until `release`.
        """
        with self._lock:
            self._expire()
            keep = set(busy) | self._inflight | set(needs)
            idle = [sid for sid in self._sessions if sid not in keep]  # least recently used first
            self._check_count_room(needs, idle)
            extra = sum(max(0, int(n) - self._reserved.get(sid, 0)) for sid, n in needs.items())
            if self.max_bytes is not None and extra > 0:
                total = self.reserved_bytes()
                if total + extra > self.max_bytes:
                    asking = {sid: max(0, int(n) - self._reserved.get(sid, 0)) for sid, n in needs.items()}
                    held = [sid for sid in idle if self._reserved.get(sid, 0) > 0]
                    victims, short = plan_evictions(
                        held, self._bytes_by_group(asking), self.max_bytes, total + extra - self.max_bytes,
                        {self._group(sid) for sid in needs}, lambda sid: self._reserved.get(sid, 0), self._group,
                    )  # fmt: skip
                    if short > 0:
                        self.refusals += 1
                        raise CapacityError(
                            f"session memory budget full: {len(needs)} session(s) need {_gib(extra)} more, "
                            f"{_gib(total)} of sessions.max_bytes={_gib(self.max_bytes)} is reserved by "
                            f"{len(self._reserved)} session(s) in use or queued, and no idle session this request "
                            "may evict frees enough (other tenants' sessions within their share are never "
                            "evicted); retry later or raise sessions.max_bytes / add replicas",
                            retry_after_s=self.retry_after_s,
                        )
                    for victim in victims:
                        self._evict(victim, "bytes")
            for sid, n in needs.items():
                self._reserved[sid] = max(self._reserved.get(sid, 0), int(n))
                self._inflight.add(sid)

    def _check_count_room(self, needs: dict[str, int], idle: list[str]) -> None:
        """`CapacityError` when the request's new sessions cannot get a slot of `max_sessions` by the fair rule (nor
        from its own group's sessions, which storing evicts even when busy). Evicts nothing: storing does."""
        new = [sid for sid in needs if sid not in self._sessions and sid not in self._inflight]
        excess = len(self._sessions.keys() | self._inflight) + len(new) - self.max_sessions
        if not new or excess <= 0:
            return
        asking = Counter(self._group(sid) for sid in new)
        victims, short = plan_evictions(
            idle, self._count_by_group() + asking, self.max_sessions, excess, set(asking), lambda _: 1, self._group
        )
        # storing evicts the group's own sessions even when busy (its continuing rows included): they count as room
        own = [s for s in self._sessions if self._group(s) in asking and s not in victims]
        short = int(short)
        if short > len(own):
            self.refusals += 1
            raise CapacityError(
                f"session slots full: {len(new)} new session(s) need {excess} of sessions.max_sessions="
                f"{self.max_sessions} slots freed and only {excess - short + len(own)} may be (this tenant's own "
                "idle sessions, or those of a tenant over its share; other tenants' sessions are never evicted); "
                "retry later, end sessions, or raise sessions.max_sessions / add replicas",
                retry_after_s=self.retry_after_s,
            )

    def release(self, session_ids: Iterable[str]) -> None:
        """The call of these sessions is over: stored ones keep their reservation, the others give it back."""
        with self._lock:
            for sid in session_ids:
                self._inflight.discard(sid)
                if sid not in self._sessions:
                    self._reserved.pop(sid, None)

    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(self._reserved.values())

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
                "reserved_bytes": self.reserved_bytes(),
                "refusals": self.refusals,
                "evictions": self.evictions,
                "restarts": {r: self.restarts.get(r, 0) for r in RESTART_REASONS},
            }

    # -- eviction ------------------------------------------------------------------------------------------------------

    def _evict(self, session_id: str, cause: str = "lru") -> None:
        self._sessions.pop(session_id, None)
        self._reserved.pop(session_id, None)
        self._evicted[session_id] = None
        self._evicted.move_to_end(session_id)
        while len(self._evicted) > self._remember:
            self._evicted.popitem(last=False)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(session_id, cause)

    def _group(self, session_id: str) -> str:
        return "" if self.group_of is None else self.group_of(session_id)

    def _count_by_group(self) -> Counter[str]:
        return Counter(self._group(sid) for sid in self._sessions.keys() | self._inflight)

    def _bytes_by_group(self, asking: dict[str, int] | None = None) -> Counter[str]:
        used: Counter[str] = Counter()
        for sid, n in self._reserved.items():
            used[self._group(sid)] += n
        for sid, n in (asking or {}).items():
            used[self._group(sid)] += n
        return used

    # -- group quotas --------------------------------------------------------------------------------------------------

    def group_counts(self) -> dict[str, int]:
        """Live sessions per group (the groups with none are absent)."""
        with self._lock:
            return dict(Counter(self._group(sid) for sid in self._sessions))

    def check_group_room(
        self,
        session_ids: Iterable[str],
        limit: int | None,
        total_limit: int | None = None,
        elsewhere: int = 0,
        label: str = "group",
    ) -> None:
        """Raise `QuotaExceeded` when the new sessions among `session_ids` would take their group past `limit` live
        sessions in this store, or past `total_limit` counting `elsewhere` (the group's sessions held elsewhere, e.g.
        on other replicas). Live and admitted sessions count; continuing ones ask for nothing. The message names
        only the group's own numbers; its retry hint is when the group's oldest idle session expires."""
        with self._lock:
            self._expire()
            new = [sid for sid in session_ids if sid not in self._sessions and sid not in self._inflight]
            if not new:
                return
            new_groups = Counter(self._group(sid) for sid in new)
            refuse_over_quota(self._count_by_group(), new_groups, limit, total_limit, elsewhere, label,
                              self._group_retry_after)  # fmt: skip

    def _group_retry_after(self, group: str) -> float:
        """Seconds until the group's least recently used idle session expires (the store's hint without a TTL)."""
        if self.ttl_s is None:
            return self.retry_after_s
        now = self._clock()
        for sid, state in self._sessions.items():  # least recently used first
            if sid not in self._inflight and self._group(sid) == group:
                return max(1.0, self.ttl_s - (now - state.last_used))
        return self.retry_after_s

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        now = self._clock()
        # least recently used first: stop at the first one still fresh; a session in an admitted call is in use
        for sid in list(self._sessions):
            if now - self._sessions[sid].last_used <= self.ttl_s:
                break
            if sid not in self._inflight:
                self._evict(sid, "ttl")


def fair_victim(
    idle: list[str], used: Counter[str], capacity: float, asking: set[str], group: Callable[[str], str]
) -> str | None:
    """The session to evict among `idle` (least recently used first) to make room for the groups in `asking`, or
    None. `used`: each group's count or bytes, the asking groups' new rows included. While an asking group stays
    within its share (capacity / groups present) with them, the oldest idle session of another group over its share
    goes first; then the asking groups' own oldest idle session. Another group's session never goes otherwise, so a
    tenant that floods new sessions evicts only its own (issue 45)."""
    groups = {g for g, n in used.items() if n > 0} | asking
    share = capacity / max(1, len(groups))
    if any(used[g] <= share for g in asking):
        over = next((sid for sid in idle if group(sid) not in asking and used[group(sid)] > share), None)
        if over is not None:
            return over
    return next((sid for sid in idle if group(sid) in asking), None)


def plan_evictions(
    idle: list[str],
    used: Counter[str],
    capacity: float,
    need: float,
    asking: set[str],
    size: Callable[[str], float],
    group: Callable[[str], str],
) -> tuple[list[str], float]:
    """The victims (`fair_victim`, one after another) that free `need` units (`size` each), and what is still short
    (0 when they suffice). Touches nothing: the caller evicts them only when the whole request fits."""
    used, idle, victims, freed = Counter(used), list(idle), [], 0.0
    while freed < need:
        victim = fair_victim(idle, used, capacity, asking, group)
        if victim is None:
            break
        idle.remove(victim)
        victims.append(victim)
        freed += size(victim)
        used[group(victim)] -= size(victim)
    return victims, max(0.0, need - freed)


def refuse_over_quota(
    held: Counter[str],
    new: Counter[str],
    limit: int | None,
    total_limit: int | None,
    elsewhere: int,
    label: str,
    retry_after: Callable[[str], float],
) -> None:
    """Raise `QuotaExceeded` when a group's `new` sessions take it past `limit` live sessions here (`held`), or past
    `total_limit` counting `elsewhere`. The message names only the group's own numbers."""
    for group, n in new.items():
        name = f"{label} {group!r}" if group else "this store"
        if limit is not None and held[group] + n > limit:
            raise QuotaExceeded(
                f"{name} holds {held[group]} live session(s) on this replica and asks for {n} more; its quota "
                f"is {limit} per replica (max_sessions_per_replica): end a session or wait for an idle one to "
                "expire, then retry",
                "max_sessions_per_replica",
                retry_after(group),
            )
        if total_limit is not None and held[group] + elsewhere + n > total_limit:
            raise QuotaExceeded(
                f"{name} holds {held[group] + elsewhere} live session(s) in all and asks for {n} more; its "
                f"quota is {total_limit} (max_sessions): end a session or wait for an idle one to expire, "
                "then retry",
                "max_sessions",
                retry_after(group),
            )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def vae_state_nbytes(vae, canvas_hw: tuple[int, int], dtype: torch.dtype, num_frame_per_block: int) -> int:
    """Bytes of one row's causal VAE encoder state after a restart's conditioning frames at `canvas_hw`, measured by
    running the encoder on the meta device (shapes only: nothing is allocated or computed)."""
    from dreamzero.model.vae import WanVAE

    with torch.device("meta"):
        meta = WanVAE(vae.cfg if hasattr(vae, "cfg") else vae).to(dtype)
    video = torch.zeros(1, 3, 1 + 4 * num_frame_per_block, *canvas_hw, device="meta", dtype=dtype)
    _, state = meta.encode_causal(video)
    return sum(t.numel() * t.element_size() for t in state if t is not None)
