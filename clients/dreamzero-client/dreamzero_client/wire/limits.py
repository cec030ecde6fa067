"""Decode limits: what one decoded body may hold. A body of one-byte empty lists would otherwise cost ~145 bytes of
Python objects per body byte (64 MiB: ~9 GB), so `codec` refuses past these before the object graph grows: msgpack
through the unpacker's length limits and a hook per container (`Budget`), JSON through a pre-scan (`prescan_json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dreamzero_client.errors import InvalidRequest

#: nesting depth of maps/lists a body may have (keeps the tree walk far from Python's recursion limit)
MAX_DEPTH = 64
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class DecodeLimits:
    """What one decoded body may hold; past any of these it is refused (`InvalidRequest` naming the limit).

    A decoded value costs up to ~72 bytes, so the default `max_objects` (the shipped server's widest request: 128
    rows, 3 cameras x 4 frames) bounds a body at ~200 MB plus its buffers; a server sizes its own from its bounds.
    """

    #: longest body (413 past it)
    max_bytes: int = DEFAULT_MAX_BYTES
    #: deepest nesting of lists and maps
    max_depth: int = MAX_DEPTH
    #: most items in one list or map (msgpack would otherwise preallocate the list a header claims)
    max_container_len: int = 4096
    #: most values in all: containers, map keys and scalars
    max_objects: int = 2_816_124

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_container_len", "max_objects"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be an integer >= 1, got {value!r}")


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
    """Refuse a JSON body that would build more than `max_objects` values, before parsing it: commas + colons +
    opening brackets + 1 bound the values from above (inside strings they only overcount), one C-speed pass each."""
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
