"""Decode limits: what one decoded body may hold, and where large bodies decode.

A body of one-byte empty lists would otherwise cost ~145 bytes of Python objects per body byte (a 64 MiB body:
~9 GB), so `dreamzero_client.wire.codec` counts what it builds and refuses past these limits before the object
graph grows: msgpack through the unpacker's length limits and a hook per finished container (`Budget`), JSON
through a byte-count pre-scan (`prescan_json`). Servers decode through `decode_in_worker` so no body holds their
event loop. `codec` re-exports the public names.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from dreamzero_client.errors import InvalidRequest

#: nesting depth of maps/lists a body may have (keeps the tree walk far from Python's recursion limit)
MAX_DEPTH = 64

#: values one session row of the widest request holds when its arrays travel as markers: its prompt, id, seed,
#: reset flag, step, incarnation, the real-time chunking fields, and per array a marker map (map, 4 keys, 4 values,
#: the shape list and its dims: about 16 values); a row carries up to 8 non-camera arrays (state, mask, ...)
ROW_FIELD_VALUES = 32
MARKER_VALUES = 16
ROW_ARRAYS = 8
#: a frame sent as nested lists (JSON, or msgpack without markers) costs one value per number, one list per pixel
#: and one per image row: H * W * 4 + H + 1 values
DEFAULT_FRAME_HW = (180, 320)


def nested_frame_values(height: int, width: int) -> int:
    """Decoded values of one [H, W, 3] frame sent as nested lists."""
    return height * width * 4 + height + 1


def widest_request_values(
    max_rows: int, max_cameras: int, max_frames: int, frame_hw: tuple[int, int], nested_rows: int
) -> int:
    """Decoded values of the widest legal request (see `DecodeLimits.for_request`), plus a margin for the envelope."""
    marker_rows = max_rows * (ROW_FIELD_VALUES + (max_cameras * max_frames + ROW_ARRAYS) * MARKER_VALUES)
    return marker_rows + nested_rows * max_cameras * max_frames * nested_frame_values(*frame_hw) + 4096


def widest_container(max_rows: int, frame_hw: tuple[int, int]) -> int:
    """The longest list of a legal request: a row per session, a raw camera frame's row of pixels (up to 4x the
    model's frame side: the embodiment resizes it), a real-time chunking prefix (1024 actions)."""
    return max(max_rows, 4 * max(frame_hw), 4096)


#: the shipped request bounds: sessions.max_sessions rows, DROID's 3 cameras, a 4-frame stack
DEFAULT_ROWS, DEFAULT_CAMERAS, DEFAULT_FRAMES = 128, 3, 4
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class DecodeLimits:
    """What one decoded body may hold; past any of these it is refused (`InvalidRequest` naming the limit).

    Decoded Python objects cost up to ~72 bytes each, so `max_objects` bounds a body's decoded size at about
    72 * max_objects bytes plus its raw strings and array buffers (no more than the body). A server builds its own
    with `for_request`; the defaults are `for_request()`'s (about 2.8 million values: ~200 MB at most).
    """

    #: longest body (413 past it)
    max_bytes: int = DEFAULT_MAX_BYTES
    #: deepest nesting of lists and maps
    max_depth: int = MAX_DEPTH
    #: most items in one list or map (msgpack would otherwise preallocate the list a header claims)
    max_container_len: int = widest_container(DEFAULT_ROWS, DEFAULT_FRAME_HW)
    #: most values in all: containers, map keys and scalars
    max_objects: int = widest_request_values(DEFAULT_ROWS, DEFAULT_CAMERAS, DEFAULT_FRAMES, DEFAULT_FRAME_HW, 1)

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_container_len", "max_objects"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def for_request(
        cls,
        max_rows: int = DEFAULT_ROWS,
        max_cameras: int = DEFAULT_CAMERAS,
        max_frames: int = DEFAULT_FRAMES,
        frame_hw: tuple[int, int] = DEFAULT_FRAME_HW,
        nested_rows: int = 1,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_depth: int = MAX_DEPTH,
    ) -> DecodeLimits:
        """Limits that fit the widest legal request: `max_rows` session rows, each with `max_cameras` x `max_frames`
        frames and its other arrays as NumPy markers, plus `nested_rows` rows whose frames (of `frame_hw`) arrive as
        nested lists (a JSON client's form; more is refused: send arrays as msgpack markers)."""
        return cls(
            max_bytes=max_bytes,
            max_depth=max_depth,
            max_container_len=widest_container(max_rows, frame_hw),
            max_objects=widest_request_values(max_rows, max_cameras, max_frames, frame_hw, nested_rows),
        )


DEFAULT_LIMITS = DecodeLimits()


class Budget:
    """Counts the values the msgpack unpacker builds, container by container (its hooks), and stops it past the
    limit: the overshoot is at most one container of `max_container_len` items."""

    __slots__ = ("left", "limits")

    def __init__(self, limits: DecodeLimits):
        self.limits, self.left = limits, limits.max_objects

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise InvalidRequest(too_many_values(self.limits))

    def list_hook(self, items: list) -> list:
        self.spend(len(items) + 1)
        return items

    def pairs_hook(self, pairs: list) -> dict:
        self.spend(2 * len(pairs) + 1)
        try:
            return dict(pairs)
        except TypeError:  # a list or map used as a key
            raise InvalidRequest("msgpack map keys must be strings") from None


def too_many_values(limits: DecodeLimits) -> str:
    return (
        f"request body holds more than {limits.max_objects} values (decode limit max_objects); send arrays as "
        "msgpack NumPy markers, or fewer rows per request"
    )


def prescan_json(body: bytes | str, limits: DecodeLimits) -> None:
    """Refuse a JSON body that would build more than `max_objects` values, before parsing it.

    Every value but the last of a container is followed by a comma, every key by a colon: commas + colons + opening
    brackets + 1 bounds the values from above (brackets, commas and colons inside strings only overcount). Each
    count is one C-speed pass over the bytes.
    """
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    total = 1
    for ch in (b",", b":", b"[", b"{"):
        total += raw.count(ch)
        if total > limits.max_objects:
            raise InvalidRequest(too_many_values(limits))


def check_tree(obj: Any, limits: DecodeLimits) -> None:
    """Nesting depth and container lengths of a decoded JSON tree (msgpack's are checked while unpacking)."""
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise InvalidRequest(f"request body is nested more than {limits.max_depth} levels deep (max_depth)")
        if len(node if isinstance(node, (list, dict)) else ()) > limits.max_container_len:
            raise InvalidRequest(
                f"request body holds a list or map of {len(node)} items; the decode limit max_container_len is "
                f"{limits.max_container_len}"
            )
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))


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
