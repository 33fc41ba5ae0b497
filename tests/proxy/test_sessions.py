"""Session identity: explicit headers and fields win, in order; else a fingerprint stable across turns."""

from __future__ import annotations

import pytest

from proxy.sessions import SESSION_HEADERS, identify, priority

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


def test_priority_hints() -> None:
    assert priority({}) == "interactive"
    assert priority({"x-deepseek-harness-compact": "1"}) == "background"
    assert priority({"x-parent-session-id": "p"}) == "subagent"
    assert priority({"x-parent-session-id": "p", "x-hyperharness-priority": "Interactive"}) == "interactive"
