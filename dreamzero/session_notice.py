"""One warning per session whose 1-frame observations keep restarting it (`single_frame`), for the in-process policy
and the server alike.

A loop that repeats a first call's one frame restarts its session every call; its actions show that only as a policy
that never builds on its past, and every reply says `restarted` where nobody reads it. The line names the session and
what to send instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dreamzero.types import SessionReport

#: sessions remembered as told; past it the set starts over (bounded memory; a session may then be told again)
MAX_REMEMBERED = 4096


class SingleFrameNotice:
    """Call with each reply's session reports; logs a `single_frame` restart once per session id."""

    def __init__(self, logger: logging.Logger, max_remembered: int = MAX_REMEMBERED):
        self.logger, self.max_remembered = logger, max_remembered
        self.told: set[str] = set()

    def __call__(self, reports: Iterable[SessionReport]) -> None:
        for report in reports:
            if report.restart_reason != "single_frame" or report.session_id in self.told:
                continue
            if len(self.told) >= self.max_remembered:
                self.told.clear()
            self.told.add(report.session_id)
            self.logger.warning(
                "session %r restarted (single_frame): a 1-frame observation after its first call starts it again; "
                "send the frames since the last call (a block, 4 on DROID) to continue it (docs/model.md 6.1)",
                report.session_id,
            )
