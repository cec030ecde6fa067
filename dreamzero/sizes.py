"""Byte sizes as configs write them: a count, "40GiB", "512 MB", "8e9", or "auto" (`sessions.max_bytes`,
`preprocess.ingress_max_bytes`). Pure Python: the serving config reads it without torch."""

from __future__ import annotations

import re

from dreamzero.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(value: int | float | str | None, field: str = "sessions.max_bytes") -> int | str | None:
    """None, "auto", a byte count, or a string like "40GiB" / "512 MB" -> None | "auto" | int > 0."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None if value is None else "auto"
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r}: give bytes (e.g. 40GiB) or auto")
    if isinstance(value, (int, float)):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{field}={value!r} is not a size; use bytes, e.g. 40GiB, 512MiB, 8e9, or auto")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n <= 0 or n != n:
        raise ConfigError(f"{field}={value!r} must be > 0")
    return int(n)
