"""Matching a request onto stored snapshots: tolerant of stripped/renamed reasoning and re-serialized
arguments, strict on edits; every divergence has a reason."""

from __future__ import annotations

from array import array

import pytest

from proxy.transcripts import MessageKeys, Snapshot, common_prefix_len, context_key, match, message_key

pytestmark = pytest.mark.unit

SYS = {"role": "system", "content": "You are a coding agent."}
USER = {"role": "user", "content": "fix the bug"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": {"path": "a.py", "n": 1}}}
REPLY = {"role": "assistant", "content": "Let me look.", "reasoning_content": "think", "tool_calls": [CALL]}
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}
CTX = context_key("[]", {"enable_thinking": True})


def snapshot() -> Snapshot:
    return Snapshot(
        ids=array("I", range(100)),
        prompt_len=60,
        msg_keys=[message_key(SYS), message_key(USER)],
        msg_ends=[20, 60],
        reply_key=message_key(REPLY),
        context=CTX,
        finish_reason="tool_calls",
    )


def test_splice_when_history_extends() -> None:
    m = match([snapshot()], [SYS, USER, REPLY, TOOL], CTX)
    assert m.reason is None and m.snapshot is not None and m.new_from == 3


@pytest.mark.parametrize(
    "variant",
    [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},  # reasoning stripped
        {"role": "assistant", "content": "Let me look.", "reasoning": "think", "tool_calls": [CALL]},  # renamed
        {"role": "assistant", "content": "  Let me look.\n", "tool_calls": [CALL]},  # whitespace
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [CALL]},  # parts
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [  # re-serialized arguments
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"n":1,  "path":"a.py"}'},
                }
            ],
        },
    ],
)
def test_tolerated_reply_variants(variant) -> None:  # type: ignore[no-untyped-def]
    m = match([snapshot()], [SYS, USER, variant, TOOL], CTX)
    assert m.reason is None, m


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([SYS, {"role": "user", "content": "fix the other bug"}, REPLY, TOOL], "history_edited"),
        ([SYS, USER, {**REPLY, "content": "Something else."}, TOOL], "reply_changed"),
        ([SYS, USER, {"role": "user", "content": "hello?"}], "reply_missing"),
        ([SYS, {"role": "user", "content": "summary of everything"}], "history_edited"),
        ([SYS], "history_truncated"),
        ([SYS, USER, REPLY], "no_new_messages"),
    ],
)
def test_divergence_reasons(messages, reason) -> None:  # type: ignore[no-untyped-def]
    m = match([snapshot()], messages, CTX)
    assert m.reason == reason


def test_context_change_diverges() -> None:
    m = match([snapshot()], [SYS, USER, REPLY, TOOL], context_key("[]", {"enable_thinking": False}))
    assert m.reason == "tools_or_options_changed"


def test_picks_extending_snapshot_among_several() -> None:
    other = snapshot()
    other.msg_keys = [message_key(SYS), message_key({"role": "user", "content": "summarize"})]
    target = snapshot()
    m = match([other, target], [SYS, USER, REPLY, TOOL], CTX)
    assert m.snapshot is target and m.reason is None


def test_shared_tokens_for_accounting() -> None:
    m = match([snapshot()], [SYS, {"role": "user", "content": "other"}], CTX)
    assert m.shared_tokens == 20  # only the system message still matches
    assert match([], [SYS, USER], CTX).snapshot is None


def test_snapshot_bytes_round_trip() -> None:
    s = snapshot()
    t = Snapshot.from_bytes(s.to_bytes())
    assert (list(t.ids), t.msg_keys, t.msg_ends, t.snapshot_id) == (list(s.ids), s.msg_keys, s.msg_ends, s.snapshot_id)


def test_common_prefix_len() -> None:
    a = array("I", range(20000))
    assert common_prefix_len(a, list(range(20000))) == 20000
    assert common_prefix_len(a, list(range(12345)) + [7]) == 12345
    assert common_prefix_len(a, [1]) == 0
    assert common_prefix_len(a, []) == 0


def test_message_keys_cache_agrees() -> None:
    from proxy.transcripts import MessageKeys

    keys = MessageKeys(max_entries=2)
    msgs = [SYS, USER, REPLY, TOOL, {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    assert keys.keys(msgs) == [message_key(m) for m in msgs]
    assert keys.keys(msgs) == [message_key(m) for m in msgs]  # again, through the (evicting) cache
    assert keys(msgs[4]) == keys(USER)  # list content is keyed directly, same identity


def test_message_keys_cache_is_bounded_by_the_characters_it_holds() -> None:
    """Its keys are the messages' strings: large tool results must not stay alive by the thousand."""
    keys = MessageKeys(max_chars=10_000)
    big = [{"role": "tool", "tool_call_id": f"c{i}", "content": f"{i:05d}" + "x" * 995} for i in range(50)]
    assert keys.keys(big) == [message_key(m) for m in big]
    assert keys._chars <= 10_000 and len(keys._cache) == 10
    calls = [{"role": "assistant", "content": None,
              "tool_calls": [{"id": f"t{i}", "type": "function", "function": {"name": "f", "arguments": "y" * 3000}}]}
             for i in range(5)]
    assert keys.keys(calls) == [message_key(m) for m in calls]
    assert keys._chars <= 10_000 and len(keys._cache) < 10
