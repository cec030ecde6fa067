"""CFG-parallel inference: one session's conditional and unconditional branches on two ranks (two devices).

Classifier-free guidance runs the DiT on a cond and an uncond row per session. With `cfg_parallel: 2` rank 0 runs
the cond rows and rank 1 the uncond rows of the same batch, each holding only its branch's text rows and KV caches.
At every DiT step the ranks swap their predictions (`BranchGroup.exchange`: video velocity and action of all G rows,
one all-gather) and both combine the same guided velocity from the same two tensors, so the schedulers, the dynamic
step-skip decision and real-time chunking advance identically on both ranks without further talk.

The session decisions are rank 0's (`BranchGroup.agree_rows`): before a call rank 0 sends each row's restart reason
and incarnation and the ids its store still holds; rank 1 follows them, drops what rank 0 no longer holds, and says
which rows it could not continue (a state it lost), which then restart on both. Every exchange is bounded by the
group's timeout; a dead or stuck peer raises `PeerLost` instead of hanging, and the group is then unusable (the
caller reports itself unhealthy).

A group makes one warm exchange when it is built (`BranchGroup.warm_up`: each rank's rank, branch and device type over
gloo, then one small all-gather on the tensor backend), because NCCL creates its communicator lazily, on the first
collective: without it, an NCCL init failure (no peer access, /dev/shm too small, mismatched devices) would surface
in the first robot's first DiT step instead of failing the replica's start.

The group is a raw torch.distributed process group over a TCP store (gloo on CPU, NCCL for the tensors on CUDA),
not the process-global default one, so two ranks can also live in one process (the tests run them as threads).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dreamzero.rtc import CARRIED_ACROSS
from dreamzero.sessions import BRANCHES, SessionStore

#: rank -> the CFG branch it runs
RANK_BRANCH = {0: BRANCHES[0], 1: BRANCHES[1]}


class PeerLost(RuntimeError):
    """The other rank of a CFG-parallel pair did not answer within the timeout (dead, stuck or disconnected)."""


@dataclass
class RowDecisions:
    """Rank 0's decisions for one call: each row's restart reason (None: continue) and the other ids its store holds
    (rank 1 drops the rest: eviction, TTL and drops stay rank 0's)."""

    reasons: list[str | None]
    live: list[str]


class BranchGroup:
    """This process's rank in a CFG-parallel pair: rank 0 runs the "cond" rows, rank 1 the "uncond" rows.

    `store` is a torch.distributed Store both ranks reach (a TCPStore, rank 0 its master); `device` decides the
    backend of the per-step tensor exchange (NCCL on CUDA, gloo otherwise); the session decisions always travel over
    gloo. `timeout_s` bounds every exchange.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        device: torch.device | str = "cpu",
        timeout_s: float = 60.0,
        warm: bool = True,
    ):
        if rank not in RANK_BRANCH:
            raise ValueError(f"a CFG-parallel rank is 0 or 1, got {rank}")
        self.rank, self.branch, self.timeout_s = rank, RANK_BRANCH[rank], float(timeout_s)
        self.device = torch.device(device)
        timeout = timedelta(seconds=self.timeout_s)
        self._objects = dist.ProcessGroupGloo(dist.PrefixStore("objects", store), rank, 2, timeout)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._tensors = dist.ProcessGroupNCCL(dist.PrefixStore("tensors", store), rank, 2, opts)
        else:
            self._tensors = dist.ProcessGroupGloo(dist.PrefixStore("tensors", store), rank, 2, timeout)
        self.broken: str | None = None  # why the group can no longer be used (a failed exchange)
        self.collectives = 0  # collectives started so far: a failure after one leaves the other rank waiting
        self.exchanges = 0  # per-step exchanges so far (tests and metrics)
        self.exchanged_bytes = 0
        self.wait_s = 0.0  # time spent in collectives: the transfers plus waiting for the other rank
        self.peer: dict | None = None  # what the other rank said in the warm exchange
        if warm:
            self.warm_up()

    def warm_up(self) -> dict:
        """The join's one exchange on both process groups (module docstring: why); returns the peer's hello.
        PeerLost (the group closed) when the peer does not answer within the timeout or is no CFG partner of this
        rank: a different rank number, or another device type (NCCL on one side, gloo on the other)."""
        hello = {"rank": self.rank, "branch": self.branch, "device": self.device.type}
        try:
            peer = self._objects_gather(hello)[1 - self.rank]
            if (peer.get("rank"), peer.get("device")) != (1 - self.rank, self.device.type):
                self.broken = f"the peer is no CFG partner of rank {self.rank} on {self.device.type}: {peer}"
                raise PeerLost(self.broken)
            probe = torch.full((1,), float(self.rank), device=self.device)
            parts = [torch.empty_like(probe) for _ in range(2)]
            self._run(lambda: self._tensors.allgather([parts], [probe]), "the warm-up tensor")
            if [float(t.item()) for t in parts] != [0.0, 1.0]:
                self.broken = f"the warm-up all-gather returned {[float(t.item()) for t in parts]}, not [0.0, 1.0]"
                raise PeerLost(self.broken)
        except PeerLost:
            self.close()
            raise
        self.peer = peer
        return peer

    def close(self) -> None:
        """Let go of both process groups (a group left to the interpreter's exit may abort it)."""
        for pg in (self._tensors, self._objects):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - a peer already gone; nothing left to release
                pass
        self.broken = self.broken or "closed"

    # -- the per-step exchange ------------------------------------------------------------------------------------

    def exchange(self, pred_v: torch.Tensor, pred_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's predictions for its G rows -> (v_cond, v_uncond, a_cond), the same tensors on both ranks.

        Both ranks send video [G, z, F, h, w] and action [G, A, ad] in fp32 (the uncond action is not needed, but
        one all-gather of equal parts is simpler than two sends, and it is 1% of the bytes on DROID 14B).
        """
        v, a = pred_v.float().contiguous(), pred_a.float().contiguous()
        mine = torch.cat([v.flatten(), a.flatten()])
        parts = [torch.empty_like(mine) for _ in range(2)]
        self._run(lambda: self._tensors.allgather([parts], [mine]), "the per-step predictions")
        self.exchanges += 1
        self.exchanged_bytes += 2 * mine.numel() * mine.element_size()
        nv = v.numel()
        cond, uncond = parts
        return cond[:nv].view_as(v), uncond[:nv].view_as(v), cond[nv:].view_as(a)

    # -- the session decisions ------------------------------------------------------------------------------------

    def agree_rows(self, rows, batch, store: SessionStore, resolve) -> list:
        """Make both ranks' rows of this call agree (rank 0's decisions win); returns this rank's rows.

        Rank 0 passes its rows (`resolve(None)`: its own decisions); rank 1 passes None and builds its rows with
        `resolve(reasons)` from rank 0's. A row rank 1 cannot follow restarts on both, reason "evicted": one rank 0
        continues while rank 1 lost its state, or one restarting with its carried chunk (`rtc.CARRIED_ACROSS`) that
        rank 1 no longer holds (the two ranks would steer the actions differently). Incarnations stay rank 0's
        business: rank 1 never checks them (it follows rank 0's reasons).
        """
        if self.rank == 0:
            ids = set(batch.session_ids)
            self._objects_gather(RowDecisions([r.reason for r in rows], [s for s in store.ids() if s not in ids]))
            lost = self._objects_gather([])[1]
            for i in lost:
                rows[i] = restart_row(rows[i], "evicted")
            return rows
        decided: RowDecisions = self._objects_gather(None)[0]
        keep = set(decided.live) | set(batch.session_ids)
        store.drop([sid for sid in store.ids() if sid not in keep])
        rows = resolve(decided.reasons)
        # resolve_rows takes rank 0's reason only where this store holds the state: a different one means it did not
        lost = [
            r.index
            for r in rows
            if r.restarted and r.reason != (why := decided.reasons[r.index]) and (why is None or why in CARRIED_ACROSS)
        ]
        self._objects_gather(lost)
        return rows

    def _objects_gather(self, obj) -> list:
        """Every rank's `obj` (pickled), in rank order."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        sizes = [torch.empty_like(size) for _ in range(2)]
        self._run(lambda: self._objects.allgather([sizes], [size]), "the session decisions")
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        parts = [torch.empty_like(padded) for _ in range(2)]
        self._run(lambda: self._objects.allgather([parts], [padded]), "the session decisions")
        return [pickle.loads(p[: int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes)]

    def _run(self, start, what: str) -> None:
        if self.broken is not None:
            raise PeerLost(f"the CFG-parallel group is unusable: {self.broken}")
        self.collectives += 1
        t0 = time.perf_counter()
        try:
            work = start()
            if not work.wait(timedelta(seconds=self.timeout_s)):
                raise TimeoutError(f"no answer in {self.timeout_s:g} s")
        except Exception as exc:  # any failure of a collective leaves the pair out of step
            peer = 1 - self.rank
            self.broken = f"exchanging {what} with rank {peer} failed: {exc}"
            raise PeerLost(self.broken) from exc
        finally:
            self.wait_s += time.perf_counter() - t0


def restart_row(row, reason: str):
    """`row` restarted with `reason` (a fresh state keeping the session's prompts, text rows and carried chunk)."""
    from dreamzero.pipeline.rows import Row, restarted_state

    state = restarted_state(row.state, row.state.session_id, row.state.prompt, row.state.negative_prompt, reason)
    return Row(index=row.index, state=state, restarted=True, reason=reason, seed=row.seed)


def tcp_store(host: str, port: int, rank: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous of a pair: rank 0 listens (port 0: any free port, read back `.port`), rank 1 connects."""
    return dist.TCPStore(
        host, port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


__all__ = ["RANK_BRANCH", "BranchGroup", "PeerLost", "RowDecisions", "restart_row", "tcp_store"]
