"""The audit log is written (issue 45, item 7): its own logger sent to a file (or stdout) by the project, one line per
session start, reset, eviction, end and refusal with the tenant and the reason; a session id cannot forge a line;
and a refused request logs one line in the replica's log, not a traceback."""

from __future__ import annotations

import logging
import os

import pytest

from deployments.audit import (
    AUDIT_ENV,
    RefusalOneLine,
    audit_handler,
    audit_log,
    configure_info_log,
    field,
    serve_log_dir,
)
from deployments.replica_report import eviction_audit
from deployments.tenants import audit, audit_refusal, audit_reports, scoped_id, tenant_of
from dreamzero.errors import CapacityError, ConfigError, QuotaExceeded
from dreamzero.sessions import SessionState, SessionStore
from dreamzero.types import SessionReport

FORGED = "arm\n2026-01-01 00:00:00 INFO dreamzero.audit session start tenant=beta session=x replica=r"


@pytest.fixture
def audit_file(tmp_path):
    """The audit logger sent to a file, as `DREAMZERO_AUDIT_LOG=<path>` makes a replica do; restored afterwards."""
    path = tmp_path / "audit.log"
    handler = audit_handler(str(path))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    level, propagate = audit_log.level, audit_log.propagate
    audit_log.addHandler(handler)
    audit_log.setLevel(logging.INFO)
    audit_log.propagate = False
    yield path
    audit_log.removeHandler(handler)
    handler.close()
    audit_log.setLevel(level)
    audit_log.propagate = propagate


def test_every_session_event_is_one_line_and_no_id_forges_one(audit_file):
    store = SessionStore(max_sessions=1, group_of=tenant_of, on_evict=eviction_audit("r1"))  # as a replica's
    forged = scoped_id("alpha", FORGED)
    audit_reports([SessionReport(forged, 1, True, "new_session", 1, "i1")], "r1")
    store.put(SessionState(session_id=forged, prompt="p", negative_prompt="n"))
    store.put(SessionState(session_id=scoped_id("alpha", "b\u2028c"), prompt="p", negative_prompt="n"))  # evicts
    audit("reset", scoped_id("alpha", 'q" tenant=beta'), "r1", "asked")
    audit("end", "plain-id", "r1")
    audit_refusal("alpha", "policy", QuotaExceeded("over", "max_sessions", 3.0), rows=2)
    audit_refusal("beta", "policy", CapacityError("full"), rows=16)

    lines = audit_file.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 6 and all(" INFO dreamzero.audit " in line for line in lines)
    body = [line.split(" dreamzero.audit ", 1)[1] for line in lines]
    escaped = field(FORGED)
    assert body[0] == f"session start tenant=alpha session={escaped} replica=r1 reason=new_session"
    assert body[1] == f"session evict tenant=alpha session={escaped} replica=r1 cause=lru"
    assert body[2] == 'session reset tenant=alpha session="q\\" tenant=beta" replica=r1 asked'
    assert body[3] == "session end tenant=default session=plain-id replica=r1"
    assert body[4] == "refuse tenant=alpha at=policy reason=quota_exceeded:max_sessions rows=2"
    assert body[5] == "refuse tenant=beta at=policy reason=no_capacity rows=16"
    assert "\\n" in escaped and "\\u2028" in field("b\u2028c")


def test_the_audit_target_is_the_operators_choice(tmp_path, monkeypatch):
    monkeypatch.setenv(AUDIT_ENV, "off")
    assert audit_handler() is None
    monkeypatch.setenv(AUDIT_ENV, "stdout")
    assert isinstance(audit_handler(), logging.StreamHandler)
    monkeypatch.setenv(AUDIT_ENV, "somewhere")
    with pytest.raises(ConfigError, match=AUDIT_ENV):
        audit_handler()
    monkeypatch.setenv(AUDIT_ENV, "file")
    monkeypatch.chdir(tmp_path)  # outside Ray, Serve's log directory is ./serve
    handler = audit_handler()
    try:
        # Serve's log directory: the Ray session's when this process has one (earlier tests), else ./serve
        assert handler.baseFilename == os.path.join(serve_log_dir(), "dreamzero_audit.log")
    finally:
        handler.close()


def test_a_refused_request_logs_one_line_not_a_traceback(caplog):
    logger = logging.getLogger("test.serve.replica")
    logger.addFilter(RefusalOneLine())
    with caplog.at_level(logging.INFO, logger.name):
        for exc in (QuotaExceeded("tenant 'a' holds 2", "max_sessions_per_replica", 5.0), RuntimeError("boom")):
            try:
                raise exc
            except Exception:
                logger.exception("Request failed.")
    quota, other = caplog.records
    assert quota.getMessage() == "Request refused: QuotaExceeded (max_sessions_per_replica)"
    assert quota.exc_info is None and quota.levelno == logging.INFO
    assert other.exc_info is not None and other.levelno == logging.ERROR  # a real failure keeps its traceback
    assert "\n" not in logging.Formatter().format(quota)  # one line: no traceback below it


def test_a_doors_info_lines_reach_a_log(capfd):
    configure_info_log("test.dreamzero.door")
    configure_info_log("test.dreamzero.door")  # once: no second handler
    logging.getLogger("test.dreamzero.door").info("ZMQ front door listening on tcp://127.0.0.1:5555")
    err = capfd.readouterr().err
    assert err.count("ZMQ front door listening") == 1 and " INFO " in err


def test_a_flood_of_refusals_is_one_line_a_second_with_its_count():
    from deployments.tenants import RefusalLines

    now = [0.0]
    lines = RefusalLines(every_s=1.0, clock=lambda: now[0])
    key = ("attacker", "zmq/reset", "quota_exceeded:resets_per_s")
    assert lines.admit(key) == 0  # the first is written at once
    assert [lines.admit(key) for _ in range(500)] == [None] * 500  # the rest of that second are counted
    assert lines.admit(("other", "zmq/reset", "quota_exceeded:resets_per_s")) == 0  # another tenant is its own line
    now[0] = 1.5
    assert lines.admit(key) == 500  # the next line says how many it stands for
    for i in range(RefusalLines.MAX_KEYS + 10):
        lines.admit((f"t{i}", "http", "unauthorized"))
    assert len(lines._last) == RefusalLines.MAX_KEYS  # bounded whatever the callers send
