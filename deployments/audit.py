"""Where the audit log and the doors' INFO lines go, and how a caller's text is written into them.

Serve configures only its own `ray.serve` logger in a replica, so lines on our loggers at INFO were dropped. Each
deployment that writes them calls `configure_audit_log()` (the `dreamzero.audit` logger: one line per session start,
reset, eviction, end and refusal, deployments.tenants) and `configure_info_log(name)` (a door's own INFO lines, e.g.
where the ZeroMQ door listens) once at start.

`DREAMZERO_AUDIT_LOG` (set it in the application's `runtime_env.env_vars`) chooses the audit log's target:
`file` (the default: `dreamzero_audit.log` in Serve's log directory, `/tmp/ray/session_latest/logs/serve/` on a
node by default; every replica of the node appends to it), `stdout` (the replica's stdout, which Ray keeps in its
worker log and `serve run` shows), an absolute file path, or `off`.

A session id is the caller's text: `field` writes it as is when it is plain (letters, digits, `-_.:/@+`), else as a
JSON string (control characters, newlines, quotes, spaces, `=` and non-ASCII escaped), so no id can end a line or
forge a field. A refused request is logged in one line, never with a traceback (`RefusalOneLine`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

from dreamzero.errors import CapacityError, InvalidRequest, NotReady, QuotaExceeded

audit_log = logging.getLogger("dreamzero.audit")

#: the environment variable that chooses the audit log's target, and its default
AUDIT_ENV, AUDIT_DEFAULT = "DREAMZERO_AUDIT_LOG", "file"
AUDIT_FILE = "dreamzero_audit.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_PLAIN = re.compile(r"[A-Za-z0-9_.:/@+\-]+")
#: expected refusals of a request (4xx, 503): the reply says why; a traceback in the replica's log says nothing more
REFUSALS = (QuotaExceeded, CapacityError, NotReady, InvalidRequest)


def field(text: str) -> str:
    """`text` as one audit-line field: as is when plain, else a JSON string (ASCII, every control char escaped)."""
    return text if _PLAIN.fullmatch(text) else json.dumps(text, ensure_ascii=True)


def serve_log_dir() -> str:
    """Serve's log directory on this node (its working directory's `serve/` outside Ray)."""
    try:
        from ray.serve._private.logging_utils import get_serve_logs_dir

        return get_serve_logs_dir()
    except Exception:  # noqa: BLE001 - Ray internals move between versions: fall back to Serve's own fallback
        return os.path.join(os.getcwd(), "serve")


def audit_handler(target: str | None = None) -> logging.Handler | None:
    """The handler for `target` (None: `$DREAMZERO_AUDIT_LOG`, default `file`); None for `off`. A bad value is a
    ConfigError naming the variable."""
    from dreamzero.errors import ConfigError

    target = (target if target is not None else os.environ.get(AUDIT_ENV, AUDIT_DEFAULT)).strip()
    if target == "off":
        return None
    if target == "stdout":
        return logging.StreamHandler(sys.stdout)
    if target == "file":
        path = os.path.join(serve_log_dir(), AUDIT_FILE)
    elif os.path.isabs(target):
        path = target
    else:
        raise ConfigError(f"{AUDIT_ENV}={target!r}: use file, stdout, off or an absolute file path")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return logging.FileHandler(path, mode="a", encoding="utf-8")


def configure_audit_log(target: str | None = None) -> logging.Handler | None:
    """Send `dreamzero.audit` to its target (once per process: later calls keep the first handler)."""
    for h in audit_log.handlers:
        if getattr(h, "_dreamzero_audit", False):
            return h
    handler = audit_handler(target)
    audit_log.setLevel(logging.INFO)
    audit_log.propagate = False  # its own log: not mixed into the replica's (and not dropped by the root's level)
    if handler is None:
        audit_log.disabled = True
        return None
    handler.setFormatter(logging.Formatter(FORMAT))
    handler._dreamzero_audit = True
    audit_log.addHandler(handler)
    return handler


def configure_info_log(name: str) -> None:
    """Let logger `name`'s INFO lines reach the replica's stderr (Ray's worker log; `serve run`'s console)."""
    logger = logging.getLogger(name)
    if any(getattr(h, "_dreamzero_info", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler._dreamzero_info = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class RefusalOneLine(logging.Filter):
    """On Serve's `ray.serve` logger of a replica: "Request failed." with the traceback of an expected refusal
    (`REFUSALS`: a quota's 429, a full store's 503, bad input) becomes one line naming the refusal."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, REFUSALS):
            quota = getattr(exc, "quota", None)
            what = f"{type(exc).__name__}" + (f" ({quota})" if quota else "")
            record.msg, record.args = "Request refused: %s", (what,)
            record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.INFO, "INFO"
        return True


def one_line_refusals(logger_name: str = "ray.serve") -> None:
    """Install `RefusalOneLine` on `logger_name` once."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, RefusalOneLine) for f in logger.filters):
        logger.addFilter(RefusalOneLine())
