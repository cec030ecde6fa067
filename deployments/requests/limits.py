"""Server-side decode sizing and the decode worker pool: the `DecodeLimits` a door builds from its request bounds
(`request_limits`), and `decode_in_worker` / `decode_body_async`, which decode large bodies off the event loop.
The limits themselves and the bounded decoders live in the robot's client package (`dreamzero_client.wire.limits`,
`dreamzero_client.wire.codec`), which decodes replies with the same bounds.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dreamzero_client.wire import codec
from dreamzero_client.wire.limits import MAX_DEPTH, DecodeLimits

#: values one session row of the widest request holds when its arrays travel as markers: its prompt, id, seed,
#: reset flag, step, incarnation, the real-time chunking fields, and per array a marker map (map, 4 keys, 4 values,
#: the shape list and its dims: about 16 values); a row carries up to 8 non-camera arrays (state, mask, ...)
ROW_FIELD_VALUES = 32
MARKER_VALUES = 16
ROW_ARRAYS = 8
#: a frame sent as nested lists (JSON, or msgpack without markers) costs one value per number, one list per pixel
#: and one per image row: H * W * 4 + H + 1 values
DEFAULT_FRAME_HW = (180, 320)
#: the shipped request bounds: sessions.max_sessions rows, DROID's 3 cameras, a 4-frame stack
DEFAULT_ROWS, DEFAULT_CAMERAS, DEFAULT_FRAMES = 128, 3, 4


def nested_frame_values(height: int, width: int) -> int:
    """Decoded values of one [H, W, 3] frame sent as nested lists."""
    return height * width * 4 + height + 1


def widest_request_values(
    max_rows: int, max_cameras: int, max_frames: int, frame_hw: tuple[int, int], nested_rows: int
) -> int:
    """Decoded values of the widest legal request (see `request_limits`), plus a margin for the envelope."""
    marker_rows = max_rows * (ROW_FIELD_VALUES + (max_cameras * max_frames + ROW_ARRAYS) * MARKER_VALUES)
    return marker_rows + nested_rows * max_cameras * max_frames * nested_frame_values(*frame_hw) + 4096


def widest_container(max_rows: int, frame_hw: tuple[int, int]) -> int:
    """The longest list of a legal request: a row per session, a raw camera frame's row of pixels (up to 4x the
    model's frame side: the embodiment resizes it), a real-time chunking prefix (1024 actions)."""
    return max(max_rows, 4 * max(frame_hw), 4096)


def request_limits(
    max_rows: int = DEFAULT_ROWS,
    max_cameras: int = DEFAULT_CAMERAS,
    max_frames: int = DEFAULT_FRAMES,
    frame_hw: tuple[int, int] = DEFAULT_FRAME_HW,
    nested_rows: int = 1,
    max_bytes: int = DecodeLimits.max_bytes,
    max_depth: int = MAX_DEPTH,
) -> DecodeLimits:
    """Limits that fit the widest legal request: `max_rows` session rows, each with `max_cameras` x `max_frames`
    frames and its other arrays as NumPy markers, plus `nested_rows` rows whose frames (of `frame_hw`) arrive as
    nested lists (a JSON client's form; more is refused: send arrays as msgpack markers). With no argument: the
    client's defaults, `DecodeLimits()`."""
    return DecodeLimits(
        max_bytes=max_bytes,
        max_depth=max_depth,
        max_container_len=widest_container(max_rows, frame_hw),
        max_objects=widest_request_values(max_rows, max_cameras, max_frames, frame_hw, nested_rows),
    )


#: bodies up to this size decode on the caller's thread (a thread hop costs more than decoding them)
INLINE_DECODE_BYTES = 64 * 1024
#: decoding threads per process: concurrent large bodies queue for them rather than multiply the memory they cost
DECODE_THREADS = 2
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_T = TypeVar("_T")


def _decoder_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="dreamzero-decode")
        return _pool


async def decode_in_worker(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    """Run `fn(*args)` (decoding and validating a body of `size` bytes) off the event loop when the body is large.

    Python-level decoding gives the interpreter's lock up every few milliseconds, so the loop keeps answering
    (health checks, other callers) while a large body decodes; the pool's `DECODE_THREADS` bound the concurrency.
    """
    if size <= INLINE_DECODE_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_decoder_pool(), lambda: fn(*args))


async def decode_body_async(
    body: bytes, content_type: str | None, limits: DecodeLimits | None = None
) -> tuple[Any, str]:
    """`codec.decode_body` through `decode_in_worker`."""
    return await decode_in_worker(len(body), codec.decode_body, body, content_type, None, limits)
