"""Sizes the GPU check chooses from a device's memory through the memory planner (`dreamzero.planner`), never a
fixed list: the batch sizes the GPU tier times, the largest batch the latency benchmark runs (`--batch auto`), and
the robots-per-GPU fleet sizes. A size the planner says does not fit is reported as such, with its reason, for the
caller to record (not an assertion failure): the same check then passes on an 80 GiB H100 and a 141 GiB H200.

Imported by benchmarks/model_latency.py, benchmarks/robots_per_gpu.py and tests/gpu (the planner is imported
lazily: this module is read by scripts that run before a torch is importable).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SizeCase:
    """One batch size judged by the planner for one device."""

    rows: int
    fits: bool
    why: str


def device_memory_bytes(device) -> int | None:
    """Usable bytes of `device`: CUDA's, the simulated GPU's ($DREAMZERO_SIMULATED_GPU), or None (plain CPU)."""
    from dreamzero.planner import device_memory

    return device_memory(device)


#: what the benchmarks and the tier build: every component on the GPU, the DiT in the model dtype (the planner would
#: offload the 14B's text encoder on an 80 GB card; these runs materialise the whole model on the device)
ON_GPU = {"text_encoder": "gpu", "image_encoder": "gpu", "dit_weights": "model"}


def _plan(config, capacity: int, dtype, rows="auto", max_sessions: int = 64):
    from dreamzero.planner import plan_serving

    return plan_serving(config, capacity, dtype=dtype, rows=rows, max_sessions=max_sessions, placement=ON_GPU)


def largest_rows(config, capacity: int, dtype, max_sessions: int = 64) -> tuple[int, str]:
    """(rows per model call the planner allows on `capacity` bytes, its one-line summary); 0 when nothing fits."""
    plan = _plan(config, capacity, dtype, "auto", max_sessions)
    return (plan.rows if plan.fits else 0), plan.summary()


def tier_sizes(config, capacity: int, dtype, max_sessions: int = 64) -> list[SizeCase]:
    """The batch sizes the GPU tier times on this device: 1, the powers of two below the planner's rows, the planner's
    rows themselves, and the next power of two above them (which the planner refuses: recorded as "does not fit"
    with its reason). Each judged by the planner with that many rows per call."""
    top, _ = largest_rows(config, capacity, dtype, max_sessions)
    wanted = {1}
    n = 2
    while n < top:
        wanted.add(n)
        n *= 2
    if top >= 1:
        wanted.add(top)
    if top < max_sessions:  # one size past what fits (none where max_sessions, not memory, capped the rows)
        wanted.add(n if n > top else 2 * n)
    return [judge(config, capacity, dtype, rows, max_sessions) for rows in sorted(wanted)]


def judge(config, capacity: int, dtype, rows: int, max_sessions: int = 64) -> SizeCase:
    """Whether a batch of `rows` full-window sessions fits `capacity` bytes by the planner, and why."""
    plan = _plan(config, capacity, dtype, rows, max(max_sessions, rows))
    return SizeCase(rows, bool(plan.fits and plan.rows >= rows), plan.summary())


def fleet_sizes(config, capacity: int | None, dtype, cpu_default: tuple[int, ...] = (1, 2, 4)) -> list[int]:
    """Robots-per-GPU fleet sizes to try: on a device, doubling up to twice the sessions the planner holds (past the
    last that keeps pace, the run stops by itself); on a plain CPU `cpu_default`."""
    if capacity is None:
        return list(cpu_default)
    plan = _plan(config, capacity, dtype)
    held = plan.sessions if plan.fits else 0
    sizes, n = [], 1
    while n <= max(1, 2 * held):
        sizes.append(n)
        n *= 2
    return sizes
