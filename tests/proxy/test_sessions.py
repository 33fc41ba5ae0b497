"""Session identity and the parent link: explicit headers and fields win, in order, then DeepSeek Harness'
session log; else a fingerprint stable across turns."""

from __future__ import annotations

import pytest

from proxy.sessions import PARENT_HEADERS, SESSION_HEADERS, LogIds, dsh_log_ids, identify, parent_of

pytestmark = pytest.mark.unit

MSGS = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]


@pytest.mark.parametrize("header", SESSION_HEADERS)
def test_each_header(header: str) -> None:
    ident = identify({header: "abc"}, {"user": "u"}, MSGS, "[]")
    assert (ident.key, ident.source) == ("h:abc", header)


def test_body_fields_then_fingerprint() -> None:
    assert identify({}, {"prompt_cache_key": "p", "user": "u"}, MSGS, "[]").source == "prompt_cache_key"
    assert identify({}, {"user": "u"}, MSGS, "[]").key == "b:u"
    assert identify({}, {"metadata": {"session_id": "m"}}, MSGS, "[]").key == "b:m"
    fp = identify({}, {}, MSGS, "[]")
    assert fp.source == "fingerprint"
    later = MSGS + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    assert identify({}, {}, later, "[]").key == fp.key  # stable across turns
    assert identify({}, {}, MSGS, '[{"t":1}]').key != fp.key  # tools matter
    other = [MSGS[0], {"role": "user", "content": "another task"}]
    assert identify({}, {}, other, "[]").key != fp.key


def test_dsh_session_log_ids() -> None:
    assert dsh_log_ids({"sessionId": "child", "parentSessionId": "parent"}) == LogIds("child", "parent")
    seen = {"version": 1, "session": {"version": 4, "id": "session-4ace", "cwd": "/w"}, "events": []}  # 0.2.1
    assert dsh_log_ids(seen) == LogIds("session-4ace", None)
    assert dsh_log_ids(None) == LogIds() and dsh_log_ids("text") == LogIds()
    # After headers and body fields, before the fingerprint; keyed like DSH's session header.
    log = dsh_log_ids(seen)
    assert identify({}, {}, MSGS, "[]", log).key == "h:session-4ace"
    assert identify({}, {"user": "u"}, MSGS, "[]", log).key == "b:u"
    assert identify({"x-session-id": "s"}, {}, MSGS, "[]", log).key == "h:s"


@pytest.mark.parametrize("header", PARENT_HEADERS)
def test_parent_headers_then_the_log(header: str) -> None:
    assert parent_of({header: " p "}) == "p"
    assert parent_of({header: "p"}, LogIds("c", "q")) == "p"
    assert parent_of({}, LogIds("c", "q")) == "q"
    assert parent_of({}) is None
